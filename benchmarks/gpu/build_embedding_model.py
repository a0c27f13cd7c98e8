"""A random-weight embedding checkpoint of Qwen3-Embedding-0.6B's shape (bf16; 28 layers of 1,024,
its vocabulary the tokenizer given), in the sentence-transformers layout mlx-relay serves with
`--embedding-model` (last-token pooling): for measuring `/v1/embeddings` on a lease (issue 47.1).

    python benchmarks/gpu/build_embedding_model.py OUT_DIR --tokenizer DIR [--tiny]

Weights: mlx-embeddings' own Qwen3 model's parameter tree (names and shapes as it loads them),
normal(0, 0.02) (norms 1). The tokenizer's files are copied in; `--tiny`: 2 layers of 64 (a CPU
dry run).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mlx_relay.testing.family_fixtures import _write_sentence_transformers
from mlx_relay.testing.fixtures import _dump_json

SHAPE = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 128}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    from mlx_embeddings.models import qwen3
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(args.tokenizer)))
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **(TINY if args.tiny else SHAPE),
              "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "max_position_embeddings": 32768,
              "vocab_size": vocab, "tie_word_embeddings": True, "attention_bias": False, "torch_dtype": "bfloat16"}
    args.out.mkdir(parents=True, exist_ok=True)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    mx.random.seed(0)
    weights = {k: (mx.ones(v.shape) if v.ndim == 1 else mx.random.normal(v.shape) * 0.02).astype(mx.bfloat16)
               for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(args.out / "model.safetensors"), weights)
    _dump_json(args.out / "config.json", config)
    _write_sentence_transformers(args.out, config["hidden_size"])
    for name in TOKENIZER_FILES:
        if (args.tokenizer / name).is_file():
            shutil.copy(args.tokenizer / name, args.out / name)
    params = sum(v.size for v in weights.values())
    print(f"built {args.out}: {params / 1e9:.2f} B parameters, vocabulary {vocab}")


if __name__ == "__main__":
    main()
