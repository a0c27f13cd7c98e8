"""The committed small trained checkpoint ``models/relay-tiny-coder`` (issue 4, point 6):
small enough to ship, loads strictly with mlx_vlm and its MTP drafter, greedy decoding with the
drafter gives exactly the tokens of plain greedy decoding, and the head's drafts are mostly accepted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CHECKPOINT = Path(__file__).resolve().parents[1] / "models" / "relay-tiny-coder"  # as conftest's tiny_coder

# Held-out-style prompts: stdlib-like code the model has not seen verbatim.
PROMPTS = [
    'def _pack_uint32(x):\n    """Convert a 32-bit integer to little-endian."""\n',
    "class Parser:\n    def __init__(self, source):\n        self.source = source\n",
    "import os\n\n\ndef walk(path):\n    for name in os.listdir(path):\n",
]


def test_checkpoint_is_complete_and_small() -> None:
    names = {p.name for p in CHECKPOINT.iterdir()}
    for required in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "preprocessor_config.json",
        "processor_config.json",
        "README.md",
    ):
        assert required in names
    assert sum(p.stat().st_size for p in CHECKPOINT.iterdir()) <= 16_000_000
    config = json.loads((CHECKPOINT / "config.json").read_text(encoding="utf-8"))
    assert config["model_type"] == "qwen3_5"
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    assert set(config["text_config"]["layer_types"]) == {"linear_attention", "full_attention"}


@pytest.mark.timeout(120)
def test_mtp_greedy_is_exact_and_drafts_are_accepted() -> None:
    import mlx_vlm
    from mlx_vlm.speculative.drafters import load_drafter

    model, processor = mlx_vlm.load(str(CHECKPOINT), strict=True)
    drafter, kind = load_drafter(str(CHECKPOINT), kind="mtp")
    assert kind == "mtp"

    def greedy(prompt: str, **draft: object) -> list[int]:
        return [
            r.token for r in mlx_vlm.stream_generate(model, processor, prompt, max_tokens=32, temperature=0.0, **draft)
        ]

    accepted = rounds = 0
    for prompt in PROMPTS:
        base = greedy(prompt)
        for block in (2, 3):
            spec = greedy(prompt, draft_model=drafter, draft_kind="mtp", draft_block_size=block)
            assert spec == base, f"MTP (block {block}) changed greedy output for {prompt[:20]!r}"
            if block == 2:
                accepted += sum(drafter.accept_lens)
                rounds += len(drafter.accept_lens)
    assert rounds > 0
    assert accepted / rounds >= 0.5, f"MTP acceptance at block 2 is {accepted / rounds:.2f}"


def test_only_the_default_model_ships_in_the_package() -> None:
    """relay-tiny-coder is the repository's (tests, benchmarks): the package's models folder, which
    the wheel's package data takes whole, holds the embedded default model alone."""
    from mlx_relay.default_model import DEFAULT_MODEL_NAME, default_model_path

    assert [p.name for p in default_model_path().parent.iterdir() if p.is_dir()] == [DEFAULT_MODEL_NAME]
    assert (CHECKPOINT / "model.safetensors").is_file()
