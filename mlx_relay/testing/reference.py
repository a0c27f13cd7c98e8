"""Plain single-sequence greedy decoding with the raw mlx-vlm loop: the reference that batched,
speculative and cached paths must match token for token; and mlx-vlm's processor, the reference
for the server's own tokenizer and image/video preprocessing.

Run it in its own process (it touches MLX on the calling thread):
    python -m mlx_relay.testing.reference MODEL_DIR MAX_TOKENS < prompts.json > tokens.json
where prompts.json is a list of token-id lists.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def vlm_processor(model_path: Path) -> Any:
    """mlx-vlm's processor for the checkpoint (tokenizer, image and video processors), loaded as
    mlx-vlm loads it: importing the checkpoint's model package installs its torch-free processor
    (this loads MLX: tests only)."""
    from mlx_vlm.utils import get_model_and_args, load_processor

    get_model_and_args(json.loads((model_path / "config.json").read_text()), model_path)
    return load_processor(str(model_path), add_detokenizer=False)


def greedy_reference(model_path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import mlx.core as mx
    import mlx_vlm
    from mlx_vlm.generate.ar import generate_step

    from mlx_relay.engine.models.checkpoint import eos_token_ids, read_config

    model, _processor = mlx_vlm.load(str(model_path))
    eos = set(eos_token_ids(read_config(model_path)))
    out: list[list[int]] = []
    for prompt in prompts:
        tokens: list[int] = []
        for token, _ in generate_step(mx.array([prompt]), model, None, None, max_tokens=max_tokens, temperature=0.0):
            tokens.append(int(token))
            if tokens[-1] in eos:
                break
        out.append(tokens)
    return out


def sparse_greedy_reference(model_path: Path, prompt: list[int], kept: list[int], max_tokens: int) -> list[int]:
    """SpecPrefill's definition, written out plainly: one forward of the kept tokens at their
    original positions (explicit M-RoPE triples), then greedy decoding one token at a time at
    the prompt's true positions len(prompt), len(prompt) + 1, ..."""
    import mlx.core as mx
    import mlx_vlm

    from mlx_relay.engine.models.checkpoint import eos_token_ids, read_config

    model, _processor = mlx_vlm.load(str(model_path))
    lm = model.language_model
    eos = set(eos_token_ids(read_config(model_path)))
    cache = lm.make_cache()

    def forward(tokens: list[int], positions: list[int]) -> int:
        pos = mx.broadcast_to(mx.array(positions, dtype=mx.int32)[None, None, :], (3, 1, len(positions)))
        out = lm(mx.array([tokens], dtype=mx.int32), cache=cache, position_ids=pos)
        return int(mx.argmax(out.logits[0, -1]).item())

    token = forward([prompt[p] for p in kept], kept)
    out = [token]
    while len(out) < max_tokens and token not in eos:
        token = forward([token], [len(prompt) + len(out) - 1])
        out.append(token)
    return out


def main() -> None:
    model, max_tokens = Path(sys.argv[1]), int(sys.argv[2])
    prompts = json.load(sys.stdin)
    json.dump(greedy_reference(model, prompts, max_tokens), sys.stdout)


if __name__ == "__main__":
    main()
