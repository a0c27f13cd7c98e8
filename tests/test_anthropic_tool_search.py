"""Anthropic tool search on `/v1/messages` (issue 30, point 1): tools with `defer_loading` stay out of
the prompt and the tool-call grammar until a `tool_reference` in a tool_result loads them, and the
reference reaches the model as the tool's definition. Conversion on its own, the routes over a
scripted service (the 400s), and Claude Code's recorded round trip
(`tests/agent_requests/claude-code-toolsearch/`) through the grammar and the reply parser; the
recorded requests' replays against a real server are `tests/test_agent_requests.py`'s."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import msgspec
import pytest
from transformers import AutoTokenizer

from mlx_relay.chat.grammar import OutputConstraint, lazy_tool_grammar
from mlx_relay.chat.output import ToolCallEnd
from mlx_relay.chat.reply_parser import ReplyParser
from mlx_relay.default_model import default_model_path
from mlx_relay.errors import InvalidRequest
from mlx_relay.http.formats.anthropic.request import to_chat_request
from mlx_relay.http.formats.anthropic.types import CountTokensRequest, MessagesRequest
from mlx_relay.service import ChatRequest
from tests.test_anthropic_messages import ScriptedService, scripted_client
from tests.test_grammar import accepts

RECORDED = Path(__file__).parent / "agent_requests" / "claude-code-toolsearch"
STOCK_SCHEMA = {"type": "object", "properties": {"path": {"title": "Path", "type": "integer"}}, "required": ["path"]}
TOOLS: list[dict[str, Any]] = [
    {"name": "ToolSearch", "description": "Fetches deferred tools.",
     "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}},
    {"name": "DeferredToolPlaceholder", "description": "never call this tool",
     "input_schema": {"type": "object", "properties": {}}, "defer_loading": True},
    {"name": "mcp__stock__get_stock", "description": "Get a stock — by path.", "input_schema": STOCK_SCHEMA,
     "defer_loading": True},
    {"name": "mcp__stock__delete_stock", "description": "Delete a stock.", "input_schema": STOCK_SCHEMA,
     "defer_loading": True},
]
ASK = {"role": "user", "content": "What is stock 423?"}
SEARCH = {"role": "assistant", "content": [
    {"type": "tool_use", "id": "toolu_1", "name": "ToolSearch", "input": {"query": "select:mcp__stock__get_stock"}}]}
STOCK_CALL = ("<tool_call>\n<function=mcp__stock__get_stock>\n<parameter=path>\n423\n</parameter>\n</function>\n"
              "</tool_call>")


def found(*names: str, before: str | None = None) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": before}] if before is not None else []
    content += [{"type": "tool_reference", "tool_name": n} for n in names]
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": content}]}


def convert(messages: list[dict[str, Any]], body_type: type[CountTokensRequest] = MessagesRequest) -> ChatRequest:
    body = {"model": "tiny", "max_tokens": 8, "messages": messages, "tools": TOOLS}
    return to_chat_request(msgspec.json.decode(json.dumps(body), type=body_type))


def declared(req: ChatRequest) -> list[str]:
    return [t.function.name for t in req.tools or []]


def test_a_deferred_tool_is_declared_once_a_tool_result_references_it() -> None:
    assert declared(convert([ASK])) == ["ToolSearch"]  # the placeholder and the MCP tools: not yet
    req = convert([ASK, SEARCH, found("mcp__stock__get_stock")])
    assert declared(req) == ["ToolSearch", "mcp__stock__get_stock"]  # the request's order; never the placeholder
    assert req.tools and req.tools[1].function.parameters == STOCK_SCHEMA
    for body_type in (MessagesRequest, CountTokensRequest):  # count_tokens converts the same way
        assert convert([ASK, SEARCH, found("mcp__stock__get_stock")], body_type).tools == req.tools
    # loaded for the rest of the conversation: later turns keep it declared
    later = [ASK, SEARCH, found("mcp__stock__get_stock"),
             {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "mcp__stock__get_stock",
                                                "input": {"path": 423}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "123456"}]}]
    assert declared(convert(later)) == ["ToolSearch", "mcp__stock__get_stock"]


def test_a_reference_reaches_the_model_as_the_tools_definition() -> None:
    """One `<functions>` block per run of references, one `<function>` JSON line per tool, in the
    form ToolSearch's description promises (description, name, parameters)."""
    req = convert([ASK, SEARCH, found("mcp__stock__get_stock", "mcp__stock__delete_stock", before="Found: ")])
    tool = req.messages[-1]
    assert (tool.role, tool.tool_call_id, tool.name) == ("tool", "toolu_1", "ToolSearch")
    schema = json.dumps(STOCK_SCHEMA)
    assert tool.content == (
        "Found: <functions>\n"
        f'<function>{{"description": "Get a stock — by path.", "name": "mcp__stock__get_stock", '
        f'"parameters": {schema}}}</function>\n'
        f'<function>{{"description": "Delete a stock.", "name": "mcp__stock__delete_stock", '
        f'"parameters": {schema}}}</function>\n'
        "</functions>")
    assert declared(req) == ["ToolSearch", "mcp__stock__get_stock", "mcp__stock__delete_stock"]


def test_a_reference_to_a_tool_not_in_tools_is_refused() -> None:
    with pytest.raises(InvalidRequest) as refused:
        convert([ASK, SEARCH, found("mcp__stock__get_stock", "mcp__stock__sell")])
    assert refused.value.param == "messages[2].content[0].content[1].tool_name"
    assert "'mcp__stock__sell'" in refused.value.message and refused.value.param in refused.value.message


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
async def test_the_routes_refuse_an_unknown_reference_in_anthropics_shape(path: str) -> None:
    service = ScriptedService([])
    body = {"model": "tiny", "max_tokens": 8, "tools": TOOLS, "messages": [ASK, SEARCH, found("nope")]}
    async with scripted_client(service) as http:
        r = await http.post(path, json=body)
        outside = await http.post(path, json={**body, "messages": [  # only inside a tool_result
            {"role": "user", "content": [{"type": "tool_reference", "tool_name": "mcp__stock__get_stock"}]}]})
    assert r.status_code == 400, r.text
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": (
        "messages[2].content[0].content[0].tool_name: tool_reference names a tool that is not in tools: 'nope'")}}
    assert outside.status_code == 400 and outside.json()["error"]["type"] == "invalid_request_error", outside.text
    assert service.requests == []


def recorded(name: str) -> ChatRequest:
    body = json.loads((RECORDED / f"{name}.json").read_text())["body"]
    return to_chat_request(msgspec.json.decode(json.dumps(body), type=MessagesRequest))


def test_claude_codes_round_trip_declares_what_it_loaded() -> None:
    """Claude Code 2.1.332's recorded requests: before ToolSearch the MCP tool is not even in
    `tools`; after it, it is (deferred) and loaded by the tool_result's reference."""
    first, searched, called = recorded("001"), recorded("002"), recorded("003")
    assert "ToolSearch" in declared(first) and "DeferredToolPlaceholder" not in declared(first)
    assert "mcp__stock__get_stock" not in declared(first)
    for req in (searched, called):
        assert declared(req) == [*declared(first), "mcp__stock__get_stock"]
    reference = searched.messages[-1]
    assert reference.role == "tool" and isinstance(reference.content, str)
    assert reference.content.startswith('<functions>\n<function>{"description": "Get a stock.", '
                                        '"name": "mcp__stock__get_stock", "parameters": {')


def test_a_call_to_the_loaded_tool_is_admitted_and_parsed_as_a_call() -> None:
    """The grammar `auto` decodes under, built from the declared tools of Claude Code's request after
    ToolSearch, admits a call to the loaded MCP tool and no call to the placeholder; the reply
    parser reads that call as a tool call."""
    tools = recorded("002").tools
    tok = AutoTokenizer.from_pretrained(default_model_path())
    llg = llguidance.hf.from_tokenizer(tok, eos_token=tok.convert_tokens_to_ids("<|im_end|>"))
    grammar, _ = lazy_tool_grammar(OutputConstraint(tools=tools), frozenset(tok.get_added_vocab()), llg)
    assert grammar is not None
    assert accepts(grammar, "Loaded. " + STOCK_CALL, tok, llg)
    placeholder = "<tool_call>\n<function=DeferredToolPlaceholder>\n</function>\n</tool_call>"
    assert not accepts(grammar, placeholder, tok, llg)
    before, _ = lazy_tool_grammar(OutputConstraint(tools=recorded("001").tools), frozenset(tok.get_added_vocab()), llg)
    assert before is not None and not accepts(before, STOCK_CALL, tok, llg)  # not callable before it is loaded
    parser = ReplyParser(tools=tools, tool_format="qwen3_coder")
    ends = [e for e in parser.feed(STOCK_CALL) + parser.finish() if isinstance(e, ToolCallEnd)]
    assert [(e.name, json.loads(e.arguments)) for e in ends] == [("mcp__stock__get_stock", {"path": 423})]
