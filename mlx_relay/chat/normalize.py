"""Message normalization: the rules the Normalizer actor applies before the chat template.

Coding agents (OpenCode, Claude Code, Codex, Qwen Code, Cline) send message sequences that strict chat
templates (Qwen 3.x) reject with "System message must be at the beginning": system messages in the middle
of a conversation, several system messages, the ``developer`` role, consecutive same-role turns. The
functions here rewrite such a sequence into one every ChatML-style template accepts, then convert it to the
plain dicts Hugging Face chat templates expect. They are pure: no I/O, no globals, inputs never mutated.

Rules of :func:`normalize_messages`, in order:

a. ``developer`` becomes ``system``.
b. Every system message is merged into one, hoisted to position 0. Texts are joined with ``"\\n\\n"`` in
   order of appearance (empty texts are skipped; all empty gives ``""``). A system message with image or
   video parts raises :class:`NormalizationError` (the HTTP layer answers 400).
c. Consecutive messages of the same role are merged (after the hoist, so ``user, system, user`` becomes one
   user turn). Text is joined with ``"\\n\\n"``. If either side carries media, the result is a list of
   parts: the left parts, a ``TextPart("\\n\\n")`` separator (only when both sides are non-empty), then the
   right parts; nothing is coalesced, dropped or reordered, so it renders exactly like the string join.
   Assistant turns also concatenate ``tool_calls`` and join ``reasoning_content``. ``tool`` messages are
   never merged: each answers its own ``tool_call_id``.
d. Tool calls and tool results keep their ids, names and arguments untouched.
e. Content may be a string, a list of parts or ``None``. A list of text parts only is collapsed to a string,
   the texts joined with ``""`` (this is how Qwen templates render a text-only list anyway, so the prompt
   is unchanged). ``None`` stays ``None`` (assistant turns with ``tool_calls``); ``""`` is kept.
f. Output messages are new structs (``msgspec.structs.replace``) with fresh lists; parts are shared (they
   are never modified).
g. Nothing is invented: a lone system message stays a lone system message. An empty list raises
   :class:`NormalizationError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from msgspec.structs import replace

from mlx_relay.chat.types import (
    ChatMessage,
    ContentPart,
    ImageUrlPart,
    MediaPart,
    TextPart,
    ToolCall,
    VideoUrlPart,
)

__all__ = [
    "NormalizationError",
    "media_parts",
    "normalize_messages",
    "to_template_messages",
]

_SEPARATOR = "\n\n"

Content = str | list[ContentPart] | None


class NormalizationError(ValueError):
    """A message sequence that cannot be made acceptable to the chat template (a client error: HTTP 400)."""


# ---------------------------------------------------------------------------------------------------------
# Content helpers
# ---------------------------------------------------------------------------------------------------------


def _has_media(content: Content) -> bool:
    return isinstance(content, list) and any(not isinstance(p, TextPart) for p in content)


def _canonical_content(content: Content) -> Content:
    """A fresh copy of ``content``; a list of text parts only collapses to a string (joined with "")."""
    if content is None or isinstance(content, str):
        return content
    if _has_media(content):
        return list(content)
    return "".join(p.text for p in content if isinstance(p, TextPart))


def _is_empty(content: Content) -> bool:
    return content is None or len(content) == 0


def _merge_content(left: Content, right: Content) -> Content:
    """Join two canonical contents as rule (c) says; ``None`` only when both sides are ``None``."""
    if left is None and right is None:
        return None
    if _is_empty(right):
        return _canonical_content(left) if left is not None else _canonical_content(right)
    if _is_empty(left):
        return _canonical_content(right)
    if isinstance(left, str) and isinstance(right, str):
        return left + _SEPARATOR + right
    left_parts: list[ContentPart] = [TextPart(left)] if isinstance(left, str) else list(left or [])
    right_parts: list[ContentPart] = [TextPart(right)] if isinstance(right, str) else list(right or [])
    return [*left_parts, TextPart(_SEPARATOR), *right_parts]


def _join_optional_text(left: str | None, right: str | None) -> str | None:
    if left is None or right is None:
        return left if right is None else right
    if not left or not right:
        return left or right
    return left + _SEPARATOR + right


def system_prefixes(messages: list[ChatMessage]) -> list[str]:
    """The one system prompt rule (b) makes of the system (and developer) messages, as it stands
    after each of their non-empty texts in turn (the last: the whole). The prefix cache snapshots
    where each ends (`chat.prompt_render`): a new conversation may share the first parts only."""
    texts = [t for i, m in enumerate(messages) if m.role in ("system", "developer") if (t := _system_text(m, i))]
    return [_SEPARATOR.join(texts[:j]) for j in range(1, len(texts) + 1)]


def _system_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    if _has_media(content):
        raise NormalizationError(
            f"messages[{index}]: a {message.role} message may only contain text, not image or video parts"
        )
    return "".join(p.text for p in content if isinstance(p, TextPart))


def _copy(message: ChatMessage, **changes: Any) -> ChatMessage:
    """A new struct with fresh content/tool_calls lists, so callers may mutate the output safely."""
    changes.setdefault("content", _canonical_content(message.content))
    if "tool_calls" not in changes and message.tool_calls is not None:
        changes["tool_calls"] = list(message.tool_calls)
    return replace(message, **changes)


# ---------------------------------------------------------------------------------------------------------
# normalize_messages
# ---------------------------------------------------------------------------------------------------------


def _merge_same_role(left: ChatMessage, right: ChatMessage) -> ChatMessage:
    tool_calls: list[ToolCall] | None = None
    if left.tool_calls is not None or right.tool_calls is not None:
        tool_calls = [*(left.tool_calls or []), *(right.tool_calls or [])]
    return replace(
        left,
        content=_merge_content(left.content, right.content),
        name=left.name if left.name == right.name else None,
        tool_calls=tool_calls,
        reasoning_content=_join_optional_text(left.reasoning_content, right.reasoning_content),
    )


def normalize_messages(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """Rewrite ``messages`` so strict chat templates accept them (rules a–g in the module docstring).

    Raises :class:`NormalizationError` for an empty list or a system/developer message with media.
    """
    if not messages:
        raise NormalizationError("messages must contain at least one message")

    system_texts: list[str] = []
    first_system: ChatMessage | None = None
    rest: list[ChatMessage] = []

    for index, message in enumerate(messages):
        if message.role in ("system", "developer"):  # rules (a) and (b)
            system_texts.append(_system_text(message, index))
            if first_system is None:
                first_system = message
            continue
        current = _copy(message)
        previous = rest[-1] if rest else None
        if previous is not None and previous.role == current.role and current.role != "tool":  # rule (c)
            rest[-1] = _merge_same_role(previous, current)
        else:
            rest.append(current)

    if first_system is None:
        return rest
    non_empty = [t for t in system_texts if t]
    system = replace(
        first_system,
        role="system",
        content=_SEPARATOR.join(non_empty),
        name=first_system.name if len(system_texts) == 1 else None,
        tool_calls=None,
        tool_call_id=None,
        reasoning_content=None,
    )
    return [system, *rest]


# ---------------------------------------------------------------------------------------------------------
# to_template_messages / media_parts
# ---------------------------------------------------------------------------------------------------------


def _template_content(content: Content) -> str | list[dict[str, Any]]:
    # None becomes "": templates test `content is string` or pipe it through filters such as `trim`, where
    # None would render as the text "None".
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, TextPart):
            parts.append({"type": "text", "text": part.text})
        elif isinstance(part, ImageUrlPart):
            parts.append({"type": "image"})
        elif isinstance(part, VideoUrlPart):
            parts.append({"type": "video"})
        else:  # pragma: no cover - the ContentPart union is closed
            raise NormalizationError(f"unsupported content part: {type(part).__name__}")
    return parts


def _template_arguments(call: ToolCall, index: int) -> dict[str, Any]:
    raw = call.function.arguments
    if not raw.strip():
        # Some clients send "" for a call without arguments; that is an empty object, not an error.
        return {}
    try:
        arguments = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise NormalizationError(
            f"messages[{index}]: tool call {call.id!r} ({call.function.name}): arguments are not valid "
            f"JSON: {exc}"
        ) from None
    except RecursionError:  # deeper than the decoder goes (the body's own depth limit never saw this string)
        raise NormalizationError(
            f"messages[{index}]: tool call {call.id!r} ({call.function.name}): arguments are nested too deeply"
        ) from None
    if not isinstance(arguments, dict):
        raise NormalizationError(
            f"messages[{index}]: tool call {call.id!r} ({call.function.name}): arguments must be a JSON "
            f"object, got {type(arguments).__name__}"
        )
    return arguments


def to_template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Convert (normalized) messages to the plain dicts Hugging Face chat templates expect.

    ``content`` is a string (``None`` becomes ``""``) or, when media is present, a list of
    ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` / ``{"type": "video"}`` dicts. Assistant
    ``tool_calls`` carry their arguments as a dict parsed from the JSON string (Qwen templates iterate
    ``arguments|items``); arguments that are not a JSON object raise :class:`NormalizationError`. Tool
    messages carry ``tool_call_id`` and ``name``; assistant messages carry ``reasoning_content``.
    """
    result: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        out: dict[str, Any] = {"role": message.role, "content": _template_content(message.content)}
        if message.role == "assistant":
            if message.tool_calls:
                out["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {
                            "name": call.function.name,
                            "arguments": _template_arguments(call, index),
                        },
                    }
                    for call in message.tool_calls
                ]
            if message.reasoning_content is not None:
                out["reasoning_content"] = message.reasoning_content
        elif message.role == "tool":
            if message.tool_call_id is not None:
                out["tool_call_id"] = message.tool_call_id
            if message.name is not None:
                out["name"] = message.name
        result.append(out)
    return result


def media_parts(messages: Sequence[ChatMessage]) -> list[MediaPart]:
    """The image/video parts of ``messages`` in the order their placeholders appear in the prompt.

    Templates render messages in order and each message's parts in order, and normalization never reorders
    media (system messages cannot carry any), so this is simply document order.
    """
    return [
        part
        for message in messages
        if isinstance(message.content, list)
        for part in message.content
        if isinstance(part, ImageUrlPart | VideoUrlPart)
    ]
