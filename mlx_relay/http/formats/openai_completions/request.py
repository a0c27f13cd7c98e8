"""OpenAI legacy Completions: the wire request into front-end-neutral `ChatRequest`s.

The prompt (a string, token ids, or a list of either) is tokenized as it is: no chat template,
no normalization, no reply parsing (the route opens the replies raw), so the text is exactly
what the model generated. Each prompt gets `n` choices, numbered prompt by prompt; all of them
are admitted together and decode in the same batch.
"""

from __future__ import annotations

from typing import Any

from mlx_relay.errors import InvalidRequest
from mlx_relay.http.formats.openai_completions.types import CompletionRequest
from mlx_relay.http.formats.speculation import speculation_of
from mlx_relay.http.replies import choice_requests
from mlx_relay.service import ChatRequest

MAX_PROMPTS = 16


def prompts_of(body: CompletionRequest) -> list[str | list[int]]:
    p: Any = body.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
        return list(p)
    raise InvalidRequest("prompt must be a string, a list of strings, token ids or a list of token-id lists",
                         param="prompt")


def to_requests(body: CompletionRequest) -> list[ChatRequest]:
    if body.suffix:
        raise InvalidRequest("suffix (fill-in-the-middle) is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequest("best_of must equal n (no server-side ranking)", param="best_of")
    if body.logprobs is not None and not 0 <= body.logprobs <= 20:
        raise InvalidRequest("logprobs must be between 0 and 20", param="logprobs")
    prompts = prompts_of(body)
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequest(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    if body.echo and not all(isinstance(p, str) for p in prompts):
        raise InvalidRequest("echo needs text prompts", param="echo")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    speculation = speculation_of(body.speculation)
    out: list[ChatRequest] = []
    for prompt in prompts:
        req = ChatRequest(
            messages=[], prompt=prompt, max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
            top_k=body.top_k, min_p=body.min_p, seed=body.seed, stop=stop, logprobs=body.logprobs is not None,
            top_logprobs=body.logprobs or 0, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
            mtp=body.mtp is not False, speculation=speculation.method,
            max_draft_tokens=speculation.max_draft_tokens, specprefill=body.specprefill,
            specprefill_keep=body.specprefill_keep if body.specprefill_keep is not None else body.specprefill_keep_pct,
            specprefill_anchor_ngram=body.specprefill_anchor_ngram)
        out.extend(choice_requests(req, body.n))
    return out
