"""Scenarios as data: one JSON file per scenario, decoded into typed, validated structs.

    {"name": "short_chat", "kind": "chat", "requests": 200,
     "prompt": {"min": 8, "max": 48}, "output": {"min": 16, "max": 64, "unit": "tokens"},
     "max_tokens": 64, "temperature": 0.0, "seed": 0}

Kinds: `chat` (one user turn), `image` (a user turn with PNG `data:` images, see `ImageSpec`),
`agent_session` (a shared long system prompt and a conversation that grows turn by turn, with
tool calls and tool results, see `AgentSpec`) and `mix` (weighted sub-scenarios, named or
inline). `load_scenario` takes a shipped name (`benchmarks/scenarios/NAME.json`) or a path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from mlx_relay.bench.errors import ScenarioError

Kind = Literal["chat", "agent_session", "image", "mix"]


class Length(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A length drawn per request: uniform in [min, max], or normal around the middle
    (sd = range / 4) clipped to it; in words, or approximate tokens."""

    min: int
    max: int
    dist: Literal["uniform", "normal"] = "uniform"
    unit: Literal["words", "tokens"] = "words"


class ImageSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Images per request; a `repeat_fraction` of them come from a small pool shared by all
    requests (`pool` distinct images: cache hits for a server that caches vision features), the
    rest are distinct images never seen before."""

    per_request: int = 1
    width: int = 224
    height: int = 224
    repeat_fraction: float = 0.5
    pool: int = 4


class AgentSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A coding-agent conversation: a long system prompt shared by every session (a prefix
    cache's best case), or one of its own per session (`distinct_system_prompts`: many agents,
    each with its own instructions, so that only a session's own turns share its prefix),
    `turns` requests each resending the whole history plus the reply the server actually gave; a
    `tool_fraction` of the turns after the first are tool turns (the previous reply carries a tool
    call, then a `tool` message with its result)."""

    system_prompt: Length = Length(600, 600)
    distinct_system_prompts: bool = False
    turns: Length = Length(4, 8)
    user_message: Length = Length(10, 40)
    tool_fraction: float = 0.5
    tool_result: Length = Length(40, 160)
    tools: int = 4  # tool definitions sent with every request


class MixPart(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    scenario: str | Scenario  # a shipped name, a path relative to the mix file, or inline
    weight: float = 1.0


class Scenario(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    kind: Kind
    description: str = ""
    requests: int = 200  # default request count of a run (`--requests` overrides)
    prompt: Length = Length(8, 48)
    output: Length = Length(16, 64, unit="tokens")  # drawn per request into max_tokens
    max_tokens: int = 256  # cap on the drawn output length
    temperature: float = 0.0
    seed: int = 0
    agent: AgentSpec | None = None
    images: ImageSpec | None = None
    mix: list[MixPart] | None = None


def shipped_dir() -> Path:
    """`benchmarks/scenarios/` of this checkout."""
    return Path(__file__).resolve().parents[2] / "benchmarks" / "scenarios"


def shipped_names() -> list[str]:
    return sorted(p.stem for p in shipped_dir().glob("*.json"))


def _locate(name_or_path: str, base: Path) -> Path:
    direct = Path(name_or_path)
    shipped = shipped_dir()
    for candidate in (direct, base / name_or_path, base / f"{name_or_path}.json", shipped / f"{name_or_path}.json"):
        if candidate.is_file():
            return candidate
    known = ", ".join(shipped_names()) or "none"
    raise ScenarioError(f"no scenario '{name_or_path}' (a path to a JSON file, or one of: {known})")


def validate(s: Scenario) -> None:
    problems: list[str] = []
    lengths = [("prompt", s.prompt), ("output", s.output)]
    if s.agent is not None:
        lengths += [("agent.system_prompt", s.agent.system_prompt), ("agent.turns", s.agent.turns),
                    ("agent.user_message", s.agent.user_message), ("agent.tool_result", s.agent.tool_result)]
    for label, length in lengths:
        if not 0 < length.min <= length.max:
            problems.append(f"{label}: need 0 < min <= max (got {length.min}, {length.max})")
    if s.requests < 1 or s.max_tokens < 1:
        problems.append("requests and max_tokens must be at least 1")
    if not 0.0 <= s.temperature <= 2.0:
        problems.append("temperature must be in [0, 2]")
    if s.kind == "agent_session" and s.agent is None:
        problems.append("an agent_session scenario needs an 'agent' section")
    if s.agent is not None and not 0.0 <= s.agent.tool_fraction <= 1.0:
        problems.append("agent.tool_fraction must be in [0, 1]")
    if s.kind == "image":
        if s.images is None:
            problems.append("an image scenario needs an 'images' section")
        elif not (s.images.per_request >= 1 and s.images.pool >= 1 and 0.0 <= s.images.repeat_fraction <= 1.0
                  and s.images.width >= 8 and s.images.height >= 8):
            problems.append("images: per_request >= 1, pool >= 1, repeat_fraction in [0, 1], sides >= 8")
    if s.kind == "mix":
        if not s.mix:
            problems.append("a mix scenario needs a non-empty 'mix' list")
        elif any(p.weight <= 0 for p in s.mix):
            problems.append("mix weights must be positive")
    if problems:
        raise ScenarioError(f"scenario '{s.name}': " + "; ".join(problems))


def load_scenario(name_or_path: str | Path, *, base: Path | None = None, seen: tuple[Path, ...] = ()) -> Scenario:
    """Load, resolve (a mix's named parts are loaded too) and validate a scenario."""
    path = _locate(str(name_or_path), base or shipped_dir()).resolve()
    if path in seen:
        raise ScenarioError(f"scenario mix cycle through {path}")
    try:
        scenario = msgspec.json.decode(path.read_bytes(), type=Scenario)
    except (msgspec.DecodeError, OSError) as exc:
        raise ScenarioError(f"{path}: {exc}") from None
    return resolve(scenario, base=path.parent, seen=(*seen, path))


def resolve(scenario: Scenario, *, base: Path | None = None, seen: tuple[Path, ...] = ()) -> Scenario:
    """Validate `scenario` and replace each named mix part by the loaded scenario."""
    validate(scenario)
    if scenario.kind != "mix" or not scenario.mix:
        return scenario
    parts: list[MixPart] = []
    for part in scenario.mix:
        sub = part.scenario
        if isinstance(sub, str):
            sub = load_scenario(sub, base=base, seen=seen)
        else:
            sub = resolve(sub, base=base, seen=seen)
        if sub.kind == "mix":
            raise ScenarioError(f"scenario '{scenario.name}': a mix cannot contain a mix ('{sub.name}')")
        parts.append(MixPart(sub, part.weight))
    return msgspec.structs.replace(scenario, mix=parts)
