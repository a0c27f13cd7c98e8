"""A mixture of experts' router and its combine (GPU thread only; called from the Qwen3.5 family's
layer loop, `models/qwen3_5/layers.py`, for mlx-vlm's `Qwen3_5MoeSparseMoeBlock`).

    inds, scores = route_topk(gate_logits, k, normalize)     # [..., E] -> [..., k] each
    out = combine(h, expert_out, scores, shared_gate, shared_out)

`route_topk` is the library's router: softmax (precise), the k largest probabilities and their
experts, renormalized to sum to one when the model says so. `combine` is the rest of the block
plus the residual add: `h + sum_k scores_k * expert_out_k + sigmoid(shared_gate) * shared_out`.
On a CUDA GPU each is one kernel launch where the library runs five and three (every input read
through its strides: the logits and the shared gate may be views of one merged product, read in
place); elsewhere the library's own operations. The kernel's top-k lists experts by falling
probability (ties to the lower index), where `argpartition` leaves them in no set order: the sum
over experts may then round differently in bf16, never pick other experts.
"""

from __future__ import annotations

import math

import mlx.core as mx

from mlx_relay.engine.kernels.backend import cuda_kernels_available

# The offset of index n over an array's first `lead` dimensions (row-major), the rest at 0: every
# input is read through its strides (the router's logits and the shared expert's gate may be views of
# one merged product, `merged_projections.py`, each row strided by the whole product's width)
LEAD_AT = """
template <typename Sh, typename St>
__device__ inline size_t relay_lead_at(unsigned n, const Sh& shape, const St& strides, int lead) {
  size_t at = 0;
  for (int d = lead - 1; d >= 0; --d) {
    const unsigned s = static_cast<unsigned>(shape[d]);
    at += (size_t)(n % s) * (size_t)strides[d];
    n /= s;
  }
  return at;
}
"""

ROUTE_HEADER = LEAD_AT + """
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
ROUTE_SOURCE = """
  const int row = blockIdx.x;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int warps = (blockDim.x + 31) / 32;
  __shared__ float p[E];
  __shared__ float red[32];
  __shared__ float top[KTOP];
  auto rq_ = [](float x) { return static_cast<float>(static_cast<OutT>(x)); };
  const size_t at = relay_lead_at(row, logits_shape, logits_strides, logits_ndim - 1);
  const float v = tid < E ? static_cast<float>(logits[at + (size_t)tid * logits_strides[logits_ndim - 1]])
                          : __int_as_float(0xff800000);
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
  const unsigned n = i / D, d = i % D;
  auto last = [](const auto& st, int ndim, int k) { return (size_t)k * (size_t)st[ndim - 1]; };
  auto rq_ = [](float x) { return static_cast<float>(static_cast<OutT>(x)); };
  const size_t e0 = relay_lead_at(n, expert_out_shape, expert_out_strides, expert_out_ndim - 2) +
                    last(expert_out_strides, expert_out_ndim, d);
  const size_t s0 = relay_lead_at(n, scores_shape, scores_strides, scores_ndim - 1);
  float acc = 0.f;
  for (int j = 0; j < KTOP; ++j)
    acc += rq_(static_cast<float>(expert_out[e0 + (size_t)j * expert_out_strides[expert_out_ndim - 2]]) *
               static_cast<float>(scores[s0 + last(scores_strides, scores_ndim, j)]));
  const float g = static_cast<float>(shared_gate[relay_lead_at(n, shared_gate_shape, shared_gate_strides,
                                                                shared_gate_ndim - 1)]);
  const float sg = rq_(1.f / (1.f + expf(-g)));
  const float so = static_cast<float>(shared_out[relay_lead_at(n, shared_out_shape, shared_out_strides,
                                                                shared_out_ndim - 1) +
                                                 last(shared_out_strides, shared_out_ndim, d)]);
  const float hh = static_cast<float>(h[relay_lead_at(n, h_shape, h_strides, h_ndim - 1) + last(h_strides, h_ndim, d)]);
  const float moe = rq_(rq_(acc) + rq_(sg * so));
  out[i] = static_cast<OutT>(hh + moe);
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
    kernel = mx.fast.cuda_kernel(name="relay_moe_route_topk_s", input_names=["logits"],
                                 output_names=["inds", "scores"], source=ROUTE_SOURCE, header=ROUTE_HEADER,
                                 ensure_row_contiguous=False)
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
    kernel = mx.fast.cuda_kernel(name="relay_moe_combine_s",
                                 input_names=["h", "expert_out", "scores", "shared_gate", "shared_out"],
                                 output_names=["out"], source=COMBINE_SOURCE, header=LEAD_AT,
                                 ensure_row_contiguous=False)
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
