"""OpenAI Responses API: the wire request into the front-end-neutral `ChatRequest`, and the
response object that echoes its settings (`translate`).

Input items become chat messages (`items_to_messages`): `instructions` a leading system message,
`function_call` items assistant `tool_calls` (merged into the assistant turn before them),
`function_call_output` items `tool` messages, reasoning items the next assistant turn's
`reasoning_content`. A stored response's output becomes the assistant turn a continuation sees
(`output_messages`). Tools and `tool_choice`, namespaces and all: `tools.py`.
"""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec

from mlx_relay.chat.types import (
    ChatMessage,
    ContentPart,
    FunctionCall,
    ImageUrl,
    ImageUrlPart,
    ResponseFormat,
    TextPart,
    ToolCall,
)
from mlx_relay.errors import InvalidRequest
from mlx_relay.http.formats.responses.tools import ToolNames, parse_tool_choice, to_tool_defs
from mlx_relay.http.formats.responses.types import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputImagePart,
    InputItem,
    InputTextPart,
    MessageItem,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    ReasoningConfig,
    ReasoningItem,
    RefusalPart,
    ResponseObject,
    ResponsesRequest,
    TextConfig,
    TextFormat,
    convert,
    new_id,
    type_of,
)
from mlx_relay.http.formats.speculation import speculation_of
from mlx_relay.service import ChatRequest

_ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


_PART_TYPES: dict[str, type[InputTextPart | RefusalPart | InputImagePart]] = {
    "input_text": InputTextPart,
    "output_text": InputTextPart,
    "text": InputTextPart,
    "refusal": RefusalPart,
    "input_image": InputImagePart,
}


# history items of OpenAI's hosted tools: nothing a local model can continue from, so left out
_HOSTED_CALL_ITEMS = frozenset({
    "web_search_call", "file_search_call", "tool_search_call", "image_generation_call", "code_interpreter_call",
    "computer_call", "computer_call_output", "mcp_call", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "local_shell_call", "local_shell_call_output",
})


def _custom_as_function(raw: dict[str, Any], where: str) -> InputItem:
    """Codex's freeform tools (e.g. apply_patch) travel as function calls with one `input`."""
    if raw.get("type") == "custom_tool_call":
        args = json.dumps({"input": raw.get("input", "")}, ensure_ascii=False)
        return convert({"call_id": raw.get("call_id"), "name": raw.get("name"), "arguments": args},
                        FunctionCallItem, where)
    return convert({"call_id": raw.get("call_id"), "output": raw.get("output", "")}, FunctionCallOutputItem, where)


def parse_items(input: str | list[dict[str, Any]]) -> list[InputItem]:
    """The request's `input` as typed items; a string is one user message."""
    if isinstance(input, str):
        return [MessageItem(role="user", content=input)]
    items: list[InputItem] = []
    for i, raw in enumerate(input):
        where = f"input[{i}]"
        kind = type_of(raw, where, default="message")
        if kind in _HOSTED_CALL_ITEMS:
            continue
        if kind in ("custom_tool_call", "custom_tool_call_output"):
            items.append(_custom_as_function(raw, where))
            continue
        cls = _ITEM_TYPES.get(kind)
        if cls is None:
            supported = ", ".join(_ITEM_TYPES)
            raise InvalidRequest(f"{where}: input item type '{kind}' is not supported (supported: {supported})",
                                 param=f"{where}.type")
        items.append(convert(raw, cls, where))
    return items


def _parts(raw: str | list[dict[str, Any]], where: str) -> str | list[ContentPart]:
    """Message or tool-output content as chat content parts."""
    if isinstance(raw, str):
        return raw
    parts: list[ContentPart] = []
    for j, part in enumerate(raw):
        at = f"{where}[{j}]"
        kind = type_of(part, at)
        cls = _PART_TYPES.get(kind)
        if cls is None:
            supported = ", ".join(_PART_TYPES)
            raise InvalidRequest(f"{at}: content part type '{kind}' is not supported (supported: {supported})",
                                 param=f"{at}.type")
        value = convert(part, cls, at)
        if isinstance(value, InputTextPart):
            parts.append(TextPart(value.text))
        elif isinstance(value, RefusalPart):
            parts.append(TextPart(value.refusal))
        elif value.image_url:
            parts.append(ImageUrlPart(ImageUrl(value.image_url, value.detail)))
        else:
            raise InvalidRequest(f"{at}: input_image needs an image_url (a URL or a data URL); file_id is not "
                                 "supported", param=f"{at}.image_url")
    return parts


def _reasoning_text(item: ReasoningItem) -> str:
    texts = [p.text for p in item.content] if item.content else [p.text for p in item.summary]
    return "\n\n".join(t for t in texts if t)


def _join(left: str | None, right: str | None) -> str | None:
    if not left or not right:
        return left or right
    return left + "\n\n" + right


def items_to_messages(items: list[InputItem], names: ToolNames | None = None) -> list[ChatMessage]:
    """Chat messages for the items, in order. Function calls join the assistant turn right before
    them (its text and earlier calls), a namespaced one under the name the model knows it by
    (`names`); reasoning text goes to the next assistant turn (dropped if none follows)."""
    names = names or ToolNames()
    messages: list[ChatMessage] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            reasoning = _join(reasoning, _reasoning_text(item))
        elif isinstance(item, MessageItem):
            content = _parts(item.content, f"input[{i}].content")
            if item.role == "assistant":
                messages.append(ChatMessage("assistant", content, reasoning_content=reasoning))
                reasoning = None
            else:
                messages.append(ChatMessage(item.role, content))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(item.call_id, FunctionCall(names.qualified(item.namespace, item.name), item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
                last.reasoning_content = _join(last.reasoning_content, reasoning)
            else:
                messages.append(ChatMessage("assistant", None, tool_calls=[call], reasoning_content=reasoning))
            reasoning = None
        else:
            output = _parts(item.output, f"input[{i}].output")
            messages.append(ChatMessage("tool", output, tool_call_id=item.call_id))
    return messages


def output_messages(output: list[OutputItem], names: ToolNames | None = None) -> list[ChatMessage]:
    """A response's output as the assistant turn a continuation sees (namespaced calls under the
    names the model knows them by)."""
    names = names or ToolNames()
    turn = ChatMessage("assistant", "")
    for item in output:
        if isinstance(item, OutputReasoning):
            turn.reasoning_content = _join(turn.reasoning_content, "".join(p.text for p in item.content))
        elif isinstance(item, OutputMessage):
            text = "".join(p.text for p in item.content)
            turn.content = _join(turn.content if isinstance(turn.content, str) else None, text) or ""
        else:
            namespace = item.namespace if isinstance(item.namespace, str) else None
            call = ToolCall(item.call_id, FunctionCall(names.qualified(namespace, item.name), item.arguments))
            turn.tool_calls = [*(turn.tool_calls or []), call]
    return [turn]


def response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema" and fmt.schema is None:
        raise InvalidRequest("text.format of type json_schema needs a schema", param="text.format.schema")
    return ResponseFormat(fmt.type, fmt.schema, fmt.name, fmt.strict)


def _text_echo(text: TextConfig | None) -> TextConfig:
    if text is None:
        return TextConfig(TextFormat("text"))
    return text if text.format is not None else msgspec.structs.replace(text, format=TextFormat("text"))


def thinking(reasoning: ReasoningConfig | None) -> bool | None:
    """`reasoning.effort` as the chat template's `enable_thinking`; no effort leaves its default."""
    if reasoning is None or reasoning.effort is None:
        return None
    return reasoning.effort.lower() not in ("none", "minimal")


def translate(body: ResponsesRequest, model: str, conversation: list[ChatMessage], tools: list[FunctionTool],
              names: ToolNames) -> tuple[ChatRequest, ResponseObject]:
    """The chat request for `conversation` (earlier turns and this input, as messages) under the
    body's settings with `tools` (`parse_tools`), and the response object that echoes them
    (`in_progress`, no output yet)."""
    if not conversation:
        raise InvalidRequest("input must not be empty", param="input")
    choice, choice_echo = parse_tool_choice(body.tool_choice, tools, names)
    system = [ChatMessage("system", body.instructions)] if body.instructions else []
    speculation = speculation_of(body.speculation)
    req = ChatRequest(
        messages=system + conversation,
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=to_tool_defs(tools),
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        response_format=response_format(body.text),
        enable_thinking=thinking(body.reasoning),
        specprefill=body.specprefill,
        specprefill_keep=body.specprefill_keep,
        specprefill_anchor_ngram=body.specprefill_anchor_ngram,
        speculation=speculation.method,
        max_draft_tokens=speculation.max_draft_tokens,
    )
    response = ResponseObject(
        id=new_id("resp"), created_at=int(time.time()), status="in_progress", model=model, output=[],
        parallel_tool_calls=req.parallel_tool_calls, tool_choice=choice_echo, tools=tools,
        text=_text_echo(body.text), store=body.store is not False, instructions=body.instructions,
        previous_response_id=body.previous_response_id, max_output_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, reasoning=body.reasoning,
        metadata=body.metadata or {}, user=body.user, prompt_cache_key=body.prompt_cache_key,
    )
    return req, response
