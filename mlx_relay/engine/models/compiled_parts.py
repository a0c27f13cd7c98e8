"""Compiled pieces of an eager chunk forward, made once and kept (GPU thread only; held by the
lanes' `stage_forward.ModelForward` and handed to the families' `prefill_forward` and `mixed_forward`).

A prefill chunk's forward runs eagerly: its shapes change from step to step (the context it
attends to grows), so it cannot be traced whole as the decode step is. But most of a layer does
not read the context: a recurrent mixer over its conv window and state, a mixture of experts over
the chunk's positions. For a small chunk those parts are launch-bound on a GPU, the host building
each operation's graph while the device waits (an H200 profile of a 16-token slice beside 8
decoding rows on the 35B-A3B shape: 46 ms wall, 22.5 ms of kernels, 23.5 ms between them:
`benchmarks/results/gpu-h200-2026-11-29c/`). A family compiles such a part per layer through
`part(key, make)`: `make()` builds the part's pure function once (its layer's weights captured as
constants, as the compiled decode step captures them), `mx.compile` traces it per input shape and
replays the trace. The chunk sizes that run compiled are few (`PrefillOptions.compiles`: multiples of
`COMPILED_GRANULE` up to a bound), so are the traces.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import mlx.core as mx


class CompiledParts:
    """Compiled functions by key: `part(key, make)` compiles `make()` the first time `key` is asked
    for. `traces` counts the traces of them all (MLX calls a compiled function's Python body only
    to trace it: once per new input shape) and `calls` the parts asked for, so a test can tell that
    a step ran compiled parts and traced none of them anew."""

    def __init__(self) -> None:
        self._parts: dict[Hashable, Callable[..., Any]] = {}
        self.traces = 0
        self.calls = 0

    def part(self, key: Hashable, make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        self.calls += 1
        fn = self._parts.get(key)
        if fn is None:
            body = make()

            def traced(*args: Any) -> Any:
                self.traces += 1
                return body(*args)

            fn = self._parts[key] = mx.compile(traced)
        return fn

    def __len__(self) -> int:
        return len(self._parts)
