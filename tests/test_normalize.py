"""Tests for mlx_relay.chat.normalize: one test per rule, realistic agent sequences, template rendering."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest
from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlx_relay.chat.normalize import (
    NormalizationError,
    media_parts,
    normalize_messages,
    to_template_messages,
)
from mlx_relay.chat.types import (
    ChatMessage,
    FunctionCall,
    ImageUrl,
    ImageUrlPart,
    TextPart,
    ToolCall,
    VideoUrlPart,
)

# ---------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------


def system(text: str) -> ChatMessage:
    return ChatMessage(role="system", content=text)


def dev(text: str) -> ChatMessage:
    return ChatMessage(role="developer", content=text)


def user(content: Any) -> ChatMessage:
    return ChatMessage(role="user", content=content)


def asst(content: Any = None, *, calls: list[ToolCall] | None = None, reasoning: str | None = None):
    return ChatMessage(role="assistant", content=content, tool_calls=calls, reasoning_content=reasoning)


def call(call_id: str, name: str, arguments: str) -> ToolCall:
    return ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))


def tool(call_id: str, content: Any, name: str | None = None) -> ChatMessage:
    return ChatMessage(role="tool", content=content, tool_call_id=call_id, name=name)


def img(url: str) -> ImageUrlPart:
    return ImageUrlPart(image_url=ImageUrl(url=url))


def vid(url: str) -> VideoUrlPart:
    return VideoUrlPart(video_url=url)


def roles(messages: list[ChatMessage]) -> list[str]:
    return [m.role for m in messages]


def snapshot(messages: list[ChatMessage]) -> bytes:
    return msgspec.json.encode(messages)


# ---------------------------------------------------------------------------------------------------------
# Rule (a): developer -> system
# ---------------------------------------------------------------------------------------------------------


def test_developer_becomes_system():
    out = normalize_messages([dev("Be terse."), user("hi")])
    assert out == [system("Be terse."), user("hi")]


def test_developer_and_system_merge_in_order_of_appearance():
    out = normalize_messages([system("A"), user("hi"), dev("B")])
    assert out == [system("A\n\nB"), user("hi")]


# ---------------------------------------------------------------------------------------------------------
# Rule (b): system messages merged and hoisted
# ---------------------------------------------------------------------------------------------------------


def test_system_in_the_middle_is_hoisted_and_merged():
    msgs = [system("rules"), user("q1"), asst("a1"), system("reminder"), user("q2")]
    out = normalize_messages(msgs)
    assert out == [system("rules\n\nreminder"), user("q1"), asst("a1"), user("q2")]


def test_system_only_in_the_middle_moves_to_front():
    out = normalize_messages([user("q1"), asst("a1"), system("late"), user("q2")])
    assert out == [system("late"), user("q1"), asst("a1"), user("q2")]


def test_system_system_user_user():
    out = normalize_messages([system("S1"), system("S2"), user("U1"), user("U2")])
    assert out == [system("S1\n\nS2"), user("U1\n\nU2")]


def test_system_hoist_makes_neighbours_merge():
    out = normalize_messages([user("a"), system("s"), user("b")])
    assert out == [system("s"), user("a\n\nb")]


def test_system_text_parts_joined_and_empty_system_texts_skipped():
    msgs = [
        ChatMessage(role="system", content=[TextPart("You are "), TextPart("helpful.")]),
        system(""),
        ChatMessage(role="system", content=None),
        system("Use tools."),
        user("hi"),
    ]
    assert normalize_messages(msgs)[0] == system("You are helpful.\n\nUse tools.")


def test_single_empty_system_is_kept():
    assert normalize_messages([system(""), user("hi")]) == [system(""), user("hi")]


def test_system_message_with_image_is_an_error():
    msgs = [ChatMessage(role="system", content=[TextPart("look"), img("data:x")]), user("hi")]
    with pytest.raises(NormalizationError, match=r"messages\[0\].*image or video"):
        normalize_messages(msgs)


def test_developer_message_with_video_is_an_error():
    msgs = [user("hi"), ChatMessage(role="developer", content=[vid("file:///v.mp4")])]
    with pytest.raises(NormalizationError, match=r"messages\[1\]"):
        normalize_messages(msgs)


def test_normalization_error_is_a_value_error():
    assert issubclass(NormalizationError, ValueError)


# ---------------------------------------------------------------------------------------------------------
# Rule (c): consecutive same-role turns merged
# ---------------------------------------------------------------------------------------------------------


def test_consecutive_assistant_turns_merge_content_calls_and_reasoning():
    c1, c2 = call("c1", "read", '{"path": "a"}'), call("c2", "read", '{"path": "b"}')
    msgs = [
        user("go"),
        asst("first", calls=[c1], reasoning="think 1"),
        asst("second", calls=[c2], reasoning="think 2"),
    ]
    out = normalize_messages(msgs)
    assert out == [user("go"), asst("first\n\nsecond", calls=[c1, c2], reasoning="think 1\n\nthink 2")]


def test_consecutive_assistant_turns_with_none_content():
    c1, c2 = call("c1", "ls", "{}"), call("c2", "pwd", "{}")
    out = normalize_messages([user("go"), asst(None, calls=[c1]), asst(None, calls=[c2])])
    assert out[1] == asst(None, calls=[c1, c2])
    assert out[1].content is None


def test_assistant_text_then_tool_call_turn():
    c1 = call("c1", "ls", "{}")
    out = normalize_messages([user("go"), asst("Let me look.", reasoning="hmm"), asst("", calls=[c1])])
    assert out[1] == asst("Let me look.", calls=[c1], reasoning="hmm")


def test_consecutive_users_with_images_keep_image_order():
    i1, i2, i3 = img("data:1"), img("data:2"), img("data:3")
    msgs = [
        user([TextPart("first"), i1]),
        user([i2, TextPart("second"), i3]),
        user("third"),
    ]
    out = normalize_messages(msgs)
    assert len(out) == 1
    assert out[0].content == [
        TextPart("first"),
        i1,
        TextPart("\n\n"),
        i2,
        TextPart("second"),
        i3,
        TextPart("\n\n"),
        TextPart("third"),
    ]
    assert media_parts(out) == [i1, i2, i3] == media_parts(msgs)


def test_merge_of_text_and_image_only_turns():
    i1 = img("data:1")
    out = normalize_messages([user("describe this"), user([i1])])
    assert out[0].content == [TextPart("describe this"), TextPart("\n\n"), i1]


def test_merge_with_empty_side_adds_no_separator():
    assert normalize_messages([user(""), user("x")]) == [user("x")]
    assert normalize_messages([user("x"), user("")]) == [user("x")]
    assert normalize_messages([user(""), user("")]) == [user("")]
    i1 = img("data:1")
    assert normalize_messages([user(""), user([i1])])[0].content == [i1]


def test_user_names_kept_only_when_equal():
    a = ChatMessage(role="user", content="a", name="alice")
    b = ChatMessage(role="user", content="b", name="alice")
    c = ChatMessage(role="user", content="c", name="bob")
    assert normalize_messages([a, b])[0].name == "alice"
    assert normalize_messages([a, c])[0].name is None


# ---------------------------------------------------------------------------------------------------------
# Rule (d): tool turns preserved, never merged
# ---------------------------------------------------------------------------------------------------------


def test_tool_turns_preserved_and_consecutive_results_not_merged():
    c1 = call("call_1", "read_file", '{"path": "README.md"}')
    c2 = call("call_2", "grep", '{"pattern": "TODO", "flags": ["-n"]}')
    msgs = [
        user("check"),
        asst(None, calls=[c1, c2]),
        tool("call_1", "# Readme", name="read_file"),
        tool("call_2", "a.py:3: TODO", name="grep"),
    ]
    out = normalize_messages(msgs)
    assert out == msgs
    assert roles(out) == ["user", "assistant", "tool", "tool"]
    assert [m.tool_call_id for m in out[2:]] == ["call_1", "call_2"]
    assert out[1].tool_calls == [c1, c2]
    assert out[1].tool_calls[1].function.arguments == '{"pattern": "TODO", "flags": ["-n"]}'


def test_tool_calls_converted_for_template():
    c1 = call("call_1", "edit", '{"path": "a.py", "edits": [{"old": "x", "new": "y"}]}')
    msgs = normalize_messages([user("fix"), asst("", calls=[c1]), tool("call_1", "ok", name="edit")])
    tpl = to_template_messages(msgs)
    assert tpl[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "edit",
                    "arguments": {"path": "a.py", "edits": [{"old": "x", "new": "y"}]},
                },
            }
        ],
    }
    assert tpl[2] == {"role": "tool", "content": "ok", "tool_call_id": "call_1", "name": "edit"}


@pytest.mark.parametrize("arguments", ['["a", "b"]', '"path"', "42", "null", "{not json", '{"a": 1'])
def test_tool_call_arguments_not_a_json_object_is_an_error(arguments: str):
    msgs = [user("go"), asst(None, calls=[call("c9", "ls", arguments)])]
    with pytest.raises(NormalizationError, match=r"messages\[1\].*'c9' \(ls\).*arguments"):
        to_template_messages(normalize_messages(msgs))


def test_empty_tool_call_arguments_mean_empty_object():
    tpl = to_template_messages([user("go"), asst(None, calls=[call("c1", "pwd", "")])])
    assert tpl[1]["tool_calls"][0]["function"]["arguments"] == {}


# ---------------------------------------------------------------------------------------------------------
# Rule (e): string vs list content
# ---------------------------------------------------------------------------------------------------------


def test_text_only_part_list_collapses_to_string():
    out = normalize_messages([user([TextPart("hello "), TextPart("world")])])
    assert out == [user("hello world")]


def test_list_and_string_content_are_equivalent():
    as_list = normalize_messages([system("s"), user([TextPart("a")]), user([TextPart("b")])])
    as_str = normalize_messages([system("s"), user("a"), user("b")])
    assert as_list == as_str == [system("s"), user("a\n\nb")]


def test_media_lists_stay_lists_and_empty_string_kept():
    i1 = img("data:1")
    out = normalize_messages([user([TextPart("see"), i1]), asst(""), tool("c", "")])
    assert out[0].content == [TextPart("see"), i1]
    assert out[1].content == ""
    assert out[2].content == ""


def test_template_content_forms():
    i1, v1 = img("data:1"), vid("file:///v.mp4")
    msgs = [user([TextPart("a"), i1, v1]), asst(None, calls=[call("c", "f", "{}")], reasoning="r")]
    tpl = to_template_messages(normalize_messages(msgs))
    assert tpl[0] == {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "video"}],
    }
    assert tpl[1]["content"] == ""  # None becomes "" for the template
    assert tpl[1]["reasoning_content"] == "r"


def test_media_parts_in_template_order():
    i1, i2, v1 = img("data:1"), img("data:2"), vid("file:///v.mp4")
    msgs = [
        system("s"),
        user([i1, TextPart("a")]),
        asst("ok"),
        user([TextPart("b"), v1]),
        user([i2]),
    ]
    out = normalize_messages(msgs)
    assert media_parts(out) == [i1, v1, i2]
    assert media_parts([system("s"), user("no media")]) == []


# ---------------------------------------------------------------------------------------------------------
# Rule (f): no in-place mutation
# ---------------------------------------------------------------------------------------------------------


def test_input_is_not_mutated_and_output_is_fresh():
    i1 = img("data:1")
    c1, c2 = call("c1", "a", "{}"), call("c2", "b", "{}")
    msgs = [
        user([TextPart("x"), i1]),
        dev("d"),
        user([TextPart("y")]),
        asst("a", calls=[c1]),
        asst(None, calls=[c2]),
        tool("c1", "r1"),
        tool("c2", "r2"),
        system("s"),
    ]
    before = snapshot(msgs)
    first_content = msgs[0].content
    out = normalize_messages(msgs)
    assert snapshot(msgs) == before
    assert msgs[0].content is first_content and len(first_content) == 2
    assert msgs[1].role == "developer"
    assert msgs[3].tool_calls == [c1]
    assert all(o is not m for o in out for m in msgs)
    # Mutating the output leaves the input alone.
    out[-1].content = "changed"
    for m in out:
        if isinstance(m.content, list):
            m.content.clear()
        if m.tool_calls:
            m.tool_calls.clear()
    assert snapshot(msgs) == before


def test_unchanged_messages_are_still_copies():
    c1 = call("c1", "a", "{}")
    msgs = [user([TextPart("x"), img("data:1")]), asst(None, calls=[c1]), tool("c1", "r")]
    out = normalize_messages(msgs)
    assert out == msgs
    assert out[0].content is not msgs[0].content
    assert out[1].tool_calls is not msgs[1].tool_calls


# ---------------------------------------------------------------------------------------------------------
# Rule (g): nothing invented, empty list rejected
# ---------------------------------------------------------------------------------------------------------


def test_empty_message_list_is_an_error():
    with pytest.raises(NormalizationError, match="at least one message"):
        normalize_messages([])


def test_system_only_stays_system_only():
    assert normalize_messages([system("a"), dev("b")]) == [system("a\n\nb")]


def test_idempotent():
    for seq in AGENT_SEQUENCES.values():
        once = normalize_messages(seq.messages)
        assert normalize_messages(once) == once


# ---------------------------------------------------------------------------------------------------------
# Realistic agent sequences
# ---------------------------------------------------------------------------------------------------------


class AgentSequence(msgspec.Struct):
    messages: list[ChatMessage]
    raw_is_valid: bool  # whether the strict template already accepts the un-normalized sequence
    expected_roles: list[str]


_READ = call("toolu_01", "Read", '{"file_path": "/repo/main.py"}')
_BASH = call("toolu_02", "Bash", '{"command": "pytest -q", "timeout": 120}')
_CLINE_READ = call("call_a", "read_file", '{"path": "src/app.ts"}')
_CLINE_LIST = call("call_b", "list_files", '{"path": "src", "recursive": true}')
_QWEN_SHELL = call("call_q", "run_shell_command", '{"command": "ls"}')

AGENT_SEQUENCES: dict[str, AgentSequence] = {
    # OpenCode sends its provider prompt and the environment/AGENTS.md block as two system messages,
    # and the user text plus a synthetic reminder as two user messages.
    "opencode": AgentSequence(
        messages=[
            system(
                "You are opencode, an interactive CLI tool that helps users with software engineering tasks."
            ),
            system("<env>\nWorking directory: /repo\nPlatform: linux\n</env>"),
            user("Fix the failing test in tests/test_app.py"),
            user([TextPart("<system-reminder>Plan mode is off.</system-reminder>")]),
        ],
        raw_is_valid=False,
        expected_roles=["system", "user"],
    ),
    # Claude Code style: a system reminder injected mid-conversation, between tool turns.
    "claude_code": AgentSequence(
        messages=[
            system("You are Claude Code, Anthropic's official CLI for Claude."),
            user("Run the tests and fix what fails."),
            asst("I'll read the file first.", calls=[_READ]),
            tool("toolu_01", "def main():\n    return 1\n", name="Read"),
            system("<system-reminder>The TodoWrite tool hasn't been used recently.</system-reminder>"),
            asst(None, calls=[_BASH]),
            tool("toolu_02", "1 failed, 3 passed", name="Bash"),
            asst("One test fails; fixing it now."),
            user("Thanks, go ahead."),
        ],
        raw_is_valid=False,
        expected_roles=["system", "user", "assistant", "tool", "assistant", "tool", "assistant", "user"],
    ),
    # A system message between two tool results of the same assistant turn: the tool results must stay apart.
    "claude_code_between_tool_results": AgentSequence(
        messages=[
            system("You are Claude Code."),
            user("Read and test."),
            asst(None, calls=[_READ, _BASH]),
            tool("toolu_01", "contents", name="Read"),
            system("<system-reminder>Keep going.</system-reminder>"),
            tool("toolu_02", "ok", name="Bash"),
        ],
        raw_is_valid=False,
        expected_roles=["system", "user", "assistant", "tool", "tool"],
    ),
    # Codex (Responses-style) sends its instructions with the developer role.
    "codex": AgentSequence(
        messages=[
            dev("You are Codex, based on GPT-5. You are running as a coding agent in the Codex CLI."),
            user([TextPart("<environment_context>cwd: /repo</environment_context>")]),
            user("Add a --verbose flag."),
        ],
        raw_is_valid=False,
        expected_roles=["system", "user"],
    ),
    # Cline with native tool calling: already well-formed; normalization must leave it unchanged.
    "cline": AgentSequence(
        messages=[
            system("You are Cline, a highly skilled software engineer."),
            user([TextPart("<task>\nRefactor app.ts\n</task>"), TextPart("\n<environment_details/>")]),
            asst("Let me look at the project.", calls=[_CLINE_READ, _CLINE_LIST]),
            tool("call_a", "export const app = 1;"),
            tool("call_b", "src/app.ts\nsrc/util.ts"),
            user("Also keep the public API unchanged."),
        ],
        raw_is_valid=True,
        expected_roles=["system", "user", "assistant", "tool", "tool", "user"],
    ),
    # Qwen Code: a screenshot pasted as a follow-up user turn, then a system reminder, then a tool round.
    "qwen_code": AgentSequence(
        messages=[
            system("You are Qwen Code, an interactive CLI agent."),
            user("Why does the page render like this?"),
            user([img("data:image/png;base64,AAAA"), TextPart("(screenshot)")]),
            system("<system-reminder>You are in auto-edit mode.</system-reminder>"),
            asst(None, calls=[_QWEN_SHELL], reasoning="Inspect the repo first."),
            tool("call_q", "index.html\nstyle.css", name="run_shell_command"),
            asst("The CSS grid is missing a column template."),
        ],
        raw_is_valid=False,
        expected_roles=["system", "user", "assistant", "tool", "assistant"],
    ),
}


@pytest.mark.parametrize("name", list(AGENT_SEQUENCES))
def test_agent_sequence_shape(name: str):
    seq = AGENT_SEQUENCES[name]
    out = normalize_messages(seq.messages)
    assert roles(out) == seq.expected_roles
    assert sum(m.role == "system" for m in out) == 1
    # Tool calls and results survive untouched, in order.
    calls_in = [c for m in seq.messages for c in (m.tool_calls or [])]
    calls_out = [c for m in out for c in (m.tool_calls or [])]
    assert calls_out == calls_in
    results_in = [(m.tool_call_id, m.name, m.content) for m in seq.messages if m.role == "tool"]
    results_out = [(m.tool_call_id, m.name, m.content) for m in out if m.role == "tool"]
    assert results_out == results_in
    assert media_parts(out) == media_parts(seq.messages)


def test_opencode_exact_result():
    out = normalize_messages(AGENT_SEQUENCES["opencode"].messages)
    assert out[0].content == (
        "You are opencode, an interactive CLI tool that helps users with software engineering tasks."
        "\n\n<env>\nWorking directory: /repo\nPlatform: linux\n</env>"
    )
    assert out[1].content == (
        "Fix the failing test in tests/test_app.py\n\n<system-reminder>Plan mode is off.</system-reminder>"
    )


def test_cline_is_unchanged_apart_from_collapsed_text_parts():
    msgs = AGENT_SEQUENCES["cline"].messages
    out = normalize_messages(msgs)
    assert out[1].content == "<task>\nRefactor app.ts\n</task>\n<environment_details/>"
    assert out[0] == msgs[0] and out[2:] == msgs[2:]


# ---------------------------------------------------------------------------------------------------------
# Template rendering
# ---------------------------------------------------------------------------------------------------------

# A minimal strict Qwen-like ChatML template: system only first, user/assistant must alternate, tool turns
# must follow an assistant (or tool) turn and answer a known tool call id, content must be a string or a list
# of parts (never null), tool call arguments must be a mapping (rendered via `arguments|items`).
STRICT_TEMPLATE = r"""
{%- set ns = namespace(call_ids=[]) -%}
{%- macro render_content(content) -%}
{%- if content is none -%}
{{- raise_exception('Message content must not be null.') -}}
{%- elif content is string -%}
{{- content -}}
{%- else -%}
{%- for part in content -%}
{%- if part.type == 'image' or part.type == 'image_url' -%}
<|vision_start|><|image_pad|><|vision_end|>
{%- elif part.type == 'video' or part.type == 'video_url' -%}
<|vision_start|><|video_pad|><|vision_end|>
{%- elif part.type == 'text' -%}
{{- part.text -}}
{%- else -%}
{{- raise_exception('Unknown content part type.') -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- for message in messages -%}
{%- set prev = messages[loop.index0 - 1] if not loop.first else none -%}
{%- if message.role == 'system' -%}
{%- if not loop.first -%}{{- raise_exception('System message must be at the beginning.') -}}{%- endif -%}
<|im_start|>system
{{ render_content(message.content) }}<|im_end|>
{% elif message.role == 'user' -%}
{%- if prev is not none and prev.role == 'user' -%}
{{- raise_exception('Conversation roles must alternate user/assistant.') -}}
{%- endif -%}
<|im_start|>user
{{ render_content(message.content) }}<|im_end|>
{% elif message.role == 'assistant' -%}
{%- if prev is not none and prev.role == 'assistant' -%}
{{- raise_exception('Conversation roles must alternate user/assistant.') -}}
{%- endif -%}
<|im_start|>assistant
{% if message.reasoning_content is string and message.reasoning_content -%}
<think>
{{ message.reasoning_content }}
</think>

{% endif -%}
{{ render_content(message.content) }}
{%- for tc in message.tool_calls or [] -%}
{%- if tc.function.arguments is not mapping -%}
{{- raise_exception('Tool call arguments must be a mapping.') -}}
{%- endif -%}
{%- set ns.call_ids = ns.call_ids + [tc.id] %}
<tool_call>
<function={{ tc.function.name }}>
{% for key, value in tc.function.arguments|items -%}
<parameter={{ key }}>
{{ value|tojson if value is not string else value }}
</parameter>
{% endfor -%}
</function>
</tool_call>
{%- endfor -%}
<|im_end|>
{% elif message.role == 'tool' -%}
{%- if prev is none or prev.role not in ['assistant', 'tool'] -%}
{{- raise_exception('Tool message must follow an assistant tool call.') -}}
{%- endif -%}
{%- if message.tool_call_id not in ns.call_ids -%}
{{- raise_exception('Tool message answers an unknown tool call id.') -}}
{%- endif -%}
{%- if prev.role != 'tool' -%}
<|im_start|>user
{% endif -%}
<tool_response>
{{ render_content(message.content) }}
</tool_response>
{% if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
<|im_end|>
{% endif -%}
{%- else -%}
{{- raise_exception('Unknown role: ' ~ message.role) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""

PROJECT_TEMPLATE_PATH = Path(__file__).resolve().parents[1] / "mlx_relay" / "testing" / "chat_template.jinja"


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    # Same signature as the `tojson` filter transformers installs for chat templates.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _templates() -> list[tuple[str, str]]:
    templates = [("strict", STRICT_TEMPLATE)]
    if PROJECT_TEMPLATE_PATH.is_file():
        templates.append(("project", PROJECT_TEMPLATE_PATH.read_text(encoding="utf-8")))
    return templates


TEMPLATES = _templates()


def render(template_source: str, messages: list[dict[str, Any]]) -> str:
    return _environment().from_string(template_source).render(messages=messages, add_generation_prompt=True)


def render_normalized(template_source: str, messages: list[ChatMessage]) -> str:
    return render(template_source, to_template_messages(normalize_messages(messages)))


@pytest.mark.parametrize(("template_name", "template_source"), TEMPLATES, ids=[t[0] for t in TEMPLATES])
@pytest.mark.parametrize("name", list(AGENT_SEQUENCES))
def test_agent_sequence_renders_after_normalization(name: str, template_name: str, template_source: str):
    seq = AGENT_SEQUENCES[name]
    prompt = render_normalized(template_source, seq.messages)
    assert prompt.count("<|im_start|>system") == 1
    for m in seq.messages:
        for part in m.content if isinstance(m.content, list) else [m.content]:
            text = part.text if isinstance(part, TextPart) else part
            if isinstance(text, str) and text.strip() and m.role != "assistant":
                assert text.strip() in prompt, f"{template_name}: lost {text!r}"
    n_images = sum(isinstance(p, ImageUrlPart) for p in media_parts(seq.messages))
    assert prompt.count("<|image_pad|>") == n_images


@pytest.mark.parametrize("name", list(AGENT_SEQUENCES))
def test_strict_template_rejects_raw_sequences(name: str):
    """Without the normalizer the strict template fails on every malformed agent sequence."""
    seq = AGENT_SEQUENCES[name]
    raw = to_template_messages(seq.messages)  # conversion only, no normalization
    if seq.raw_is_valid:
        assert render(STRICT_TEMPLATE, raw) == render_normalized(STRICT_TEMPLATE, seq.messages)
    else:
        with pytest.raises(TemplateError):
            render(STRICT_TEMPLATE, raw)


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([user("a"), system("s")], "System message must be at the beginning"),
        ([system("s"), system("t"), user("u")], "System message must be at the beginning"),
        ([user("a"), user("b")], "alternate"),
        ([user("a"), asst("b"), asst("c")], "alternate"),
        ([dev("d"), user("u")], "Unknown role"),
    ],
    ids=["system-late", "two-systems", "user-user", "assistant-assistant", "developer"],
)
def test_strict_template_is_strict(messages: list[ChatMessage], error: str):
    with pytest.raises(TemplateError, match=error):
        render(STRICT_TEMPLATE, to_template_messages(messages))
    render_normalized(STRICT_TEMPLATE, messages)  # and the normalizer fixes it


def test_strict_template_renders_tool_round_exactly():
    msgs = [
        system("S"),
        user("U"),
        asst(None, calls=[call("c1", "grep", '{"pattern": "x", "n": 2}')]),
        tool("c1", "r1"),
    ]
    prompt = render_normalized(STRICT_TEMPLATE, msgs)
    assert prompt == (
        "<|im_start|>system\nS<|im_end|>\n"
        "<|im_start|>user\nU<|im_end|>\n"
        "<|im_start|>assistant\n"
        "<tool_call>\n<function=grep>\n"
        "<parameter=pattern>\nx\n</parameter>\n"
        "<parameter=n>\n2\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_image_placeholders_follow_media_parts_order():
    i1, i2 = img("data:1"), img("data:2")
    v1 = vid("file:///v.mp4")
    msgs = [user([i1, TextPart("a")]), user([v1, TextPart("b"), i2])]
    out = normalize_messages(msgs)
    prompt = render(STRICT_TEMPLATE, to_template_messages(out))
    placeholders = [tok for tok in prompt.split("<|vision_start|>")[1:]]
    kinds = ["image" if p.startswith("<|image_pad|>") else "video" for p in placeholders]
    expected = ["image" if isinstance(p, ImageUrlPart) else "video" for p in media_parts(out)]
    assert kinds == expected == ["image", "video", "image"]
    assert "a\n\n<|vision_start|><|video_pad|>" in prompt
