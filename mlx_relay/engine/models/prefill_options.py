"""How a prefill chunk's forward runs (no MLX): given whole to the families' `prefill_forward` by
the lanes' `stage_forward.ModelForward`.

- The bound on its transient memory beyond the caches. Attention is where a chunk's working set
  grows with its context: where MLX has no fused attention for the model's head width (its CUDA
  backend, for Qwen3.5's 256), it materializes the scores of every query against every key it
  reads, about three copies of heads x queries x keys elements (the scores, their mask applied,
  their softmax). `attention_rows` is how many queries a block may hold so that a block's scores
  stay within `attention_bytes`.
- The levers of issue 43 (each on by default where it pays; off, that part runs the library's arithmetic, so
  `benchmarks/prefill_parts.py` measures what each buys): the GatedDeltaNet recurrence as our
  kernel, the conv as shifted multiply-adds, the experts as grouped GEMMs, their 8-bit weights
  read in place by our kernel. Each applies only where it can (a CUDA GPU; `kernels/`).
"""

from __future__ import annotations

from typing import Literal

import msgspec

#: how a prefill chunk's routed experts run (`EngineConfig.prefill_experts`, `--prefill-experts`):
#: "dequantize" each projection's experts to float for MLX's grouped GEMM (`kernels/grouped_experts.py`),
#: "kernel" our grouped 8-bit GEMM reading them in place (`kernels/grouped_qmm.py`), "narrow" the
#: same with few rows an expert on the tensor cores (`kernels/narrow_qmm.py`) and grouped from
#: `NARROW_MIN_ROUTES` pairs, "library" mlx-vlm's `SwitchGLU` (MLX's `gather_qmm`, a matmul per routed
#: pair on CUDA)
PrefillExperts = Literal["dequantize", "kernel", "narrow", "library"]

#: copies of a block's scores alive at once in MLX's unfused attention (scores, masked, softmax)
SCORE_COPIES = 3
ROW_GRANULE = 64  # blocks of whole 64-query tiles
#: (token, expert) pairs from which "narrow" runs the experts grouped. The step of 8 decoding rows
#: beside a 256-token slice (2,112 pairs), an H200: 62.5 ms from 256 pairs against 76.9 from 1,024 and
#: 80.2 with "kernel" at `dbca7b6`, 65.8 against 78.3 at `7fe2ab8`; from 64 pairs the sort and gathers
#: around the kernel cost the small slices more than it saves (benchmarks/results/gpu-h200-2026-11-28c/,
#: -28d/)
NARROW_MIN_ROUTES = 256
#: a chunk's layers run compiled per part (`models/compiled_parts.py`) only at a multiple of this many
#: tokens: the scheduler's shares are multiples of 64 from 64 tokens (`scheduling/token_budget.granular`),
#: its floor 16, so few shapes are traced; another length (a prompt's last chunk) runs eagerly
COMPILED_GRANULE = 16
#: the largest chunk whose layers run compiled on a CUDA GPU by default: beyond it the device's work
#: hides the host's graph building (a 2,048-token chunk of the 35B-A3B shape ~190 ms of kernels)
COMPILED_MAX_TOKENS = 512


class PrefillOptions(msgspec.Struct, frozen=True):
    attention_bytes: int = 8 << 30  # one attention block's scores
    recurrence_kernel: bool = True
    # off: on an H100 the library's grouped Conv1d took 3.27 ms a layer of 2,048 tokens and the
    # shifted multiply-adds 3.97 ms (benchmarks/results/prefill-h100-2026-11-28/)
    shifted_conv: bool = False
    grouped_experts: bool = True
    # (token, expert) pairs from which the grouped path pays on a GPU: below it the library's
    # per-pair quantized matmul reads less than one dequantization of every expert writes, and no
    # less than our kernels read in place (one projection of the 35B-A3B shape on an H200: 229 us
    # the library's, 224 `grouped_qmv`'s at 576 pairs, 751 and 363 at 2,112, with the sort and gather
    # around ours still to pay: benchmarks/results/kernel-profile-h200-2026-11-28/)
    grouped_min_routes: int = 1024
    # our grouped 8-bit kernel inside the grouped experts (`kernels/grouped_qmm.py`); off: every
    # expert dequantized for MLX's grouped GEMM (`prefill_experts` says which the engine runs)
    quantized_kernel: bool = True
    # ... with few rows an expert on the tensor cores (`kernels/narrow_qmm.py`) instead of `grouped_qmv`'s
    # CUDA cores
    narrow_kernel: bool = False
    # on a GPU, queue the chunk's layers one ahead of the device (`chunk_forward.pacing`:
    # its transient memory two layers'); off, the chunk's graph is built whole and evaluated by the
    # caller (`benchmarks/prefill_parts.py` so times the host's graph building apart)
    paced: bool = True
    # the largest chunk of one unpadded row whose layers run compiled per part (recurrent mixer,
    # experts: `models/compiled_parts.py`); None: `COMPILED_MAX_TOKENS` on a CUDA GPU, 0 (never) elsewhere
    compiled_max_tokens: int | None = None

    def compiles(self, tokens: int, cuda: bool) -> bool:
        """Whether a chunk of `tokens` positions (one row, no padding) runs its layers compiled per part."""
        bound = self.compiled_max_tokens if self.compiled_max_tokens is not None else (
            COMPILED_MAX_TOKENS if cuda else 0)
        return 0 < tokens <= bound and tokens % COMPILED_GRANULE == 0

    def with_experts(self, experts: PrefillExperts) -> PrefillOptions:
        """These options with the experts run as `experts` says."""
        narrow = experts == "narrow"
        return msgspec.structs.replace(self, grouped_experts=experts != "library",
                                       quantized_kernel=experts in ("kernel", "narrow"), narrow_kernel=narrow,
                                       grouped_min_routes=NARROW_MIN_ROUTES if narrow else self.grouped_min_routes)

    def attention_rows(self, rows: int, heads: int, keys: int, itemsize: int) -> int:
        """Queries per attention block for `rows` rows of `heads` query heads over `keys` keys."""
        per_query = max(1, rows * heads * keys * itemsize * SCORE_COPIES)
        fit = self.attention_bytes // per_query
        return max(ROW_GRANULE, fit - fit % ROW_GRANULE)


def prefill_experts(configured: PrefillExperts | Literal["auto"], backend: str) -> PrefillExperts:
    """The experts' path on `backend`: as configured; "auto" our kernels on a CUDA GPU, narrow where an
    expert has few rows (experts they do not fit are dequantized: `kernels/grouped_qmm.kernel_fits`);
    off a CUDA GPU the library's. Narrow since `dbca7b6`'s H200 lease: its kernel passes the float32
    check (relative error 0.0021-0.0033, MLX's own 0.0025-0.0031), and the mixed step at a 256-token
    slice took 62.5 ms against 80.2 (`NARROW_MIN_ROUTES`); a lone 4,096-token chunk has many rows an
    expert and runs `grouped_qmm`'s tensor-core tiles either way.

    Our kernel: on an H200 as close to a float32 truth as the library's `SwitchGLU` (relative error
    0.0061 at 256 tokens, 0.0067 at 2,048: benchmarks/gpu/experts_truth.py), a 4,096-token chunk 376
    ms where dequantizing took 428 and a 256-token chunk 74 ms where it took 209
    (benchmarks/results/prefill-h200-2026-11-28/)."""
    if backend != "cuda":
        return "library"
    return "narrow" if configured == "auto" else configured
