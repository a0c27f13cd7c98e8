"""Tool-call grammars for llguidance, in the model's own tool-call syntax (Lark text; built by
`chat.grammar`, which owns the constraint and the validation).

Two shapes:
- forced (`tool_choice` "required" or a named function): the reply is calls and nothing else;
- lazy (`tool_choice` "auto" with tools declared): free text until the model opens a call
  (`<tool_call>`: one special token in Qwen's vocabulary, else its text), then the rest of the
  call constrained to a declared tool and its parameter schema, then free text again (more calls
  only with `parallel_tool_calls`). Free text may not spell tool markup (`<tool_call>`,
  `</tool_call>`, `<function=`, `</function>`, `<parameter=`, `</parameter>`), so no markup
  reaches a reply's text and every call the reply parser sees was constrained. A thinking block
  the model opens itself (`<think>` first, the prompt left none open) is free.

Values in the Qwen3-Coder XML format are written the way the reply parser (mlx-lm's
`qwen3_coder` reader, then the schema choosing among its readings) reads them back: a string is
raw text (an enum or const as its literal text; a free string within its length bounds and
`pattern`, never containing `</parameter>` or `</tool_call>`, never "null" in any case, which the
reader turns into None), a boolean `true`/`false` or `True`/`False` (Qwen's templates write
Python's; forcing JSON's made relay-tiny-agent write `false` where it meant `True`: exact calls
24/30 against 29/30 unconstrained), anything else JSON (`3`, `{"a": 1}`); a schema that admits
strings and JSON scalars (`["string", "null"]`, `anyOf` of both) admits each branch in its own
writing, as one lexeme; one that mixes strings with objects or arrays is written as JSON (a string
then quoted: the parser still finds a valid reading). Not held: a JSON value's inner strings may
spell `</parameter>` (llguidance's JSON strings cannot exclude it). `format` is an annotation
here as in JSON Schema 2020-12 and in the reply parser's validator: a raw string is not held to
it. In the Hermes JSON format the whole call is one JSON object (`{"name": ..., "arguments":
...}`) checked by llguidance's JSON Schema support.

A tool whose schema cannot be written exactly in the XML format (a parameter or function name
the reader cannot read back, a `pattern` with anchors inside, keywords about the whole argument
object beyond `properties`/`required`) raises `ToolGrammarError` naming it; `chat.grammar`
decides what that means for the request.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from mlx_relay.chat.types import ToolDef

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
THINK_START, THINK_END = "<think>", "</think>"
# what free text may not spell: the XML format's tags (a `<function=` without its opener is a call
# the reply parser would pass on as text)
MARKUP = (CALL_START, CALL_END, "<function=", "</function>", "<parameter=", "</parameter>")
# what a raw XML value may not hold: the reader ends the value / the call at these
_VALUE_STOPS = ("</parameter>", CALL_END)
_CLOSE = "\n</parameter>\n"
_NAME_OK = re.compile(r"[^\s<>]+")  # mlx-lm's name rule: a name is read up to whitespace, `<` or `>`

_ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly", "format", "$schema", "$id", "$anchor", "$defs", "definitions", "nullable"})
_STRING_KEYS = frozenset({"type", "enum", "const", "minLength", "maxLength", "pattern", "contentMediaType",
                          "contentEncoding"})
# the keywords of the argument object itself that the per-parameter XML grammar holds (others: loose)
_OBJECT_KEYS = frozenset({"type", "properties", "required", "additionalProperties", "unevaluatedProperties"})


class ToolGrammarError(ValueError):
    """A tool whose calls this grammar cannot enforce exactly (`tool`: its name)."""

    def __init__(self, tool: str, why: str) -> None:
        super().__init__(f"tool '{tool}': {why}")
        self.tool = tool


def lark_str(text: str) -> str:
    return json.dumps(text)


def token_or_text(text: str, special: frozenset[str]) -> str:
    """A tag that is one token of its own is named as a token (`<tool_call>`), else as text."""
    return text if text in special else lark_str(text)


def _regex_alt(texts: Sequence[str]) -> str:
    return "|".join(re.escape(t).replace("/", "\\/") for t in texts)


def _excluding(texts: Sequence[str]) -> str:
    """A terminal's `& ~...` part: no substring among `texts`."""
    return f"~/(?s:.*)({_regex_alt(texts)})(?s:.*)/"


FREE_TEXT = f"/(?s:.*)/ & {_excluding(MARKUP)}"


# -- parameter values in the XML format ----------------------------------------------------------------


def _resolve(schema: Any, defs: dict[str, Any]) -> Any:
    """A schema with a local `$ref` (`#/$defs/X`, `#/definitions/X`) replaced by its target (a few hops)."""
    for _ in range(8):
        if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
            return schema
        ref = schema["$ref"]
        m = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref)
        if m is None or m.group(2) not in defs or set(schema) - _ANNOTATIONS - {"$ref"}:
            return schema
        schema = defs[m.group(2)]
    return schema


def _types(schema: dict[str, Any]) -> set[str] | None:
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return set(t)
    return None


def _raw_pattern(pattern: str, tool: str) -> str:
    """A JSON Schema `pattern` (a search, unanchored unless it says `^`/`$`) as a whole-value regex."""
    start, end = pattern.startswith("^"), pattern.endswith("$") and not pattern.endswith("\\$")
    inner = pattern[1 if start else 0:len(pattern) - (1 if end else 0)]
    if re.search(r"(?<!\\)[$^](?![^\[]*\])", inner):
        raise ToolGrammarError(tool, f"the pattern {pattern!r} has anchors inside")
    inner = inner.replace("/", "\\/")
    return f"/{'' if start else '(?s:.*)'}(?:{inner}){'' if end else '(?s:.*)'}/"


# JSON scalars as whole-value regexes (a value that may be a raw string or one of these is one lexeme)
# (numbers bounded to stay finite as a float: mlx-lm's reader goes through `float()` then `int()`)
# (booleans also as Python writes them: Qwen's templates render a call's arguments with Jinja's
# `string`, so the models write `True`/`False`, and mlx-lm's reader reads any case)
_SCALARS = {"null": "null", "boolean": "true|false|True|False", "integer": "-?(0|[1-9][0-9]{0,199})",
            "number": "-?(0|[1-9][0-9]{0,199})(\\.[0-9]{1,200})?([eE][+-]?[0-9]{1,2})?"}


class _Values:
    """Collects the terminals and rules of one grammar's XML parameter values."""

    def __init__(self, rules: list[str]) -> None:
        self.rules = rules

    def value(self, rule: str, schema: Any, defs: dict[str, Any], tool: str) -> str:
        """The grammar of one parameter's value and its closing `\\n</parameter>\\n`: a rule name.
        A raw value and its closing are one lexeme (the value ends where the closing tag first
        appears: llguidance's lexer does not split a longer match it has followed), so a value that
        may be a raw string is one terminal of all its forms."""
        s = _resolve(schema, defs)
        if s is True or s == {} or not isinstance(s, dict):  # any value: the reader keeps text, or JSON
            return self._terminal(rule, [self._raw({}, tool, allow_null=True)])
        keys = set(s) - _ANNOTATIONS
        types = _types(s)
        if ("enum" in keys or "const" in keys) and keys <= {"enum", "const", "type"}:
            values = s["enum"] if isinstance(s.get("enum"), list) else [s.get("const")]
            return self._literals(rule, values, types, tool)
        if keys == {"type"} and types and types <= set(_SCALARS):  # numbers kept finite, booleans either way
            return self._terminal(rule, [f"/{_SCALARS[t]}/" for t in sorted(types)])
        forms = self._forms(s, defs, tool)
        if forms is not None:
            return self._terminal(rule, forms)
        return self._json(rule, s, defs)

    def _forms(self, s: dict[str, Any], defs: dict[str, Any], tool: str) -> list[str] | None:
        """A schema that admits strings, as regex forms (a raw string's, JSON scalars'); None when it
        admits no string or something no regex here can hold (it is written as JSON)."""
        keys = set(s) - _ANNOTATIONS
        types = _types(s)
        if types is not None and "string" in types and keys <= _STRING_KEYS:
            scalars = types - {"string"}
            if not scalars <= set(_SCALARS):
                return None
            return [self._raw(s, tool), *(f"/{_SCALARS[t]}/" for t in sorted(scalars))]
        branches = s.get("anyOf", s.get("oneOf"))
        if isinstance(branches, list) and branches and keys in ({"anyOf"}, {"oneOf"}):
            forms: list[str] = []
            for branch in branches:
                b = _resolve(branch, defs)
                if not isinstance(b, dict):
                    return None
                bkeys, btypes = set(b) - _ANNOTATIONS, _types(b)
                if btypes is not None and len(btypes) == 1 and bkeys == {"type"} and btypes <= set(_SCALARS):
                    forms.append(f"/{_SCALARS[next(iter(btypes))]}/")
                    continue
                sub = self._forms(b, defs, tool)
                if sub is None:
                    return None
                forms += sub
            return forms if any(" & " in f for f in forms) else None  # some branch is a string
        return None

    def _terminal(self, rule: str, forms: list[str]) -> str:
        name = rule.upper()
        self.rules.append(f"{name}: " + " | ".join(forms))
        self.rules.append(f"{name}_END: {name} {lark_str(_CLOSE)}")
        self.rules.append(f"{rule}: {name}_END")
        return rule

    def _json(self, rule: str, schema: dict[str, Any], defs: dict[str, Any]) -> str:
        if defs and "$defs" not in schema and "definitions" not in schema:
            schema = {**schema, "$defs": defs, "definitions": defs}  # its `$ref`s resolve against the tool's root
        self.rules.append(f"{rule}: %json{json.dumps(schema)} {lark_str(_CLOSE)}")
        return rule

    def _literals(self, rule: str, values: list[Any], types: set[str] | None, tool: str) -> str:
        """An enum or const: each value's text (a string raw, anything else compact JSON)."""
        texts = []
        for v in values:
            if isinstance(v, str):
                if types is not None and "string" not in types:
                    continue
                if v.lower() == "null" or any(stop in v for stop in _VALUE_STOPS):
                    raise ToolGrammarError(tool, f"the value {v[:40]!r} cannot be written raw in a tool call")
                texts.append(v)
            else:
                texts.append(json.dumps(v, separators=(",", ":"), ensure_ascii=False))
        if not texts:
            raise ToolGrammarError(tool, "a parameter admits no value")
        alternatives = " | ".join(lark_str(t) for t in dict.fromkeys(texts))
        self.rules.append(f"{rule}: ({alternatives}) {lark_str(_CLOSE)}")
        return rule

    @staticmethod
    def _raw(s: dict[str, Any], tool: str, allow_null: bool = False) -> str:
        """A raw string's regex form: within its length bounds and pattern, never holding what ends
        the value, never "null" (the reader reads it as None) unless `allow_null`."""
        lo, hi = s.get("minLength", 0), s.get("maxLength")
        if not isinstance(lo, int) or not (hi is None or isinstance(hi, int)):
            raise ToolGrammarError(tool, "a string length bound is not an integer")
        parts = [f"/(?s:.{{{lo},{'' if hi is None else hi}}})/", _excluding(_VALUE_STOPS)]
        if not allow_null:
            parts.append("~/(?i:null)/")
        if isinstance(s.get("pattern"), str):
            parts.append(_raw_pattern(s["pattern"], tool))
        return " & ".join(parts)


def _xml_call(i: int, tool: ToolDef, values: _Values, special: frozenset[str]) -> str:
    name = tool.function.name
    if not _NAME_OK.fullmatch(name):
        raise ToolGrammarError(name, "its name cannot be read back from a call")
    params = tool.function.parameters or {}
    if not isinstance(params, dict) or set(params) - _ANNOTATIONS - _OBJECT_KEYS or \
            params.get("type", "object") != "object":
        raise ToolGrammarError(name, "its parameters are not a plain object of properties")
    defs = {**params.get("definitions", {}), **params.get("$defs", {})}
    props: dict[str, Any] = params.get("properties") or {}
    required = params.get("required") or []
    if not isinstance(props, dict) or not isinstance(required, list) or set(required) - set(props):
        raise ToolGrammarError(name, "it requires a parameter it does not define")
    parts = [lark_str(f"\n<function={name}>\n")]
    for j, (pname, schema) in enumerate(props.items()):
        if not _NAME_OK.fullmatch(pname):
            raise ToolGrammarError(name, f"the parameter name {pname!r} cannot be read back from a call")
        value = values.value(f"v{i}_{j}", schema, defs, name)
        rule = f"p{i}_{j}"
        values.rules.append(f'{rule}: {lark_str(f"<parameter={pname}>" + chr(10))} {value}')
        parts.append(rule if pname in required else f"{rule}?")
    parts += [lark_str("</function>\n"), token_or_text(CALL_END, special)]
    values.rules.append(f"body{i}: " + " ".join(parts))
    return f"body{i}"


def _json_call(i: int, tool: ToolDef, values: _Values, special: frozenset[str]) -> str:
    params = tool.function.parameters or {"type": "object"}
    schema: dict[str, Any] = {"type": "object", "properties": {"name": {"const": tool.function.name},
                                                               "arguments": params},
                              "required": ["name", "arguments"], "additionalProperties": False}
    for key in ("$defs", "definitions"):  # the arguments' `#/$defs/...` refs resolve at the call's root
        if isinstance(params.get(key), dict):
            schema[key] = params[key]
    # written as `json.dumps` writes it (as Hermes-style models do), no whitespace of the model's choosing
    # between tokens: a random-weight model otherwise spends its tokens on it and never closes the call
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    values.rules.append(f"body{i}: {lark_str(chr(10))} %json{json.dumps(schema)} {lark_str(chr(10))} "
                        f"{token_or_text(CALL_END, special)}")
    return f"body{i}"


def _loose_call(i: int, tool: ToolDef, values: _Values, special: frozenset[str], tool_format: str) -> str:
    """A call to `tool` that is only well-formed: its name, then any text that does not close the
    block early (the reply parser checks its arguments)."""
    name = tool.function.name
    end = token_or_text(CALL_END, special)
    if tool_format == "json":
        schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False}
        values.rules.append(f"body{i}: {lark_str(chr(10))} %json{json.dumps(schema)} {lark_str(chr(10))} {end}")
        return f"body{i}"
    if not _NAME_OK.fullmatch(name):
        raise ToolGrammarError(name, "its name cannot be read back from a call")
    values.rules.append(f"LOOSE{i}: /(?s:.*)/ & {_excluding((CALL_START, CALL_END, '<function=', '</function>'))}")
    values.rules.append(f'LOOSE{i}_END: LOOSE{i} {lark_str("</function>" + chr(10))}')  # one lexeme (as a value)
    values.rules.append(f'body{i}: {lark_str(f"{chr(10)}<function={name}>{chr(10)}")} LOOSE{i}_END {end}')
    return f"body{i}"


def call_rules(tools: Sequence[ToolDef], tool_format: str, special: frozenset[str],
               loose: frozenset[str] = frozenset()) -> list[str]:
    """`call` (a whole `<tool_call>...</tool_call>` block), `body` (what follows its opener: one of
    the tools' calls) and every rule they need; `ToolGrammarError` for the first tool that cannot be
    enforced exactly. Tools named in `loose` get calls that are only well-formed."""
    rules: list[str] = []
    values = _Values(rules)
    build = _xml_call if tool_format == "qwen3_coder" else _json_call
    alternatives = [_loose_call(i, t, values, special, tool_format) if t.function.name in loose
                    else build(i, t, values, special) for i, t in enumerate(tools)]
    return [f"call: {token_or_text(CALL_START, special)} body", "body: " + " | ".join(alternatives), *rules]


def forced_start(most: int) -> str:
    """Calls only: at least one, at most `most`, one line apart."""
    return f'start: call ("\\n" call){{0,{most - 1}}}' if most > 1 else "start: call"


def lazy_rules(parallel: bool, special: frozenset[str]) -> list[str]:
    """Free text with calls in it (any number with `parallel`, else at most one); a thinking block the
    model opens itself is free. The call's opener is the `<tool_call>` token when the vocabulary has
    it (free text cannot produce a special token), else the text, ended lazily."""
    think = ""
    rules = [f"TEXT: {FREE_TEXT}"]
    if THINK_START in special and THINK_END in special:
        # any token but the block's end, up to it
        think = "think? "
        rules.append(f"think: {THINK_START} ANY_TEXT {THINK_END}")
        rules.append("ANY_TEXT: /(?s:.*)/")
    if CALL_START in special:
        rules.append("segment: TEXT call")
    else:  # the text before a call ends (lazily) with the opener
        rules.append(f"opener[lazy]: TEXT {lark_str(CALL_START)}")
        rules.append("segment: opener body")
    return [f"start: {think}segment{'*' if parallel else '?'} TEXT", *rules]
