"""16-bit copies of the dense 8-bit projections (`engine/models/dense_copies.py`, `--dense-16bit`):
on a float32 qwen3_5_moe language model quantized to 8 bits, swapping each decoder layer's dense
projections for a `DenseCopy` leaves the library's own forward where it was (the copy is the
library's dequantization, a prompt's logits over 40 rows equal within float32 rounding, a one-row
step's exactly: it runs the 8-bit call), copies only the dense projections (not the experts, the
embeddings or the head), counts the bytes it adds (and the pool reserves as much, read from the
checkpoint's headers), and through the engine's boot path
(`loader.add_copies`) copies a model of ours only when configured."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.test_decode_step import _library_greedy, _positions
from tests.test_moe_decode import build_moe_lm


def _quantized_lm() -> Any:
    import mlx.core as mx
    import mlx.nn as nn

    lm = build_moe_lm(11)
    nn.quantize(lm, group_size=64, bits=8)
    mx.eval(lm.parameters())
    return lm


def test_copies_keep_the_library_forward(gpu: Callable) -> None:
    def run() -> dict[str, Any]:
        import mlx.core as mx
        import mlx.nn as nn

        from mlx_relay.engine.models.dense_copies import DenseCopy, add_dense_copies

        lm = _quantized_lm()
        prompt = list(range(20, 60))

        def prompt_logits() -> mx.array:
            out = lm(mx.array([prompt]), cache=lm.make_cache(), position_ids=_positions(0, len(prompt)))
            return out.logits

        before, greedy_before = prompt_logits(), _library_greedy(lm, prompt, 8)
        dense = [m for layer in lm.model.layers for _, m in layer.named_modules() if type(m) is nn.QuantizedLinear]
        expect = sum(m.weight.shape[0] * m.weight.shape[1] * 32 // m.bits * 4 for m in dense)  # float32 copies
        added = add_dense_copies(list(lm.model.layers))
        after, greedy_after = prompt_logits(), _library_greedy(lm, prompt, 8)
        layer = lm.model.layers[0]
        copy = layer.mlp.shared_expert.up_proj
        x1, x8 = mx.random.normal((1, 1, 64)), mx.random.normal((1, 8, 64))
        return {
            "added": added, "expect": expect, "dense": len(dense),
            "copies": sum(type(m) is DenseCopy for lay in lm.model.layers for _, m in lay.named_modules()),
            "left_8bit": sum(type(m) is nn.QuantizedLinear and not path.endswith("quantized")
                             for lay in lm.model.layers for path, m in lay.named_modules()),
            "experts_kept": type(layer.mlp.switch_mlp.up_proj).__name__,
            "embed_kept": type(lm.model.embed_tokens).__name__, "head_kept": type(lm.lm_head).__name__,
            "prompt_diff": mx.abs(after - before).max().item(), "prompt_scale": mx.abs(before).max().item(),
            "greedy": (greedy_before, greedy_after),
            "one_row_is_8bit": mx.array_equal(copy(x1), copy.quantized(x1)).item(),
            "eight_rows_diff": mx.abs(copy(x8) - copy.quantized(x8)).max().item(),
        }

    got = gpu(run)
    assert got["dense"] > 0 and got["copies"] == got["dense"] and got["left_8bit"] == 0
    assert got["added"] == got["expect"]
    assert got["experts_kept"] == "QuantizedSwitchLinear"
    assert got["embed_kept"] == "QuantizedEmbedding" and got["head_kept"] == "QuantizedLinear"
    assert got["prompt_diff"] <= 1e-5 * max(1.0, got["prompt_scale"])
    assert got["greedy"][0] == got["greedy"][1]
    assert got["one_row_is_8bit"] and got["eight_rows_diff"] <= 1e-5


def test_add_copies_runs_only_when_configured(gpu: Callable) -> None:
    def run() -> tuple[int, int]:
        from types import SimpleNamespace

        from mlx_relay.config import EngineConfig
        from mlx_relay.engine.models.loader import add_copies

        def loaded() -> Any:
            lm = _quantized_lm()
            return SimpleNamespace(model=SimpleNamespace(language_model=lm))

        return (add_copies(loaded(), EngineConfig(model_path="m")),  # type: ignore[arg-type]
                add_copies(loaded(), EngineConfig(model_path="m", dense_16bit=True)))  # type: ignore[arg-type]

    off, on = gpu(run)
    assert off == 0 and on > 0


def test_the_serve_flag_sets_it() -> None:
    from mlx_relay.cli import build_parser, serve_overrides

    args = build_parser().parse_args(["serve", "m", "--dense-16bit"])
    assert serve_overrides(args)["dense_16bit"] is True
    assert serve_overrides(build_parser().parse_args(["serve", "m"]))["dense_16bit"] is False


def test_the_pool_counts_the_copies_from_the_checkpoint_s_headers(gpu: Callable, tmp_path: Any) -> None:
    """`footprint.dense_copy_bytes` (no MLX: the safetensors headers and the config) is what
    `add_dense_copies` adds on the loaded model (16-bit weights)."""
    def run() -> int:
        import mlx.core as mx
        import mlx.nn as nn
        from mlx.utils import tree_flatten

        from mlx_relay.engine.models.dense_copies import add_dense_copies

        lm = build_moe_lm(12)
        lm.apply(lambda x: x.astype(mx.bfloat16))
        nn.quantize(lm, group_size=64, bits=8)
        weights = {f"language_model.{k}": v for k, v in tree_flatten(lm.parameters())}
        half = len(weights) // 2  # two files, as a sharded checkpoint
        names = sorted(weights)
        mx.save_safetensors(str(tmp_path / "model-00001.safetensors"), {k: weights[k] for k in names[:half]})
        mx.save_safetensors(str(tmp_path / "model-00002.safetensors"), {k: weights[k] for k in names[half:]})
        return add_dense_copies(list(lm.model.layers))

    added = gpu(run)
    from mlx_relay.engine.models.footprint import dense_copy_bytes

    config = {"quantization": {"group_size": 64, "bits": 8}}
    assert added > 0 and dense_copy_bytes(tmp_path, config) == added
