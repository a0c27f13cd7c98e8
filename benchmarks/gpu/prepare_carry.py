"""Prepare, on the development machine, what a GPU run carries besides the MLX kit: the real
Qwen3.5-vocabulary tokenizer plus the processor files, packed small (the model itself is built
on the GPU machine by build_random_model.py; no weights travel).

    python benchmarks/gpu/prepare_carry.py .device-carry
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from mlx_relay.testing.fixtures import FixtureSpec, fixture_path
from mlx_relay.testing.qwen_vocab import pack_tokenizer, qwen35_tokenizer_path

PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                   "generation_config.json")


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
            shutil.copy2(fixture / name, staging / name)
        packed = pack_tokenizer(staging, args.out / "tokenizer.tar.xz")
    print(f"wrote {packed} ({packed.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
