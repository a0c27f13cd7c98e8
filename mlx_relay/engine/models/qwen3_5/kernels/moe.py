"""A mixture of experts' router and its combine (GPU thread only; called from the Qwen3.5 family's
layer loop, `models/qwen3_5/layers.py`, for mlx-vlm's `Qwen3_5MoeSparseMoeBlock`).

    inds, scores = route_topk(gate_logits, k, normalize)     # [..., E] -> [..., k] each
    out = combine(h, expert_out, scores, shared_gate, shared_out)

`route_topk` is the library's router: softmax (precise), the k largest probabilities and their
experts, renormalized to sum to one when the model says so. `combine` is the rest of the block
plus the residual add: `h + sum_k scores_k * expert_out_k + sigmoid(shared_gate) * shared_out`.
On a CUDA GPU each is one kernel launch where the library runs five and three; elsewhere the
library's own operations. The kernel's top-k lists experts by falling probability (ties to the
lower index), where `argpartition` leaves them in no set order: the sum over experts may then round
differently in bf16, never pick other experts.
"""

from __future__ import annotations

import math

import mlx.core as mx

from mlx_relay.engine.kernels.backend import cuda_kernels_available

_ROUTE_HEADER = """
__device__ inline float relay_route_warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, offset));
  return v;
}
__device__ inline float relay_route_warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
  return v;
}
"""

# One thread block per row, one thread per expert (E <= 1024); E, KTOP, NORM, OutT template.
_ROUTE_SOURCE = """
  const int row = blockIdx.x;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int warps = (blockDim.x + 31) / 32;
  __shared__ float p[E];
  __shared__ float red[32];
  __shared__ float top[KTOP];
  auto rq_ = [](float x) { return static_cast<float>(static_cast<OutT>(x)); };
  const float v = tid < E ? static_cast<float>(logits[(size_t)row * E + tid]) : __int_as_float(0xff800000);
  float m = relay_route_warp_max(v);
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = red[0];
  for (int w = 1; w < warps; ++w) m = fmaxf(m, red[w]);
  __syncthreads();
  const float e = tid < E ? expf(v - m) : 0.f;
  float s = relay_route_warp_sum(e);
  if (lane == 0) red[warp] = s;
  __syncthreads();
  s = 0.f;
  for (int w = 0; w < warps; ++w) s += red[w];
  if (tid < E) p[tid] = rq_(e / s);
  __syncthreads();
  if (tid < E) {
    const float mine = p[tid];
    int rank = 0;
    for (int j = 0; j < E; ++j) rank += (p[j] > mine) || (p[j] == mine && j < tid);
    if (rank < KTOP) {
      inds[(size_t)row * KTOP + rank] = static_cast<uint32_t>(tid);
      top[rank] = mine;
    }
  }
  __syncthreads();
  if (tid < KTOP) {
    float sc = top[tid];
    if (NORM) {
      float total = 0.f;
      for (int j = 0; j < KTOP; ++j) total += top[j];
      sc = rq_(sc / rq_(total));
    }
    scores[(size_t)row * KTOP + tid] = static_cast<OutT>(sc);
  }
"""

# One thread per output element; D, KTOP, OutT template.
# the positions' count is read from `shared_gate`'s shape ([..., 1]) at run time, not a template
# argument: a template argument is compiled into the kernel, so every new count of positions (each
# prefill chunk length, each mixed step's) compiled it anew, ~1.5 s a count on an H200
# (benchmarks/results/mixed-steps-h200-2026-11-28/)
COMBINE_SOURCE = """
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  size_t N = 1;
  for (int a = 0; a < shared_gate_ndim; ++a) N *= (size_t)shared_gate_shape[a];
  if (i >= N * D) return;
  const size_t n = i / D, d = i % D;
  auto rq_ = [](float x) { return static_cast<float>(static_cast<OutT>(x)); };
  float acc = 0.f;
  for (int j = 0; j < KTOP; ++j)
    acc += rq_(static_cast<float>(expert_out[(n * KTOP + j) * D + d]) * static_cast<float>(scores[n * KTOP + j]));
  const float sg = rq_(1.f / (1.f + expf(-static_cast<float>(shared_gate[n]))));
  const float moe = rq_(rq_(acc) + rq_(sg * static_cast<float>(shared_out[i])));
  out[i] = static_cast<OutT>(static_cast<float>(h[i]) + moe);
"""


def route_topk(logits: mx.array, k: int, normalize: bool) -> tuple[mx.array, mx.array]:
    """The experts [..., k] (uint32) and their weights [..., k] (the logits' dtype)."""
    E = logits.shape[-1]
    if cuda_kernels_available() and E <= 1024:
        return cuda_route_topk(logits, k, normalize)
    return fallback_route_topk(logits, k, normalize)


def cuda_route_topk(logits: mx.array, k: int, normalize: bool) -> tuple[mx.array, mx.array]:
    lead, E = logits.shape[:-1], logits.shape[-1]
    rows = math.prod(lead)
    threads = max(32, -(-E // 32) * 32)
    kernel = mx.fast.cuda_kernel(name="relay_moe_route_topk", input_names=["logits"],
                                 output_names=["inds", "scores"], source=_ROUTE_SOURCE, header=_ROUTE_HEADER)
    inds, scores = kernel(
        inputs=[logits],
        template=[("E", E), ("KTOP", k), ("NORM", normalize), ("OutT", logits.dtype)],
        grid=(threads * rows, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(*lead, k), (*lead, k)], output_dtypes=[mx.uint32, logits.dtype])
    return inds, scores


def fallback_route_topk(logits: mx.array, k: int, normalize: bool) -> tuple[mx.array, mx.array]:
    """mlx-vlm's `Qwen3_5MoeSparseMoeBlock` router, op for op."""
    gates = mx.softmax(logits, axis=-1, precise=True)
    inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if normalize:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds, scores


def combine(h: mx.array, expert_out: mx.array, scores: mx.array, shared_gate: mx.array, shared_out: mx.array
            ) -> mx.array:
    """`h` [..., D] plus the block's output: `expert_out` [..., k, D] weighted by `scores` [..., k],
    plus `shared_out` [..., D] gated by sigmoid(`shared_gate` [..., 1])."""
    if cuda_kernels_available():
        return cuda_combine(h, expert_out, scores, shared_gate, shared_out)
    return fallback_combine(h, expert_out, scores, shared_gate, shared_out)


def cuda_combine(h: mx.array, expert_out: mx.array, scores: mx.array, shared_gate: mx.array, shared_out: mx.array
                 ) -> mx.array:
    D, k = h.shape[-1], scores.shape[-1]
    N = h.size // D
    kernel = mx.fast.cuda_kernel(name="relay_moe_combine",
                                 input_names=["h", "expert_out", "scores", "shared_gate", "shared_out"],
                                 output_names=["out"], source=COMBINE_SOURCE)
    (out,) = kernel(
        inputs=[h, expert_out, scores, shared_gate, shared_out],
        template=[("D", D), ("KTOP", k), ("OutT", h.dtype)],
        grid=(N * D, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[h.shape], output_dtypes=[h.dtype])
    return out


def fallback_combine(h: mx.array, expert_out: mx.array, scores: mx.array, shared_gate: mx.array,
                     shared_out: mx.array) -> mx.array:
    """The library's block after its router, op for op, then the residual add."""
    y = (expert_out * scores[..., None]).sum(axis=-2)
    return h + (y + mx.sigmoid(shared_gate) * shared_out)
