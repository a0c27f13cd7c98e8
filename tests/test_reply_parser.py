"""Tests for mlx_relay.chat.reply_parser and mlx_relay.chat.tool_schema: reasoning, content, tool
calls in both formats, schema checks, the mlx-lm parser behaviour we rely on, and split-invariance
(one piece, character by character and random splits give the same reply)."""

from __future__ import annotations

import json
import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from mlx_lm.tool_parsers import json_tools, qwen3_coder

from mlx_relay.chat import tool_schema
from mlx_relay.chat.output import (
    ContentDelta,
    ReasoningDelta,
    ReplyEvent,
    TokenLogprob,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from mlx_relay.chat.reply_parser import TOOL_FORMATS, ReplyParser, tool_format_for_template
from mlx_relay.chat.types import FunctionDef, ToolDef

TEMPLATE_PATH = Path(__file__).resolve().parents[1] / "mlx_relay" / "testing" / "chat_template.jinja"
MARKUP = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=")

READ_FILE = ToolDef(FunctionDef(
    name="read_file",
    description="Read a file",
    parameters={
        "type": "object",
        "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["path"],
        "additionalProperties": False,
    },
))
SEARCH = ToolDef(FunctionDef(
    name="search",
    parameters={
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "max_results": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "tag": {"type": ["string", "null"]},
            "filters": {"type": "object", "properties": {"lang": {"type": "string"}}},
            "exact": {"type": "boolean"},
        },
        "required": ["query"],
    },
))
NO_PARAMS = ToolDef(FunctionDef(name="now"))
TOOLS = [READ_FILE, SEARCH, NO_PARAMS]


def xml_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def json_call(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@dataclass
class Reply:
    """A parsed reply, merged: what a client would end up with."""

    reasoning: str = ""
    content: str = ""
    calls: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    events: list[ReplyEvent] = field(default_factory=list)
    invalid: list[tuple[str, str]] = field(default_factory=list)  # (reason, what) the parser reported

    @property
    def reasons(self) -> list[str]:
        return [reason for reason, _ in self.invalid]


def merge(events: list[ReplyEvent], *, strict: bool = True) -> Reply:
    """Merge events, checking the order rules of mlx_relay.chat.output on the way (`strict`: and
    that no markup is in any text, for replies that write none outside their tags)."""
    reply = Reply(events=events)
    open_call: ToolCallStart | None = None
    fragments = ""
    for ev in events:
        if isinstance(ev, ReasoningDelta | ContentDelta):
            assert open_call is None, "text inside a tool call"
            assert ev.text, "empty delta"
            assert not (strict and any(tag in ev.text for tag in MARKUP)), ev
            if isinstance(ev, ReasoningDelta):
                reply.reasoning += ev.text
            else:
                reply.content += ev.text
        elif isinstance(ev, ToolCallStart):
            assert open_call is None
            assert ev.index == len(reply.calls)
            open_call, fragments = ev, ""
        elif isinstance(ev, ToolCallArguments):
            assert open_call is not None and ev.index == open_call.index
            fragments += ev.fragment
        else:
            assert isinstance(ev, ToolCallEnd)
            assert open_call is not None
            assert (ev.index, ev.id, ev.name) == (open_call.index, open_call.id, open_call.name)
            assert ev.arguments == fragments
            reply.calls.append((ev.index, ev.name, json.loads(ev.arguments)))
            reply.ids.append(ev.id)
            open_call = None
    assert open_call is None
    return reply


def parse(pieces: list[str] | str, *, tools: list[ToolDef] | None = TOOLS, think_open: bool = False,
          tool_format: str | None = "qwen3_coder", reason: str = "stop", strict: bool = True) -> Reply:
    invalid: list[tuple[str, str]] = []
    parser = ReplyParser(tools=tools, tool_format=tool_format, think_open=think_open,
                         on_invalid=lambda reason, what: invalid.append((reason, what)))
    events: list[ReplyEvent] = []
    for piece in [pieces] if isinstance(pieces, str) else pieces:
        events += parser.feed(piece)
    events += parser.finish(reason)
    reply = merge(events, strict=strict)
    reply.invalid = invalid
    assert parser.calls == len(reply.calls)
    return reply


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, min(len(text) - 1, 40))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


# -- reasoning ------------------------------------------------------------------------------


def test_think_open_reply_starts_in_reasoning_and_newlines_after_close_are_dropped() -> None:
    reply = parse("Let me think.\nStep 2.</think>\n\nThe answer is 4.", think_open=True)
    assert reply.reasoning == "Let me think.\nStep 2."
    assert reply.content == "The answer is 4."


def test_leading_think_tag_opens_reasoning_when_not_open_from_the_prompt() -> None:
    for text in ("<think>\nhmm</think>\n\nHi", "  \n<think>hmm</think>Hi"):
        reply = parse(text)
        assert (reply.reasoning, reply.content) == ("hmm", "Hi")
    # the same, split inside the tags and between the newlines
    reply = parse(["<th", "ink>", "\nhm", "m</thi", "nk>\n", "\nHi"])
    assert (reply.reasoning, reply.content) == ("hmm", "Hi")


def test_think_tag_later_in_content_is_just_content() -> None:
    reply = parse("Use <think> tags like <think>this</think>.", strict=False)
    assert reply.reasoning == ""
    assert reply.content == "Use <think> tags like <think>this</think>."


def test_unclosed_thinking_block_is_reasoning_at_finish() -> None:
    reply = parse(["still thinking", " </thi"], think_open=True, reason="length")
    assert reply.reasoning == "still thinking </thi"
    assert reply.content == ""


def test_text_held_as_a_possible_tag_is_content_at_finish() -> None:
    assert parse("  <thi").content == "  <thi"
    assert parse("see <tool_ca").content == "see <tool_ca"


def test_tool_markup_inside_reasoning_stays_reasoning() -> None:
    reply = parse("maybe <tool_call> read_file?</think>ok", think_open=True, strict=False)
    assert reply.reasoning == "maybe <tool_call> read_file?"
    assert (reply.content, reply.calls) == ("ok", [])


# -- tool calls ------------------------------------------------------------------------------


def test_qwen3_coder_call_with_content_before_it() -> None:
    text = "Let me look.\n\n" + xml_call("read_file", path="src/main.py", limit="20")
    reply = parse(text)
    assert reply.content == "Let me look.\n\n"
    assert reply.calls == [(0, "read_file", {"path": "src/main.py", "limit": 20})]
    assert re.fullmatch(r"call_[0-9a-f]{24}", reply.ids[0])
    args = [ev for ev in reply.events if isinstance(ev, ToolCallArguments)]
    assert [a.fragment for a in args] == ['{"path":"src/main.py","limit":20}']  # one compact fragment


def test_json_call_hermes_style() -> None:
    text = 'Sure.<tool_call>\n{"name": "read_file", "arguments": {"path": "x"}}\n</tool_call>'
    reply = parse(text, tool_format="json")
    assert reply.content == "Sure."
    assert reply.calls == [(0, "read_file", {"path": "x"})]


def test_json_call_arguments_given_as_a_string_and_block_shape_decides_the_format() -> None:
    text = '<tool_call>{"name": "read_file", "arguments": "{\\"path\\": \\"é.txt\\"}"}</tool_call>'
    for fmt in TOOL_FORMATS:
        reply = parse(text, tool_format=fmt)
        assert reply.calls == [(0, "read_file", {"path": "é.txt"})]
        end = reply.events[-1]
        assert isinstance(end, ToolCallEnd) and end.arguments == '{"path":"é.txt"}'  # ensure_ascii=False
    assert parse(xml_call("now"), tool_format="json").calls == [(0, "now", {})]


def test_parallel_calls_are_numbered_whitespace_between_dropped_other_text_kept() -> None:
    text = ("Two reads.\n" + xml_call("read_file", path="a") + "\n\n" + xml_call("read_file", path="b")
            + "\n  Done reading.\n" + json_call("now", {}) + "\n\n")
    reply = parse(text)
    assert reply.content == "Two reads.\nDone reading.\n"
    assert reply.calls == [(0, "read_file", {"path": "a"}), (1, "read_file", {"path": "b"}), (2, "now", {})]
    assert len(set(reply.ids)) == 3


def test_a_tool_call_starts_when_its_block_is_whole() -> None:
    """(Until issue 44.8 the call started as soon as its name was read, and one cut by max_tokens
    then had to end with arguments `{}`, which its schema may refuse.)"""
    parser = ReplyParser(tools=TOOLS)
    assert parser.feed("<tool_call>\n<function=read_fi") == []
    assert parser.feed("le>\n<parameter=path>\nsrc/") == []
    assert parser.feed("main.py\n</parameter>\n</function>\n</tool_") == []
    events = parser.feed("call>")
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArguments, ToolCallEnd]
    assert (events[0].index, events[0].name) == (0, "read_file")
    assert parser.calls == 1
    assert parser.finish() == []


def test_no_tools_means_tool_markup_is_plain_content() -> None:
    text = "x " + xml_call("read_file", path="a")
    assert parse(text, tools=None, strict=False).content == text
    assert parse(text, tools=[], strict=False).content == text
    assert parse(text, tool_format=None, strict=False).content == text  # tools given, but no tool format


def test_unknown_tool_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown tool format"):
        ReplyParser(tools=TOOLS, tool_format="pythonic")


def test_an_undeclared_function_is_delivered_as_written_and_reported() -> None:
    """The agent rejects it and tells the model; nothing fails."""
    parser = ReplyParser(tools=TOOLS, on_invalid=lambda reason, what: seen.append((reason, what)))
    seen: list[tuple[str, str]] = []
    start, *_ = parser.feed("<tool_call>\n<function=delete_all>\n</function>\n</tool_call>")
    assert isinstance(start, ToolCallStart) and start.name == "delete_all"
    assert seen == [("undeclared_tool", "the model called 'delete_all', which is not a declared tool "
                                        "(declared: read_file, search, now)")]
    reply = parse(xml_call("delete_all", force="true", depth="3"))
    assert reply.calls == [(0, "delete_all", {"force": "true", "depth": "3"})] and reply.reasons == ["undeclared_tool"]
    reply = parse(json_call("delete_all", {"force": True}), tool_format="json")
    assert reply.calls == [(0, "delete_all", {"force": True})] and reply.reasons == ["undeclared_tool"]


def test_arguments_off_the_schema_are_delivered_as_written_and_reported() -> None:
    for text, args, problem in [
        (xml_call("read_file", limit="5"), {"limit": 5}, "'path' is a required property"),
        (json_call("read_file", {}), {}, "'path' is a required property"),
        (xml_call("read_file", path="a", limit="abc"), {"path": "a", "limit": "abc"},
         r"'abc' is not of type 'integer' \(at 'limit'\)"),
        (xml_call("read_file", path="a", mode="rb"), {"path": "a", "mode": "rb"}, "Additional properties"),
    ]:
        reply = parse(text)
        assert reply.calls == [(0, "read_file", args)], text
        [(reason, what)] = reply.invalid
        assert reason == "schema_mismatch" and re.search("read_file: " + problem, what), what
        end = reply.events[-1]
        assert isinstance(end, ToolCallEnd) and json.loads(end.arguments) == args  # a JSON object string


def test_unreadable_blocks_are_content_as_written() -> None:
    """A block that cannot be read as a call reaches the client as the text the model wrote."""
    for block in ['<tool_call>{"name": "now", "arguments": {</tool_call>',
                  "<tool_call>\nplease call read_file\n</tool_call>",
                  "<tool_call>[]</tool_call>",
                  '<tool_call>{"name": "now", "arguments": [1]}</tool_call>',
                  '<tool_call>{"name": "now", "arguments": {"x": NaN}}</tool_call>',
                  '<tool_call>{"arguments": {}}</tool_call>']:
        reply = parse("Here: " + block + "\nDone.", strict=False)
        assert (reply.content, reply.calls, reply.reasons) == ("Here: " + block + "Done.", [], ["unreadable"]), block


def test_a_block_that_names_its_function_but_cannot_be_read_is_a_call_with_empty_arguments() -> None:
    """An XML block that names its function is a call, however the rest reads: it ends, with
    arguments `{}` (the reason says why)."""
    tools = [ToolDef(FunctionDef(name="scale", parameters={"type": "object", "properties": {"k": {"type": "number"}}}))]
    reply = parse(xml_call("scale", k="NaN"), tools=tools)  # mlx-lm reads a float NaN, which JSON cannot carry
    assert reply.calls == [(0, "scale", {})] and reply.reasons == ["unreadable"]


def test_json_block_may_hold_a_list_of_calls() -> None:
    text = '<tool_call>[{"name": "now"}, {"name": "read_file", "arguments": {"path": "a"}}]</tool_call>'
    assert parse(text, tool_format="json").calls == [(0, "now", {}), (1, "read_file", {"path": "a"})]


def test_a_call_cut_by_max_tokens_is_dropped() -> None:
    """Issue 44.8: a call starts (`ToolCallStart`) only when its block is whole, so one cut by
    max_tokens never reaches the client, with `{}` or any arguments its schema refuses."""
    cut = "Let me look.\n" + xml_call("read_file", path="a")[:-20]
    parser = ReplyParser(tools=TOOLS, tool_format="qwen3_coder")
    streamed = parser.feed(cut)
    assert not any(isinstance(e, ToolCallStart) for e in streamed)  # the name was read, not announced
    reply = merge([*streamed, *parser.finish("length")])
    assert reply.calls == [] and reply.invalid == []
    assert reply.content.strip() == "Let me look."
    reply = parse('Let me look.\n<tool_call>\n{"name": "read_file", "argu', reason="length")
    assert (reply.content.strip(), reply.calls, reply.invalid) == ("Let me look.", [], [])  # not announced: dropped


def test_an_unclosed_block_at_the_end_is_read_as_if_closed() -> None:
    reply = parse("Reading.\n" + xml_call("read_file", path="a").removesuffix("\n</tool_call>"))
    assert reply.calls == [(0, "read_file", {"path": "a"})] and reply.reasons == ["unclosed"]
    reply = parse("Reading.\n<tool_call>\n<function=read_file>\n<parameter=path>\na\n</parameter>\n")
    assert reply.calls == [(0, "read_file", {"path": "a"})]  # its </function> too
    reply = parse('<tool_call>\n{"name"', strict=False)
    assert (reply.content, reply.calls, reply.reasons) == ('<tool_call>\n{"name"', [], ["unclosed", "unreadable"])


def test_call_markup_without_its_opener_never_reaches_the_content() -> None:
    """Closing tags with no opener are dropped; a bare <function=...> block is a call."""
    reply = parse("I wrote it.\n</parameter>\n</function>\n</tool_call>\nAll done.")
    assert (reply.content, reply.calls) == ("I wrote it.\nAll done.", [])
    assert reply.reasons == ["stray_markup"] * 3
    bare = "<function=read_file>\n<parameter=path>\na\n</parameter>\n</function>\n</tool_call>"
    for pieces in ([f"Let me read it.\n{bare}\nok"], list(f"Let me read it.\n{bare}\nok")):
        reply = parse(pieces)
        assert (reply.content, reply.calls) == ("Let me read it.\nok", [(0, "read_file", {"path": "a"})])
        assert reply.reasons == ["stray_markup"]  # the </tool_call> it never opened


def test_schema_picks_the_reading_of_xml_values() -> None:
    text = xml_call("search", query="42", max_results="5", tag="123", filters='{"lang": "py"}', exact="true")
    [(_, _, args)] = parse(text).calls
    assert args == {"query": "42", "max_results": 5, "tag": "123", "filters": {"lang": "py"}, "exact": True}
    # a multi-line string keeps its inner newlines; only the one after/before the tags goes
    [(_, _, args)] = parse(xml_call("search", query="line 1\nline 2\n")).calls
    assert args == {"query": "line 1\nline 2\n"}


def test_logprobs_go_on_the_first_content_delta_of_their_feed() -> None:
    lp = [TokenLogprob("a", -0.1, [97])]
    parser = ReplyParser(tools=TOOLS)
    events = parser.feed("a<tool_call>\n<function=now>\n</function>\n</tool_call>b", lp)
    contents = [e for e in events if isinstance(e, ContentDelta)]
    assert [(c.text, c.logprobs) for c in contents] == [("a", lp), ("b", None)]
    assert parser.feed("<tool", lp) == []  # held back: the logprobs wait for the content
    [ev] = parser.feed("s> x", lp)
    assert ev == ContentDelta("<tools> x", lp + lp)
    assert parser.feed("y") == [ContentDelta("y")]


# -- mlx-lm's parsers: the behaviour we build on --------------------------------------------


def test_mlx_lm_qwen3_coder_parser_behaviour_we_rely_on() -> None:
    block = "<function=search>\n<parameter=query>\n007\n</parameter>\n<parameter=tag>\n123\n</parameter>\n</function>"
    raw = qwen3_coder.parse_tool_call(block)  # no tools: every value stays the text written
    assert raw == {"name": "search", "arguments": {"query": "007", "tag": "123"}}
    search = [msgspec.to_builtins(SEARCH)]
    typed = qwen3_coder.parse_tool_call(block, search)
    # by "type" alone: "string" keeps text, but a ["string", "null"] type goes through literal_eval
    assert typed["arguments"] == {"query": "007", "tag": 123}
    with pytest.raises(ValueError):  # an integer-typed value that is no number fails the whole call
        qwen3_coder.parse_tool_call(block.replace("=tag", "=max_results").replace("123", "x"),
                                    [{"function": {"name": "search", "parameters": {
                                        "properties": {"max_results": {"type": "integer"}}}}}])
    with pytest.raises(ValueError):  # the block must end with </function> (we strip it first)
        qwen3_coder.parse_tool_call(block + "\n\n")
    assert qwen3_coder.parse_tool_call(block + "\n")["name"] == "search"
    assert json_tools.parse_tool_call('\n {"name": "now"} \n') == {"name": "now"}


# -- tool_schema ----------------------------------------------------------------------------


def test_validators_are_cached_per_schema() -> None:
    key = tool_schema.schema_key({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert key == tool_schema.schema_key({"properties": {"a": {"type": "integer"}}, "type": "object"})
    assert tool_schema.validator_for(key) is tool_schema.validator_for(key)


def test_tool_without_parameters_or_with_a_broken_schema_accepts_any_object() -> None:
    broken = [
        None,
        {},
        {"type": "objekt"},
        {"type": "object", "properties": {"a": {"pattern": "("}}},
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
        {"$ref": "https://example.com/remote.json"},
    ]
    for schema in broken:
        key = tool_schema.schema_key(schema)
        assert tool_schema.argument_error(key, {"a": 1, "b": [2]}) is None, schema
        assert tool_schema.argument_error(key, [1]) is not None
    tools = [ToolDef(FunctionDef(name="odd", parameters={"type": "objekt"}))]
    assert parse(xml_call("odd", x="1"), tools=tools).calls == [(0, "odd", {"x": "1"})]


def test_schema_with_defs_and_refs_validates() -> None:
    schema = {"type": "object", "$defs": {"n": {"type": "integer"}}, "properties": {"n": {"$ref": "#/$defs/n"}}}
    tools = [ToolDef(FunctionDef(name="f", parameters=schema))]
    assert parse(xml_call("f", n="3"), tools=tools).calls == [(0, "f", {"n": 3})]
    reply = parse(xml_call("f", n="x"), tools=tools)
    assert reply.calls == [(0, "f", {"n": "x"})] and "f: 'x' is not of type 'integer'" in reply.invalid[0][1]


# -- split invariance -----------------------------------------------------------------------

REPLIES: list[tuple[str, bool]] = [
    ("I should read both files.\nThen compare.</think>\n\nReading them now.\n"
     + xml_call("read_file", path="src/main.py", limit="20") + "\n"
     + xml_call("search", query="def main", filters='{"lang": "py"}') + "\n", True),
    ("<think>\nUnicode: 日本語 ✓ — naïve café 🙂</think>\n\nRésumé: ∑ x² ≥ 0 🙂 «ok»\n"
     + json_call("read_file", {"path": "données/été.txt"}), False),
    ("if a < b:\n    return a <= b\n<tools> are fine, <tool is fine, <tool_c too, </tool_ca alone\n"
     + xml_call("search", query="a < b && <tool_call", tag="null") + " trailing text <", False),
    ("   \n  plain answer with no calls and a < sign < <\n", False),
    ("reasoning only, cut off <tool_ca <think </thin", True),
    # what a model writes wrong: a stray closer, an undeclared tool, arguments off the schema, a bare
    # <function=...> block whose </tool_call> has no opener, an unreadable block
    ("Done.</parameter>\n" + xml_call("rm_rf", path="/") + xml_call("read_file", path="a", limit="x")
     + "<function=now>\n</function>\n</tool_call>\n" + '<tool_call>{"name": 1}</tool_call>then text', False),
]


@pytest.mark.parametrize(("text", "think_open"), REPLIES)
def test_same_reply_whatever_the_split(text: str, think_open: bool) -> None:
    strict = text != REPLIES[5][0]  # the others write no markup outside their tags
    whole = parse(text, think_open=think_open, strict=strict)
    by_char = parse(list(text), think_open=think_open, strict=strict)
    outcome = (whole.reasoning, whole.content, whole.calls, whole.reasons)
    assert (by_char.reasoning, by_char.content, by_char.calls, by_char.reasons) == outcome
    for seed in range(200):
        reply = parse(random_split(text, random.Random(seed)), think_open=think_open, strict=strict)
        assert (reply.reasoning, reply.content, reply.calls, reply.reasons) == outcome, seed
        assert len(set(reply.ids)) == len(reply.ids)


def test_split_invariance_expected_values() -> None:
    first = parse(REPLIES[0][0], think_open=True)
    assert first.reasoning == "I should read both files.\nThen compare."
    assert first.content == "Reading them now.\n"
    assert first.calls == [(0, "read_file", {"path": "src/main.py", "limit": 20}),
                           (1, "search", {"query": "def main", "filters": {"lang": "py"}})]
    second = parse(REPLIES[1][0])
    assert second.reasoning == "Unicode: 日本語 ✓ — naïve café 🙂"
    assert second.content == "Résumé: ∑ x² ≥ 0 🙂 «ok»\n"
    assert second.calls == [(0, "read_file", {"path": "données/été.txt"})]
    third = parse(REPLIES[2][0])
    assert third.content.startswith("if a < b:\n    return a <= b\n<tools> are fine, <tool is fine, <tool_c too, ")
    assert third.content.endswith("trailing text <")
    assert third.calls == [(0, "search", {"query": "a < b && <tool_call", "tag": None})]
    assert parse(REPLIES[4][0], think_open=True).reasoning == REPLIES[4][0]
    wrong = parse(REPLIES[5][0], strict=False)
    assert wrong.content == 'Done.<tool_call>{"name": 1}</tool_call>then text'
    assert wrong.calls == [(0, "rm_rf", {"path": "/"}), (1, "read_file", {"path": "a", "limit": "x"}), (2, "now", {})]
    assert wrong.reasons == ["stray_markup", "undeclared_tool", "schema_mismatch", "stray_markup", "unreadable"]


# -- cost -----------------------------------------------------------------------------------


def test_character_by_character_feeding_stays_linear() -> None:
    """Counted, never timed: the Python calls a feed makes stay constant per character (the
    profiler's call events, C calls included), and the text every later feed searches again
    (`held_back`) stays bounded however long the reply grows, so a feed costs the same at the
    reply's end as at its start."""

    def cost(n: int) -> tuple[int, int]:
        text = ("word < " * n) + xml_call("search", query="x" * (7 * n)) + ("tail " * n)
        parser = ReplyParser(tools=TOOLS)
        calls, held = 0, 0

        def count(frame: Any, event: str, arg: Any) -> None:
            nonlocal calls
            calls += event in ("call", "c_call")

        for ch in text:
            sys.setprofile(count)
            parser.feed(ch)
            sys.setprofile(None)
            held = max(held, parser.held_back)
        parser.finish()
        assert parser.calls == 1
        return calls, held

    (small, held_small), (large, held_large) = cost(250), cost(2_000)
    assert large / small < 8 * 1.25, (small, large)  # 8x the text, 8x the calls (quadratic: 64x)
    assert held_small == held_large <= 600, (held_small, held_large)


# -- tool_format_for_template -----------------------------------------------------------------

HERMES_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- for tool_call in message.tool_calls %}{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}"
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{%- endfor %}"
)


def test_tool_format_for_template() -> None:
    assert tool_format_for_template(TEMPLATE_PATH.read_text("utf-8")) == "qwen3_coder"
    assert tool_format_for_template(HERMES_TEMPLATE) == "json"
    assert tool_format_for_template("{{ messages[0].content }}") is None
    assert tool_format_for_template(None) is None
    assert tool_format_for_template("") is None
