"""Request bodies into typed structs, with every way a body can be bad answered as a 4xx.

Every route decodes its body here: not JSON, invalid UTF-8 or nested past the decoder's
recursion limit is a 400, JSON of the wrong shape a 422 (msgspec's path names the field), and
free-form JSON inside the struct (schemas, tool arguments, template kwargs: the `Any` fields)
deeper than `RequestLimits.max_json_depth` a 400, before any of it reaches code that recurses.
The body's size and read time are bounded earlier, by `http.guard.RequestGuard`.

Decoding is msgspec's lax mode, which is what the OpenAPI document promises: an integral float
is an integer (JSON Schema's `integer` includes `3.0`, which some clients send) and numeric or
boolean strings are read as numbers and booleans, as pydantic-based servers read them.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from mlx_relay.errors import InvalidRequest
from mlx_relay.http.errors import decode_error

B = TypeVar("B")


def decode_body(raw: bytes, body_type: type[B], max_depth: int) -> B:
    try:
        body = msgspec.json.decode(raw, type=body_type, strict=False)
    except msgspec.DecodeError as exc:
        raise decode_error(exc) from None
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    except RecursionError:
        raise InvalidRequest(f"the request body is nested too deeply (the limit is {max_depth} levels)") from None
    check_depth(body, max_depth)
    return body


def check_depth(value: Any, limit: int) -> None:
    """Raises `InvalidRequest` if a dict/list inside `value` (structs included) nests deeper than
    `limit`; iterative, so the check itself never recurses."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, msgspec.Struct):
            children: Any = (getattr(item, f) for f in item.__struct_fields__)
        elif isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth >= limit:
            raise InvalidRequest(f"the request body is nested too deeply (the limit is {limit} levels)")
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, msgspec.Struct | dict | list | tuple))



