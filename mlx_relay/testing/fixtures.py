"""Tiny real Qwen3.5-style checkpoints: builds the tiny real models that tests, benchmarks
and ``make serve`` run on.

A fixture is a complete Hugging Face-layout Qwen3.5 vision-language checkpoint (hybrid
GatedDeltaNet + gated-attention text model, a small vision tower and an ``mtp.*`` MTP head)
of about 0.5 M parameters, built deterministically from a :class:`FixtureSpec`. Both
``mlx_vlm.load(path)`` and ``mlx_lm.load(path)`` load it strictly, and
``mlx_vlm.speculative.drafters.load_drafter(path, kind="mtp")`` loads its MTP head.

Recipe (``/work/shared/notes/mlx-libraries.md`` section 3):

* tokenizer: byte-level BPE with 1000 tokens trained locally plus the 26 Qwen3.5 added
  tokens (ids 1000..1025), see :mod:`mlx_relay.testing.tokenizer_builder`;
* weights: the parameter tree of mlx_vlm's own ``qwen3_5.Model`` and
  ``Qwen3_5MTPDraftModel`` (so names and shapes are exactly what the libraries expect),
  filled with values drawn from numpy's PCG64 keyed by ``(seed, tensor name)`` -- not from
  MLX's RNG, so the bytes are identical on every backend (CPU, Metal, CUDA) -- then mapped
  back to HF names and layouts (conv1d axis, NCDHW patch embed, zero-centred RMSNorms,
  ``mtp.`` prefix);
* the ``lm_head`` rows of the 26 added tokens are zero, so greedy decoding of the random
  model never emits ``<|im_end|>``, ``<think>`` or ``<tool_call>`` by accident.

Layouts: ``vlm`` (the default, above); ``text`` and ``text_no_mtp`` are the same weights as a
text-only ``Qwen3_5ForCausalLM`` checkpoint (``model_type: qwen3_5_text``, ``model.*`` names, no
vision tower or processor files), with and without the ``mtp.*`` head.

Variants: ``bf16`` (bf16 weights, ``A_log`` fp32), ``fp32`` (all float32, for exactness
tests), ``bigram`` (float32; residual branches scaled by 0.02 so the target is almost
``lm_head(norm(embed(x)))``, and the MTP head computes the same bigram: ``fc = [I | 0]``,
its ``o_proj``/``down_proj`` zero; MTP drafts are then almost always accepted).

:func:`fixture_path` caches built fixtures under ``$MLX_RELAY_CACHE`` (default
``~/.cache/mlx-relay``) in ``fixtures/<variant>-s<seed>-r<RECIPE_VERSION>``, building into a
temporary directory and renaming it into place under an ``fcntl.flock`` lock.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any, Final, Literal

import msgspec
import numpy as np

from mlx_relay.default_model import DEFAULT_MODEL_NAME
from mlx_relay.testing.tokenizer_builder import (
    BASE_VOCAB_SIZE,
    SPECIAL_TOKENS,
    build_tokenizer,
    token_id,
    write_tokenizer_files,
)

__all__ = [
    "RECIPE_VERSION",
    "FixtureSpec",
    "Layout",
    "Variant",
    "build_fixture",
    "default_model_path",
    "fixture_config",
    "fixture_path",
]

#: Bump whenever anything that changes a fixture's bytes changes.
RECIPE_VERSION: Final[int] = 2

Variant = Literal["bf16", "fp32", "bigram"]
Layout = Literal["vlm", "text", "text_no_mtp"]

#: Written last into every fixture; its presence marks a complete checkpoint.
MANIFEST_NAME: Final[str] = "mlx_relay_fixture.json"

# Init scales. Linear weights are N(0, gain^2 / fan_in). Defaults keep the residual stream
# dominated by the context-carrying mixers (slowly decaying GatedDeltaNet, attention), so
# different prompts give different continuations instead of a prompt-independent bigram.
_EMBED_STD: Final[float] = 0.5
_MIXER_OUT_GAIN: Final[float] = 5.0  # self_attn.o_proj, linear_attn.out_proj
_A_RANGE: Final[tuple[float, float]] = (0.01, 1.0)  # A = exp(A_log); small A = long memory
# bigram: embeddings N(0, 1), every residual branch output scaled by 0.02.
_BIGRAM_RESIDUAL_SCALE: Final[float] = 0.02
# Text-model RMSNorms that Qwen3.5 checkpoints store zero-centred (the loaders add 1.0).
_ZERO_CENTRED_SUFFIXES: Final[tuple[str, ...]] = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "language_model.norm.weight",
    "mtp.norm.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
)
# Output projections of residual branches (attention, linear attention, MLP).
_MIXER_OUT_SUFFIXES: Final[tuple[str, ...]] = (".self_attn.o_proj.weight", ".linear_attn.out_proj.weight")
_RESIDUAL_OUT_SUFFIXES: Final[tuple[str, ...]] = (*_MIXER_OUT_SUFFIXES, ".mlp.down_proj.weight")


class FixtureSpec(msgspec.Struct, frozen=True):
    """Everything that determines a fixture's bytes (together with :data:`RECIPE_VERSION`
    and the installed mlx_lm/mlx_vlm sources the tokenizer is trained on)."""

    variant: Variant = "bf16"
    seed: int = 0
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    max_position_embeddings: int = 4096
    layout: Layout = "vlm"

    @property
    def dirname(self) -> str:
        """Cache folder name; non-default sizes are spelled out so they never collide."""
        name = f"{self.variant}-s{self.seed}-r{RECIPE_VERSION}"
        defaults = FixtureSpec(self.variant, self.seed)
        extra = [
            f"{field}{getattr(self, field)}"
            for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "max_position_embeddings", "layout")
            if getattr(self, field) != getattr(defaults, field)
        ]
        return "-".join([name, *extra])


# --------------------------------------------------------------------------- config


def fixture_config(spec: FixtureSpec, vocab_size: int = BASE_VOCAB_SIZE + len(SPECIAL_TOKENS)) -> dict[str, Any]:
    """config.json for ``spec`` (vocab_size must equal the tokenizer size, never padded)."""
    if spec.variant not in ("bf16", "fp32", "bigram"):
        raise ValueError(f"unknown fixture variant {spec.variant!r}")
    if spec.layout not in ("vlm", "text", "text_no_mtp"):
        raise ValueError(f"unknown fixture layout {spec.layout!r}")
    if spec.num_hidden_layers % 4:
        raise ValueError("num_hidden_layers must be a multiple of full_attention_interval (4)")
    dtype = "bfloat16" if spec.variant == "bf16" else "float32"
    im_end, endoftext = token_id("<|im_end|>"), token_id("<|endoftext|>")
    head_dim, partial_rotary = 32, 0.25
    text_config = {
        "model_type": "qwen3_5_text",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "full_attention_interval": 4,
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(spec.num_hidden_layers)
        ],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,  # mlx_vlm needs it explicit
        "attention_bias": False,
        "attn_output_gate": True,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": partial_rotary,
            # sum(mrope_section) == head_dim * partial_rotary_factor / 2
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": endoftext,
        "pad_token_id": None,
        "dtype": dtype,
    }
    vision_config = {
        "model_type": "qwen3_5",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": spec.hidden_size,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,  # must be a perfect square
        "deepstack_visual_indexes": [],
        "hidden_act": "gelu_pytorch_tanh",
        "initializer_range": 0.02,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text_config,
        "vision_config": vision_config,
        "image_token_id": token_id("<|image_pad|>"),
        "video_token_id": token_id("<|video_pad|>"),
        "vision_start_token_id": token_id("<|vision_start|>"),
        "vision_end_token_id": token_id("<|vision_end|>"),
        "eos_token_id": [im_end, endoftext],
        "pad_token_id": endoftext,
        "tie_word_embeddings": False,
        "dtype": dtype,
    }


def _aux_files() -> dict[str, dict[str, Any]]:
    """generation_config.json and the three processor files (shipped so nothing hits the Hub)."""
    im_end, endoftext = token_id("<|im_end|>"), token_id("<|endoftext|>")
    processor = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2}
    norm = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255}
    return {
        "generation_config.json": {
            "do_sample": False,
            "eos_token_id": [im_end, endoftext],
            "pad_token_id": endoftext,
        },
        "preprocessor_config.json": {
            "image_processor_type": "Qwen2VLImageProcessorFast",
            **processor,
            **norm,
            "do_rescale": True,
            "do_normalize": True,
            "do_convert_rgb": True,
            "size": {"shortest_edge": 1024, "longest_edge": 65536},
        },
        "video_preprocessor_config.json": {
            "video_processor_type": "Qwen3VLVideoProcessor",
            **processor,
            **norm,
            "do_rescale": True,
            "do_normalize": True,
            "do_convert_rgb": True,
            "fps": 2.0,
            "min_frames": 2,
            "max_frames": 8,
            "size": {"shortest_edge": 1024, "longest_edge": 65536},
        },
        "processor_config.json": {"processor_class": "Qwen3VLProcessor"},
    }


# --------------------------------------------------------------------------- weights


def _mlx_param_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """MLX-layout parameter names and shapes of mlx_vlm's qwen3_5 model and its MTP head.

    The modules' own random init stays lazy and is never evaluated (only shapes are read),
    but constructing them still advances MLX's global RNG key."""
    from mlx.utils import tree_flatten
    from mlx_vlm.models.qwen3_5 import Model, ModelConfig
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import Qwen3_5MTPDraftModel
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.config import Qwen3_5MTPConfig

    # Deep copies: the config classes normalise rope keys in place.
    model = Model(ModelConfig.from_dict(copy.deepcopy(config)))
    drafter = Qwen3_5MTPDraftModel(Qwen3_5MTPConfig.from_dict({"text_config": copy.deepcopy(config["text_config"])}))
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    shapes.update({f"mtp.{k}": tuple(v.shape) for k, v in tree_flatten(drafter.parameters())})
    return shapes


def _rng(seed: int, name: str) -> np.random.Generator:
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, digest])))


def _init_value(name: str, shape: tuple[int, ...], spec: FixtureSpec) -> np.ndarray:
    """The float32 value (MLX layout) of one parameter."""
    rng = _rng(spec.seed, name)
    bigram = spec.variant == "bigram"
    target = not name.startswith("mtp.")
    if name.endswith("dt_bias"):
        return np.ones(shape, np.float32)
    if name.endswith(".bias"):
        return np.zeros(shape, np.float32)
    if name.endswith("A_log"):
        return np.log(rng.uniform(*_A_RANGE, size=shape)).astype(np.float32)
    if len(shape) == 1:  # RMSNorm / LayerNorm scales
        return np.ones(shape, np.float32)
    if name.endswith("embed_tokens.weight"):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(1.0 if bigram else _EMBED_STD)
    if name.endswith("pos_embed.weight"):
        return rng.standard_normal(shape, dtype=np.float32)
    gain = 1.0
    if name.endswith("lm_head.weight"):
        w = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[1]))
        w[BASE_VOCAB_SIZE:] = 0.0  # greedy never picks an added token (EOS, <think>, ...)
        return w
    if bigram and not target:  # MTP head computes the same bigram as the target
        if name == "mtp.fc.weight":  # fc([e | h]) = e
            hidden = shape[0]
            return np.concatenate([np.eye(hidden), np.zeros((hidden, hidden))], axis=1).astype(np.float32)
        if name.endswith(_RESIDUAL_OUT_SUFFIXES):
            return np.zeros(shape, np.float32)
    elif bigram and name.endswith(_RESIDUAL_OUT_SUFFIXES):
        gain = _BIGRAM_RESIDUAL_SCALE
    elif target and name.endswith(_MIXER_OUT_SUFFIXES):
        gain = _MIXER_OUT_GAIN
    fan_in = int(np.prod(shape[1:]))  # Linear (out, in), Conv1d (C, K, 1), Conv3d (O, T, H, W, C)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(gain / np.sqrt(fan_in))


def _to_hf(name: str, value: np.ndarray) -> tuple[str, np.ndarray]:
    """Map an MLX-layout parameter back to the HF checkpoint name and layout."""
    if name.startswith("language_model.model."):
        name = "model.language_model." + name[len("language_model.model.") :]
    elif name.startswith("language_model.lm_head."):
        name = name[len("language_model.") :]
    elif name.startswith("vision_tower."):
        name = "model.visual." + name[len("vision_tower.") :]
    if name.endswith("conv1d.weight"):  # MLX (C, K, 1) -> torch (C, 1, K)
        value = np.ascontiguousarray(value.transpose(0, 2, 1))
    if name.endswith("patch_embed.proj.weight"):  # MLX NDHWC -> torch NCDHW
        value = np.ascontiguousarray(value.transpose(0, 4, 1, 2, 3))
    if name.endswith(_ZERO_CENTRED_SUFFIXES) and "linear_attn" not in name:
        value = value - 1.0
    return name, value


def fixture_weights(spec: FixtureSpec, config: dict[str, Any]) -> dict[str, tuple[str, np.ndarray]]:
    """HF name -> (safetensors dtype, float32 value), sorted by name."""
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, shape in sorted(_mlx_param_shapes(config).items()):
        hf_name, value = _to_hf(name, _init_value(name, shape, spec))
        dtype = "F32" if spec.variant != "bf16" or hf_name.endswith("A_log") else "BF16"
        out[hf_name] = (dtype, value.astype(np.float32))
    return dict(sorted(out.items()))


def text_only_config(config: dict[str, Any], *, with_mtp: bool) -> dict[str, Any]:
    """The text-only (``Qwen3_5ForCausalLM``) config.json of a VLM fixture config."""
    text = copy.deepcopy(config["text_config"])
    text["architectures"] = ["Qwen3_5ForCausalLM"]
    text["eos_token_id"] = config["eos_token_id"]
    text["pad_token_id"] = config["pad_token_id"]
    if not with_mtp:
        text["mtp_num_hidden_layers"] = 0
    return text


def text_only_weights(
    weights: dict[str, tuple[str, np.ndarray]], *, with_mtp: bool
) -> dict[str, tuple[str, np.ndarray]]:
    """HF text-only names: ``model.language_model.X`` -> ``model.X``; no vision tower."""
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, value in weights.items():
        if name.startswith("model.visual.") or (name.startswith("mtp.") and not with_mtp):
            continue
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        out[name] = value
    return dict(sorted(out.items()))


def _bf16_bytes(value: np.ndarray) -> bytes:
    """float32 -> bfloat16 bytes, round-to-nearest-even (finite inputs)."""
    bits = np.ascontiguousarray(value, dtype="<f4").view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def save_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """Write a safetensors file byte-for-byte deterministically (sorted keys, fixed header)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        dtype, value = tensors[name]
        blob = _bf16_bytes(value) if dtype == "BF16" else np.ascontiguousarray(value, dtype="<f4").tobytes()
        header[name] = {"dtype": dtype, "shape": list(value.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for blob in blobs:
            fh.write(blob)


# --------------------------------------------------------------------------- build + cache


def _dump_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_fixture(out_dir: Path, spec: FixtureSpec) -> Path:
    """Write a complete checkpoint for ``spec`` into ``out_dir`` (created if missing) and
    return it. Deterministic: the same spec gives byte-identical files (given the same
    installed mlx_lm/mlx_vlm, whose sources are the tokenizer corpus). Prefer
    :func:`fixture_path`, which caches. Side effect: advances MLX's global RNG key."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = fixture_config(spec, vocab_size=tokenizer.get_vocab_size(with_added_tokens=True))
    write_tokenizer_files(out_dir, tokenizer, model_max_length=spec.max_position_embeddings)
    weights = fixture_weights(spec, config)
    aux = _aux_files()
    if spec.layout != "vlm":
        with_mtp = spec.layout == "text"
        weights = text_only_weights(weights, with_mtp=with_mtp)
        config = text_only_config(config, with_mtp=with_mtp)
        aux = {"generation_config.json": aux["generation_config.json"]}
    _dump_json(out_dir / "config.json", config)
    for filename, content in aux.items():
        _dump_json(out_dir / filename, content)
    save_safetensors(out_dir / "model.safetensors", weights)
    _dump_json(
        out_dir / MANIFEST_NAME,
        {
            "recipe_version": RECIPE_VERSION,
            "spec": msgspec.to_builtins(spec),
            "tokenizer_corpus": {pkg: version(pkg.replace("_", "-")) for pkg in ("mlx_lm", "mlx_vlm")},
        },
    )
    return out_dir


def _cache_root(cache_dir: Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("MLX_RELAY_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "mlx-relay"


def _is_complete(path: Path) -> bool:
    return (path / MANIFEST_NAME).is_file()


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def build_cached(root: Path, name: str, is_complete: Callable[[Path], bool], build: Callable[[Path], object]) -> Path:
    """`root/name`, built once by `build(tmp_dir)`: into a temporary sibling renamed into place
    under an exclusive `flock`, so concurrent processes never see a half-written folder; leftovers
    of a killed builder are removed."""
    target = root / name
    if is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{name}.lock"):
        if is_complete(target):  # another process finished it while we waited
            return target
        tmp_prefix = f".{name}.tmp-"
        for stale in root.glob(tmp_prefix + "*"):  # left by a killed builder
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # incomplete leftover: replace it
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=root))
        try:
            build(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def fixture_path(spec: FixtureSpec = FixtureSpec(), cache_dir: Path | None = None) -> Path:
    """The cached fixture for ``spec``, built on first use.

    Lives in ``<cache_dir or $MLX_RELAY_CACHE or ~/.cache/mlx-relay>/fixtures/<spec.dirname>``.
    The build goes into a temporary sibling directory that is renamed into place while an
    exclusive ``flock`` is held, so concurrent processes never see a half-written fixture.
    """
    root = _cache_root(cache_dir) / "fixtures"
    return build_cached(root, spec.dirname, _is_complete, lambda tmp: build_fixture(tmp, spec))


def default_model_path(cache_dir: Path | None = None) -> Path:
    """The embedded default model for ``make serve``: the small trained checkpoint shipped in the
    package (``mlx_relay/models/relay-tiny-agent``, :data:`mlx_relay.default_model.DEFAULT_MODEL_NAME`:
    a Qwen3.5-style hybrid with an MTP head, trained on an agent curriculum), or the bf16 seed-0
    fixture if it is missing."""
    shipped = Path(__file__).resolve().parent.parent / "models" / DEFAULT_MODEL_NAME
    if (shipped / "model.safetensors").is_file():
        return shipped
    return fixture_path(FixtureSpec("bf16", 0), cache_dir)
