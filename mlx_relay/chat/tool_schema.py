"""Tool parameter schemas: checks a tool call's arguments against the tool's declared JSON Schema.

Used by `mlx_relay.chat.reply_parser.ReplyParser` when a tool call's block closes. A request's
tool definitions are client input, so a schema that is itself invalid (or whose `$ref`s cannot be
resolved) never crashes the reply: such a tool, like a tool without `parameters`, accepts any
JSON object. Validators are built once per distinct schema (cached by its JSON text).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError, ValidationError, best_match
from jsonschema.protocols import Validator
from referencing.exceptions import Unresolvable

ANY_OBJECT = '{"type": "object"}'  # the schema key of a tool that declares no (usable) parameters


def schema_key(schema: dict[str, Any] | None) -> str:
    """The cache key of a parameter schema: its JSON text (keys sorted); `ANY_OBJECT` for none."""
    if not schema:
        return ANY_OBJECT
    try:
        return json.dumps(schema, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        return ANY_OBJECT


@functools.lru_cache(maxsize=256)
def validator_for(key: str) -> Validator:
    """A validator for the schema whose `schema_key` is `key`; an invalid schema gets `ANY_OBJECT`'s."""
    schema = json.loads(key)
    if isinstance(schema, dict):
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            cls.check_schema(schema)
            return cls(schema)
        except SchemaError:
            pass
    return jsonschema.Draft202012Validator(json.loads(ANY_OBJECT))


def _errors(key: str, arguments: Any) -> list[ValidationError]:
    try:
        return list(validator_for(key).iter_errors(arguments))
    except (Unresolvable, RecursionError):  # a broken $ref: the schema cannot judge, only the shape can
        return list(validator_for(ANY_OBJECT).iter_errors(arguments))


def _describe(error: ValidationError) -> str:
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{error.message} (at '{where}')" if where else error.message


def argument_error(key: str, arguments: Any) -> str | None:
    """What is wrong with `arguments` under the schema `key` (the most relevant error), or None."""
    if not isinstance(arguments, dict):
        return f"the arguments must be a JSON object, not {type(arguments).__name__}"
    error = best_match(_errors(key, arguments))
    return None if error is None else _describe(error)


def _fits(key: str, arguments: dict[str, Any], name: str) -> bool:
    """Whether the schema finds nothing wrong at (or under) the argument `name`."""
    return not any(e.absolute_path and e.absolute_path[0] == name for e in _errors(key, arguments))


def choose_values(key: str, candidates: dict[str, list[Any]]) -> dict[str, Any]:
    """Arguments from several readings of each value (e.g. as typed by a parser, as the raw text,
    as JSON): per argument the first reading the schema accepts there, else the first reading.
    Fast path: when the first readings fit together, they are the answer."""
    args = {name: values[0] for name, values in candidates.items()}
    if argument_error(key, args) is None:
        return args
    for name, values in candidates.items():
        for value in values:
            trial = {**args, name: value}
            if _fits(key, trial, name):
                args = trial
                break
    return args
