"""Build, on the GPU machine, a random-weight dense draft for SpecPrefill: Qwen3-0.6B's text
shape (28 layers of plain attention, hidden 1024, 16 query / 8 KV heads of 128, MLP 3072, tied
embeddings) with the Qwen3.5 vocabulary and tokenizer, bf16, as an mlx-lm `qwen3` checkpoint.

Why a second draft next to `build_random_model.py --shape draft` (Qwen3.5-0.8B's hybrid shape):
on CUDA, mlx-lm runs GatedDeltaNet prefill as a per-token loop (its fast kernel is Metal-only),
so a hybrid draft loaded through mlx-lm scores slower there than the target prefills; a draft
of plain attention layers shows what scoring costs when the draft's own prefill is fast.

    python benchmarks/gpu/build_dense_draft.py OUT_DIR --tokenizer DIR [--tiny]

(Since issue 19.5 the hybrid draft is loaded through mlx-vlm, whose GatedDeltaNet prefill is a
chunked scan off Metal: `mlx_relay/engine/scoring/draft_library.py`; this dense draft stays the
comparison.) `--tiny`: the same architecture at toy size, for checking the scripts on a CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

CONFIG = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "num_hidden_layers": 28,
    "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-6, "vocab_size": 248320, "max_position_embeddings": 262144, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}
TINY_OVERRIDES = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "chat_template.jinja")


def build(out: Path, tokenizer_dir: Path, tiny: bool = False) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    tic = time.perf_counter()
    mx.random.seed(0)
    config = {**CONFIG, **(TINY_OVERRIDES if tiny else {})}
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    n = sum(v.size for v in weights.values())
    print(f"built dense draft {out} ({n / 1e9:.2f} B bf16 parameters) in {time.perf_counter() - tic:.1f}s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="toy size, for a CPU dry run")
    args = ap.parse_args()
    build(args.out, args.tokenizer, args.tiny)


if __name__ == "__main__":
    main()
