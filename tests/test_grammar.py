"""Output grammars (`mlx_relay/chat/grammar.py`) walked token by token with llguidance on the
embedded model's tokenizer: what each admits first, and whole replies they accept or refuse."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
from transformers import AutoTokenizer

from mlx_relay.chat.grammar import GrammarError, OutputConstraint, build_grammar, check_grammar, lazy_tool_grammar
from mlx_relay.chat.output import ContentDelta, ToolCallEnd
from mlx_relay.chat.reply_parser import ReplyParser
from mlx_relay.chat.tool_grammar import call_rules, lazy_rules
from mlx_relay.chat.types import FunctionDef, ResponseFormat, ToolDef
from mlx_relay.default_model import default_model_path

TOOLS = [ToolDef(FunctionDef("delete_stock", "Delete a stock.", {
    "type": "object", "properties": {"path": {"type": "integer"}}, "required": ["path"]}))]
JSON = OutputConstraint(response_format=ResponseFormat("json_object"))
FORCED = OutputConstraint(tools=TOOLS, tool_choice="required")
CALL = "<tool_call>\n<function=delete_stock>\n<parameter=path>\n423\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture(scope="module")
def tok() -> Any:
    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def llg(tok: Any) -> Any:
    return llguidance.hf.from_tokenizer(tok, eos_token=tok.convert_tokens_to_ids("<|im_end|>"))


def first_tokens(grammar: str, tok: Any, llg: Any) -> set[str]:
    matcher = llguidance.LLMatcher(llg, grammar)
    mask = llguidance.numpy.allocate_token_bitmask(1, llg.vocab_size)
    llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
    allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:llg.vocab_size])
    return {tok.decode([int(t)]) for t in allowed}


def accepts(grammar: str, text: str, tok: Any, llg: Any) -> bool:
    matcher = llguidance.LLMatcher(llg, grammar)
    for t in tok.encode(text, add_special_tokens=False):
        if not matcher.consume_token(t):
            return False
    return matcher.is_accepting()


@pytest.mark.parametrize(("constraint", "body", "first"), [(JSON, '{"path": 423}', "{"), (FORCED, CALL, "<tool_call>")],
                         ids=["json_object", "forced_call"])
def test_a_grammar_after_thinking_admits_the_separator_and_no_other_text(
        constraint: OutputConstraint, body: str, first: str, tok: Any, llg: Any) -> None:
    """After `</think>` a model writes "\\n\\n" before its answer (Qwen's templates): a grammar that
    follows a thinking block admits that whitespace first, then only its own body."""
    special = frozenset(tok.get_added_vocab())
    plain, after = build_grammar(constraint, special), build_grammar(constraint, special, after_thinking=True)
    assert plain is not None and after is not None
    check_grammar(after, llg)
    assert first_tokens(plain, tok, llg) == {first}  # without a thinking block: the body at once
    opening = first_tokens(after, tok, llg)
    assert first in opening and "\n\n" in opening, opening
    assert all(t.strip() in ("", first) for t in opening), opening  # whitespace, or whitespace and the body's start
    assert accepts(after, "\n\n" + body, tok, llg) and accepts(after, body, tok, llg)
    assert not accepts(plain, "\n\n" + body, tok, llg)
    assert not accepts(after, "\n\nSure: " + body, tok, llg) and not accepts(after, "\n\n", tok, llg)


# -- tool_choice auto: the lazy grammar ---------------------------------------------------------------------

WEATHER = [ToolDef(FunctionDef("get_weather", "Weather in a city.", {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}, "alerts": {"type": "boolean"}, "note": {"type": ["string", "null"]},
        "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["city", "unit"]}))]
WEATHER_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                "<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
                "<parameter=alerts>\ntrue\n</parameter>\n</function>\n</tool_call>")


def lazy(tools: list[ToolDef], tok: Any, llg: Any, parallel: bool = True) -> tuple[str, list[str]]:
    grammar, loose = lazy_tool_grammar(OutputConstraint(tools=tools, parallel_tool_calls=parallel),
                                       frozenset(tok.get_added_vocab()), llg)
    assert grammar is not None
    return grammar, loose


def test_auto_admits_free_text_and_declared_well_formed_calls(tok: Any, llg: Any) -> None:
    """Free text until `<tool_call>`, then only a call to a declared tool with its schema's values
    written as the reader reads them (a string enum raw), then free text again."""
    grammar, loose = lazy(WEATHER, tok, llg)
    assert loose == []
    assert accepts(grammar, "Sure, let me look.", tok, llg) and accepts(grammar, "", tok, llg)
    assert accepts(grammar, "Looking. " + WEATHER_CALL, tok, llg)
    assert accepts(grammar, WEATHER_CALL.replace("\ntrue\n", "\nTrue\n"), tok, llg)  # as Qwen's template writes it
    assert accepts(grammar, WEATHER_CALL + "\n" + WEATHER_CALL + "\nDone.", tok, llg)
    assert not accepts(grammar, "<tool_call>\n<function=get_forecast>\n", tok, llg)  # undeclared
    assert not accepts(grammar, WEATHER_CALL.replace("celsius", '"celsius"'), tok, llg)  # an enum is raw
    assert not accepts(grammar, WEATHER_CALL.replace("\n3\n", "\nthree\n"), tok, llg)  # integer
    assert not accepts(grammar, WEATHER_CALL.replace("<parameter=unit>\ncelsius\n</parameter>\n", ""), tok, llg)
    one, _ = lazy(WEATHER, tok, llg, parallel=False)
    assert accepts(one, WEATHER_CALL + "\nDone.", tok, llg)
    assert not accepts(one, WEATHER_CALL + "\n" + WEATHER_CALL, tok, llg)


@pytest.mark.parametrize("markup", ["<tool_call>", "</tool_call>", "<function=get_weather>", "</function>",
                                    "<parameter=city>", "</parameter>"])
def test_auto_free_text_never_spells_tool_markup(markup: str, tok: Any, llg: Any) -> None:
    """The markup as text (pieces of ordinary tokens, not the `<tool_call>` token) is refused in
    free text: every call the reply parser sees went through the grammar."""
    grammar, _ = lazy(WEATHER, tok, llg)
    pieces = [t for t in tok.encode("x" + markup, add_special_tokens=False)]
    assert all(tok.decode([t]) not in ("<tool_call>", "</tool_call>") for t in pieces[1:]) or markup in (
        "<tool_call>", "</tool_call>")
    matcher = llguidance.LLMatcher(llg, grammar)
    spelled = [t for ch in "x" + markup for t in tok.encode(ch, add_special_tokens=False)]  # character by character
    assert not all(matcher.consume_token(t) for t in spelled)


def test_after_the_trigger_token_the_matcher_masks_everything_else(tok: Any, llg: Any) -> None:
    """In free text the mask admits nearly the whole vocabulary; right after `<tool_call>` only the
    call's next piece."""
    grammar, _ = lazy(WEATHER, tok, llg)
    free = first_tokens(grammar, tok, llg)
    assert "<tool_call>" in free and len(free) > 800
    matcher = llguidance.LLMatcher(llg, grammar)
    assert matcher.consume_token(tok.convert_tokens_to_ids("<tool_call>"))
    mask = llguidance.numpy.allocate_token_bitmask(1, llg.vocab_size)
    llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
    allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:llg.vocab_size])
    assert {tok.decode([int(t)]) for t in allowed} <= {"\n", "\n<"}, [tok.decode([int(t)]) for t in allowed]


def test_auto_keeps_exact_tools_exact_and_loosens_an_unenforceable_one(tok: Any, llg: Any) -> None:
    """A schema the XML grammar cannot hold exactly (a keyword on the whole argument object) does
    not refuse an `auto` request: that tool's calls are only well-formed, the others stay exact."""
    odd = ToolDef(FunctionDef("odd", "x", {"type": "object", "minProperties": 1,
                                           "properties": {"a": {"type": "string"}}}))
    grammar, loose = lazy([*WEATHER, odd], tok, llg)
    assert loose == ["odd"]
    assert accepts(grammar, "<tool_call>\n<function=odd>\nanything\n</function>\n</tool_call>", tok, llg)
    assert not accepts(grammar, WEATHER_CALL.replace("celsius", "kelvin"), tok, llg)
    with pytest.raises(GrammarError, match="odd"):  # forced: a 400, as before
        build_grammar(OutputConstraint(tools=[odd], tool_choice="required"), frozenset(tok.get_added_vocab()))


def test_forced_call_starts_within_a_bounded_prefix(tok: Any, llg: Any) -> None:
    """After a thinking block a forced call may be led by one or two newlines, nothing else."""
    after = build_grammar(FORCED, frozenset(tok.get_added_vocab()), after_thinking=True)
    assert after is not None
    assert accepts(after, "\n\n" + CALL, tok, llg) and accepts(after, "\n" + CALL, tok, llg)
    for lead in ("\n\n\n", " \n", "\r\t", " "):
        assert not accepts(after, lead + CALL, tok, llg), lead


# -- round trip: what the grammar admits, the reply parser reads back valid ------------------------------------

ROUND_TRIP_SCHEMAS: dict[str, Any] = {
    "string": {"type": "string"},
    "bounded": {"type": "string", "minLength": 2, "maxLength": 5},
    "pattern": {"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"},
    "enum": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "mixed_enum": {"enum": ["auto", 1, None, True]},
    "integer": {"type": "integer", "minimum": 0, "maximum": 99},
    "number": {"type": "number"},
    "boolean": {"type": "boolean"},
    "nullable_boolean": {"type": ["boolean", "null"]},
    "nullable": {"type": ["string", "null"], "maxLength": 4},
    "optional": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
    "ref": {"$ref": "#/$defs/Unit"},
    "array": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
    "object": {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"],
               "additionalProperties": False},
    "any": {},
}


def walk_texts(grammar: str, tok: Any, llg: Any, seed: int, limit: int = 120) -> str | None:
    """A random path through a one-parameter call: tokens chosen uniformly among the allowed, and
    from a random step on, the call's closing tags as soon as the grammar allows them there; as
    text, None if it does not finish within `limit` tokens."""
    rng = np.random.default_rng(seed)
    matcher = llguidance.LLMatcher(llg, grammar)
    mask = llguidance.numpy.allocate_token_bitmask(1, llg.vocab_size)
    closing = tok.encode("\n</parameter>\n</function>\n</tool_call>", add_special_tokens=False)
    close_from = int(rng.integers(0, 12))
    ids: list[int] = []
    for step in range(limit):
        if step >= close_from and ids and matcher.validate_tokens(closing) == len(closing):
            assert matcher.consume_tokens(closing)
            return tok.decode(ids + closing)
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:llg.vocab_size])
        if matcher.is_stopped() or not len(allowed):
            break
        choice = int(rng.choice(allowed))
        assert matcher.consume_token(choice)
        ids.append(choice)
    return tok.decode(ids) if matcher.is_stopped() else None


@pytest.mark.parametrize("name", list(ROUND_TRIP_SCHEMAS))
def test_every_call_the_grammar_admits_parses_to_valid_arguments(name: str, tok: Any, llg: Any) -> None:
    """Random walks through a forced call of a one-parameter tool: each finished call, fed to the
    reply parser (mlx-lm's reader and the schema's choice of reading), is a call to the tool whose
    arguments validate against the schema."""
    params = {"type": "object", "properties": {"v": ROUND_TRIP_SCHEMAS[name]}, "required": ["v"],
              "$defs": {"Unit": {"type": "string", "enum": ["c", "f"]}}}
    tools = [ToolDef(FunctionDef("t", "x", params))]
    grammar = build_grammar(OutputConstraint(tools=tools, tool_choice="required", parallel_tool_calls=False),
                            frozenset(tok.get_added_vocab()))
    assert grammar is not None
    check_grammar(grammar, llg)
    finished = 0
    for seed in range(12):
        text = walk_texts(grammar, tok, llg, seed)
        if text is None:
            continue
        finished += 1
        parser = ReplyParser(tools=tools)
        events = parser.feed(text) + parser.finish()
        ends = [e for e in events if isinstance(e, ToolCallEnd)]
        assert len(ends) == 1 and ends[0].name == "t", (text, events)
        jsonschema.validate(json.loads(ends[0].arguments), params)
    assert finished >= 3, name


@pytest.mark.parametrize("tool_format", ["qwen3_coder", "json"])
def test_what_the_lazy_grammar_admits_the_parser_splits_into_text_and_calls(tool_format: str, tok: Any,
                                                                             llg: Any) -> None:
    """Text, a call, text: the grammar admits it in the model's format (Qwen3-Coder XML or Hermes
    JSON), and the reply parser delivers the text as content without markup and the call as a
    call to the declared tool with valid arguments."""
    if tool_format == "json":
        call = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                "</tool_call>")
    else:
        call = WEATHER_CALL
    grammar, _ = lazy_tool_grammar(OutputConstraint(tools=WEATHER, tool_format=tool_format),
                                   frozenset(tok.get_added_vocab()), llg)
    assert grammar is not None
    text = "Let me check. " + call + "\nDone."
    assert accepts(grammar, text, tok, llg)
    assert not accepts(grammar, "Let me check. " + call.replace("celsius", "kelvin"), tok, llg)
    parser = ReplyParser(tools=WEATHER, tool_format=tool_format)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert content == "Let me check. Done."
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [e.name for e in ends] == ["get_weather"]
    jsonschema.validate(json.loads(ends[0].arguments), WEATHER[0].function.parameters)


def test_without_a_tool_call_token_the_text_opener_starts_the_call(tok: Any, llg: Any) -> None:
    """A vocabulary without a `<tool_call>` token: the opener is text, ended lazily, and what follows
    it is held to the declared tools as with the token (here the tags are spelled out character by
    character, as such a vocabulary would write them)."""
    rules = call_rules(WEATHER, "qwen3_coder", frozenset())
    grammar = llguidance.grammar_from("lark", "\n".join([*lazy_rules(True, frozenset()), *rules]))

    def spelled(text: str) -> bool:
        matcher = llguidance.LLMatcher(llg, grammar)
        ids = [t for ch in text for t in tok.encode(ch, add_special_tokens=False)]
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    assert spelled("Let me see. " + WEATHER_CALL + " ok") and spelled(WEATHER_CALL + WEATHER_CALL)
    assert not spelled("x <tool_call>\n<function=nope>\n") and not spelled("x </parameter>")


def test_a_huge_integer_the_grammar_admits_parses_to_valid_arguments(tok: Any, llg: Any) -> None:
    """An integer with a bound only on one side is JSON (llguidance holds the bound): 400 digits
    are admitted, and mlx-lm's reader, which goes through `float()` (infinite here: OverflowError),
    no longer fails the parse; the JSON reading is the exact integer."""
    params = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}, "required": ["n"]}
    tools = [ToolDef(FunctionDef("t", "x", params))]
    grammar = build_grammar(OutputConstraint(tools=tools, tool_choice="required"), frozenset(tok.get_added_vocab()))
    assert grammar is not None
    text = f"<tool_call>\n<function=t>\n<parameter=n>\n1{'0' * 400}\n</parameter>\n</function>\n</tool_call>"
    assert accepts(grammar, text, tok, llg)
    parser = ReplyParser(tools=tools)
    ends = [e for e in parser.feed(text) + parser.finish() if isinstance(e, ToolCallEnd)]
    assert json.loads(ends[0].arguments) == {"n": 10**400}
