"""Anthropic Messages: the wire request (`types.MessagesRequest`, or `CountTokensRequest`: the
prompt side alone) into the front-end-neutral `ChatRequest`: system blocks, text / image /
document / tool_use / tool_result / thinking blocks, tools, tool_choice, thinking.

Tool search (client-side, as Claude Code runs it for MCP tools): a tool with `defer_loading` is
left out of the `ChatRequest` (neither in the prompt nor callable) until a tool_result of the
conversation holds a `tool_reference` to it; from then on it is declared like any tool. The
reference reaches the model where it stands, as the tool's definition in the form ToolSearch's
description promises (`<functions>`, one `<function>{"description", "name", "parameters"}</function>`
line per tool). A reference to a tool that is not in `tools` is a 400.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import msgspec

from mlx_relay.chat.types import (
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDef,
    ImageUrl,
    ImageUrlPart,
    NamedToolChoice,
    TextPart,
    ToolCall,
    ToolDef,
)
from mlx_relay.errors import InvalidRequest
from mlx_relay.http.formats.anthropic.types import (
    Base64Source,
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    InputBlock,
    InputMessage,
    MessagesRequest,
    PlainTextSource,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingAdaptive,
    ThinkingBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    Tool,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolResultPart,
    ToolUseBlock,
    UrlSource,
)
from mlx_relay.http.formats.speculation import speculation_of
from mlx_relay.service import ChatRequest

_ERROR_PREFIX = "Error: "  # a tool_result with is_error: true reaches the model as this + its text


class ToolSet:
    """The request's client tools by name, and the deferred ones the conversation loaded."""

    def __init__(self, tools: list[Tool] | None) -> None:
        self.tools = [t for t in tools or () if t.input_schema is not None or t.type in (None, "custom")]
        self.by_name = {t.name: t for t in self.tools}
        self.loaded: set[str] = set()

    def reference(self, refs: Sequence[tuple[ToolReferenceBlock, str]]) -> TextPart:
        """Consecutive references of a tool_result as one `<functions>` block; each loads its tool."""
        lines = []
        for ref, where in refs:
            tool = self.by_name.get(ref.tool_name)
            if tool is None:
                raise InvalidRequest(f"{where}: tool_reference names a tool that is not in tools: {ref.tool_name!r}",
                                     param=where)
            self.loaded.add(tool.name)
            spec = {"description": tool.description, "name": tool.name, "parameters": tool.input_schema}
            entry = {k: v for k, v in spec.items() if v is not None}
            lines.append(f"<function>{json.dumps(entry, ensure_ascii=False)}</function>")
        return TextPart("<functions>\n" + "\n".join(lines) + "\n</functions>")

    def declared(self) -> list[ToolDef] | None:
        """Client tools only: server tools (a versioned `type`, no `input_schema`) run on Anthropic's
        side, and this server has none, so they are left out; so are deferred tools not loaded."""
        defs = [ToolDef(FunctionDef(t.name, t.description, t.input_schema))
                for t in self.tools if not t.defer_loading or t.name in self.loaded]
        return defs or None


def _image_url(block: ImageBlock, where: str) -> ImageUrlPart:
    source = block.source
    if isinstance(source, Base64Source):
        return ImageUrlPart(ImageUrl(f"data:{source.media_type};base64,{source.data}"))
    if isinstance(source, UrlSource):
        return ImageUrlPart(ImageUrl(source.url))
    raise InvalidRequest("file sources (the Files API) are not supported: send base64 or a URL", param=where)


def _document_text(block: DocumentBlock, where: str) -> TextPart:
    if not isinstance(block.source, PlainTextSource):
        raise InvalidRequest("only plain-text documents are supported", param=where)
    heading = "\n".join(s for s in (block.title, block.context) if s)
    return TextPart(f"{heading}\n\n{block.source.data}" if heading else block.source.data)


def _part(block: TextBlock | ImageBlock | DocumentBlock, where: str) -> ContentPart:
    if isinstance(block, TextBlock):
        return TextPart(block.text)
    if isinstance(block, ImageBlock):
        return _image_url(block, where)
    return _document_text(block, where)


def _content(parts: list[ContentPart]) -> str | list[ContentPart]:
    """Text-only parts collapse to a string (as the normalizer would: joined with "")."""
    if all(isinstance(p, TextPart) for p in parts):
        return "".join(p.text for p in parts if isinstance(p, TextPart))
    return parts


def _result_parts(blocks: list[ToolResultPart], tools: ToolSet, where: str) -> list[ContentPart]:
    parts: list[ContentPart] = []
    refs: list[tuple[ToolReferenceBlock, str]] = []
    for k, block in enumerate(blocks):
        at = f"{where}.content[{k}]"
        if isinstance(block, ToolReferenceBlock):
            refs.append((block, f"{at}.tool_name"))
            continue
        if refs:
            parts.append(tools.reference(refs))
            refs = []
        parts.append(_part(block, at))
    if refs:
        parts.append(tools.reference(refs))
    return parts


def _tool_result(block: ToolResultBlock, names: dict[str, str], tools: ToolSet, where: str) -> ChatMessage:
    if block.content is None or isinstance(block.content, str):
        parts: list[ContentPart] = [TextPart(block.content or "")]
    else:
        parts = _result_parts(block.content, tools, where)
    if block.is_error:
        parts.insert(0, TextPart(_ERROR_PREFIX))
    return ChatMessage(role="tool", content=_content(parts), tool_call_id=block.tool_use_id,
                       name=names.get(block.tool_use_id))


def _user_messages(blocks: list[InputBlock], names: dict[str, str], tools: ToolSet, where: str
                   ) -> list[ChatMessage]:
    """One `tool` message per tool_result, the other blocks as user turns between them (in order)."""
    out: list[ChatMessage] = []
    pending: list[ContentPart] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if isinstance(block, ToolResultBlock):
            if pending:
                out.append(ChatMessage(role="user", content=_content(pending)))
                pending = []
            out.append(_tool_result(block, names, tools, at))
        elif isinstance(block, TextBlock | ImageBlock | DocumentBlock):
            pending.append(_part(block, at))
        else:
            raise InvalidRequest(f"a {type(block).__struct_config__.tag} block belongs in an assistant message",
                                 param=at)
    if pending:
        out.append(ChatMessage(role="user", content=_content(pending)))
    return out


def _assistant_message(blocks: list[InputBlock], names: dict[str, str], where: str) -> ChatMessage:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            if block.thinking:
                thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            names[block.id] = block.name
            arguments = msgspec.json.encode(block.input).decode()
            calls.append(ToolCall(id=block.id, function=FunctionCall(block.name, arguments)))
        elif not isinstance(block, RedactedThinkingBlock):  # redacted thinking is opaque: dropped
            raise InvalidRequest(f"a {type(block).__struct_config__.tag} block belongs in a user message",
                                 param=f"{where}.content[{j}]")
    return ChatMessage(
        role="assistant",
        content="".join(texts) if texts or not calls else None,
        tool_calls=calls or None,
        reasoning_content="\n\n".join(thoughts) if thoughts else None,
    )


# Claude Code's first system block carries a per-request nonce ("...; cch=<nonce>;"); kept, it
# would make every prompt's prefix new and defeat the prefix cache (vllm-mlx #522)
_BILLING_HEADER = "x-anthropic-billing-header:"


def _system_message(system: str | list[TextBlock] | None) -> list[ChatMessage]:
    if system is None:
        return []
    if isinstance(system, str):
        text = system
    else:
        text = "\n\n".join(b.text for b in system if not b.text.lstrip().startswith(_BILLING_HEADER))
    return [ChatMessage(role="system", content=text)] if text else []


def _system_text(content: str | list[InputBlock]) -> str:
    if isinstance(content, str):
        return content
    return "\n\n".join(b.text for b in content if isinstance(b, TextBlock))


def to_messages(system: str | list[TextBlock] | None, messages: list[InputMessage], tools: ToolSet
                ) -> list[ChatMessage]:
    """The conversation as chat messages; the deferred tools its tool_results reference are
    recorded as loaded in `tools`."""
    if not messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    out = _system_message(system)
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool messages answering them
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.role == "system":  # the normalizer merges it into the system prompt
            out.append(ChatMessage(role="system", content=_system_text(message.content)))
        elif isinstance(message.content, str):
            out.append(ChatMessage(role=message.role, content=message.content))
        elif message.role == "assistant":
            out.append(_assistant_message(message.content, names, where))
        else:
            out.extend(_user_messages(message.content, names, tools, where))
    return out


def _tool_choice(body: CountTokensRequest, tools: list[ToolDef] | None) -> dict[str, object]:
    choice = body.tool_choice
    if choice is None:
        return {}
    if isinstance(choice, ToolChoiceNone):
        return {"tool_choice": "none"}
    names = {t.function.name for t in tools or []}
    if isinstance(choice, ToolChoiceAny | ToolChoiceTool) and not names:
        raise InvalidRequest(f"tool_choice {choice.__struct_config__.tag!r} needs tools", param="tool_choice")
    mapped: object = "auto"
    if isinstance(choice, ToolChoiceAny):
        mapped = "required"
    elif isinstance(choice, ToolChoiceTool):
        if choice.name not in names:
            raise InvalidRequest(f"tool_choice names an undeclared tool: {choice.name!r}", param="tool_choice.name")
        mapped = NamedToolChoice(choice.name)
    return {"tool_choice": mapped, "parallel_tool_calls": not choice.disable_parallel_tool_use}


def _thinking(body: CountTokensRequest) -> dict[str, object]:
    thinking = body.thinking
    if isinstance(thinking, ThinkingDisabled):
        return {"enable_thinking": False}
    if isinstance(thinking, ThinkingAdaptive):
        return {"enable_thinking": True}
    if isinstance(thinking, ThinkingEnabled):
        if thinking.budget_tokens is not None and thinking.budget_tokens < 1:
            raise InvalidRequest("thinking.budget_tokens must be at least 1", param="thinking.budget_tokens")
        return {"enable_thinking": True, "thinking_budget": thinking.budget_tokens}
    return {}  # not given: the chat template's default


def to_chat_request(body: CountTokensRequest) -> ChatRequest:
    """The prompt side of a request (all that `count_tokens` needs); `MessagesRequest` adds sampling.
    Anthropic's rule: a tool_choice that forces tool use (`any`, `tool`) excludes extended
    thinking (asking for both is a 400; forcing alone turns the template's thinking off)."""
    toolset = ToolSet(body.tools)
    messages = to_messages(body.system, body.messages, toolset)  # first: it loads deferred tools
    tools = toolset.declared()
    fields: dict[str, object] = {**_tool_choice(body, tools), **_thinking(body)}
    if isinstance(body.tool_choice, ToolChoiceAny | ToolChoiceTool):
        if fields.get("enable_thinking"):
            raise InvalidRequest("thinking may not be enabled when tool_choice forces tool use", param="thinking")
        fields["enable_thinking"] = False
    if isinstance(body, MessagesRequest):
        speculation = speculation_of(body.speculation)
        fields.update(
            max_tokens=body.max_tokens,
            stop=tuple(body.stop_sequences or ()),
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            specprefill=body.specprefill,
            specprefill_keep=body.specprefill_keep,
            specprefill_anchor_ngram=body.specprefill_anchor_ngram,
            speculation=speculation.method,
            max_draft_tokens=speculation.max_draft_tokens,
        )
    return ChatRequest(messages=messages, tools=tools, **fields)  # type: ignore[arg-type]
