"""The speculative-decoding extensions every wire format carries, written once:

- the request's `speculation` (an mlx-relay body extension): where its drafts may come from and
  how many context drafts a round may verify, `{"method": "auto" | "mtp" | "context" | "draft" |
  "none", "max_draft_tokens": 0..16}`, both keys optional. The body field is loosely typed
  (`SpeculationField`, documented in the OpenAPI schema as that object) and read here
  (`speculation_of`), so that a value of the wrong shape is a 400 in the route's error shape,
  never a schema error; the values themselves are checked with the rest of the request
  (`service.validate_request`: an unknown method, a count out of range, "draft" without a
  draft model).
- the usage's `speculation` (`speculation_usage`): drafted and accepted tokens per source,
  `{"mtp": {"drafted", "accepted", "acceptance"}, "context": {...}}`, only the sources that
  drafted (no key at all when none did).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

import msgspec

from mlx_relay.chat.output import Drafts, ReplyDone, SourceDrafts
from mlx_relay.config import MAX_DRAFT_TOKENS
from mlx_relay.errors import InvalidRequest
from mlx_relay.service import SPECULATION_METHODS

SpeculationField = Annotated[Any, msgspec.Meta(
    description="mlx-relay extension: where this request's speculative drafts may come from (method: auto, the "
                "server's choice; mtp, the model's MTP head; context, tokens copied from the prompt and the "
                "output so far; draft, a draft model; none) and at most how many context drafts a round "
                "verifies (max_draft_tokens; capped by the server's). Both keys are optional.",
    extra_json_schema={"anyOf": [
        {"type": "object", "properties": {
            "method": {"enum": list(SPECULATION_METHODS)},
            "max_draft_tokens": {"type": "integer", "minimum": 0, "maximum": MAX_DRAFT_TOKENS},
        }},
        {"type": "null"},
    ]},
)]
"""The body's `speculation` field: any JSON value on the wire, read by `speculation_of`."""


class Speculation(msgspec.Struct, frozen=True):
    """A request's `speculation`, read (None: not given, the server's default)."""

    method: str | None = None
    max_draft_tokens: int | None = None


def speculation_of(raw: object) -> Speculation:
    """The body's `speculation` (None: not given). A value of the wrong shape is a 400 naming it;
    numbers are read as the body is (msgspec's lax mode: `4.0` and `"4"` are 4)."""
    if raw is None:
        return Speculation()
    if not isinstance(raw, dict):
        raise InvalidRequest('speculation must be an object such as {"method": "context", "max_draft_tokens": 4}',
                             param="speculation")
    method, count = raw.get("method"), raw.get("max_draft_tokens")
    if method is not None and not isinstance(method, str):
        raise InvalidRequest(f"speculation.method must be a string, one of {', '.join(SPECULATION_METHODS)}",
                             param="speculation.method")
    if count is not None:
        try:
            count = msgspec.convert(count, int, strict=False)
        except msgspec.ValidationError:
            raise InvalidRequest(f"speculation.max_draft_tokens must be an integer from 0 to {MAX_DRAFT_TOKENS}",
                                 param="speculation.max_draft_tokens") from None
    return Speculation(method, count)


class SourceUsage(msgspec.Struct):
    """One source's drafts on this request: verified, accepted, and the share accepted."""

    drafted: int
    accepted: int
    acceptance: float


class SpeculationUsage(msgspec.Struct, omit_defaults=True):
    """mlx-relay usage extension: the speculative drafts per source (only the sources that drafted)."""

    mtp: SourceUsage | None = None  # the model's MTP head
    context: SourceUsage | None = None  # tokens copied from the request's context
    draft: SourceUsage | None = None  # the server's draft model (`--draft-model`)


def _source(d: SourceDrafts) -> SourceUsage | None:
    return SourceUsage(d.drafted, d.accepted, round(d.accepted / d.drafted, 4)) if d.drafted else None


def speculation_usage(dones: Iterable[ReplyDone]) -> SpeculationUsage | None:
    """The request's drafts per source, summed over its replies (choices, prompts); None when no
    source drafted."""
    total = sum((done.drafts for done in dones), Drafts())
    sources = {name: _source(d) for name, d in total.by_source().items()}
    return SpeculationUsage(**sources) if any(sources.values()) else None
