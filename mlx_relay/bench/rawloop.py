"""The raw-library-loop driver: the same scenarios, served by mlx-vlm's `BatchGenerator` alone.

No actors, no HTTP, no normalization, no detokenization while generating: requests are rendered
with the checkpoint's chat template, tokenized, and inserted into one continuous
`BatchGenerator` on the model's LanguageModel, stepped on one thread (`GPUThread`, as MLX
needs). Token times are taken on that thread as the library returns them. This is the floor a
server's figures are compared against (`mlx-relay bench --raw-loop MODEL`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from mlx_relay.bench.records import Measurement, Outcome
from mlx_relay.bench.workload import BenchRequest
from mlx_relay.engine.hosting.gpu_thread import GPUThread

# (request id, time on the GPU thread, token, finish reason)
_Event = tuple[int, float, int, str | None]


@dataclass
class _Loop:
    """Lives on the GPU thread: the generator and the requests in it."""

    model: Any
    processor: Any
    max_num_seqs: int
    emit: Callable[[list[_Event]], None]
    waiting: deque[tuple[int, list[int], int]] = field(default_factory=deque)
    running: dict[int, int] = field(default_factory=dict)  # generator uid -> request id
    gen: Any = None

    def __post_init__(self) -> None:
        from mlx_vlm.generate.ar import BatchGenerator

        self.gen = BatchGenerator(self.model.language_model, self.processor,
                                  completion_batch_size=self.max_num_seqs + 8, prefill_batch_size=8,
                                  compute_logprobs=False, greedy_sampling=True)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, rid: int, ids: list[int], max_tokens: int) -> None:
        self.waiting.append((rid, ids, max_tokens))

    def step(self) -> None:
        import mlx.core as mx

        while self.waiting and len(self.running) < self.max_num_seqs:
            rid, ids, max_tokens = self.waiting.popleft()
            emb = self.model.get_input_embeddings(mx.array([ids]), None)
            kwargs = {k: v for k, v in emb.to_dict().items() if v is not None}
            (uid,) = self.gen.insert([ids], max_tokens=[max_tokens], prompt_kwargs=[kwargs])
            self.running[uid] = rid
        _, responses = self.gen.next()
        now = time.perf_counter()
        events = []
        for r in responses:
            rid = self.running[r.uid]
            if r.finish_reason is not None:
                del self.running[r.uid]
            events.append((rid, now, r.token, r.finish_reason))
        if events:
            self.emit(events)

    def close(self) -> None:
        self.gen.close()


class RawLoopDriver:
    def __init__(self, thread: GPUThread, loop: _Loop, tokenizer: Any, model_path: Path, *,
                 label: str = "raw-loop") -> None:
        self._thread = thread
        self._loop = loop
        self._tokenizer = tokenizer
        self._queues: dict[int, asyncio.Queue[_Event]] = {}
        self._ids = itertools.count()
        self.label = label
        self.model = model_path.name
        self.description = f"mlx-vlm BatchGenerator on {model_path} (no server)"

    @classmethod
    @asynccontextmanager
    async def open(cls, model_path: Path, *, max_num_seqs: int = 64, label: str = "raw-loop"
                   ) -> AsyncIterator[RawLoopDriver]:
        aloop = asyncio.get_running_loop()
        thread = GPUThread("raw-loop", on_fatal=lambda exc: None)
        thread.start()
        holder: list[RawLoopDriver] = []

        def emit(events: list[_Event]) -> None:
            aloop.call_soon_threadsafe(holder[0]._deliver, events)

        def load() -> tuple[_Loop, Any]:
            import mlx_vlm

            model, processor = mlx_vlm.load(str(model_path))
            return _Loop(model, processor, max_num_seqs, emit), processor.tokenizer

        try:
            loop, tokenizer = await asyncio.wrap_future(thread.submit(load))
            driver = cls(thread, loop, tokenizer, model_path, label=label)
            holder.append(driver)
            thread.stepper = loop
            yield driver
        finally:
            if holder:
                await asyncio.wrap_future(thread.submit(holder[0]._loop.close))
            await anyio.to_thread.run_sync(thread.stop, 30.0)

    def _deliver(self, events: list[_Event]) -> None:
        for event in events:
            queue = self._queues.get(event[0])
            if queue is not None:
                queue.put_nowait(event)

    def _render(self, request: BenchRequest) -> list[int]:
        text = self._tokenizer.apply_chat_template(request.messages, tools=request.tools, add_generation_prompt=True,
                                                   tokenize=False)
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    async def send(self, request: BenchRequest) -> Outcome:
        t0 = time.perf_counter()
        try:
            ids = await anyio.to_thread.run_sync(self._render, request)
        except Exception as exc:
            return Outcome(Measurement(error="http_4xx", error_detail=f"{type(exc).__name__}: {exc}"), "")
        rid = next(self._ids)
        queue: asyncio.Queue[_Event] = asyncio.Queue()
        self._queues[rid] = queue
        times: list[float] = []
        tokens: list[int] = []
        finish: str | None = None
        try:
            self._thread.submit(self._loop.add, rid, ids, request.max_tokens)
            while finish is None:
                _, at, token, finish = await queue.get()
                times.append(at - t0)
                tokens.append(token)
        finally:
            del self._queues[rid]
        text = await anyio.to_thread.run_sync(lambda: self._tokenizer.decode(tokens, skip_special_tokens=True))
        return Outcome(Measurement(
            ttft_s=times[0], itl_s=[b - a for a, b in itertools.pairwise(times)], e2e_s=times[-1],
            prompt_tokens=len(ids), completion_tokens=len(tokens), content_chunks=len(times),
            finish_reason=finish,
        ), text)
