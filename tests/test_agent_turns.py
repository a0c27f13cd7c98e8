"""`make agents`' per-request costs (benchmarks/agents/turns.py): the server's request log lines
read back as the server wrote them, matched to the recorder's exchanges by request id, and each
tool round judged against the request whose tool calls it answers (issue 43). Counts only."""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType
from typing import Any

from mlx_relay.log_format import TextFormatter
from mlx_relay.testing.scripts import load_script

_AGENTS = Path(__file__).resolve().parents[1] / "benchmarks" / "agents"
Json = dict[str, Any]


def _turns() -> ModuleType:
    load_script(_AGENTS / "checks.py", "checks")  # what turns.py imports
    return load_script(_AGENTS / "turns.py", "agent_turns")


def _line(**fields: Any) -> str:
    """A request log line as the server's text format writes it."""
    record = logging.LogRecord("mlx_relay.requests", logging.INFO, __file__, 0, "request", None, None)
    record.fields = fields
    return TextFormatter().format(record)


def _logged(request_id: str, prompt: int, cached: int, ttft: float, finish: str = "tool_calls") -> str:
    return _line(request_id=request_id, method="POST", route="/v1/messages", model="relay-tiny-agent", status=200,
                 stream=True, prompt_tokens=prompt, cached_tokens=cached, completion_tokens=40, ttft_s=ttft,
                 duration_s=ttft + 1.5, finish_reason=finish, error=None, error_type=None,
                 response_id=f"msg_{request_id}")


TOOLS = [{"name": "Bash", "input_schema": {"type": "object"}}]
STOCK = {"name": "mcp__stock__get_stock", "input_schema": {"type": "object"}}
SYSTEM = [{"type": "text", "text": "You are Claude Code."}]


def _exchange(seq: int, request_id: str | None, tools: list[Json], results: int, system: list[Json] = SYSTEM) -> Json:
    """A recorded Anthropic request carrying `results` tool results."""
    messages: list[Json] = [{"role": "user", "content": [{"type": "text", "text": "get the stock"}]}]
    for k in range(results):
        messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"t{k}", "name": "x", "input": {}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{k}", "content": "ok"}]}]
    return {"seq": seq, "method": "POST", "path": "/v1/messages?beta=true", "status": 200, "request_id": request_id,
            "body": {"system": system, "tools": tools, "messages": messages, "stream": True}}


def test_the_text_format_reads_back_as_written() -> None:
    turns = _turns()
    lines = ["INFO uvicorn.error: Started server process [9794]",
             _logged("a1", 26277, 0, 331.1725),
             _line(request_id="b2", status=400, prompt_tokens=None, error='too long: "x" = 3 tokens', stream=False),
             "mlx-relay: ready"]
    parsed = turns.parse_request_log(lines)
    assert [p["request_id"] for p in parsed] == ["a1", "b2"]
    assert parsed[0]["prompt_tokens"] == 26277 and parsed[0]["cached_tokens"] == 0
    assert parsed[0]["ttft_s"] == 331.1725 and parsed[0]["stream"] is True and parsed[0]["error"] is None
    assert parsed[1]["error"] == 'too long: "x" = 3 tokens' and parsed[1]["prompt_tokens"] is None
    assert parsed[1]["stream"] is False


def test_each_round_is_judged_against_the_request_it_answers() -> None:
    """Claude Code's shape: the second request declares the tool its tool search loaded (another
    prompt), the third restores the second's prompt but its empty thinking block's token, the
    fourth falls two tokens short; a GET and a request the log lacks are kept apart."""
    turns = _turns()
    log = turns.parse_request_log([
        _logged("r1", 26277, 0, 300.0), _logged("r2", 26672, 0, 290.0), _logged("r3", 26818, 26671, 8.5),
        _logged("r4", 26950, 26816, 8.9, finish="stop")])
    marked = [{**SYSTEM[0], "cache_control": {"type": "ephemeral"}}]  # a moved cache mark: the same prompt
    records = [_exchange(1, "r1", TOOLS, 0), {"seq": 2, "method": "GET", "path": "/v1/models", "status": 200},
               _exchange(3, "r2", [*TOOLS, STOCK], 1), _exchange(4, "r3", [*TOOLS, STOCK], 2, system=marked),
               _exchange(5, "r4", [*TOOLS, STOCK], 3), _exchange(6, "missing", [*TOOLS, STOCK], 4)]
    costs = turns.request_costs("messages", records, log)
    assert [c.seq for c in costs] == [1, 3, 4, 5, 6]
    assert [c.uncached_tokens for c in costs] == [26277, 26672, 147, 134, None]
    assert [c.answers for c in costs] == [None, 1, 3, 4, None]  # #5 ended without tool calls: #6 answers none
    assert [c.continues for c in costs] == [None, False, True, True, None]
    assert [c.past_prompt for c in costs] == [None, -26277, -1, -2, None]
    assert [c.restored for c in costs] == [None, None, True, False, None]
    loop = turns.loop_summary(costs)
    assert (loop.rounds, loop.continuing, loop.restored, loop.new_prompts) == (3, 2, 1, [3])
    assert loop.every_round_restored is False
    assert (loop.first_ttft_s, loop.last_ttft_s, loop.first_prompt_tokens, loop.last_prompt_tokens) == (
        300.0, 8.9, 26277, 26950)
    table = turns.costs_table(costs).splitlines()
    assert len(table) == 2 + len(costs)
    assert table[4] == "| 4 | /v1/messages?beta=true | 200 | 26,818 | 26,671 | 147 | 8.50 | tool_calls | 3 | -1 | yes |"
    assert table[5].endswith("| 4 | -2 | NO |") and "new prompt" in table[3]
    assert table[6] == "| 6 | /v1/messages?beta=true | 200 | - | - | - | - | - | - | - | - |"
    line = turns.loop_line(loop)
    assert "3 tool round(s); 2 continued" in line and "1 of them restored it" in line and "#3" in line


def test_a_turn_without_tool_calls_has_no_loop() -> None:
    turns = _turns()
    costs = turns.request_costs("messages", [_exchange(1, "r1", TOOLS, 0)],
                                turns.parse_request_log([_logged("r1", 500, 256, 0.4, finish="stop")]))
    loop = turns.loop_summary(costs)
    assert loop.rounds == 0 and loop.every_round_restored is None and loop.first_ttft_s is None
    assert turns.loop_line(loop).startswith("no tool round")


def test_a_responses_round_that_restored_the_whole_turn() -> None:
    """Codex's shape: the round restores the previous prompt and the reply (the call as generated)."""
    turns = _turns()
    tools = [{"type": "function", "name": "mcp__stock__get_stock"}]
    first: Json = {"instructions": "You are Codex.", "tools": tools,
                   "input": [{"type": "message", "role": "user", "content": "get the stock"}]}
    call = {"type": "function_call", "name": "mcp__stock__get_stock", "call_id": "c1", "arguments": "{}"}
    result = {"type": "function_call_output", "call_id": "c1", "output": "1"}
    second = first | {"input": [*first["input"], call, result]}
    records = [{"seq": 1, "method": "POST", "path": "/v1/responses", "status": 200, "request_id": "q1", "body": first},
               {"seq": 2, "method": "POST", "path": "/v1/responses", "status": 200, "request_id": "q2", "body": second}]
    log = turns.parse_request_log([_logged("q1", 21347, 0, 131.5), _logged("q2", 21477, 21397, 1.07, finish="stop")])
    costs = turns.request_costs("responses", records, log)
    assert [(c.answers, c.continues, c.past_prompt, c.restored) for c in costs] == [
        (None, None, None, None), (1, True, 50, True)]
    assert turns.costs_table(costs).splitlines()[-1].endswith("| 1 | +50 | yes |")
    assert turns.loop_summary(costs).every_round_restored is True
