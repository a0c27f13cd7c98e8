"""OpenAI legacy Completions: reply events as a stream of `text_completion` frames
(`streaming.SSEEncoder`), ending as Chat Completions' streams end (`[DONE]`, or an error frame
and `[DONE]`)."""

from __future__ import annotations

import time

import msgspec

from mlx_relay.chat.output import ContentDelta, ReplyDone, ReplyEvent
from mlx_relay.http.formats.openai_chat.encoder import DONE, error_frames
from mlx_relay.http.formats.openai_completions.types import (
    Completion,
    CompletionChoice,
    CompletionRequest,
    completion_logprobs,
    completion_usage,
)
from mlx_relay.service import ChatRequest


class CompletionStream:
    """`text_completion` frames (`streaming.SSEEncoder`): the echoed prompts, text deltas with
    their logprobs, a finish frame per choice, the usage frame when asked for, `[DONE]`; a
    failure is an error frame and `[DONE]` (the choices still open get no finish frame)."""

    def __init__(self, reqs: list[ChatRequest], n: int, rid: str, model: str, body: CompletionRequest) -> None:
        self.reqs, self.n, self.rid, self.model, self.body = reqs, n, rid, model, body
        self.created = int(time.time())
        self.offsets = [0] * len(reqs)
        self.dones: dict[int, ReplyDone] = {}

    @property
    def done(self) -> bool:
        return len(self.dones) == len(self.reqs)

    def _frame(self, completion: Completion) -> bytes:
        return b"data: " + msgspec.json.encode(completion) + b"\n\n"

    def _choice(self, choice: CompletionChoice) -> bytes:
        return self._frame(Completion(self.rid, self.created, self.model, [choice]))

    def start(self) -> list[bytes]:
        if not self.body.echo:
            return []
        frames = []
        for i, req in enumerate(self.reqs):
            assert isinstance(req.prompt, str)
            self.offsets[i] = len(req.prompt)
            frames.append(self._choice(CompletionChoice(req.prompt, i, None)))
        return frames

    def event(self, index: int, ev: ReplyEvent) -> list[bytes]:
        if isinstance(ev, ContentDelta):
            logprobs = None
            if self.body.logprobs is not None:
                logprobs = completion_logprobs(list(ev.logprobs or ()), self.offsets[index])
            self.offsets[index] += len(ev.text)
            return [self._choice(CompletionChoice(ev.text, index, None, logprobs))]
        if isinstance(ev, ReplyDone):
            self.dones[index] = ev
            return [self._choice(CompletionChoice("", index, ev.finish_reason))]
        return []

    def failed(self, exc: Exception) -> list[bytes]:
        """The error frame says why and `[DONE]` ends the stream; a choice still open gets no
        finish frame (it did not finish: no "length" may claim it did)."""
        return error_frames(exc)

    def end(self) -> list[bytes]:
        usage = []
        if self.body.stream_options and self.body.stream_options.include_usage and self.dones:
            usage = [self._frame(Completion(self.rid, self.created, self.model, [],
                                            completion_usage(self.dones, self.n)))]
        return [*usage, DONE]
