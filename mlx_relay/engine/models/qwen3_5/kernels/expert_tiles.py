"""Where each expert's rows and tiles start in rows sorted by expert (GPU thread only): the offsets
the grouped kernels read (`grouped_qmm`'s tiles of 64 rows, `narrow_qmm`'s of 8), made in one
launch, and the CUDA lines by which a block finds its tile. Written once for both kernels.

    at = tiles(experts, num_experts, rows_a_tile)   # experts [R] sorted -> Tiles (row_off, tile_off: [E + 1])

A grouped kernel's grid has `at.max_tiles` blocks along x (sized without a host sync: every expert
may end in a part tile); its source defines `RT` (rows a tile) and then `TILE_LOOKUP`, which leaves
`e` (the block's expert), `p` (its first row) and `rows` (its rows, 1 to RT), or returns the whole
block where it has no tile.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from mlx_relay.engine.kernels.backend import cuda_kernels_available
from mlx_relay.engine.models.qwen3_5.kernels.grouped_qmv import expert_counts, starts


class Tiles(NamedTuple):
    """Each expert's first row and first tile in the sorted rows ([E + 1] int32 each: the last entry
    the end) and how many tiles there can be at most. One per layer: its projections share it."""

    row_off: mx.array
    tile_off: mx.array
    max_tiles: int


# One block of a power of two threads above E (at most 1,024), thread i for entry i of E + 1:
# expert i's first row in the sorted `experts` (a binary search) and its first tile (a block-wide
# scan of each expert's tiles). MLX's CUDA backend spends ~10-20 us of the host's an operation: the
# scatter, scans and concatenations this replaces were seven.
OFFSETS_SOURCE = """
  __shared__ int first[1024], scan[1024];
  const int i = threadIdx.x, R = experts_shape[0];
  int start = R;
  if (i <= E) {
    int lo = 0, hi = R;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if ((int)experts[mid] < i) lo = mid + 1; else hi = mid;
    }
    start = lo;
  }
  first[i] = start;
  __syncthreads();
  const int tiles = i < E ? (first[i + 1] - start + RT - 1) / RT : 0;
  scan[i] = tiles;
  __syncthreads();
  for (int off = 1; off < (int)blockDim.x; off *= 2) {
    const int v = i >= off ? scan[i - off] : 0;
    __syncthreads();
    scan[i] += v;
    __syncthreads();
  }
  if (i <= E) {
    row_off[i] = start;
    tile_off[i] = scan[i] - tiles;
  }
"""

#: The block's tile (`blockIdx.x`): `e`, `p`, `rows` (see the module docstring).
TILE_LOOKUP = """
  __shared__ int tile_e, tile_p, tile_rows;
  if (threadIdx.x == 0) {
    const int tile = blockIdx.x;
    if (tile >= tile_off[E]) {
      tile_e = -1;
    } else {
      int lo = 0, hi = E;  // the last expert whose first tile is at or before this one
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (tile_off[mid] <= tile) lo = mid; else hi = mid;
      }
      tile_e = lo;
      tile_p = row_off[lo] + (tile - tile_off[lo]) * RT;
      tile_rows = min(RT, row_off[lo + 1] - tile_p);
    }
  }
  __syncthreads();
  if (tile_e < 0) return;
  const int e = tile_e, p = tile_p, rows = tile_rows;
"""


def tiles(experts: mx.array, num_experts: int, rows_a_tile: int) -> Tiles:
    """`Tiles` of the sorted `experts` [R] in tiles of `rows_a_tile` rows: one launch on a CUDA GPU,
    else (and for more than 1,023 experts) MLX's prefix sums (`tests/test_prefill_forward.py` pins
    them and the blocks' schedule on this CPU; `benchmarks/gpu/kernel_check.py` the kernel against numpy)."""
    max_tiles = -(-experts.size // rows_a_tile) + num_experts
    if num_experts + 1 > 1024 or not cuda_kernels_available():
        counts = expert_counts(experts, num_experts)
        return Tiles(starts(counts), starts((counts + rows_a_tile - 1) // rows_a_tile), max_tiles)
    kernel = mx.fast.cuda_kernel(name="relay_expert_tiles", input_names=["experts"],
                                 output_names=["row_off", "tile_off"], source=OFFSETS_SOURCE)
    threads = 1 << max(5, num_experts.bit_length())  # a power of two above E, a warp at least
    row_off, tile_off = kernel(inputs=[experts], template=[("E", num_experts), ("RT", rows_a_tile)],
                               grid=(threads, 1, 1), threadgroup=(threads, 1, 1),
                               output_shapes=[(num_experts + 1,)] * 2, output_dtypes=[mx.int32, mx.int32])
    return Tiles(row_off, tile_off, max_tiles)
