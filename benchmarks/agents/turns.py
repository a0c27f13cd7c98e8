"""What each request of an agent's turn cost (issue 43): prompt, cached and uncached tokens and
time to first token, and whether each round of the agent's tool loop restored the previous request.

The counts and the time are the server's own, from its request log (one `mlx_relay.requests` line
per request: `prompt_tokens=`, `cached_tokens=`, `ttft_s=`, measured from the request's arrival to
its first token), matched to the recorder's exchanges by the `x-request-id` the server answered
with; the exchanges give the order the requests arrived in and what each sent.

A tool round is a request that answers the tool calls of an earlier one: it carries tool results,
and the request it answers is the latest earlier one that ended in tool calls, if no round has
answered that one yet (requests between them that carry no tool results, an agent's side requests,
are not part of the loop). It continues that
request's prompt when both declare the same tools and system prompt (agents that load a tool on
demand, Claude Code's tool search, Codex's MCP namespace, declare one more from their second request
on: the rendered prompt then differs from the tools block on and starts anew). A round that
continues it restored it when `cached >= previous prompt - SLACK`. SLACK is one token: a client that
sends no reasoning back for a reply that thought gets an empty thinking block rendered where the
previous prompt ended inside `<think>\\n`, and the block's `\\n\\n` is one token there, not the
prompt's last (docs/prefix-cache.md; tests/test_agent_requests.py gives Claude Code's recorded loop
the same token). Every other part of the previous prompt is repeated verbatim by the next round.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from checks import tool_results_in

Json = dict[str, Any]

LOGGER = "mlx_relay.requests"
SLACK = 1  # tokens: an empty thinking block's `\n\n` where the previous prompt ended in `<think>\n`
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def _value(text: str) -> Any:
    """A text-format log value back as it was: `-` None, JSON-quoted strings, numbers, booleans."""
    if text == "-":
        return None
    if text.startswith('"'):
        return json.loads(text)
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_request_log(lines: Iterable[str]) -> list[Json]:
    """The fields of each request line of a server log in the text format (`LEVEL mlx_relay.requests:
    request key=value ...`), in the order they were written."""
    out: list[Json] = []
    for line in lines:
        _, _, rest = line.partition(" ")
        if not rest.startswith(f"{LOGGER}: request "):
            continue
        out.append({k: _value(v) for k, v in _FIELD.findall(rest.removeprefix(f"{LOGGER}: request "))})
    return out


@dataclass(frozen=True)
class RequestCost:
    seq: int  # the exchange's number, in the order the requests arrived
    path: str
    status: int
    prompt_tokens: int | None
    cached_tokens: int | None
    ttft_s: float | None
    duration_s: float | None
    finish_reason: str | None
    answers: int | None = None  # a tool round: the seq of the request whose tool calls it answers
    continues: bool | None = None  # that request's tools and system prompt declared again
    restored: bool | None = None  # cached >= that request's prompt - SLACK (rounds that continue it)
    past_prompt: int | None = None  # cached - that request's prompt (> 0: its reply restored too)

    @property
    def uncached_tokens(self) -> int | None:
        if self.prompt_tokens is None or self.cached_tokens is None:
            return None
        return self.prompt_tokens - self.cached_tokens

    def as_json(self) -> Json:
        return asdict(self) | {"uncached_tokens": self.uncached_tokens}


def _without_cache_marks(obj: Any) -> Any:
    """A body part with Anthropic's `cache_control` marks left out (they move with the conversation)."""
    if isinstance(obj, dict):
        return {k: _without_cache_marks(v) for k, v in obj.items() if k != "cache_control"}
    if isinstance(obj, list):
        return [_without_cache_marks(x) for x in obj]
    return obj


def preamble(body: Any) -> str:
    """What a prompt starts with, besides the conversation: the tools and the system prompt."""
    if not isinstance(body, dict):
        return ""
    system = body.get("system", body.get("instructions"))
    if system is None and isinstance(body.get("messages"), list):  # OpenAI chat: the system messages
        system = [m for m in body["messages"] if isinstance(m, dict) and m.get("role") in ("system", "developer")]
    return json.dumps(_without_cache_marks([body.get("tools"), system]), sort_keys=True)


def request_costs(api: str, records: list[Json], log: list[Json]) -> list[RequestCost]:
    """Each POST of one agent's recording (in arrival order) with its log line's counts and time,
    and for a tool round, the request it answers and whether it restored that request's prompt."""
    by_id: dict[str, list[Json]] = {}
    for fields in log:
        by_id.setdefault(str(fields.get("request_id")), []).append(fields)
    out: list[RequestCost] = []
    last_call: tuple[RequestCost, Json] | None = None  # the latest request that ended in tool calls
    for r in sorted(records, key=lambda r: r["seq"]):
        if r.get("method") != "POST":
            continue
        lines = by_id.get(str(r.get("request_id")))
        fields = lines.pop(0) if lines else {}
        cost = RequestCost(seq=r["seq"], path=r["path"], status=r.get("status", 0),
                           prompt_tokens=fields.get("prompt_tokens"), cached_tokens=fields.get("cached_tokens"),
                           ttft_s=fields.get("ttft_s"), duration_s=fields.get("duration_s"),
                           finish_reason=fields.get("finish_reason"))
        if last_call is not None and tool_results_in(api, r.get("body")):
            prev, prev_body = last_call
            continues = preamble(prev_body) == preamble(r.get("body"))
            cost = _round(cost, prev, continues)
            last_call = None  # answered
        out.append(cost)
        if cost.finish_reason == "tool_calls":
            last_call = (cost, r.get("body"))
    return out


def _round(cost: RequestCost, prev: RequestCost, continues: bool) -> RequestCost:
    past_prompt = restored = None
    if prev.prompt_tokens is not None and cost.cached_tokens is not None:
        past_prompt = cost.cached_tokens - prev.prompt_tokens
        restored = past_prompt >= -SLACK if continues else None
    return RequestCost(**{**asdict(cost), "answers": prev.seq, "continues": continues, "restored": restored,
                          "past_prompt": past_prompt})


@dataclass(frozen=True)
class LoopSummary:
    rounds: int  # tool rounds (requests answering an earlier request's tool calls)
    continuing: int  # of them, those that declared the same tools and system prompt
    restored: int  # of those, the ones that restored the previous request's prompt
    new_prompts: list[int]  # the seqs of the rounds that started another prompt (tools or system changed)
    first_ttft_s: float | None  # the loop's first request (the one its first round answers)
    last_ttft_s: float | None  # its last round
    first_prompt_tokens: int | None
    last_prompt_tokens: int | None

    @property
    def every_round_restored(self) -> bool | None:
        return None if not self.continuing else self.restored == self.continuing

    def as_json(self) -> Json:
        return asdict(self) | {"every_round_restored": self.every_round_restored, "slack_tokens": SLACK}


def loop_summary(costs: list[RequestCost]) -> LoopSummary:
    rounds = [c for c in costs if c.answers is not None]
    continuing = [c for c in rounds if c.continues]
    first = next((c for c in costs if rounds and c.seq == rounds[0].answers), None)
    last = rounds[-1] if rounds else None
    return LoopSummary(rounds=len(rounds), continuing=len(continuing),
                       restored=sum(bool(c.restored) for c in continuing),
                       new_prompts=[c.seq for c in rounds if not c.continues],
                       first_ttft_s=first.ttft_s if first else None, last_ttft_s=last.ttft_s if last else None,
                       first_prompt_tokens=first.prompt_tokens if first else None,
                       last_prompt_tokens=last.prompt_tokens if last else None)


def _n(x: Any) -> str:
    return "-" if x is None else f"{x:,}" if isinstance(x, int) else f"{x:.2f}" if isinstance(x, float) else str(x)


def _restored_cell(c: RequestCost) -> str:
    if c.answers is None:
        return "-"
    if not c.continues:
        return "new prompt (tools or system changed)"
    return "not logged" if c.restored is None else "yes" if c.restored else "NO"


def costs_table(costs: list[RequestCost]) -> str:
    """A row per request: its counts and TTFT; a tool round's, the request it answers (#), its cached
    tokens less that request's prompt (> 0: the reply restored too) and whether it restored that prompt."""
    rows = ["| # | route | status | prompt | cached | uncached | TTFT s | finish | answers # | cached - its prompt "
            "| restored it |", "|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for c in costs:
        past = "-" if c.past_prompt is None else f"{c.past_prompt:+,}"
        rows.append(f"| {c.seq} | {c.path} | {c.status} | {_n(c.prompt_tokens)} | {_n(c.cached_tokens)} | "
                    f"{_n(c.uncached_tokens)} | {_n(c.ttft_s)} | {_n(c.finish_reason)} | {_n(c.answers)} | {past} | "
                    f"{_restored_cell(c)} |")
    return "\n".join(rows) + "\n"


def loop_line(s: LoopSummary) -> str:
    if not s.rounds:
        return "no tool round (no request answered an earlier one's tool calls)"
    every = {True: "every one restored it", False: f"{s.restored} of them restored it", None: "none to judge"}
    text = (f"{s.rounds} tool round(s); {s.continuing} continued the previous request's prompt, "
            f"{every[s.every_round_restored]} (cached >= its prompt - {SLACK} token)")
    if s.new_prompts:
        seqs = ", ".join(f"#{q}" for q in s.new_prompts)
        text += f"; {len(s.new_prompts)} started another prompt ({seqs}: tools or system prompt changed)"
    return text + (f"; TTFT {_n(s.first_ttft_s)} s (first, {_n(s.first_prompt_tokens)} tokens) -> "
                   f"{_n(s.last_ttft_s)} s (last, {_n(s.last_prompt_tokens)} tokens)")
