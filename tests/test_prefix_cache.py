"""The prefix cache end to end (issue 5), on the float32 tiny VLM: agent-shaped conversations hit
(system prompt, previous turn, the same image again), hits return exactly what a server without
the cache returns, concurrent conversations on one snapshot stay apart, and the counters, the
byte budget and the flush endpoint say what happened. A turn is snapshotted only where a next
turn is likely (a multi-turn conversation, or declared tools), and hits are counted per kind
(issue 15.8)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from mlx_relay.chat.reply import ChatReply
from mlx_relay.relay import Relay
from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import LiveServer
from tests.test_vision_path import image_message, png_data_url

SYSTEM = ("You are a careful coding agent. Follow the repository's conventions, keep changes small, "
          "run the tests before you answer, and explain what you changed and why. ") * 3
OPTS: dict[str, Any] = {"max_tokens": 10, "temperature": 0}
TOOLS = [{"type": "function", "function": {"name": "run_tests", "description": "Run the test suite",
                                           "parameters": {"type": "object", "properties": {}}}}]
CACHE: dict[str, Any] = {"prefix_min_snapshot_tokens": 8, "max_num_seqs": 8, "mtp_policy": "always",
                         "context_policy": "always"}


def conversation(question: str, turns: list[tuple[str, str]] = ()) -> list[dict[str, Any]]:  # type: ignore[assignment]
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for user, assistant in turns:
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return [*msgs, {"role": "user", "content": question}]


async def test_agent_turns_hit_and_equal_the_uncached_server(fp32_model: Path) -> None:
    questions = ["Fix the failing test in utils.py", "Now add a docstring", "And a type hint"]
    # turn by turn, each turn carrying the previous replies (as an agent does)
    async with Relay.start(fp32_model, prefix_cache=True, **CACHE) as relay:
        cached: list[ChatReply] = []
        turns: list[tuple[str, str]] = []
        for q in questions:
            r = await relay.chat(conversation(q, turns), **OPTS)
            cached.append(r)
            turns.append((q, r.raw_text))
            if len(turns) == 1:
                one_shot = (await relay.prefix_cache_stats())["prefix_cache"]
        stats = await relay.prefix_cache_stats()
    async with Relay.start(fp32_model, prefix_cache=False, **CACHE) as relay:
        plain = []
        turns = []
        for q in questions:
            r = await relay.chat(conversation(q, turns), **OPTS)
            plain.append(r)
            turns.append((q, r.raw_text))
        off = await relay.prefix_cache_stats()
    assert [r.token_ids for r in cached] == [r.token_ids for r in plain]
    assert cached[0].cached_tokens == 0
    # turn 2 restores at least the system prompt; later turns restore the previous turn's whole state
    assert cached[1].cached_tokens > 0
    assert cached[2].cached_tokens > cached[1].cached_tokens
    assert all(r.cached_tokens == 0 for r in plain)
    # turn 1 is a one-shot chat (no earlier reply, no tools): its turn is not snapshotted
    assert one_shot["turn_entries"] == 0 and one_shot["turns_skipped"] == 1
    assert one_shot["by_kind"]["system"]["inserts"] == 1
    pc = stats["prefix_cache"]
    # turn 3's snapshot supersedes turn 2's, which the conversation has moved past
    assert pc["hits"] == 2 and pc["misses"] == 1 and pc["system_entries"] == 1 and pc["turn_entries"] == 1
    assert pc["turns_skipped"] == 1
    kinds = pc["by_kind"]
    assert kinds["turn"]["inserts"] == 2 and kinds["turn"]["superseded"] == pc["superseded"] == 1
    assert (kinds["system"]["hits"], kinds["turn"]["hits"], kinds["media"]["hits"]) == (1, 1, 0)
    assert kinds["turn"]["hit_tokens"] == cached[2].cached_tokens
    assert pc["bytes"] == stats["snapshots"]["bytes"] == sum(k["bytes"] for k in kinds.values()) > 0
    assert off["prefix_cache"] == {"enabled": False}


async def test_concurrent_divergent_suffixes_never_mix(fp32_model: Path) -> None:
    """Eight conversations on one system snapshot, decoding together (MTP lane and plain lane, as
    `mtp_max_batch` routes them), each equal to the same request on a server without the cache."""
    questions = [f"Task {i}: " + "rename the variable " * (i % 3 + 1) for i in range(8)]

    async def run_all(relay: Relay) -> dict[int, ChatReply]:
        out: dict[int, ChatReply] = {}

        async def one(i: int) -> None:
            out[i] = await relay.chat(conversation(questions[i]), **OPTS)

        async with anyio.create_task_group() as tg:
            for i in range(len(questions)):
                tg.start_soon(one, i)
        return out

    async with Relay.start(fp32_model, prefix_cache=True, **CACHE) as relay:
        await relay.chat(conversation("warm the system prompt"), **OPTS)
        together = await run_all(relay)
    async with Relay.start(fp32_model, prefix_cache=False, **CACHE) as relay:
        alone = {i: await relay.chat(conversation(q), **OPTS) for i, q in enumerate(questions)}
    assert {i: r.token_ids for i, r in together.items()} == {i: r.token_ids for i, r in alone.items()}
    assert all(r.cached_tokens > 0 for r in together.values())
    assert any(r.mtp_drafted > 0 for r in together.values())
    assert any(r.mtp_drafted == 0 for r in together.values())


async def test_same_image_twice_hits_a_different_image_never(fp32_model: Path) -> None:
    a, b = png_data_url(11, (128, 96)), png_data_url(12, (128, 96))
    asks = [image_message("What is in this picture?", a), image_message("Which colours dominate?", a),
            image_message("Which colours dominate?", b)]
    async with Relay.start(fp32_model, prefix_cache=True, **CACHE) as relay:
        cached = [await relay.chat(m, **OPTS) for m in asks]
    async with Relay.start(fp32_model, prefix_cache=False, **CACHE) as relay:
        plain = [await relay.chat(m, **OPTS) for m in asks]
    assert [r.token_ids for r in cached] == [r.token_ids for r in plain]
    assert cached[0].cached_tokens == 0
    assert cached[1].cached_tokens >= 12  # up to the image's end (12 patch tokens, and the header)
    assert cached[2].cached_tokens == 0  # same pad token ids, another image: no hit


async def test_budget_evicts_least_recent_and_flush_empties(fp32_model: Path) -> None:
    """Agents (declared tools) get turn snapshots from their first turn; under the budget the
    turns that did not come back go, the system prompt every chat hit stays; the next user turn of
    the last chat restores its turn."""
    # the system prompt (with the tools) and two turns, about 1 MiB each (MTP's: rows under the
    # declared tools' lazy grammar decode with MTP, the head's state in each turn snapshot)
    budget = 4 << 20
    async with Relay.start(fp32_model, prefix_cache=True, prefix_cache_bytes=budget, **CACHE) as relay:
        for i in range(6):
            r = await relay.chat(conversation(f"question {i}"), tools=TOOLS, **OPTS)
        stats = (await relay.prefix_cache_stats())["prefix_cache"]
        assert stats["budget_bytes"] == budget
        assert 0 < stats["bytes"] <= budget
        assert stats["evictions"] > 0 and stats["evicted_bytes"] > 0
        kinds = stats["by_kind"]
        # three turn snapshots each: the reply's header (a next user turn restores it), the prompt's
        # end and the whole turn (a next tool round restores one)
        assert kinds["turn"]["inserts"] == 6 * 3 and stats["turns_skipped"] == 0
        assert kinds["turn"]["evictions"] == stats["evictions"] and kinds["system"]["entries"] == 1
        nxt = await relay.chat(conversation("go on", [("question 5", r.raw_text)]), tools=TOOLS, **OPTS)
        assert nxt.cached_tokens > kinds["system"]["hit_tokens"] // kinds["system"]["hits"]
        stats = (await relay.prefix_cache_stats())["prefix_cache"]
        assert stats["by_kind"]["turn"]["hits"] == 1
        flushed = await relay.flush_prefix_cache()
        assert flushed.entries == stats["entries"] and flushed.bytes == stats["bytes"]
        after = await relay.prefix_cache_stats()
        assert after["prefix_cache"]["entries"] == 0 and after["prefix_cache"]["bytes"] == 0
        assert after["snapshots"]["held"] == 0 and after["snapshots"]["bytes"] == 0


def test_usage_reports_cached_tokens_and_endpoints(server: LiveServer) -> None:
    long_system = SYSTEM * 8  # past the default 256-token snapshot threshold
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": long_system}, {"role": "user", "content": "hi"}]}
    first = local_http.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    body["messages"][1]["content"] = "hello there"
    second = local_http.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 256
    # streamed: the final usage chunk carries it too
    with local_http.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json=body | {"stream": True, "stream_options": {"include_usage": True}}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    assert '"cached_tokens"' in lines[-1]
    stats = local_http.get(server.url + "/v1/cache/stats", timeout=10).json()
    assert stats["prefix_cache"]["hits"] >= 2 and stats["prefix_cache"]["bytes"] > 0
    flushed = local_http.post(server.url + "/v1/cache/flush", timeout=10).json()
    assert flushed["flushed_entries"] >= 1
    assert local_http.get(server.url + "/v1/cache/stats", timeout=10).json()["prefix_cache"]["entries"] == 0
