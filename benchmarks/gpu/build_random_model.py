"""Build, on the machine that will serve it, a random-weight model of Qwen3.5-35B-A3B's exact
shape (40 layers, 3 GatedDeltaNet : 1 gated attention, 256 experts with 8 active, vocabulary
248,320), 8-bit affine g64 quantized the way `mlx_vlm.convert -q --q-bits 8` does it (the
vision tower stays bf16), saved as an mlx-vlm checkpoint with the real Qwen3.5 vocabulary.
No weights travel: the figures it gives are honest for speed, its text is noise.

    python benchmarks/gpu/build_random_model.py OUT_DIR --tokenizer DIR [--shape 35b-a3b|122b-a10b|397b-a17b|draft]
        [--bits 8|4] [--tiny] [--seed 0]

`--shape 122b-a10b` / `397b-a17b` (issue 46.2: a model larger than one card, served by the
pipeline) build the larger Qwen3.5 MoE shapes from their published figures (122B-A10B: 48 layers,
hidden 3,072, 256 experts with 8 active and a shared one, 32 query heads, 12 of 48 layers full
attention; 397B-A17B: 60 layers, hidden 4,096, 512 experts with 10 active, 32 query / 2 KV heads of
256; both expert widths 1,024). What those figures leave open is filled as the 35B-A3B's (2 KV heads of
256, linear-attention heads of 128, 16 key heads) with 64 value heads, which lands the 122B shape at
122.1 B parameters. These are written layer by layer, each decoder layer's quantized weights to a
shard of its own and then dropped (`model-layer-NNN.safetensors`, an index beside), so neither the
device nor the host ever holds the whole model (122B at 8 bits is ~130 GB). `--bits 4` quantizes
them (and the 35B-A3B shape) to 4 bits instead of 8.

`--shape draft` builds instead a small dense `qwen3_5` model with the same vocabulary and
tokenizer, for SpecPrefill's draft (benchmarks/bench_specprefill.py): the text shape of
Qwen3.5-0.8B (hidden 1024, 24 layers, 3 GatedDeltaNet : 1 gated attention, 8 attention heads /
2 KV heads of 256, MLP 3584, linear-attention heads 16 key / 16 value of 128, tied embeddings),
bf16 (not quantized), with the tiny vision tower of `--tiny` and no MTP head, about 0.75 B
parameters (1.5 GB). `mlx_lm.load(OUT_DIR)` and `mlx_vlm.load(OUT_DIR)` both load it.

Memory: every weight is drawn in bf16 one decoder layer at a time, evaluated and quantized
before the next, with MLX's buffer cache off, so the peak stays near the final 8-bit size
(a whole-model random init ran out of GPU memory; ../shared/device/README.md).
`--tiny` builds the same architecture at toy size, for checking the script on a CPU.

`--mtp-agree RATE` (0 < RATE <= 1; issue 17.5) builds the 35B-A3B shape with chosen values instead
of noise (benchmarks/gpu/mtp_agree.py): the target's greedy next token is a fixed long cycle over
the regular vocabulary (the fixtures' bigram construction), and the MTP head drafts the target's
next token on a set share of the cycle, so MTP's block-2 acceptance is RATE; every layer, expert
and projection is still full size, 8-bit and computed. After quantization it checks the chain, the
head's agreement and the whole target on a window of the cycle, and prints the figures. With
`--tiny` the hidden size is 256 (not 64) so that the bigram stays exact over the full vocabulary.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import time
from pathlib import Path
from typing import Any

# Public config figures of Qwen3.5-35B-A3B (text) and its vision tower.
TEXT_35B_A3B: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text",
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "rms_norm_eps": 1e-6,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "full_attention_interval": 4,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "norm_topk_prob": True,
    "mtp_num_hidden_layers": 1,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
}
# The larger shapes (issue 46.2): the published figures, the rest as the 35B-A3B's (module docstring).
TEXT_122B_A10B: dict[str, Any] = {**copy.deepcopy(TEXT_35B_A3B), "hidden_size": 3072, "num_hidden_layers": 48,
                                  "num_attention_heads": 32, "linear_num_value_heads": 64,
                                  "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024}
TEXT_397B_A17B: dict[str, Any] = {**copy.deepcopy(TEXT_35B_A3B), "hidden_size": 4096, "num_hidden_layers": 60,
                                  "num_attention_heads": 32, "linear_num_value_heads": 64, "num_experts": 512,
                                  "num_experts_per_tok": 10, "moe_intermediate_size": 1024,
                                  "shared_expert_intermediate_size": 1024}
# --spill-dir: what a layer shard leaves free on OUT's filesystem (the rest of the model, the index)
SPILL_RESERVE = 4 * 2**30
MOE_SHAPES: dict[str, dict[str, Any]] = {"35b-a3b": TEXT_35B_A3B, "122b-a10b": TEXT_122B_A10B,
                                         "397b-a17b": TEXT_397B_A17B}
VISION_35B_A3B: dict[str, Any] = {
    "model_type": "qwen3_5_moe",
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 2048,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [],
}
TINY_OVERRIDES: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True},
}
TINY_VISION: dict[str, Any] = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                               "out_hidden_size": 64, "num_position_embeddings": 64}
# --tiny --mtp-agree: the cycle's logit margin is ~sqrt(hidden / 2) competitor deviations, too thin at 64
TINY_AGREE_HIDDEN = 256

# SpecPrefill's draft: the text shape of the dense Qwen3.5-0.8B, the same vocabulary, no MoE, no MTP head.
TEXT_DRAFT: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "intermediate_size": 3584,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "full_attention_interval": 4,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "rope_parameters": copy.deepcopy(TEXT_35B_A3B["rope_parameters"]),
}
DRAFT_TINY_OVERRIDES: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 128, "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "rope_parameters": copy.deepcopy(TINY_OVERRIDES["rope_parameters"]),
}
SHAPES = (*MOE_SHAPES, "draft")


TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "chat_template.jinja", "generation_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
    "processor_config.json",
)


def special_ids(tokenizer_dir: Path) -> dict[str, int]:
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    return {t["content"]: t["id"] for t in tok["added_tokens"]}


def make_config(tokenizer_dir: Path, tiny: bool, shape: str = "35b-a3b", agree: bool = False) -> dict[str, Any]:
    if shape == "draft":
        return make_draft_config(tokenizer_dir, tiny)
    text = copy.deepcopy(MOE_SHAPES[shape])
    vision = {**copy.deepcopy(VISION_35B_A3B), "out_hidden_size": text["hidden_size"]}
    if tiny:
        text.update(copy.deepcopy(TINY_OVERRIDES))
        vision.update(TINY_VISION)
        if agree:
            text["hidden_size"] = vision["out_hidden_size"] = TINY_AGREE_HIDDEN
    return _full_config(tokenizer_dir, text, vision, "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")


def make_draft_config(tokenizer_dir: Path, tiny: bool) -> dict[str, Any]:
    """The draft: dense `qwen3_5`, tied embeddings, the tiny vision tower whatever `tiny` says."""
    text = copy.deepcopy(TEXT_DRAFT)
    if tiny:
        text.update(copy.deepcopy(DRAFT_TINY_OVERRIDES))
    vision = {**copy.deepcopy(VISION_35B_A3B), **TINY_VISION, "model_type": "qwen3_5",
              "out_hidden_size": text["hidden_size"]}
    config = _full_config(tokenizer_dir, text, vision, "qwen3_5", "Qwen3_5ForConditionalGeneration")
    config["tie_word_embeddings"] = True
    return config


def _full_config(tokenizer_dir: Path, text: dict[str, Any], vision: dict[str, Any], model_type: str,
                 architecture: str) -> dict[str, Any]:
    ids = special_ids(tokenizer_dir)
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    text["eos_token_id"] = eos
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vocab_size": text["vocab_size"],
        "eos_token_id": eos,
        "tie_word_embeddings": False,
    }


def _init_value(name: str, shape: tuple[int, ...], dtype: Any) -> Any:
    import mlx.core as mx

    if name.endswith("A_log"):
        return mx.log(mx.random.uniform(1.0, 16.0, shape)).astype(mx.float32)
    if name.endswith("dt_bias"):
        return mx.ones(shape, dtype=dtype)
    if "norm" in name and len(shape) == 1:
        return mx.ones(shape, dtype=dtype)
    if name.endswith(".bias"):
        return mx.zeros(shape, dtype=dtype)
    return (mx.random.normal(shape) * 0.02).astype(dtype)


def _agree_init_value(name: str, shape: tuple[int, ...], dtype: Any) -> Any:
    """--mtp-agree: residual branches' output projections drawn small (mtp_agree.py), the rest as usual."""
    from mtp_agree import RESIDUAL_OUT_SUFFIXES, residual_out_value

    if name.endswith(RESIDUAL_OUT_SUFFIXES):
        return residual_out_value(shape, dtype)
    return _init_value(name, shape, dtype)


def randomize(module: Any, prefix: str, init: Any = _init_value) -> None:
    """Replace every parameter of `module` with a random bf16 draw, evaluated one at a time."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    for name, value in tree_flatten(module.parameters()):
        new = init(f"{prefix}.{name}", tuple(value.shape), mx.bfloat16)
        mx.eval(new)
        module.update(tree_unflatten([(name, new)]))


def _noted(overrides: dict[str, dict], path: str, chosen: bool | dict, bits: int) -> bool | dict:
    """A quantization predicate's answer for `path`, kept in `overrides` where it quantizes at other
    than `bits` (the routers' 8 bits in a 4-bit build): the config must say so for a loader."""
    if isinstance(chosen, dict) and chosen.get("bits", bits) != bits:
        overrides[path] = chosen
    return chosen


def build_mtp_head(config: dict[str, Any], predicate: Any, group_size: int, bits: int, agree: bool = False,
                   overrides: dict[str, dict] | None = None) -> Any:
    """Random weights for the checkpoint's one-layer MTP head, quantized like the decoder layers
    (`agree`: fc = [diag(+1, -1) | 0] and small residual outputs, mtp_agree.py); the module.
    `overrides` gets the head's modules quantized at other than `bits` (as `mtp.<path>`)."""
    overrides = {} if overrides is None else overrides
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import Qwen3_5MTPDraftModel
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.config import Qwen3_5MTPConfig

    head = Qwen3_5MTPDraftModel(Qwen3_5MTPConfig.from_dict({"text_config": copy.deepcopy(config["text_config"])}))
    randomize(head, "mtp", _agree_init_value if agree else _init_value)
    if agree:
        from mtp_agree import fc_value

        head.fc.update({"weight": fc_value(config["text_config"]["hidden_size"], mx.bfloat16)})

    def head_predicate(p: str, m: Any) -> bool | dict:
        if p == "fc" or not p.startswith("layers.0."):
            return False
        return _noted(overrides, f"mtp.{p}", predicate(f"language_model.model.layers.0.{p[9:]}", m), bits)

    nn.quantize(head, group_size, bits, class_predicate=head_predicate)
    mx.eval(head.parameters())
    return head


def copy_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, out / name)


def build_draft(out: Path, tokenizer_dir: Path, *, tiny: bool, seed: int, agree_with: float | None = None,
                layers: int | None = None) -> Path:
    """SpecPrefill's draft (`--shape draft`): random bf16 weights, drawn one layer at a time, not quantized.
    `agree_with` RATE (issue 45.1): a speculative draft for the `--mtp-agree` target of the same seed,
    whose greedy next token is the target's at the cycle positions a plan of RATE agrees at
    (`mtp_agree.draft_embed_and_head`: untied embeddings and head, small residual outputs);
    `layers`: that many decoder layers (default the shape's)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import qwen3_5
    from mlx_vlm.utils import save_config, save_weights

    tic = time.perf_counter()
    mx.random.seed(seed)
    mx.set_cache_limit(0)
    config = make_draft_config(tokenizer_dir, tiny)
    text = config["text_config"]
    if layers is not None:
        text["num_hidden_layers"] = layers
        text.pop("layer_types", None)  # derived from full_attention_interval
    if agree_with is not None:
        config["tie_word_embeddings"] = text["tie_word_embeddings"] = False
        if tiny:  # the cycle's logit margin is too thin at 64 (as the target's, TINY_AGREE_HIDDEN)
            text["hidden_size"] = config["vision_config"]["out_hidden_size"] = TINY_AGREE_HIDDEN
    model = qwen3_5.Model(qwen3_5.ModelConfig.from_dict(copy.deepcopy(config)))
    lm = model.language_model
    init = _agree_init_value if agree_with is not None else _init_value
    for i, layer in enumerate(lm.model.layers):
        randomize(layer, f"language_model.model.layers.{i}", init)
    randomize(lm.model.norm, "language_model.model.norm")
    if agree_with is None:
        randomize(lm.model.embed_tokens, "language_model.model.embed_tokens")
    else:
        from mtp_agree import draft_embed_and_head, make_plan

        plan = make_plan(agree_with, min(special_ids(tokenizer_dir).values()), seed)
        embed, head = draft_embed_and_head(plan, text["vocab_size"], text["hidden_size"], mx.bfloat16)
        lm.model.embed_tokens.update({"weight": embed})
        lm.lm_head.update({"weight": head})
        del embed, head
        print(f"draft agreeing with the cycle at {plan.design_rate:.4f} of positions ({2 * plan.a} of "
              f"{plan.period} in runs)", flush=True)
    randomize(model.vision_tower, "vision_tower")
    mx.eval(model.parameters())
    n_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    out.mkdir(parents=True, exist_ok=True)
    save_weights(out, model, donate_weights=True)
    save_config(config, config_path=out / "config.json")
    copy_tokenizer(tokenizer_dir, out)
    print(f"built draft {out} ({n_bytes / 1e9:.2f} GB of bf16 weights) in {time.perf_counter() - tic:.1f}s",
          flush=True)
    return out


def _write_shard(out: Path, name: str, weights: dict[str, Any], spill: Path | None) -> int:
    """`weights` to `out/name`, or (with `spill`, once `out`'s filesystem would keep less than
    SPILL_RESERVE free) to `spill/name` linked from `out`; the bytes written."""
    import mlx.core as mx

    n_bytes = sum(v.nbytes for v in weights.values())
    if spill is not None and shutil.disk_usage(out).free - n_bytes < SPILL_RESERVE:
        spill.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(spill / name), weights, metadata={"format": "mlx"})
        (out / name).symlink_to(spill.resolve() / name)
    else:
        mx.save_safetensors(str(out / name), weights, metadata={"format": "mlx"})
    return n_bytes


def _save_layer(out: Path, i: int, layer: Any, weight_map: dict[str, str], spill: Path | None = None) -> int:
    """Layer `i`'s weights to a shard of its own (`_write_shard`), then dropped from the module; the
    bytes written."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    name = f"model-layer-{i:03d}.safetensors"
    weights = {f"language_model.model.layers.{i}.{k}": v for k, v in tree_flatten(layer.parameters())}
    n_bytes = _write_shard(out, name, weights, spill)
    weight_map.update(dict.fromkeys(weights, name))
    layer.update(tree_map(lambda _: mx.array([]), layer.parameters()))
    return n_bytes


def build(out: Path, tokenizer_dir: Path, *, tiny: bool, seed: int, mtp_agree: float | None = None,
          shape: str = "35b-a3b", bits: int = 8, layers: int | None = None, spill: Path | None = None) -> Path:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_vlm.models import qwen3_5_moe
    from mlx_vlm.utils import save_config, save_weights, skip_multimodal_module

    tic = time.perf_counter()
    mx.random.seed(seed)
    mx.set_cache_limit(0)
    agree = mtp_agree is not None
    config = make_config(tokenizer_dir, tiny, shape=shape, agree=agree)
    if layers is not None:
        config["text_config"]["num_hidden_layers"] = layers
    stream = shape != "35b-a3b"  # each layer to its own shard as it is built
    weight_map: dict[str, str] = {}
    streamed = 0
    if stream:
        out.mkdir(parents=True, exist_ok=True)
    plan = None
    if mtp_agree is not None:
        from mtp_agree import make_plan

        # the cycle: regular tokens only (no added token, none past the tokenizer's vocabulary)
        plan = make_plan(mtp_agree, min(special_ids(tokenizer_dir).values()), seed)
        print(f"mtp-agree {mtp_agree}: pattern {2 * plan.a} agree / {plan.b} disagree per {plan.period} "
              f"positions (block-2 acceptance {plan.design_rate:.4f}), cycle of {len(plan.order)} tokens",
              flush=True)
    init = _agree_init_value if agree else _init_value
    model = qwen3_5_moe.Model(qwen3_5_moe.ModelConfig.from_dict(copy.deepcopy(config)))
    group_size = 64
    model_predicate = getattr(model, "quant_predicate", None)

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if skip_multimodal_module(path) or not hasattr(module, "to_quantized"):
            return False
        if hasattr(module, "weight") and module.weight.shape[-1] % group_size != 0:
            return False
        return _noted(overrides, path, model_predicate(path, module) if model_predicate is not None else True, bits)

    overrides: dict[str, dict] = {}
    lm = model.language_model
    for i, layer in enumerate(lm.model.layers):
        randomize(layer, f"language_model.model.layers.{i}", init)
        nn.quantize(layer, group_size, bits,
                    class_predicate=lambda p, m, i=i: predicate(f"language_model.model.layers.{i}.{p}", m))
        mx.eval(layer.parameters())
        if stream:
            streamed += _save_layer(out, i, layer, weight_map, spill)
        print(f"layer {i + 1}/{len(lm.model.layers)} ({time.perf_counter() - tic:.1f}s)", flush=True)
    if plan is None:
        for name, sub in (("language_model.model.embed_tokens", lm.model.embed_tokens),
                          ("language_model.model.norm", lm.model.norm), ("language_model.lm_head", lm.lm_head)):
            randomize(sub, name)
    else:
        from mtp_agree import embed_and_head

        randomize(lm.model.norm, "language_model.model.norm")
        text = config["text_config"]
        embed, lm_head = embed_and_head(plan, text["vocab_size"], text["hidden_size"], mx.bfloat16)
        lm.model.embed_tokens.update({"weight": embed})
        lm.lm_head.update({"weight": lm_head})
        del embed, lm_head
    nn.quantize(lm, group_size, bits,
                class_predicate=lambda p, m: not p.startswith("model.layers") and predicate(f"language_model.{p}", m))
    randomize(model.vision_tower, "vision_tower")
    mx.eval(model.parameters())
    head = build_mtp_head(config, predicate, group_size, bits, agree=agree, overrides=overrides)
    if plan is not None:
        from mtp_agree import check_chain

        print(check_chain(lm, head, plan).line(), flush=True)
    mtp = {f"mtp.{k}": v for k, v in tree_flatten(head.parameters())}
    del head
    config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine", **overrides}
    n_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters())) + streamed
    out.mkdir(parents=True, exist_ok=True)
    if stream:  # the rest (embeddings, head, norm, vision tower) as one more shard, and the index of all
        rest = {k: v for k, v in tree_flatten(model.parameters()) if not k.startswith("language_model.model.layers.")}
        _write_shard(out, "model-rest.safetensors", rest, spill)
        weight_map.update(dict.fromkeys(rest, "model-rest.safetensors"))
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": n_bytes}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
        del rest
    else:
        save_weights(out, model, donate_weights=True)
    # the MTP head beside the model, in MLX layout (`load_drafter(out, kind="mtp")` reads mtp.*)
    _write_shard(out, "model-mtp.safetensors", mtp, spill)
    n_bytes += sum(v.nbytes for v in mtp.values())
    save_config(config, config_path=out / "config.json")
    copy_tokenizer(tokenizer_dir, out)
    print(f"built {out} ({n_bytes / 1e9:.2f} GB of weights) in {time.perf_counter() - tic:.1f}s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokenizer", type=Path, required=True,
                        help="dir with the real-vocab tokenizer + processor JSONs (mlx_relay.testing.qwen_vocab)")
    parser.add_argument("--tiny", action="store_true", help="same architecture at toy size (CPU check)")
    parser.add_argument("--shape", choices=SHAPES, default="35b-a3b",
                        help="35b-a3b: the 8-bit MoE target (default); 122b-a10b, 397b-a17b: the larger MoE shapes, "
                             "written layer by layer; draft: SpecPrefill's small dense bf16 draft")
    parser.add_argument("--bits", type=int, choices=(8, 4), default=8, help="the MoE shapes' quantization (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--agree-with", type=float, default=None, metavar="RATE",
                        help="draft only: a speculative draft for the --mtp-agree target of the same --seed, drafting "
                             "the target's next token at RATE of the cycle's positions (issue 45.1)")
    parser.add_argument("--layers", "--draft-layers", type=int, default=None,
                        help="decoder layers (default the shape's; e.g. 8 for a --tiny model a pipeline splits in two)")
    parser.add_argument("--spill-dir", type=Path, default=None, metavar="DIR",
                        help="the larger shapes: layer shards go to DIR (linked from OUT) once OUT's filesystem "
                             "would keep less than 4 GiB free (a tmpfs too small for the model, the disk beside)")
    parser.add_argument("--mtp-agree", type=float, default=None, metavar="RATE",
                        help="35b-a3b only: the target a fixed long bigram cycle, the MTP head agreeing with it "
                             "at block-2 acceptance RATE (0 < RATE <= 1; mtp_agree.py)")
    args = parser.parse_args()
    if args.shape == "draft":
        if args.mtp_agree is not None:
            parser.error("--mtp-agree builds the 35b-a3b shape only")
        if args.agree_with is not None and not 0.0 < args.agree_with <= 1.0:
            parser.error(f"--agree-with must be in (0, 1], got {args.agree_with}")
        build_draft(args.out, args.tokenizer, tiny=args.tiny, seed=args.seed, agree_with=args.agree_with,
                    layers=args.layers)
    else:
        if args.mtp_agree is not None and not 0.0 < args.mtp_agree <= 1.0:
            parser.error(f"--mtp-agree must be in (0, 1], got {args.mtp_agree}")
        if args.mtp_agree is not None and args.shape != "35b-a3b":
            parser.error("--mtp-agree builds the 35b-a3b shape only")
        build(args.out, args.tokenizer, tiny=args.tiny, seed=args.seed, mtp_agree=args.mtp_agree, shape=args.shape,
              bits=args.bits, layers=args.layers, spill=args.spill_dir)


if __name__ == "__main__":
    main()
