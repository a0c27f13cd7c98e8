"""Prepare, on the development machine, what a GPU run carries besides the MLX kit: the real
Qwen3.5-vocabulary tokenizer plus the processor files, packed small (the model itself is built
on the GPU machine by build_random_model.py; no weights travel). The processor files are the
tiny fixture's with the pixel bounds the Qwen3.5 checkpoints ship (`QWEN35_SIZES`): the fixture's
are small for the CPU tests (at most 65,536 pixels, so a 1,024 x 1,024 image would reach the
35B-A3B shape's vision tower as 256 x 256, 64 tokens: `gpu-h200-2026-11-29f/`'s vision run did).

    python benchmarks/gpu/prepare_carry.py .device-carry
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mlx_relay.testing.fixtures import FixtureSpec, fixture_path
from mlx_relay.testing.qwen_vocab import pack_tokenizer, qwen35_tokenizer_path

PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                   "generation_config.json")
#: each processor file's bounds (pixels, frames) as Qwen/Qwen3.5's checkpoints ship them (Qwen3-VL's processors)
QWEN35_SIZES: dict[str, dict[str, Any]] = {
    "preprocessor_config.json": {"size": {"shortest_edge": 65536, "longest_edge": 16777216}},
    "video_preprocessor_config.json": {"size": {"shortest_edge": 4096, "longest_edge": 25165824},
                                       "fps": 2, "min_frames": 4, "max_frames": 768}}


def with_checkpoint_sizes(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """`config` (a processor file's) with the checkpoints' bounds."""
    return {**config, **QWEN35_SIZES.get(name, {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    fixture = fixture_path(FixtureSpec("bf16", 0))
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp) / "tokenizer"
        shutil.copytree(qwen35_tokenizer_path(), staging)
        for name in PROCESSOR_FILES:
            config = json.loads((fixture / name).read_text())
            (staging / name).write_text(json.dumps(with_checkpoint_sizes(name, config), indent=2))
        packed = pack_tokenizer(staging, args.out / "tokenizer.tar.xz")
    print(f"wrote {packed} ({packed.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
