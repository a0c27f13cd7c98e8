"""The prefix cache's disk tier, piece by piece, on a snapshot shaped like a real model's: what each
step of a write and of a restore costs, and which thread pays it.

    write:   encode (GPU thread: one host copy, `snapshot_codec.encode`) -> write_atomic (writer
             thread: checksum, write, fsync, rename)
    restore: verify (reader thread: size, checksum over a read-only mapping, header) -> decode
             (GPU thread: `mx.load` of the file, every tensor checked against the layout)

The snapshot is synthetic (random values) with the cache layout of a Qwen3.5 hybrid: `--layers`
layers, every 4th full attention (`--kv-heads` x `--head-dim` keys and values per token, bf16),
the others GatedDeltaNet (a conv state and a `--gdn-heads` x 128 x 128 float32 state). The
defaults (32 layers, 4 x 256 KV, 32 GatedDeltaNet heads) are an assumed 9B-class shape, not read
from a checkpoint: 320 MB at 8,192 tokens. Medians of `--repeats`; the file goes to `--dir` (default: a
temporary directory; name a directory on the disk the server would use).

    python benchmarks/bench_snapshot_io.py --tokens 8192 [--dir /path/on/ssd] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from mlx_relay.cache.snapshot_files import SnapshotIdentity, verify, write_atomic
from mlx_relay.engine.memory.snapshot_codec import CacheLayout, LayerLayout, decode, encode
from mlx_relay.engine.memory.snapshots import Snapshot


def synthetic(args: argparse.Namespace) -> tuple[Snapshot, CacheLayout]:
    target, layout = [], []
    n = args.tokens
    for i in range(args.layers):
        if i % 4 == 3:
            k = mx.random.normal((1, args.kv_heads, n, args.head_dim)).astype(mx.bfloat16)
            v = mx.random.normal((1, args.kv_heads, n, args.head_dim)).astype(mx.bfloat16)
            target.append(("kv", (k, v)))
            shape = (1, args.kv_heads, -1, args.head_dim)
            layout.append(LayerLayout("kv", (shape, shape), ("bfloat16", "bfloat16")))
        else:
            conv = mx.random.normal((1, 3, args.conv_dim)).astype(mx.bfloat16)
            state = mx.random.normal((1, args.gdn_heads, 128, 128))
            target.append(("arrays", [conv, state]))
            layout.append(LayerLayout("arrays", ((1, 3, args.conv_dim), (1, args.gdn_heads, 128, 128)),
                                      ("bfloat16", "float32")))
    arrays = [a for _, value in target for a in value]
    mx.eval(arrays)
    return Snapshot(n, target, nbytes=sum(a.nbytes for a in arrays)), CacheLayout(tuple(layout), None, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--gdn-heads", type=int, default=32)
    ap.add_argument("--conv-dim", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    snap, layout = synthetic(args)
    identity = SnapshotIdentity("bench", "bfloat16", "-", "-")
    meta = {**identity.metadata(), "relay.key": "00" * 16, "relay.length": str(args.tokens), "relay.kind": "system"}
    times: dict[str, list[float]] = {"encode_gpu_thread": [], "write_writer_thread": [], "verify_reader_thread": [],
                                     "decode_gpu_thread": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for r in range(args.repeats):
            tic = time.perf_counter()
            data = encode(snap, {**meta, "relay.write": str(r)})
            t1 = time.perf_counter()
            name, size = write_atomic(Path(d), bytes(16), data)
            t2 = time.perf_counter()
            verify(Path(d) / name, identity, args.tokens)
            t3 = time.perf_counter()
            restored = decode(str(Path(d) / name), args.tokens, layout)
            mx.eval([a for _, value in restored.target for a in value])
            t4 = time.perf_counter()
            for key, dt in zip(times, (t1 - tic, t2 - t1, t3 - t2, t4 - t3), strict=True):
                times[key].append(dt)
            del data
    result = {"snapshot_bytes": snap.nbytes, "file_bytes": size, "device": str(mx.default_device()),
              "args": {k: str(v) for k, v in vars(args).items()},
              **{f"{k}_ms": round(statistics.median(v) * 1000, 1) for k, v in times.items()}}
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
