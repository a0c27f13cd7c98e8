"""The CPU BLAS preload (`tools/cpu_blas/`): where it applies (Linux, MLX's CPU wheel with its
reference BLAS, numpy's OpenBLAS, a C compiler) it builds, and under it MLX's float matmuls answer
what they answer without it: every transpose, batched, strided and ragged case against numpy's
float64 product and against MLX as shipped, in processes of their own (the preload is a process's
from its start). `make test` runs the whole suite under it, so every float32 exactness test holds
with it too."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _load_cpu_blas() -> ModuleType:
    """`tools/cpu_blas/build.py` as a module of its own name (its file name is a common one)."""
    spec = importlib.util.spec_from_file_location("mlx_relay_cpu_blas_build", ROOT / "tools" / "cpu_blas" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cpu_blas = _load_cpu_blas()

CASES = """
import json, sys
import numpy as np, mlx.core as mx
rng = np.random.default_rng(0)
out = []
def check(a, b, f):
    got = np.array(f(mx.array(a), mx.array(b)))
    want = f(a.astype(np.float64), b.astype(np.float64))
    out.append(float(np.abs(got - want).max() / (np.abs(want).max() + 1e-9)))
    return got
A, B = rng.standard_normal((37, 64)).astype(np.float32), rng.standard_normal((64, 29)).astype(np.float32)
results = [check(A, B, lambda a, b: a @ b), check(A.T.copy(), B, lambda a, b: a.T @ b),
           check(A, B.T.copy(), lambda a, b: a @ b.T), check(A.T.copy(), B.T.copy(), lambda a, b: a.T @ b.T)]
X, Y = rng.standard_normal((3, 17, 40)).astype(np.float32), rng.standard_normal((3, 40, 5)).astype(np.float32)
results.append(check(X, Y, lambda a, b: a @ b))
results.append(check(X, Y, lambda a, b: a[:, ::2, :] @ b))
V, W = rng.standard_normal((1, 300)).astype(np.float32), rng.standard_normal((300, 1000)).astype(np.float32)
results.append(check(V, W, lambda a, b: a @ b))
np.save(sys.argv[1], np.concatenate([r.ravel() for r in results]))
print(json.dumps(out))
"""


def _run(tmp: Path, name: str, preload: Path | None) -> tuple[list[float], Path]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if preload is not None:
        env["LD_PRELOAD"] = str(preload)
    out = tmp / f"{name}.npy"
    done = subprocess.run([sys.executable, "-c", CASES, str(out)], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1]), out


def test_the_preload_builds_where_it_applies(tmp_path: Path) -> None:
    applies = (sys.platform.startswith("linux") and cpu_blas.mlx_reference_blas()
               and cpu_blas.numpy_openblas() is not None and (shutil.which("cc") or shutil.which("gcc")))
    built = cpu_blas.build(tmp_path)
    assert (built is not None) == bool(applies)
    if built is not None:
        shim = ctypes.CDLL(str(built))
        assert hasattr(shim, "cblas_sgemm") and hasattr(shim, "cblas_dgemm")


def test_mlx_matmuls_answer_the_same_under_the_preload(tmp_path: Path) -> None:
    import numpy as np

    built = cpu_blas.build(tmp_path)
    errors, shipped = _run(tmp_path, "shipped", None)
    assert max(errors) < 1e-5, errors
    if built is None:  # nothing to preload here: MLX as shipped is what runs
        return
    errors_preloaded, preloaded = _run(tmp_path, "preloaded", built)
    assert max(errors_preloaded) < 1e-5, errors_preloaded
    a, b = np.load(shipped), np.load(preloaded)
    assert a.shape == b.shape and float(np.abs(a - b).max()) < 1e-4


def test_make_runs_the_suite_under_the_preload() -> None:
    """The Makefile's test, serve and agents targets preload what `build.py` prints."""
    makefile = (ROOT / "Makefile").read_text()
    assert "tools/cpu_blas/build.py" in makefile
    for target in ("test:", "serve:", "agents:"):
        recipe = makefile.split(f"\n{target}", 1)[1].split("\n\n", 1)[0]
        assert "$(RUN_ENV)" in recipe, target
