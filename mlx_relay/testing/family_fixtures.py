"""Tiny real checkpoints of two more model families, built from a seed (as `fixtures` builds the
Qwen3.5 ones): the engine serves Qwen3 through its own family (`engine/models/qwen3/`: the plain
lane, our prefill and compiled decode step over mlx-lm's layers) and Gemma 3 through the library's
own forward over KV caches (`engine/models/library_kv.py`, `engine/lanes/kv_lane.py`).

- ``qwen3``: a dense attention-only Qwen3 text model (``Qwen3ForCausalLM``, model type ``qwen3``),
  loaded by mlx-lm; the fixture tokenizer (byte-level BPE and Qwen's 26 added tokens, which are
  Qwen3's too) and a Qwen3-family chat template (``qwen3_chat_template.jinja``: Hermes-style JSON
  tool calls, thinking blocks);
- ``gemma3``: a Gemma 3 vision-language model (``Gemma3ForConditionalGeneration``, model type
  ``gemma3``: a SigLIP vision tower, a projector, a Gemma 3 text model with sliding-window and
  global attention layers), loaded by mlx-vlm; the same BPE with Gemma's added tokens (BOS/EOS,
  turns, image tokens) and a Gemma 3 chat template (``gemma3_chat_template.jinja``);
- ``gemma3_text``: the same language model as a text-only ``Gemma3ForCausalLM`` checkpoint (model
  type ``gemma3_text``), loaded by mlx-lm (whose own Gemma 3 masks the sliding window too);
- ``qwen3_embedding``: the ``qwen3`` weights without a head, laid out as Qwen3-Embedding's
  checkpoints are (a sentence-transformers model: ``modules.json``, last-token pooling in
  ``1_Pooling/config.json``, normalized), loaded by mlx-embeddings (issue 47.1).

Weights are the parameter trees of the libraries' own modules (so names and shapes are what they
load strictly), values drawn from numpy's PCG64 keyed by (seed, tensor name) as in `fixtures`,
float32. The head's rows of the added tokens are zero (Gemma 3's head is tied to its embeddings, as
in its checkpoints: those embedding rows), so greedy decoding of the random model never ends a turn
or opens a tag by accident. Each checkpoint is under 1.5 MB, built on first use (about a second)
and cached under ``$MLX_RELAY_CACHE/fixtures/<family>-fp32-s<seed>-r<FAMILY_RECIPE_VERSION>``.
"""

from __future__ import annotations

import json
from importlib import resources
from importlib.metadata import version
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np

from mlx_relay.testing.fixtures import (
    MANIFEST_NAME,
    _cache_root,
    _dump_json,
    _is_complete,
    _rng,
    build_cached,
    save_safetensors,
)
from mlx_relay.testing.tokenizer_builder import (
    BASE_VOCAB_SIZE,
    SPECIAL_TOKENS,
    _dump,
    _token_entry,
    build_tokenizer,
)

__all__ = ["FAMILY_RECIPE_VERSION", "GEMMA3_TOKENS", "Family", "build_family_fixture", "family_fixture_path"]

#: Bump whenever anything that changes these fixtures' bytes changes.
FAMILY_RECIPE_VERSION: Final[int] = 1

Family = Literal["qwen3", "gemma3", "gemma3_text", "qwen3_embedding"]

#: Gemma 3's added tokens (id order from BASE_VOCAB_SIZE), with their `special` flag.
GEMMA3_TOKENS: Final[tuple[tuple[str, bool], ...]] = (
    ("<pad>", True),
    ("<eos>", True),
    ("<bos>", True),
    ("<start_of_turn>", True),
    ("<end_of_turn>", True),
    ("<start_of_image>", True),
    ("<end_of_image>", True),
    ("<image_soft_token>", True),
)

#: Small embeddings: the layers' outputs (attention over the context) outweigh the current token's
#: embedding in the residual stream, so different prompts give different, varied continuations.
_EMBED_STD: Final[float] = 0.02


def _gemma_id(content: str) -> int:
    return BASE_VOCAB_SIZE + [c for c, _ in GEMMA3_TOKENS].index(content)


def _qwen_id(content: str) -> int:
    return BASE_VOCAB_SIZE + [c for c, _ in SPECIAL_TOKENS].index(content)


def _template(name: str) -> str:
    return resources.files("mlx_relay.testing").joinpath(name).read_text("utf-8")


# --------------------------------------------------------------------------- configs


def qwen3_config(vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": _qwen_id("<|endoftext|>"),
        "eos_token_id": _qwen_id("<|im_end|>"),
        "torch_dtype": "float32",
    }


def gemma3_config(vocab_size: int) -> dict[str, Any]:
    eos = [_gemma_id("<eos>"), _gemma_id("<end_of_turn>")]
    text = {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "rope_global_base_freq": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "sliding_window": 24,  # short: the tests' prompts and replies run past it
        "sliding_window_pattern": 2,  # layers 0, 2 sliding; 1, 3 global
        "mm_tokens_per_image": 4,
        "max_position_embeddings": 4096,
        "vocab_size": vocab_size,
    }
    vision = {
        "model_type": "siglip_vision_model",
        "num_hidden_layers": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "patch_size": 8,
        "image_size": 32,  # 4 x 4 patches, pooled to the 2 x 2 = 4 image tokens
        "layer_norm_eps": 1e-6,
    }
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text,
        "vision_config": vision,
        "boi_token_index": _gemma_id("<start_of_image>"),
        "eoi_token_index": _gemma_id("<end_of_image>"),
        "image_token_index": _gemma_id("<image_soft_token>"),
        "mm_tokens_per_image": 4,
        "pad_token_id": _gemma_id("<pad>"),
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


# --------------------------------------------------------------------------- weights


def _param_shapes(family: Literal["qwen3", "gemma3"], config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The libraries' own parameter names and shapes (their lazy init is never evaluated)."""
    from mlx.utils import tree_flatten

    if family == "qwen3":
        from mlx_lm.models import qwen3

        model: Any = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    else:
        from mlx_vlm.models import gemma3
        from mlx_vlm.models.gemma3.config import TextConfig, VisionConfig

        cfg = gemma3.ModelConfig.from_dict(config)
        cfg.text_config = TextConfig.from_dict(config["text_config"])
        cfg.vision_config = VisionConfig.from_dict(config["vision_config"])
        model = gemma3.Model(cfg)
    return {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}


def _init(family: Literal["qwen3", "gemma3"], name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = _rng(seed, f"{family}/{name}")
    if name.endswith(".bias"):
        return np.zeros(shape, np.float32)
    if len(shape) == 1:  # norm scales; Gemma's text norms scale by 1 + weight
        gemma_text = family == "gemma3" and not name.startswith("vision_tower.") and "mm_soft_emb_norm" not in name
        return np.zeros(shape, np.float32) if gemma_text else np.ones(shape, np.float32)
    if name.endswith("embed_tokens.weight") or name.endswith("position_embedding.weight"):
        w = rng.standard_normal(shape, dtype=np.float32) * np.float32(_EMBED_STD)
        if family == "gemma3" and name.endswith("embed_tokens.weight"):
            w[BASE_VOCAB_SIZE:] = 0.0  # the tied head's rows of the added tokens (as the head's rows below)
        return w
    if name.endswith("lm_head.weight"):
        w = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[1]))
        w[BASE_VOCAB_SIZE:] = 0.0  # greedy never picks an added token (end of turn, tags)
        return w
    fan_in = int(np.prod(shape[1:])) if not name.endswith("mm_input_projection_weight") else shape[0]
    return rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(fan_in))


def _weights(family: Literal["qwen3", "gemma3"], config: dict[str, Any],
             seed: int) -> dict[str, tuple[str, np.ndarray]]:
    """Name -> (dtype, value); Gemma 3 ties its head to the embeddings (as its checkpoints: no head)."""
    return {name: ("F32", _init(family, name, shape, seed))
            for name, shape in sorted(_param_shapes(family, config).items())
            if not (family == "gemma3" and name.endswith("lm_head.weight"))}


# --------------------------------------------------------------------------- tokenizer files


def _write_tokenizer(out: Path, family: Family) -> int:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json and chat_template.jinja; the
    vocabulary's size."""
    qwen = family in ("qwen3", "qwen3_embedding")
    added = SPECIAL_TOKENS if qwen else GEMMA3_TOKENS
    tokenizer = build_tokenizer(added=added)
    raw = json.loads(tokenizer.to_str())
    raw["truncation"] = raw["padding"] = None
    (out / "tokenizer.json").write_text(json.dumps(raw, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    decoder = {str(BASE_VOCAB_SIZE + i): _token_entry(c, special) for i, (c, special) in enumerate(added)}
    if qwen:
        names = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        extra: dict[str, Any] = {}
        template = "qwen3_chat_template.jinja"
    else:
        names = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
        extra = {"extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                          "image_token": "<image_soft_token>"}}
        template = "gemma3_chat_template.jinja"
    _dump(out / "tokenizer_config.json", {
        "add_bos_token": False, "add_eos_token": False, "added_tokens_decoder": decoder,
        "clean_up_tokenization_spaces": False, "model_max_length": 4096, "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": None, **names, **extra})
    _dump(out / "special_tokens_map.json", {k: v for k, v in names.items() if v is not None})
    (out / "chat_template.jinja").write_text(_template(template), encoding="utf-8")
    return int(tokenizer.get_vocab_size(with_added_tokens=True))


def _write_sentence_transformers(out: Path, dims: int) -> None:
    """A sentence-transformers layout as Qwen3-Embedding's: the transformer, last-token pooling, normalize."""
    _dump_json(out / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}])
    (out / "1_Pooling").mkdir(exist_ok=True)
    _dump_json(out / "1_Pooling" / "config.json", {
        "word_embedding_dimension": dims, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True})
    _dump_json(out / "config_sentence_transformers.json", {"prompts": {}, "default_prompt_name": None,
                                                           "similarity_fn_name": "cosine"})


def build_family_fixture(out_dir: Path, family: Family, seed: int = 0) -> Path:
    """Write the checkpoint of `family` into `out_dir` (deterministic for a seed and the installed
    libraries, whose sources are the tokenizer's corpus). Prefer `family_fixture_path`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = _write_tokenizer(out_dir, family)
    qwen = family in ("qwen3", "qwen3_embedding")
    config = qwen3_config(vocab) if qwen else gemma3_config(vocab)
    weights = _weights("qwen3" if qwen else "gemma3", config, seed)
    if family == "qwen3_embedding":
        weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        _write_sentence_transformers(out_dir, config["hidden_size"])
    if family == "gemma3_text":  # the VLM's language model alone, under mlx-lm's names
        config = config["text_config"] | {"architectures": ["Gemma3ForCausalLM"],
                                          "eos_token_id": config["eos_token_id"], "torch_dtype": "float32"}
        weights = {k.removeprefix("language_model."): v for k, v in weights.items() if k.startswith("language_model.")}
    _dump_json(out_dir / "config.json", config)
    eos = config["eos_token_id"]
    _dump_json(out_dir / "generation_config.json", {
        "do_sample": False, "eos_token_id": [eos, _qwen_id("<|endoftext|>")] if qwen else eos})
    if family == "gemma3":
        size = config["vision_config"]["image_size"]
        _dump_json(out_dir / "preprocessor_config.json", {
            "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
            "do_resize": True, "size": {"height": size, "width": size}, "resample": 2,
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": None,
            "do_pan_and_scan": None, "pan_and_scan_max_num_crops": None,
            "pan_and_scan_min_crop_size": None, "pan_and_scan_min_ratio_to_activate": None})
        _dump_json(out_dir / "processor_config.json", {"processor_class": "Gemma3Processor",
                                                       "image_seq_length": config["mm_tokens_per_image"]})
    save_safetensors(out_dir / "model.safetensors", weights)
    _dump_json(out_dir / MANIFEST_NAME, {
        "family_recipe_version": FAMILY_RECIPE_VERSION, "family": family, "seed": seed,
        "libraries": {pkg: version(pkg.replace("_", "-")) for pkg in ("mlx_lm", "mlx_vlm")}})
    return out_dir


def family_fixture_path(family: Family, seed: int = 0, cache_dir: Path | None = None) -> Path:
    """The cached checkpoint of `family`, built on first use (as `fixtures.fixture_path`)."""
    root = _cache_root(cache_dir) / "fixtures"
    return build_cached(root, f"{family}-fp32-s{seed}-r{FAMILY_RECIPE_VERSION}", _is_complete,
                        lambda tmp: build_family_fixture(tmp, family, seed))
