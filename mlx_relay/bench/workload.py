"""The work a run sends, generated from a scenario and a seed: the same seed gives the same jobs.

A job is one `ChatJob` (a chat or image request) or one `SessionJob` (an agent conversation:
its turns are sent one after another, each resending the history; see `mlx_relay.bench.session`).
Job `i` depends only on (scenario, seed, i), so a run of 16 requests sends the first 16 of a run
of 200. Request bodies are plain OpenAI JSON (dicts), ready for any OpenAI-compatible server.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import numpy as np

from mlx_relay.bench.corpus import TOKENS_PER_WORD, approx_words, code, identifier, prose
from mlx_relay.bench.images import png_data_url
from mlx_relay.bench.scenario import Length, Scenario

_CHAT, _IMAGE, _AGENT, _AGENT_SHARED, _MIX = 1, 2, 3, 4, 5  # generator salts, one per purpose

_STEMS: tuple[str, ...] = (
    "Answer briefly.", "Summarize the following.", "Explain this in simple words.",
    "Continue the text.", "What is the main point here?", "Rewrite this more clearly.",
)

# (name, description, parameter): the tools an agent session declares, first `AgentSpec.tools` of them.
_TOOLS: tuple[tuple[str, str, str], ...] = (
    ("read_file", "Read a file of the repository.", "path"),
    ("grep", "Search the repository for a pattern.", "pattern"),
    ("run_tests", "Run the test suite, or the tests matching a filter.", "filter"),
    ("edit_file", "Replace a file's content.", "path"),
    ("list_dir", "List a directory.", "path"),
    ("git_diff", "Show the working tree's changes.", "path"),
)


class BenchRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One chat request, front-end neutral: the HTTP driver adds model/stream fields."""

    id: str
    scenario: str
    messages: list[dict[str, Any]]
    max_tokens: int
    temperature: float
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None


class ChatJob(msgspec.Struct, frozen=True, tag="chat"):
    request: BenchRequest

    @property
    def request_count(self) -> int:
        return 1


class ToolCallPlan(msgspec.Struct, frozen=True):
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    result: str


class SessionTurn(msgspec.Struct, frozen=True, kw_only=True):
    """A user turn (`user`) or a tool turn (`tool_call`: the previous reply called a tool)."""

    max_tokens: int
    user: str | None = None
    tool_call: ToolCallPlan | None = None


class SessionJob(msgspec.Struct, frozen=True, kw_only=True, tag="agent_session"):
    id: str
    scenario: str
    system: str
    tools: list[dict[str, Any]]
    turns: list[SessionTurn]
    temperature: float
    seed: int | None = None

    @property
    def request_count(self) -> int:
        return len(self.turns)


Job = ChatJob | SessionJob


def draw(length: Length, rng: np.random.Generator) -> int:
    """A value of `length` in its own unit."""
    if length.dist == "normal" and length.max > length.min:
        value = round(rng.normal((length.min + length.max) / 2, (length.max - length.min) / 4))
        return int(min(length.max, max(length.min, value)))
    return int(rng.integers(length.min, length.max + 1))


def draw_words(length: Length, rng: np.random.Generator) -> int:
    value = draw(length, rng)
    return approx_words(value) if length.unit == "tokens" else value


def draw_tokens(length: Length, rng: np.random.Generator) -> int:
    value = draw(length, rng)
    return value if length.unit == "tokens" else max(1, round(value * TOKENS_PER_WORD))


def _sampling_seed(scenario: Scenario, rng: np.random.Generator) -> int | None:
    seed = int(rng.integers(0, 2**31 - 1))
    return seed if scenario.temperature > 0 else None


def _user_text(length: Length, rng: np.random.Generator) -> str:
    stem = _STEMS[int(rng.integers(0, len(_STEMS)))]
    return f"{stem}\n\n{prose(rng, draw_words(length, rng))}"


def _chat_job(scenario: Scenario, seed: int, i: int) -> ChatJob:
    rng = np.random.default_rng([seed, _CHAT, i])
    request = BenchRequest(
        id=f"{scenario.name}-{i:05d}",
        scenario=scenario.name,
        messages=[{"role": "user", "content": _user_text(scenario.prompt, rng)}],
        max_tokens=min(scenario.max_tokens, draw_tokens(scenario.output, rng)),
        temperature=scenario.temperature,
        seed=_sampling_seed(scenario, rng),
    )
    return ChatJob(request)


def _image_job(scenario: Scenario, seed: int, i: int, png_cache: dict[tuple[int, ...], str]) -> ChatJob:
    spec = scenario.images
    assert spec is not None
    rng = np.random.default_rng([seed, _IMAGE, i])
    parts: list[dict[str, Any]] = [{"type": "text", "text": _user_text(scenario.prompt, rng)}]
    for j in range(spec.per_request):
        if rng.random() < spec.repeat_fraction:
            key: tuple[int, ...] = (seed, 0, int(rng.integers(0, spec.pool)))  # the shared pool
        else:
            key = (seed, 1, i, j)  # never repeated
        if key not in png_cache:
            png_cache[key] = png_data_url(key, spec.width, spec.height)
        parts.append({"type": "image_url", "image_url": {"url": png_cache[key]}})
    request = BenchRequest(
        id=f"{scenario.name}-{i:05d}",
        scenario=scenario.name,
        messages=[{"role": "user", "content": parts}],
        max_tokens=min(scenario.max_tokens, draw_tokens(scenario.output, rng)),
        temperature=scenario.temperature,
        seed=_sampling_seed(scenario, rng),
    )
    return ChatJob(request)


def tool_definitions(count: int) -> list[dict[str, Any]]:
    defs = []
    for k in range(count):
        name, description, param = _TOOLS[k % len(_TOOLS)]
        if k >= len(_TOOLS):
            name = f"{name}_{k // len(_TOOLS)}"
        defs.append({"type": "function", "function": {
            "name": name, "description": description,
            "parameters": {"type": "object", "properties": {param: {"type": "string"}}, "required": [param]},
        }})
    return defs


def system_prompt(scenario: Scenario, seed: int, session: int) -> str:
    """Session `session`'s system prompt: the one every session of the scenario shares, or, with
    `distinct_system_prompts`, its own (different from its first words on)."""
    spec = scenario.agent
    assert spec is not None
    if not spec.distinct_system_prompts:
        rng = np.random.default_rng([seed, _AGENT_SHARED])
        return ("You are a coding agent working in a software repository. Follow these rules.\n\n"
                + prose(rng, draw_words(spec.system_prompt, rng)))
    rng = np.random.default_rng([seed, _AGENT_SHARED, session])
    return (f"Agent {identifier(rng)}, session {session}: you are a coding agent working in a software "
            "repository. Follow these rules.\n\n" + prose(rng, draw_words(spec.system_prompt, rng)))


def _session_job(scenario: Scenario, seed: int, i: int, system: str) -> SessionJob:
    spec = scenario.agent
    assert spec is not None
    rng = np.random.default_rng([seed, _AGENT, i])
    tools = tool_definitions(spec.tools)
    turns: list[SessionTurn] = []
    for k in range(draw(spec.turns, rng)):
        max_tokens = min(scenario.max_tokens, draw_tokens(scenario.output, rng))
        if k > 0 and tools and rng.random() < spec.tool_fraction:
            fn = tools[int(rng.integers(0, len(tools)))]["function"]
            param = next(iter(fn["parameters"]["properties"]))
            call = ToolCallPlan(
                id=f"call_{i}_{k}",
                name=fn["name"],
                arguments=json.dumps({param: f"src/{identifier(rng)}.py"}),
                result=code(rng, draw_words(spec.tool_result, rng)),
            )
            turns.append(SessionTurn(max_tokens=max_tokens, tool_call=call))
        else:
            turns.append(SessionTurn(max_tokens=max_tokens, user=_user_text(spec.user_message, rng)))
    return SessionJob(
        id=f"{scenario.name}-{i:05d}",
        scenario=scenario.name,
        system=system,
        tools=tools,
        turns=turns,
        temperature=scenario.temperature,
        seed=_sampling_seed(scenario, rng),
    )


class _Builder:
    """Job `i` of a scenario; holds the per-build caches (shared prompts, pool images)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.png_cache: dict[tuple[int, ...], str] = {}
        self.systems: dict[str, str] = {}

    def job(self, scenario: Scenario, i: int) -> Job:
        if scenario.kind == "mix":
            assert scenario.mix
            rng = np.random.default_rng([self.seed, _MIX, i])
            weights = np.array([p.weight for p in scenario.mix], dtype=np.float64)
            part = scenario.mix[int(rng.choice(len(weights), p=weights / weights.sum()))].scenario
            assert not isinstance(part, str), "load_scenario resolves a mix's parts"
            return self.job(part, i)
        if scenario.kind == "image":
            return _image_job(scenario, self.seed, i, self.png_cache)
        if scenario.kind == "agent_session":
            assert scenario.agent is not None
            if scenario.agent.distinct_system_prompts:
                return _session_job(scenario, self.seed, i, system_prompt(scenario, self.seed, i))
            if scenario.name not in self.systems:
                self.systems[scenario.name] = system_prompt(scenario, self.seed, i)
            return _session_job(scenario, self.seed, i, self.systems[scenario.name])
        return _chat_job(scenario, self.seed, i)


def build_jobs(scenario: Scenario, seed: int, max_requests: int) -> list[Job]:
    """Jobs 0, 1, ... until they hold `max_requests` requests (the last session is cut short)."""
    builder = _Builder(seed)
    jobs: list[Job] = []
    total = 0
    i = 0
    while total < max_requests:
        job = builder.job(scenario, i)
        if isinstance(job, SessionJob) and total + job.request_count > max_requests:
            job = msgspec.structs.replace(job, turns=job.turns[: max_requests - total])
        jobs.append(job)
        total += job.request_count
        i += 1
    return jobs


def request_count(jobs: list[Job]) -> int:
    return sum(job.request_count for job in jobs)
