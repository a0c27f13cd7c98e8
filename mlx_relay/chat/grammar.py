"""Output grammars for llguidance: `response_format` (JSON object / JSON schema), tool calls
the request requires (`tool_choice` "required" or a named function), and, with tools declared
and `tool_choice` "auto", a lazy grammar that constrains each call the model opens
(`lazy_tool_grammar`); the calls in the model's own tool-call syntax (`chat.tool_grammar`).

Built and validated by the Normalizer (it owns the tokenizer) before a request is admitted, so
a schema llguidance cannot enforce exactly is a 400 ("fail closed"), never a 200 whose output
might not match (with `auto`, that tool's calls are loosened instead: `lazy_tool_grammar` says
why); the GPU thread then compiles the same grammar text into a matcher per row.
Pure Python: grammars are llguidance's serialized text, built with `llguidance.grammar_from`.

Validation is three checks: every schema is a valid JSON Schema (its meta-schema: a `minimum`
that is a string, `properties` that is not an object), llguidance accepts the grammar without a
warning, and a matcher walks a few seeded random paths from the start without hitting one of its
resource limits (a schema with thousands of optional properties blows the parser's row limit at
the first `{`). llguidance is native code: a Rust panic (a `BaseException`) anywhere in it is a
`GrammarError` here, never a crash. Forced tool calls end after at most one call per declared
tool (with parallel calls), so a reply cannot call on until max_tokens.

A grammar that starts after a thinking block (the prompt left `<think>` open; the GPU thread
applies the grammar from the model's `</think>` on) first admits one or two newlines: the models
write a separator there (Qwen's templates: `</think>\n\n`), and a grammar that forbids it pushes
them off their own format at the answer's first token (with `response_format: json_object` and
thinking on, the trained relay-tiny-agent wrote the asked object for 21 of 30 held-out prompts
without the separator, every reply a valid object, and for 30 of 30 with it).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import jsonschema
import llguidance
import llguidance.numpy
import msgspec
import numpy as np

from mlx_relay.chat.tool_grammar import ToolGrammarError, call_rules, forced_start, lazy_rules
from mlx_relay.chat.types import NamedToolChoice, ResponseFormat, ToolChoice, ToolDef
from mlx_relay.runtime.supervision import is_failure


class OutputConstraint(msgspec.Struct, frozen=True):
    """What the reply must look like (travels in the Normalizer's Render message)."""

    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    tool_format: str | None = "qwen3_coder"


class GrammarError(ValueError):
    """The constraint cannot be enforced exactly (the message says why)."""


@contextmanager
def _native(what: str) -> Iterator[None]:
    """llguidance's panics and exceptions as a GrammarError."""
    try:
        yield
    except GrammarError:
        raise
    except BaseException as exc:
        if not is_failure(exc):
            raise
        raise GrammarError(f"{what}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def check_schema(schema: Any, where: str) -> None:
    """A valid JSON Schema (by its declared `$schema`, else draft 2020-12), or GrammarError."""
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"{where} must be a JSON Schema object")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        at = "/".join(str(p) for p in exc.absolute_path)
        raise GrammarError(f"{where} is not a valid JSON Schema{f' at {at}' if at else ''}: {exc.message[:300]}") \
            from None
    except RecursionError:
        raise GrammarError(f"{where} is nested too deeply") from None


# the separator after `</think>`: Qwen's templates write "\n\n"; one or two newlines, so a forced
# call starts within two tokens of the block's end (a wider separator, up to 8 whitespace
# characters, let a random-weight model spend its tokens on "\r\t " and answer whitespace content
# and no call), and the reply parser drops them (no whitespace content ahead of the call)
_SEPARATOR = "SEP: /\\n{1,2}/"


def _after_thinking(start: str, after_thinking: bool) -> str:
    """The grammar's start rule (`start: <body>`), led by an optional separator after a thinking block."""
    return start.replace("start: ", "start: SEP? ", 1) if after_thinking else start


def _known_format(tool_format: str | None, choice: ToolChoice) -> str:
    if tool_format not in ("qwen3_coder", "json"):
        raise GrammarError(f"tool_choice {choice!r} needs a known tool-call format; this model's is {tool_format!r}")
    return tool_format


def tool_call_grammar(tools: Sequence[ToolDef], choice: ToolChoice, parallel: bool, tool_format: str | None,
                      special: frozenset[str], after_thinking: bool = False) -> str:
    """The reply is one or more calls (one if not `parallel`) to the allowed tools, nothing else."""
    fmt = _known_format(tool_format, choice)
    allowed = list(tools)
    if isinstance(choice, NamedToolChoice):
        allowed = [t for t in tools if t.function.name == choice.name]
        if not allowed:
            raise GrammarError(f"tool_choice names '{choice.name}', which is not among the declared tools")
    try:
        rules = call_rules(allowed, fmt, special)
    except ToolGrammarError as exc:
        raise GrammarError(str(exc)) from None
    # with parallel calls: at most one per declared tool, then the reply ends
    most = len(allowed) if parallel and not isinstance(choice, NamedToolChoice) else 1
    if after_thinking:
        rules.append(_SEPARATOR)
    with _native("the tool-call grammar cannot be built"):
        return llguidance.grammar_from("lark", "\n".join([_after_thinking(forced_start(most), after_thinking), *rules]))


def lazy_tool_grammar(c: OutputConstraint, special: frozenset[str], llg_tokenizer: Any) -> tuple[str | None, list[str]]:
    """`tool_choice` "auto" with tools declared: free text, and every call the model opens constrained
    to a declared tool and its schema (`chat.tool_grammar.lazy_rules`); built and checked here, with
    the tokenizer, because it never refuses the request. Returns the grammar (None: no known format)
    and the tools whose calls it holds only to being well-formed.

    Fail closed does not mean refuse here: a coding agent declares dozens of tools (an MCP server's
    among them) and asked for none in particular; a 400 for one schema llguidance cannot enforce
    exactly would fail every turn of the agent, for a tool it may never call. So such a tool's calls
    are only well-formed (its name, then any text that does not close the block: the reply parser
    checks the arguments as for an unconstrained reply), every other tool stays exact, and the
    request's `Prompt` names the loosened tools (counted in `/metrics`:
    `tool_grammar_loose_tools_total`). Forced calls (`required`, a named function) still refuse
    such a schema with a 400: there the caller asked for a call that must be valid."""
    if c.tool_format not in ("qwen3_coder", "json") or not c.tools:
        return None, []
    fmt, tools = c.tool_format, c.tools
    loose: set[str] = set()
    for tool in tools:  # what the grammar cannot write exactly (pure Python, cheap)
        try:
            call_rules([tool], fmt, special)
        except ToolGrammarError:
            loose.add(tool.function.name)

    def attempt() -> str:
        rules = call_rules(tools, fmt, special, frozenset(loose))
        with _native("the tool-call grammar cannot be built"):
            lazy = llguidance.grammar_from("lark", "\n".join([*lazy_rules(c.parallel_tool_calls, special), *rules]))
            calls = llguidance.grammar_from("lark", "\n".join([forced_start(1), *rules]))
        validate_grammar(lazy, llg_tokenizer)
        check_grammar(calls, llg_tokenizer)  # the calls' own resource limits, walked from their opener
        return lazy

    try:
        try:
            return attempt(), sorted(loose)
        except GrammarError:  # what llguidance refuses: find the tools, loosen them, once
            for tool in tools:
                if tool.function.name not in loose:
                    try:
                        check_grammar(tool_call_grammar([tool], "required", False, fmt, special), llg_tokenizer)
                    except GrammarError:
                        loose.add(tool.function.name)
            return attempt(), sorted(loose)
    except (GrammarError, ToolGrammarError):  # not even well-formed calls can be held: unconstrained
        return None, sorted(t.function.name for t in tools)


# the whitespace a JSON reply may put between two tokens (unless its schema says otherwise): a line
# break and an indent, enough to pretty-print ten levels deep, but bounded, so a weak model cannot
# spend its tokens on whitespace and never close the object (a random-weight one did, every time)
def _json_layout() -> dict[str, Any]:
    return {"whitespace_flexible": True, "whitespace_pattern": r"(\r?\n)?[ \t]{0,40}"}


def json_grammar(fmt: ResponseFormat, after_thinking: bool = False) -> str:
    if fmt.type == "json_object":
        schema: dict[str, Any] = {"type": "object"}
    else:
        if not isinstance(fmt.schema, dict):
            raise GrammarError("response_format json_schema needs a `schema` object")
        schema = fmt.schema
        check_schema(schema, "the response_format schema")
    if "x-guidance" not in schema:
        schema = {**schema, "x-guidance": _json_layout()}
    with _native("the JSON schema cannot be compiled"):
        if after_thinking:
            start = _after_thinking(f"start: %json{json.dumps(schema)}", True)
            return llguidance.grammar_from("lark", f"{start}\n{_SEPARATOR}")
        return llguidance.grammar_from("json_schema", json.dumps(schema))


def lazy_tools(c: OutputConstraint) -> bool:
    """Tools declared, `tool_choice` "auto" and no structured `response_format` (which, as before,
    decides the whole reply): calls are constrained once opened."""
    return bool(c.tools) and c.tool_choice == "auto" and (c.response_format is None or
                                                          c.response_format.type == "text")


def build_grammar(c: OutputConstraint, special: frozenset[str], after_thinking: bool = False) -> str | None:
    """The grammar for `c`, or None when the reply is unconstrained; `after_thinking`: it applies
    from the end of a thinking block the prompt opened (a separator may lead it)."""
    forced_tools = c.tools and c.tool_choice not in ("auto", "none")
    if c.tool_choice not in ("auto", "none") and not c.tools:
        raise GrammarError("tool_choice requires tools")
    if forced_tools:
        assert c.tools is not None
        return tool_call_grammar(c.tools, c.tool_choice, c.parallel_tool_calls, c.tool_format, special,
                                 after_thinking)
    if c.response_format is not None and c.response_format.type != "text":
        return json_grammar(c.response_format, after_thinking)
    return None


def validate_grammar(grammar: str, llg_tokenizer: Any) -> None:
    """An error or any warning (a keyword llguidance would ignore) refuses it."""
    with _native("the grammar is invalid"):
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, llg_tokenizer)
    if is_error or messages:
        raise GrammarError("; ".join(m.splitlines()[0] for m in messages if m) or "the grammar is invalid")


def check_grammar(grammar: str, llg_tokenizer: Any, walks: int = 4, steps: int = 12, seed: int = 0) -> None:
    """Fail closed: `validate_grammar`, and a matcher that hits a resource limit on one of `walks`
    seeded random paths of `steps` tokens from the start refuses it too."""
    validate_grammar(grammar, llg_tokenizer)
    rng = random.Random(seed)
    n_vocab = llg_tokenizer.vocab_size
    with _native("the grammar fails when generating"):
        bitmask = llguidance.numpy.allocate_token_bitmask(1, n_vocab)
        for _ in range(walks):
            matcher = llguidance.LLMatcher(llg_tokenizer, grammar)
            for _ in range(steps):
                llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
                if matcher.is_error() or matcher.is_stopped():
                    break
                allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:n_vocab])
                if not len(allowed):
                    break
                matcher.consume_token(int(allowed[rng.randrange(len(allowed))]))
            if matcher.is_error():
                first = (matcher.get_error().strip().splitlines() or ["a parser limit"])[0][:300]
                raise GrammarError(f"the grammar fails when generating: {first}")
