"""Kernels of our own for the decode step's hot layers (GPU thread only), each through MLX's public
custom-kernel API (`mx.fast.cuda_kernel`) beside a plain-MLX fallback that computes the library's
own arithmetic.

The decode step is launch-bound on a GPU: every small primitive costs the host several
microseconds to launch (issue 32; `benchmarks/bench_decode_step.py --count-ops`). A kernel here
replaces a chain of a layer's small operations with one launch:

- `gated_delta.gated_delta_mixer`: a GatedDeltaNet layer between its input projections and its
  output projection (causal conv window, SiLU, q/k normalization, gates, the recurrent update
  and the gated RMSNorm), for a block of T positions;
- `moe.route_topk`: a mixture of experts' router (softmax, top-k, renormalization);
- `moe.combine`: the experts' weighted sum, the gated shared expert and the residual add;
- `dense.dense`: a dense 8-bit projection: over 8 to 32 rows `narrow_qmm`'s tensor-core kernel (one
  launch as MLX's quantized matmul is, less device time at those rows); over more rows, or for a
  narrow output, the weights dequantized for a 16-bit matmul (plain MLX ops; `dense.path`).

Which one runs is decided when a step is traced (`backend.cuda_kernels_available`): the kernel
where the default device is a CUDA GPU and the shapes are ones it was written for, the fallback
otherwise (every CPU run, Metal, and each test on this CPU: the float32 tests pin the fallback
greedy-exact against the library). The GPU check `benchmarks/gpu/kernel_check.py` pins each
kernel against its fallback on random inputs. This package's `__init__` imports no MLX (as every
engine folder's: `tests/test_layering.py`).
"""
