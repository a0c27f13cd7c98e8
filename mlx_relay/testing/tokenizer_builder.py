"""Tokenizer half of the tiny fixture recipe (see :mod:`mlx_relay.testing.fixtures`).

Trains a small byte-level BPE the way Qwen3.5's tokenizer is built (NFC, the Qwen3.5
pre-tokenizer regex, ByteLevel bytes-to-unicode), appends the 26 Qwen3.5 added tokens in
Qwen's order, and writes the Hugging Face tokenizer files plus our ChatML template.

The corpus is the ``*.md``/``*.py`` files shipped inside the installed ``mlx_lm`` and
``mlx_vlm`` packages, read in sorted order and capped at :data:`CORPUS_MAX_BYTES`, so the
result is deterministic for a given pair of installed library versions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import resources
from importlib.util import find_spec
from pathlib import Path
from typing import Final

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

__all__ = [
    "BASE_VOCAB_SIZE",
    "CORPUS_MAX_BYTES",
    "QWEN3_5_PRETOKENIZE_REGEX",
    "SPECIAL_TOKENS",
    "build_tokenizer",
    "chat_template_text",
    "token_id",
    "write_tokenizer_files",
]

#: Size of the trained BPE vocabulary (bytes + merges); added tokens start at this id.
BASE_VOCAB_SIZE: Final[int] = 1000

#: Deterministic cap on the training corpus, so training stays around a second.
CORPUS_MAX_BYTES: Final[int] = 3_000_000

#: Qwen3.5's pre-tokenizer split pattern (transformers' ``tokenization_qwen3_5.py``).
QWEN3_5_PRETOKENIZE_REGEX: Final[str] = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: The Qwen3.5 added tokens in Qwen's id order, with Qwen's ``special`` flag. Ids are
#: ``BASE_VOCAB_SIZE + index`` (real Qwen3.5: ``248044 + index``).
SPECIAL_TOKENS: Final[tuple[tuple[str, bool], ...]] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

_CORPUS_PACKAGES: Final[tuple[str, ...]] = ("mlx_lm", "mlx_vlm")


def token_id(content: str) -> int:
    """The fixture id of one of :data:`SPECIAL_TOKENS` (``<|im_end|>`` -> 1002)."""
    for index, (name, _special) in enumerate(SPECIAL_TOKENS):
        if name == content:
            return BASE_VOCAB_SIZE + index
    raise KeyError(content)


def chat_template_text() -> str:
    """Our ChatML template, shipped as package data next to this module."""
    return resources.files("mlx_relay.testing").joinpath("chat_template.jinja").read_text("utf-8")


def _corpus_files() -> list[Path]:
    files: list[tuple[str, Path]] = []
    for package in _CORPUS_PACKAGES:
        spec = find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"{package} is not installed; it provides the tokenizer corpus")
        root = Path(next(iter(spec.submodule_search_locations)))
        for path in root.rglob("*"):
            if path.suffix in (".md", ".py") and path.is_file() and "__pycache__" not in path.parts:
                files.append((f"{package}/{path.relative_to(root).as_posix()}", path))
    files.sort(key=lambda item: item[0])
    return [path for _name, path in files]


def _corpus(max_bytes: int = CORPUS_MAX_BYTES) -> Iterator[str]:
    budget = max_bytes
    for path in _corpus_files():
        if budget <= 0:
            return
        data = path.read_bytes()[:budget]
        budget -= len(data)
        yield data.decode("utf-8", errors="ignore")


def build_tokenizer(vocab_size: int = BASE_VOCAB_SIZE,
                    added: tuple[tuple[str, bool], ...] = SPECIAL_TOKENS) -> Tokenizer:
    """Train the byte-level BPE and append the added tokens (Qwen3.5's unless `added` names
    another family's, as `(content, special)` in id order from `vocab_size`; deterministic)."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size(with_added_tokens=False) != vocab_size:
        raise RuntimeError(
            f"BPE training produced {tokenizer.get_vocab_size(with_added_tokens=False)} tokens, expected {vocab_size}"
        )
    for content, special in added:
        token = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        tokenizer.add_tokens([token])  # one by one keeps the family's order and ids
    for index, (content, _special) in enumerate(added):
        if tokenizer.token_to_id(content) != vocab_size + index:
            raise RuntimeError(f"{content} got id {tokenizer.token_to_id(content)}, expected {vocab_size + index}")
    return tokenizer


def _token_entry(content: str, special: bool) -> dict[str, object]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": special,
    }


def _dump(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_files(out_dir: Path, tokenizer: Tokenizer, *, model_max_length: int) -> None:
    """Write tokenizer.json, vocab.json, merges.txt, tokenizer_config.json,
    special_tokens_map.json and chat_template.jinja into ``out_dir``."""
    out_dir = Path(out_dir)
    tokenizer_json = json.loads(tokenizer.to_str())
    # Qwen ships no truncation/padding defaults in tokenizer.json.
    tokenizer_json["truncation"] = None
    tokenizer_json["padding"] = None
    (out_dir / "tokenizer.json").write_text(
        json.dumps(tokenizer_json, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )

    model = tokenizer_json["model"]
    vocab = dict(sorted(model["vocab"].items(), key=lambda item: item[1]))
    _dump(out_dir / "vocab.json", vocab)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")

    added = {str(token_id(content)): _token_entry(content, special) for content, special in SPECIAL_TOKENS}
    _dump(
        out_dir / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": added,
            "additional_special_tokens": [c for c, special in SPECIAL_TOKENS[1:] if special],
            "bos_token": None,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": model_max_length,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
    )
    _dump(
        out_dir / "special_tokens_map.json",
        {
            "additional_special_tokens": [c for c, special in SPECIAL_TOKENS[1:] if special],
            "eos_token": _token_entry("<|im_end|>", True),
            "pad_token": _token_entry("<|endoftext|>", True),
        },
    )
    (out_dir / "chat_template.jinja").write_text(chat_template_text(), encoding="utf-8")
