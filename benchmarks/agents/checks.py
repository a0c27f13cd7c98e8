"""What `make agents` checks in one agent's recording (the exchanges `recorder.py` wrote), and the
SSE checks `tests/test_agent_requests.py` shares: every status 2xx (or the one refusal expected
of a prompt the context cannot hold), every stream well formed and ended by its API's terminal
event, the model's call of the MCP tool and, in a later request, the tool's result sent back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

Json = dict[str, Any]

# the event that ends a good stream, per API; events that end a failed one
TERMINAL = {"chat": "[DONE]", "messages": "message_stop", "responses": "response.completed"}
FAILED = {"error", "response.failed", "response.incomplete"}


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name or None, data) per SSE frame; comments (keep-alives) skipped, as clients do."""
    events: list[tuple[str | None, str]] = []
    event: str | None = None
    data: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line == "":
            if data:
                events.append((event, "\n".join(data)))
            event, data = None, []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)
    return events


def stream_problem(api: str, text: str) -> str | None:
    """Why an SSE body is not a well-formed, successfully ended stream of `api`; None if it is."""
    events = sse_events(text)
    if not events:
        return "an empty stream"
    names: list[str] = []
    for event, data in events:
        if data == "[DONE]":
            names.append("[DONE]")
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            return f"a frame that is not JSON: {data[:120]!r}"
        name = event or obj.get("type") or ("error" if "error" in obj else "chunk")
        if name in FAILED or (api == "chat" and "error" in obj):
            error = obj.get("error") or (obj.get("response") or {}).get("error") or obj
            return f"{name}: {json.dumps(error)[:400]}"
        names.append(name)
    if api == "messages" and names[0] != "message_start":
        return f"begins with {names[0]!r}, not message_start"
    if names[-1] != TERMINAL[api]:
        return f"ends with {names[-1]!r}, not {TERMINAL[api]!r}"
    if names.count(TERMINAL[api]) != 1:
        return f"{TERMINAL[api]!r} {names.count(TERMINAL[api])} times"
    return None


def response_problem(api: str, status: int, content_type: str, body: Json, text: str) -> str | None:
    """Why one answer is not a good one for its request (`body`); None if it is."""
    if not 200 <= status < 300:
        return f"HTTP {status}: {text[:300]}"
    streamed = isinstance(body, dict) and body.get("stream") is True
    if streamed:
        if not content_type.startswith("text/event-stream"):
            return f"a stream with content-type {content_type!r}"
        return stream_problem(api, text)
    if not content_type.startswith("application/json"):
        return f"content-type {content_type!r}"
    return None


# tools that call another tool named in their arguments (Qwen Code's bridge to its deferred tools)
BRIDGES = frozenset({"tool_call"})


def tool_calls_in(api: str, text: str, streamed: bool) -> list[str]:
    """The names of the tools the model called in one answer (a bridge call also as
    `tool_call:<the tool it calls>`)."""
    names: list[str] = []
    objs: list[Json] = []
    if streamed:
        for _, data in sse_events(text):
            if data != "[DONE]":
                try:
                    objs.append(json.loads(data))
                except ValueError:
                    pass
    else:
        try:
            objs.append(json.loads(text))
        except ValueError:
            return names
    bridged: dict[int, list[str]] = {}  # chat: a bridge call's arguments, by call index (streamed in pieces)
    for obj in objs:
        if api == "chat":
            for choice in obj.get("choices") or []:
                part = choice.get("delta") or choice.get("message") or {}
                for k, c in enumerate(part.get("tool_calls") or []):
                    fn = c.get("function") or {}
                    at = c.get("index", k)
                    if fn.get("name"):
                        names.append(fn["name"])
                        if fn["name"] in BRIDGES:
                            bridged[at] = []
                    if at in bridged and fn.get("arguments"):
                        bridged[at].append(fn["arguments"])
        elif api == "messages":
            block = obj.get("content_block") or {}
            names += [block["name"]] if block.get("type") == "tool_use" else []
            blocks = obj.get("content") or []
            names += [b["name"] for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
        else:
            item = obj.get("item") or {}
            names += [item["name"]] if item.get("type") == "function_call" else []
            items = obj.get("output") or []
            names += [i["name"] for i in items if isinstance(i, dict) and i.get("type") == "function_call"]
    for pieces in bridged.values():  # Qwen Code's tool_call(name, arguments): the tool it calls
        try:
            inner = json.loads("".join(pieces)).get("name")
        except (ValueError, AttributeError):
            inner = None
        if isinstance(inner, str):
            names.append(f"tool_call:{inner}")
    return names


def tool_results_in(api: str, body: Any) -> list[str]:
    """The tool results a request sends back to the model, as text."""
    if not isinstance(body, dict):
        return []
    out: list[str] = []
    if api == "chat":
        out = [json.dumps(m.get("content")) for m in body.get("messages") or [] if m.get("role") == "tool"]
    elif api == "messages":
        for m in body.get("messages") or []:
            if isinstance(m.get("content"), list):
                out += [json.dumps(b.get("content")) for b in m["content"] if b.get("type") == "tool_result"]
    else:
        items = body.get("input")
        if isinstance(items, list):
            out = [json.dumps(i.get("output")) for i in items if i.get("type") == "function_call_output"]
    return out


@dataclass
class Verdict:
    agent: str
    api: str
    exit_code: int | None
    requests: int = 0
    statuses: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # per exchange, "NNN path: why"
    notes: list[str] = field(default_factory=list)  # what the agent did that is no server's fault
    refused_as_expected: bool = False
    tool_called: list[str] = field(default_factory=list)
    tool_result_sent: bool = False
    final: str = ""

    retries: int = 0  # POSTs whose body an earlier POST of the turn had already sent
    task: str = "stock"

    @property
    def ok(self) -> bool:
        if self.refused_as_expected:
            return not self.problems
        return self.server_ok and self.exit_code == 0 and self.model == "round trip"

    @property
    def server_ok(self) -> bool:
        """What the server owes held: every answer 2xx or the well-formed refusal the agent handles, every
        stream ended by its terminal event (`problems` empty: a hang shows there as a stream without its
        end). An agent with no turn limit of its own that the harness had to stop on a looping model
        holds too, and `server` says so."""
        return not self.problems and self.requests > 0

    @property
    def server(self) -> str:
        """The server's verdict, in words. `ok`: every answer and stream as owed and the agent ended its
        turn itself (whether the model did the task is `model`'s to say); a turn the toy model could not
        finish, where the agent gave up at its own limit or the harness stopped it, is said as such,
        never as a pass."""
        if self.problems:
            return f"FAIL ({len(self.problems)} problems)"
        if self.requests == 0:
            return "FAIL (no request)"
        retried = f", {self.retries} requests sent again" if self.retries else ""
        if self.exit_code is None:
            return f"held; the agent stopped by the harness (no turn limit of its own){retried}"
        if self.exit_code != 0:
            return f"held; the agent gave up (exit {self.exit_code}, its turn limit){retried}"
        return f"ok{retried}"

    @property
    def model(self) -> str:
        """What the model did: called the declared tool, and its result went back to it."""
        if self.refused_as_expected:
            return "refused (prompt over the context)"
        if self.tool_called and self.tool_result_sent:
            return "round trip"
        return "called, no result back" if self.tool_called else "no call"


def judge(agent: str, api: str, records: list[Json], exit_code: int | None, final: str, tool: str, value: str,
          expect_refusal: bool) -> Verdict:
    v = Verdict(agent, api, exit_code, requests=len(records), final=final)
    sent: set[str] = set()
    for r in records:
        if r["method"] == "POST":
            key = json.dumps(r.get("body"), sort_keys=True)
            v.retries += key in sent
            sent.add(key)
        v.statuses.append(r.get("status", 0))
        if not isinstance(r.get("body"), dict) and r["method"] == "POST":
            v.problems.append(f"{r['seq']:03d} {r['path']}: a body that is not JSON")
            continue
        if r["method"] != "POST":
            continue
        if expect_refusal and r.get("status") == 400:
            if refusal_problem(api, r.get("response", "")) is None:
                v.refused_as_expected = True
                continue
        if v.tool_called and any(value in t for t in tool_results_in(api, r["body"])):
            v.tool_result_sent = True
        why = response_problem(api, r.get("status", 0), r.get("content_type", ""), r["body"], r.get("response", ""))
        if why and r.get("client_closed") and 200 <= r.get("status", 0) < 300:
            v.notes.append(f"{r['seq']:03d} {r['path']}: the agent closed the stream before its end")
        elif why:
            v.problems.append(f"{r['seq']:03d} {r['path']}: {why}")
        streamed = r["body"].get("stream") is True
        v.tool_called += [n for n in tool_calls_in(api, r.get("response", ""), streamed) if tool in n]
    if expect_refusal and not v.refused_as_expected:
        v.problems.append("expected the context-length refusal (400), got none")
    return v


def refusal_problem(api: str, text: str) -> str | None:
    """Why a 400 is not the context-length refusal the agent's SDK understands; None if it is."""
    try:
        body = json.loads(text)
    except ValueError:
        return f"not JSON: {text[:200]!r}"
    if api == "messages":
        if body.get("type") != "error" or body.get("error", {}).get("type") != "invalid_request_error":
            return f"not Anthropic's invalid_request_error shape: {text[:300]}"
        return None
    err = body.get("error")
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return f"not OpenAI's error shape: {text[:300]}"
    if err.get("code") != "context_length_exceeded" or err.get("param") == "max_tokens":
        return f"not the refusal of a prompt longer than the context: {err['message'][:200]}"
    return None
