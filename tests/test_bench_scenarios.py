"""Bench scenarios: the shipped files load; requests are a function of the seed; agent sessions
grow turn by turn with tool turns; images are deterministic PNGs, some repeated, some not."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import msgspec
import pytest
from PIL import Image

from mlx_relay.bench.cli import parse_levels, parse_targets
from mlx_relay.bench.errors import BenchError, ScenarioError
from mlx_relay.bench.runner import Level, arrival_offsets, split_waves
from mlx_relay.bench.scenario import load_scenario, shipped_names
from mlx_relay.bench.session import session_messages, session_request
from mlx_relay.bench.workload import ChatJob, SessionJob, build_jobs, request_count

SHIPPED = ["agent_fleet", "agent_sessions", "images", "long_prompt", "mix", "short_chat"]


def encode(jobs: object) -> bytes:
    return msgspec.json.encode(jobs)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_scenario_loads_and_generates(name: str) -> None:
    assert shipped_names() == SHIPPED
    scenario = load_scenario(name)
    assert scenario.name == name
    jobs = build_jobs(scenario, scenario.seed, 12)
    assert request_count(jobs) == 12


@pytest.mark.parametrize("name", ["short_chat", "agent_sessions", "agent_fleet", "mix"])
def test_the_same_seed_sends_the_same_requests(name: str) -> None:
    scenario = load_scenario(name)
    a, b = build_jobs(scenario, 7, 30), build_jobs(scenario, 7, 30)
    assert encode(a) == encode(b)
    assert encode(build_jobs(scenario, 8, 30)) != encode(a)
    # job i depends on (scenario, seed, i) only: a short run sends a prefix of a long one
    longer = build_jobs(scenario, 7, 60)
    assert encode(longer[: len(a) - 1]) == encode(a[:-1])


def test_requests_follow_the_scenario() -> None:
    scenario = load_scenario("short_chat")
    for job in build_jobs(scenario, 0, 50):
        assert isinstance(job, ChatJob)
        req = job.request
        assert 1 <= req.max_tokens <= scenario.max_tokens and req.temperature == 0.0 and req.seed is None
        words = len(req.messages[0]["content"].split())
        assert scenario.prompt.min <= words <= scenario.prompt.max + 8  # + the instruction line
    mix = build_jobs(load_scenario("mix"), 0, 200)
    assert {j.request.scenario if isinstance(j, ChatJob) else j.scenario for j in mix} == {
        "short_chat", "long_prompt", "agent_sessions", "images"}


def test_agent_sessions_grow_turn_by_turn_with_tool_turns() -> None:
    scenario = load_scenario("agent_sessions")
    jobs = build_jobs(scenario, 0, 60)
    sessions = [j for j in jobs if isinstance(j, SessionJob)]
    assert len(sessions) == len(jobs) and len({s.system for s in sessions}) == 1  # one shared system prompt
    assert all(s.tools and s.turns[0].user for s in sessions)
    job = next(s for s in sessions if any(t.tool_call for t in s.turns))
    replies = [f"reply number {k} from the server" for k in range(len(job.turns))]
    previous: list[dict] = []
    for k in range(len(job.turns)):
        messages = session_messages(job, k, replies[:k])
        assert messages[: len(previous)] == previous  # the whole history is resent ...
        assert len(messages) == 2 + 2 * k  # ... plus the previous reply and one new message
        if k:
            assistant, new = messages[-2], messages[-1]
            assert assistant["role"] == "assistant" and assistant["content"] == replies[k - 1]
            call = job.turns[k].tool_call
            if call is not None:
                assert assistant["tool_calls"][0]["function"]["name"] == call.name
                json.loads(assistant["tool_calls"][0]["function"]["arguments"])
                assert new == {"role": "tool", "tool_call_id": call.id, "content": call.result}
            else:
                assert new == {"role": "user", "content": job.turns[k].user}
        previous = messages
    request = session_request(job, 1, replies[:1])
    assert request.tools == job.tools and request.id.endswith(".t1")
    with pytest.raises(ValueError):
        session_messages(job, 2, replies[:1])
    # the last session of a run is cut to the request budget
    assert request_count(build_jobs(scenario, 0, 13)) == 13


def test_agent_fleet_sessions_each_have_their_own_system_prompt() -> None:
    """`distinct_system_prompts`: no two sessions share even their first words, and each keeps its
    own system prompt on every turn."""
    jobs = build_jobs(load_scenario("agent_fleet"), 0, 128)
    sessions = [j for j in jobs if isinstance(j, SessionJob)]
    assert len(sessions) >= 32 and all(2 <= len(s.turns) <= 4 for s in sessions[:-1])
    firsts = [s.system.split(",")[0] for s in sessions]
    assert len(set(firsts)) == len(sessions)  # different from the first words on
    assert all(len(s.system.split()) > 800 for s in sessions)
    job = sessions[0]
    replies = ["a reply"] * len(job.turns)
    assert all(session_messages(job, k, replies[:k])[0]["content"] == job.system for k in range(len(job.turns)))


def test_images_are_deterministic_pngs_some_repeated() -> None:
    scenario = load_scenario("images")
    jobs = build_jobs(scenario, 0, 24)
    urls = [part["image_url"]["url"] for j in jobs if isinstance(j, ChatJob)
            for part in j.request.messages[0]["content"] if part["type"] == "image_url"]
    assert len(urls) == 24 and all(u.startswith("data:image/png;base64,") for u in urls)
    assert 1 < len(set(urls)) < len(urls)  # repeats from the pool, and distinct images
    image = Image.open(io.BytesIO(base64.b64decode(urls[0].split(",", 1)[1])))
    assert image.format == "PNG" and image.size == (224, 224)
    assert urls == [part["image_url"]["url"] for j in build_jobs(scenario, 0, 24) if isinstance(j, ChatJob)
                    for part in j.request.messages[0]["content"] if part["type"] == "image_url"]


def test_bad_scenarios_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="no scenario"):
        load_scenario("no_such_scenario")
    cases = {
        "broken.json": "{not json",
        "unknown_field.json": '{"name": "x", "kind": "chat", "prompt_len": 3}',
        "no_agent.json": '{"name": "x", "kind": "agent_session"}',
        "bad_length.json": '{"name": "x", "kind": "chat", "prompt": {"min": 9, "max": 3}}',
        "nested_mix.json": '{"name": "x", "kind": "mix", "mix": [{"scenario": "mix"}]}',
    }
    for file, text in cases.items():
        (tmp_path / file).write_text(text)
        with pytest.raises(ScenarioError):
            load_scenario(str(tmp_path / file))
    inline = tmp_path / "inline_mix.json"
    inline.write_text('{"name": "m", "kind": "mix", "mix": [{"scenario": "short_chat", "weight": 1},'
                      ' {"scenario": {"name": "tiny", "kind": "chat", "prompt": {"min": 2, "max": 3}}}]}')
    assert len(build_jobs(load_scenario(str(inline)), 0, 10)) == 10


def test_load_levels_waves_and_arrivals() -> None:
    assert parse_levels("1,4,16", None) == [Level(concurrency=1), Level(concurrency=4), Level(concurrency=16)]
    assert parse_levels(None, "0.5,2") == [Level(rate=0.5), Level(rate=2.0)]
    assert parse_levels(None, None) == [Level(concurrency=1)]
    with pytest.raises(BenchError):
        parse_levels("a,b", None)
    with pytest.raises(BenchError):
        Level(concurrency=0)
    assert parse_targets(["http://127.0.0.1:1", "ours=http://127.0.0.1:2"]) == [
        (None, "http://127.0.0.1:1"), ("ours", "http://127.0.0.1:2")]
    jobs = build_jobs(load_scenario("agent_sessions"), 0, 40)
    waves = split_waves(jobs, 10)
    assert [j for w in waves for j in w] == jobs and all(request_count(w) >= 10 for w in waves[:-1])
    offsets = arrival_offsets(3, 0, 0, rate=4.0, n=2000)
    assert offsets == arrival_offsets(3, 0, 0, rate=4.0, n=2000) and offsets[0] == 0.0
    assert offsets[-1] / 1999 == pytest.approx(0.25, rel=0.1)  # mean gap 1 / rate
    assert arrival_offsets(3, 0, 1, 4.0, 10) != offsets[:10]
