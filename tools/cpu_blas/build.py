"""Build the CPU BLAS preload (`cblas_sgemm.c`) for this environment; print its path, or nothing.

    python tools/cpu_blas/build.py OUT_DIR     # the Makefile: LD_PRELOAD=$(that path) for serve and test

Offline tooling beside the server (no MLX imported). The preload is built only where it applies
and can be built: Linux, MLX's CPU wheel carrying its own reference BLAS (`mlx_cpu.libs/libblas-*`),
numpy's bundled OpenBLAS exporting the ILP64 symbols the shim calls, and a C compiler (`cc`).
Anywhere else it prints nothing and MLX runs as shipped (on a Mac MLX uses Accelerate; on CUDA the
matmuls are the GPU's). The library is rebuilt when the source or numpy's OpenBLAS changes.
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("cblas_sgemm.c")
SYMBOLS = ("scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_")


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def numpy_openblas() -> Path | None:
    """numpy's bundled OpenBLAS, when it exports the symbols the shim calls."""
    numpy_dir = _package_dir("numpy")
    if numpy_dir is None:
        return None
    for lib in sorted((numpy_dir.parent / "numpy.libs").glob("libscipy_openblas64_*.so")):
        try:
            handle = ctypes.CDLL(str(lib))
        except OSError:
            continue
        if all(hasattr(handle, s) for s in SYMBOLS):
            return lib
    return None


def mlx_reference_blas() -> bool:
    """Whether the installed MLX is the CPU wheel that bundles its own (reference) BLAS."""
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return False
    site = Path(next(iter(spec.submodule_search_locations))).parent
    return any((site / "mlx_cpu.libs").glob("libblas-*"))


def build(out_dir: Path) -> Path | None:
    if not sys.platform.startswith("linux") or not mlx_reference_blas():
        return None
    openblas, cc = numpy_openblas(), shutil.which("cc") or shutil.which("gcc")
    if openblas is None or cc is None:
        return None
    out = out_dir / "librelay_cblas.so"
    if out.exists() and out.stat().st_mtime >= max(SOURCE.stat().st_mtime, openblas.stat().st_mtime):
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([cc, "-O2", "-shared", "-fPIC", str(SOURCE), "-o", str(out), f"-L{openblas.parent}",
                           f"-l:{openblas.name}", f"-Wl,-rpath,{openblas.parent}"], capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return None
    return out


if __name__ == "__main__":
    built = build(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".venv/lib"))
    if built is not None:
        print(built.resolve())
