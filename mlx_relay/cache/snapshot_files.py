"""Prefix-cache snapshot files on disk (pure Python and file I/O: safe on any thread, no MLX).

The disk tier of the prefix cache keeps one safetensors file per snapshot (written by MLX's own
`mx.save_safetensors` on the GPU thread, as bytes, then to disk here), in a directory of its own
per model: `ROOT/<model fingerprint>/`. A file is named `<prefix key>-<checksum>.safetensors`:
the key is the chain hash the PrefixCacheStore keys the snapshot by (`prefix_keys.PrefixKeys`),
the checksum an xxh3-128 of the whole file's bytes, so a corrupted or truncated file is told
apart from a good one before any byte of it reaches MLX. The header's `__metadata__` carries
what the file must match to be used (`SnapshotIdentity`: format version, model fingerprint,
cache dtype, mlx and mlx-vlm versions) and what it holds (key, length, kind), so a scan at start
reads headers only.

- `write_atomic`: checksum, write to a temporary name, fsync, rename (a crash leaves a temporary
  file, which the next scan removes, never a half-written snapshot under a real name);
- `scan`: the directory's files that match this identity (the others are removed and counted by
  reason), metadata only;
- `verify`: a file checked (size, checksum, identity, key, length) before MLX loads it, or a
  typed `SnapshotFileError`.

The model fingerprint covers config.json and each weights file's name, size, safetensors header
and samples of its bytes (a fine-tune of the same architecture differs), not its path.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import struct
import uuid
from collections.abc import Iterable
from importlib.metadata import version
from pathlib import Path
from typing import ClassVar, Literal

import msgspec
import xxhash

__all__ = [
    "FORMAT_VERSION",
    "FileRecord",
    "ScanResult",
    "SnapshotCorrupt",
    "SnapshotFileError",
    "SnapshotIdentity",
    "SnapshotMismatch",
    "SnapshotMissing",
    "SnapshotTruncated",
    "file_name",
    "library_versions",
    "model_fingerprint",
    "namespace_dir",
    "remove_files",
    "scan",
    "touch_files",
    "verify",
    "write_atomic",
]

#: Bump whenever what a snapshot file holds or how its tensors are named changes.
FORMAT_VERSION = "1"
FORMAT = "mlx-relay-prefix-snapshot"
SUFFIX = ".safetensors"
_NAME = re.compile(r"^([0-9a-f]{32})-([0-9a-f]{32})\.safetensors$")
_MAX_HEADER = 16 << 20  # a header larger than this is not one of ours

RejectReason = Literal["corrupt", "truncated", "mismatch", "missing", "layout"]
REJECT_REASONS: tuple[RejectReason, ...] = ("corrupt", "truncated", "mismatch", "missing", "layout")


class SnapshotFileError(Exception):
    """A snapshot file that must not be used; `reason` says why (counted by it)."""

    reason: ClassVar[RejectReason]


class SnapshotCorrupt(SnapshotFileError):
    reason = "corrupt"  # checksum or header does not hold


class SnapshotTruncated(SnapshotFileError):
    reason = "truncated"  # shorter than its header says


class SnapshotMismatch(SnapshotFileError):
    reason = "mismatch"  # another model, dtype, library version or format


class SnapshotMissing(SnapshotFileError):
    reason = "missing"  # gone (removed by hand, or by another server on the same directory)


class SnapshotLayoutError(SnapshotFileError):
    reason = "layout"  # tensors that do not fit the live model's caches (GPU thread check)


class SnapshotIdentity(msgspec.Struct, frozen=True):
    """What a snapshot file must match to be restored into this server's model."""

    model: str  # model_fingerprint of the checkpoint
    dtype: str  # the prompt caches' dtype, e.g. "float32", "bfloat16"
    mlx: str
    mlx_vlm: str
    format_version: str = FORMAT_VERSION

    def metadata(self) -> dict[str, str]:
        return {"relay.format": FORMAT, "relay.format_version": self.format_version, "relay.model": self.model,
                "relay.dtype": self.dtype, "relay.mlx": self.mlx, "relay.mlx_vlm": self.mlx_vlm}

    def mismatch(self, meta: dict[str, str]) -> str | None:
        """The first field `meta` disagrees on (None: it matches)."""
        for name, want in self.metadata().items():
            if meta.get(name) != want:
                return f"{name} is {meta.get(name)!r}, this server's is {want!r}"
        return None


class FileRecord(msgspec.Struct, frozen=True):
    """One usable file, as a scan or a write found it."""

    key: bytes
    length: int
    kind: str
    name: str
    nbytes: int
    last_used: float  # the file's mtime (the disk tier's LRU clock persists there)


class ScanResult(msgspec.Struct, frozen=True):
    files: list[FileRecord]
    rejected: dict[str, int]  # by reason: files removed because they could not be used
    temporaries: int  # half-written files of an earlier run, removed


def library_versions() -> tuple[str, str]:
    return version("mlx"), version("mlx-vlm")


def model_fingerprint(path: Path, sample_bytes: int = 1 << 16) -> str:
    """A hash of the checkpoint's config.json and, per weights file: name, size, safetensors
    header and three samples of its bytes (start, middle, end of the data). Cheap (no full read)."""
    h = hashlib.blake2b(digest_size=16)
    h.update((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        h.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            n = struct.unpack("<Q", f.read(8))[0] if size >= 8 else 0
            h.update(f.read(min(n, _MAX_HEADER)))
            for offset in (8 + n, (8 + n + size) // 2, max(8 + n, size - sample_bytes)):
                f.seek(offset)
                h.update(f.read(sample_bytes))
    return h.hexdigest()


def namespace_dir(root: str | Path, identity: SnapshotIdentity) -> Path:
    """The model's own directory under the configured root (servers of other models may share it)."""
    return Path(root).expanduser() / f"model-{identity.model[:16]}"


def file_name(key: bytes, checksum: str) -> str:
    return f"{key.hex()}-{checksum}{SUFFIX}"


def _checksum(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def write_atomic(directory: Path, key: bytes, data: bytes | memoryview, *, fsync: bool = True) -> tuple[str, int]:
    """Write one snapshot file (temporary name, fsync, rename); returns (name, size)."""
    directory.mkdir(parents=True, exist_ok=True)
    name = file_name(key, _checksum(data))
    tmp = directory / f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, directory / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return name, len(data)


def _parse_header(head: bytes, size: int) -> tuple[dict[str, str], int]:
    """(metadata, the file size the header implies) from a file's first bytes; `size` is the
    file's size, for the checks."""
    if size < 8 or len(head) < 8:
        raise SnapshotTruncated("shorter than a safetensors header")
    n = struct.unpack("<Q", head[:8])[0]
    if n > _MAX_HEADER:
        raise SnapshotCorrupt(f"a header of {n} bytes")
    if 8 + n > size or len(head) < 8 + n:
        raise SnapshotTruncated("the file ends inside its header")
    try:
        header = json.loads(head[8:8 + n])
        meta = header.pop("__metadata__", None) or {}
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise SnapshotCorrupt(f"unreadable header: {exc}") from None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SnapshotCorrupt("unreadable header metadata")
    return meta, 8 + n + end


def _check_meta(meta: dict[str, str], identity: SnapshotIdentity, key_hex: str) -> tuple[int, str]:
    """(length, kind) of a file whose metadata matches `identity` and its own name."""
    if (why := identity.mismatch(meta)) is not None:
        raise SnapshotMismatch(why)
    if meta.get("relay.key") != key_hex:
        raise SnapshotCorrupt("the key in the header is not the one in the file's name")
    try:
        length = int(meta.get("relay.length", ""))
    except ValueError:
        raise SnapshotCorrupt("no length in the header") from None
    kind = meta.get("relay.kind", "")
    if length < 1 or kind not in ("system", "media", "turn"):
        raise SnapshotCorrupt("bad length or kind in the header")
    return length, kind


def _read_record(path: Path, identity: SnapshotIdentity) -> FileRecord:
    m = _NAME.match(path.name)
    if m is None:
        raise SnapshotCorrupt("not a snapshot file name")
    st = path.stat()
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) == 8:
            n = struct.unpack("<Q", head)[0]
            head += f.read(min(n, _MAX_HEADER))
    meta, implied = _parse_header(head, st.st_size)
    if implied > st.st_size:
        raise SnapshotTruncated(f"{st.st_size} bytes, its header says {implied}")
    if implied < st.st_size:
        raise SnapshotCorrupt(f"{st.st_size} bytes, its header says {implied}")
    length, kind = _check_meta(meta, identity, m.group(1))
    return FileRecord(bytes.fromhex(m.group(1)), length, kind, path.name, st.st_size, st.st_mtime)


def scan(directory: Path, identity: SnapshotIdentity) -> ScanResult:
    """The usable snapshot files in `directory` (headers only). Files that cannot be used here
    (unreadable, truncated, another identity) and temporaries of an interrupted write are removed."""
    files: list[FileRecord] = []
    rejected = dict.fromkeys(REJECT_REASONS, 0)
    temporaries = 0
    if not directory.is_dir():
        return ScanResult(files, rejected, 0)
    for path in sorted(directory.iterdir()):
        if path.name.endswith(".tmp") and path.name.startswith("."):
            path.unlink(missing_ok=True)
            temporaries += 1
            continue
        if not path.name.endswith(SUFFIX) or not path.is_file():
            continue  # not ours: left alone
        try:
            files.append(_read_record(path, identity))
        except SnapshotFileError as exc:
            rejected[exc.reason] += 1
            path.unlink(missing_ok=True)
        except OSError:
            rejected["missing"] += 1
    return ScanResult(files, rejected, temporaries)


def verify(path: Path, identity: SnapshotIdentity, length: int) -> int:
    """Check a file before MLX loads it: size against its header, checksum (over a read-only
    mapping: no copy) against its name, metadata against `identity` and the expected `length`.
    Returns its size; marks it used (mtime). The file's pages are then in the page cache, so the
    GPU thread's `mx.load` of it is one copy from memory. Files are immutable once written (a new
    write is a new name), so what is loaded is what was checked."""
    m = _NAME.match(path.name)
    if m is None:
        raise SnapshotCorrupt("not a snapshot file name")
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise SnapshotTruncated("shorter than a safetensors header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                n = struct.unpack("<Q", data[:8])[0]
                meta, implied = _parse_header(data[:8 + min(n, _MAX_HEADER)], size)
                if implied > size:
                    raise SnapshotTruncated(f"{size} bytes, its header says {implied}")
                if _checksum(data) != m.group(2):
                    raise SnapshotCorrupt("checksum mismatch")
    except FileNotFoundError:
        raise SnapshotMissing(str(path)) from None
    got, _kind = _check_meta(meta, identity, m.group(1))
    if got != length:
        raise SnapshotCorrupt(f"holds {got} tokens, expected {length}")
    try:
        os.utime(path)
    except OSError:
        pass
    return size


def remove_files(directory: Path, names: Iterable[str]) -> None:
    for name in names:
        (directory / name).unlink(missing_ok=True)


def touch_files(directory: Path, times: Iterable[tuple[str, float]]) -> None:
    """Persist last-use times (the disk tier's LRU order) as the files' mtimes."""
    for name, t in times:
        try:
            os.utime(directory / name, (t, t))
        except OSError:
            pass
