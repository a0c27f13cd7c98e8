"""Where the engine's own kernels may run (`backend.py`: whether the default device takes our CUDA
kernels, the most tokens one forward routes there). The kernels themselves live with the model
family whose layers they compute (`engine/models/qwen3_5/kernels/`). A kernel's template arguments
are compiled into it (MLX compiles a custom kernel per name and template, in every process): a count
that changes from call to call (positions, rows) is read from an input's shape at run time, never a
template argument. This package's `__init__`
imports no MLX (as every engine folder's: `tests/test_layering.py`).
"""
