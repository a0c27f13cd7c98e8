"""Process memory: hand what the process has freed back to the operating system.

glibc keeps freed heap pages in its arenas (one per thread that allocated) for reuse, so a
process that once held a 10 MB prompt's tokenization, or MLX buffers that were freed, stays that
much larger for good. `release_freed_memory` is called where the server knows a large amount was
just freed: after a request with a large body (`http.guard`), and on a prefix-cache flush (the
GPU thread, after MLX's own buffer cache is cleared).
"""

from __future__ import annotations

import ctypes
import gc
import sys


def release_freed_memory(collect: bool = True) -> None:
    """Free what is left in reference cycles (`collect`: an exception and the frames it holds,
    with a request's text in their locals; a full collection, ~40 ms here), then glibc's
    malloc_trim(0): every arena's free pages back to the OS. Elsewhere only the collection."""
    if collect:
        gc.collect()
    if not sys.platform.startswith("linux"):
        return
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own libc
    if trim is not None:
        trim(0)
