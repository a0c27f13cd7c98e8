"""Train a small Qwen3.5-style hybrid model with an MTP head on the stdlib's source (issue 4, point 6).

The result is a complete Hugging Face-layout Qwen3.5 vision-language checkpoint (the same
layout, config, tokenizer, chat template and processor files as the fixtures of
:mod:`mlx_relay.testing.fixtures`, just larger and trained): ``mlx_vlm.load(out)`` loads it
strictly and ``mlx_vlm.speculative.drafters.load_drafter(out, kind="mtp")`` loads its head.
The committed result is ``models/relay-tiny-coder`` (its README has the figures).

Corpus: the ``*.py`` files of a CPython standard library (``--stdlib``, default the running
interpreter's ``sysconfig.get_paths()["stdlib"]``), licensed under the Python Software
Foundation License Version 2 (PSF-2.0, ``LICENSE.txt`` in that folder). The test suite,
``idlelib``, ``lib2to3`` and ``turtledemo`` are included (they are ordinary Python source
too); left out are ``site-packages``, ``ensurepip``, the data tables ``encodings/``,
``pydoc_data/`` and ``_sysconfigdata*``, and any file that is not UTF-8, does not compile
(``badsyntax_*``, Python 2 samples), is mostly literal table rows (at least 20 non-comment
lines and half of them a bare literal, ``key: value`` or number: ``html/entities.py``,
``locale.py``, ``stringprep.py`` ...), or has more than 1 % non-ASCII characters. Files are
taken in the order of the SHA-256 of their relative path (a deterministic sample across the
whole library, not a sorted prefix) until ``--corpus-bytes`` (0, the default, takes all:
about 29 MB, 13 M tokens on CPython 3.11). A deterministic 5 % of the files (by the same
hash) are held out for evaluation and never trained on. Documents are separated by
``<|endoftext|>``.

Model: ``mlx_vlm.models.qwen3_5.Model`` (3 GatedDeltaNet + 1 gated-attention layers per 4,
text hidden size ``--hidden``, defaults 8 layers, hidden 192: 3.8 M parameters, 15.2 MB as
float32) with MLX's default init, plus ``Qwen3_5MTPDraftModel`` bound to the target's
embedding and ``lm_head`` as in the library's ``bind()``. The vision tower keeps its random
init (it is tiny, as in the fixtures). The tokenizer is the fixture's 1026-token byte-level
BPE (:mod:`mlx_relay.testing.tokenizer_builder`).

Loss: next-token cross-entropy of the target plus ``--mtp-weight`` times the MTP head's
cross-entropy for token ``t+2`` from ``(h_t, embed(tok_{t+1}))``, where ``h_t`` is the hidden
state the library feeds the drafter (the output of ``language_model.model``, as returned by
``speculative_verify_hidden``), with positions ``0..L-2`` as in ``prefill_from_target_hidden``.
AdamW, linear warmup then cosine decay to 5 % of ``--lr``; with ``--max-seconds`` the decay
follows whichever of step count and wall time is further along, and training stops (and
saves) when either runs out.

Evaluation (at the end, or ``--eval-only``): held-out loss, teacher-forced agreement of the
MTP head with the target, three greedy continuations of held-out prompts, and the MTP
acceptance measured with mlx_vlm's own drafter loop (``stream_generate`` with
``draft_kind="mtp"``) at block sizes 2 and 3, checking that greedy output with the drafter
equals greedy output without it. ``--metrics FILE`` writes all of it as JSON.

Usage (CPU)::

    python tools/train_small_mtp.py --out /tmp/small-mtp/run --steps 3000 --seed 0
    python tools/train_small_mtp.py --out /tmp/small-mtp/run --eval-only

On an NVIDIA GPU (MLX's CUDA backend; ``benchmarks/gpu/README.md`` has the kit, and the
corpus travels as a tarball of this machine's stdlib unpacked to ``/tmp/stdlib``), the
committed checkpoint was trained in two calls on one H200 (the second resumes the first)::

    python3 tools/train_small_mtp.py --out /root/run/relay-tiny-coder --stdlib /tmp/stdlib \
        --steps 100000 --max-seconds 400 --batch 64 --seq-len 256 --log-every 100 \
        --eval-every 1000 --save-every 1000000 --no-eval
    python3 tools/train_small_mtp.py --out /root/run/relay-tiny-coder --stdlib /tmp/stdlib \
        --resume --steps 100000 --max-seconds 240 --lr 1.5e-3 --batch 64 --seq-len 256 \
        --log-every 100 --eval-every 500 --save-every 1000000 --no-eval
    python3 tools/train_small_mtp.py --out /root/run/relay-tiny-coder --stdlib /tmp/stdlib --eval-only

Init and batch order are fixed by ``--seed`` (float results can still differ slightly across
BLAS builds and devices; a run stopped by ``--max-seconds`` also depends on the speed).
``--resume`` continues from ``<out>.train_state.safetensors`` (written beside ``<out>``,
because mlx_vlm loads every ``*.safetensors`` inside it) with a batch stream keyed by
``(seed, step)``, so a resumed run is not bit-identical to an uninterrupted one.

Speed: on CPU the Linux ``mlx-cpu`` wheel links netlib's reference BLAS (~5 GFLOP/s); unless
``--no-blas-shim`` is given or MLX's default device is a GPU, the script compiles a tiny
``cblas_sgemm`` forwarder to numpy's bundled OpenBLAS under ``/tmp/small-mtp/blas-shim``
and re-executes itself with it in ``LD_PRELOAD`` (about 5x faster training).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import sysconfig
import time
import warnings
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlx_relay.testing.fixtures import FixtureSpec, _to_hf, build_fixture, save_safetensors
from mlx_relay.testing.tokenizer_builder import token_id

_EXCLUDED_DIRS = frozenset({"site-packages", "ensurepip", "encodings", "pydoc_data"})
_EXCLUDED_PREFIXES = ("_sysconfigdata",)


# --------------------------------------------------------------------------- fast BLAS

_SHIM_SOURCE = """#include <stdint.h>
extern void scipy_cblas_sgemm64_(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t,
                                 const float *, int64_t, float, float *, int64_t);
void cblas_sgemm(int o, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
  scipy_cblas_sgemm64_(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
"""


def build_blas_shim(build_dir: Path) -> Path | None:
    """Build a ``cblas_sgemm`` that forwards to numpy's bundled OpenBLAS (ILP64, ``scipy_`` prefix).

    The Linux ``mlx-cpu`` wheel links the netlib reference BLAS (about 5 GFLOP/s here);
    preloading this shim makes MLX's fp32 matmuls about 5x faster. Returns None when numpy
    has no such library or there is no C compiler."""
    libs = Path(np.__file__).parent.parent / "numpy.libs"
    found = sorted(libs.glob("libscipy_openblas64_*.so"))
    if not found:
        return None
    build_dir.mkdir(parents=True, exist_ok=True)
    src, lib = build_dir / "sgemm_shim.c", build_dir / "libsgemm_shim.so"
    src.write_text(_SHIM_SOURCE)
    cmd = ["cc", "-O2", "-shared", "-fPIC", str(src), "-o", str(lib), f"-L{libs}", f"-l:{found[0].name}"]
    try:
        subprocess.run([*cmd, f"-Wl,-rpath,{libs}"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return lib


BLAS_SHIM_DIR = Path("/tmp/small-mtp/blas-shim")  # where the shim is built, once per machine


def reexec_with_blas_shim(build_dir: Path = BLAS_SHIM_DIR) -> None:
    """Re-run this process with the shim preloaded (no-op if already done or impossible)."""
    if os.environ.get("SMALL_MTP_BLAS_SHIM"):
        return
    lib = build_blas_shim(build_dir)
    if lib is None:
        print("note: no BLAS shim, MLX uses its reference BLAS (slow)", file=sys.stderr)
        return
    env = dict(os.environ, SMALL_MTP_BLAS_SHIM="1", LD_PRELOAD=f"{lib} {os.environ.get('LD_PRELOAD', '')}".strip())
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


# --------------------------------------------------------------------------- corpus

# Literal-only lines: a number, a string, ``key: value`` with a literal key, optional comma/comment.
_LITERAL_LINE = re.compile(
    r"""^\s*(?:[-+]?(?:0x[0-9a-fA-F]+|\d[\d_.eE+-]*)|[rbuRBU]*(?:'[^']*'|"[^"]*")|None|True|False)"""
    r"""\s*(?::\s*.+)?,?\s*(?:#.*)?$"""
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def path_hash(rel: str) -> bytes:
    return hashlib.sha256(rel.encode()).digest()


def corpus_files(root: Path | None = None) -> list[Path]:
    """Candidate ``*.py`` files under ``root``, in corpus order: by SHA-256 of the relative path
    (a deterministic sample across the whole library). :func:`rejection` filters them further."""
    root = stdlib_root() if root is None else root
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _EXCLUDED_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith(_EXCLUDED_PREFIXES):
            continue
        files.append(path)
    return sorted(files, key=lambda f: path_hash(f.relative_to(root).as_posix()))


def rejection(text: str, rel: str) -> str | None:
    """Why a file's text is left out of the corpus (None: it is kept)."""
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        return "empty"
    literal = sum(1 for line in lines if _LITERAL_LINE.match(line))
    if literal >= 20 and 2 * literal >= len(lines):
        return "table"
    if 100 * sum(1 for ch in text if ord(ch) > 127) > len(text):
        return "non-ascii"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(text, rel, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return "syntax"
    return None


def is_held_out(rel: str, percent: int = 5) -> bool:
    """Deterministic held-out split by file path."""
    return int.from_bytes(path_hash(rel)[:4], "little") % 100 < percent


def corpus_texts(root: Path | None = None, max_bytes: int = 0) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts) in corpus order; with ``max_bytes`` > 0 the training
    part stops at about that many bytes and the held-out part at 1/19 of it."""
    root = stdlib_root() if root is None else root
    texts: dict[bool, list[str]] = {False: [], True: []}
    sizes = {False: 0, True: 0}
    for path in corpus_files(root):
        rel = path.relative_to(root).as_posix()
        held = is_held_out(rel)
        cap = max_bytes if not held else max(max_bytes // 19, 1)
        if max_bytes > 0 and sizes[held] >= cap:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if rejection(text, rel) is not None:
            continue
        texts[held].append(text)
        sizes[held] += len(text.encode())
    return texts[False], texts[True]


def load_corpus(
    tokenizer_path: Path, max_bytes: int, root: Path | None = None
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Token ids of the training and held-out texts (see :func:`corpus_texts`), plus the
    held-out texts."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    eot = token_id("<|endoftext|>")
    train_texts, held_texts = corpus_texts(root, max_bytes)
    out = []
    for texts in (train_texts, held_texts):
        ids: list[int] = []
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eot)
        out.append(np.asarray(ids, dtype=np.int32))
    return out[0], out[1], held_texts


# --------------------------------------------------------------------------- model


def small_config(spec: FixtureSpec, linear_head_dim: int) -> dict[str, Any]:
    """The fixture config for ``spec`` with wider GatedDeltaNet heads."""
    from mlx_relay.testing.fixtures import fixture_config

    config = fixture_config(spec)
    text = config["text_config"]
    text["linear_key_head_dim"] = linear_head_dim
    text["linear_value_head_dim"] = linear_head_dim
    return config


class TargetWithMTP(nn.Module):
    """The VLM (vision tower untouched) plus its MTP head, trained jointly."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        from mlx_vlm.models.qwen3_5 import Model, ModelConfig
        from mlx_vlm.speculative.drafters.qwen3_5_mtp import Qwen3_5MTPDraftModel
        from mlx_vlm.speculative.drafters.qwen3_5_mtp.config import Qwen3_5MTPConfig

        self.vlm = Model(ModelConfig.from_dict(copy.deepcopy(config)))
        self.mtp = Qwen3_5MTPDraftModel(
            Qwen3_5MTPConfig.from_dict({"text_config": copy.deepcopy(config["text_config"])})
        )

    def losses(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        return joint_losses(self.vlm, self.mtp, tokens)


def joint_losses(vlm: nn.Module, mtp: nn.Module, tokens: mx.array) -> tuple[mx.array, mx.array]:
    """(target next-token loss, MTP loss for token ``t+2``), both mean cross-entropy."""
    lm = vlm.language_model
    seq = tokens.shape[1]
    text_pos = mx.broadcast_to(mx.arange(seq, dtype=mx.int32)[None, None, :], (3, 1, seq))
    h = lm.model(tokens, position_ids=text_pos)  # what speculative_verify_hidden hands the drafter
    main = nn.losses.cross_entropy(lm.lm_head(h[:, :-1]), tokens[:, 1:], reduction="mean")
    length = tokens.shape[1] - 1
    emb = lm.model.embed_tokens(tokens[:, 1:])
    pos = mx.arange(length, dtype=mx.int32)[None, :]
    mh = mtp._forward_hidden(emb, h[:, :-1], None, pos)
    mtp_loss = nn.losses.cross_entropy(lm.lm_head(mh[:, :-1]), tokens[:, 2:], reduction="mean")
    return main, mtp_loss


def train_state_path(out: Path) -> Path:
    """Optimizer state for ``--resume``; beside the checkpoint, since mlx_vlm loads every
    ``*.safetensors`` inside it."""
    return out.parent / f"{out.name}.train_state.safetensors"


def save_checkpoint(model: TargetWithMTP, out: Path) -> int:
    """Overwrite ``out/model.safetensors`` (fp32, HF names/layouts); returns its size."""
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    for name, value in tree_flatten(model.parameters()):
        mlx_name = name[len("vlm.") :] if name.startswith("vlm.") else name
        hf_name, arr = _to_hf(mlx_name, np.array(value.astype(mx.float32)))
        tensors[hf_name] = ("F32", arr.astype(np.float32))
    path = out / "model.safetensors"
    save_safetensors(path, tensors)
    return path.stat().st_size


# --------------------------------------------------------------------------- eval


def held_out_windows(held_ids: np.ndarray, windows: int, length: int) -> mx.array:
    """``windows`` evenly spaced held-out windows of ``length`` tokens."""
    step = max((len(held_ids) - length - 1) // windows, 1)
    return mx.array(np.stack([held_ids[i * step : i * step + length] for i in range(windows)]))


def held_out_loss(vlm: nn.Module, mtp_head: nn.Module, tokens: mx.array, batch: int = 16) -> tuple[float, float]:
    """Mean (target, MTP) cross-entropy over held-out windows."""
    main = mtp = 0.0
    for i in range(0, tokens.shape[0], batch):
        a, b = joint_losses(vlm, mtp_head, tokens[i : i + batch])
        main += a.item() * min(batch, tokens.shape[0] - i)
        mtp += b.item() * min(batch, tokens.shape[0] - i)
    return main / tokens.shape[0], mtp / tokens.shape[0]


def load_checkpoint(out: Path) -> tuple[Any, Any, Any]:
    """(model, processor, MTP drafter) as a server would load them."""
    import mlx_vlm
    from mlx_vlm.speculative.drafters import load_drafter

    model, processor = mlx_vlm.load(str(out), strict=True)
    drafter, kind = load_drafter(str(out), kind="mtp")
    assert kind == "mtp"
    return model, processor, drafter


def greedy(model: Any, processor: Any, prompt: str, max_tokens: int, **draft: Any) -> tuple[list[int], str]:
    """Greedy token ids and text of mlx_vlm's ``stream_generate`` (``draft``: drafter arguments)."""
    import mlx_vlm

    tokens, text = [], ""
    for r in mlx_vlm.stream_generate(model, processor, prompt, max_tokens=max_tokens, temperature=0.0, **draft):
        tokens.append(r.token)
        text += r.text
    return tokens, text


def mtp_acceptance(
    model: Any, processor: Any, drafter: Any, prompts: list[str], block: int, max_tokens: int
) -> dict[str, float]:
    """MTP speculative decoding through mlx_vlm's drafter loop, greedy, over ``prompts``:
    accepted drafts per round, accepted per draft (at block 2, one draft a round, the two
    are the same), tokens/s with and without the drafter, and how many prompts gave output
    different from plain greedy decoding (should be 0)."""
    accepted = rounds = drafted = 0
    base_tok = base_t = mtp_tok = mtp_t = 0.0
    mismatches = 0
    for prompt in prompts:
        t0 = time.perf_counter()
        base, _ = greedy(model, processor, prompt, max_tokens)
        base_t += time.perf_counter() - t0
        base_tok += len(base)
        t0 = time.perf_counter()
        spec, _ = greedy(
            model, processor, prompt, max_tokens, draft_model=drafter, draft_kind="mtp", draft_block_size=block
        )
        mtp_t += time.perf_counter() - t0
        mtp_tok += len(spec)
        if spec != base:
            mismatches += 1
            print(f"  note: MTP output differs from greedy for prompt {prompt[:30]!r}", file=sys.stderr)
        accepted += sum(drafter.accept_lens)
        rounds += len(drafter.accept_lens)
        drafted += sum(drafter.draft_lens) if drafter.draft_lens else (block - 1) * len(drafter.accept_lens)
    return {
        "accepted_per_round": accepted / max(rounds, 1),
        "accepted_per_draft": accepted / max(drafted, 1),
        "base_tok_s": base_tok / base_t,
        "mtp_tok_s": mtp_tok / mtp_t,
        "mismatches": mismatches,
        "rounds": rounds,
    }


def teacher_forced_agreement(model: Any, drafter: Any, tokens: mx.array) -> dict[str, float]:
    """On held-out windows (ground-truth context): how often the MTP head's argmax for token
    ``t+2`` equals the target's argmax for it (the greedy acceptance of a 1-token draft when
    the context is real text), and the top-1 accuracies of both against the text."""
    drafter.bind(model)
    lm = model.language_model
    length = tokens.shape[1]
    pos3 = mx.broadcast_to(mx.arange(length, dtype=mx.int32)[None, None, :], (3, 1, length))
    h = lm.model(tokens, position_ids=pos3)
    target = mx.argmax(lm.lm_head(h), axis=-1)  # target[:, i] predicts token i+1
    pos = mx.arange(length - 1, dtype=mx.int32)[None, :]
    mh = drafter._forward_hidden(lm.model.embed_tokens(tokens[:, 1:]), h[:, :-1], None, pos)
    draft = mx.argmax(lm.lm_head(mh), axis=-1)[:, :-1]  # draft[:, i] predicts token i+2
    return {
        "draft_agrees_with_target": mx.mean(draft == target[:, 1:-1]).item(),
        "target_top1": mx.mean(target[:, :-1] == tokens[:, 1:]).item(),
        "draft_top1": mx.mean(draft == tokens[:, 2:]).item(),
    }


def held_out_prompts(texts: list[str], count: int, chars: int) -> list[str]:
    """Deterministic prompts cut from held-out files (line-aligned starts)."""
    prompts = []
    rng = np.random.default_rng(1234)
    candidates = [t for t in texts if len(t) > 4 * chars]
    for i in range(count):
        text = candidates[i % len(candidates)]
        start = int(rng.integers(0, len(text) - 2 * chars))
        start = text.find("\n", start) + 1
        prompts.append(text[start : start + chars])
    return prompts


def demo_prompts(texts: list[str], count: int = 3) -> list[str]:
    """Readable demo prompts: held-out top-level ``def`` lines followed by a docstring, up to
    and including the docstring's first line (at most one per file)."""
    prompts = []
    for text in texts:
        start = text.find("\ndef ")
        while start >= 0:
            line_end = text.find("\n", start + 1)
            next_end = text.find("\n", line_end + 1)
            if line_end - start < 100 and text[line_end + 1 : next_end].lstrip().startswith('"""'):
                prompts.append(text[start + 1 : next_end + 1])
                break
            start = text.find("\ndef ", start + 1)
        if len(prompts) == count:
            break
    return prompts or [texts[0][:200]]


def evaluate(args: argparse.Namespace, held_texts: list[str], held_ids: np.ndarray) -> dict[str, Any]:
    t0 = time.perf_counter()
    model, processor, drafter = load_checkpoint(args.out)
    result: dict[str, Any] = {}
    main, mtp = held_out_loss(model, drafter, held_out_windows(held_ids, 64, args.seq_len + 1))
    result.update(held_out_loss=main, held_out_mtp_loss=mtp)
    print(f"held-out loss {main:.3f} (ppl {math.exp(main):.2f})  mtp {mtp:.3f}", flush=True)
    agreement = teacher_forced_agreement(model, drafter, held_out_windows(held_ids, 16, 256))
    print("teacher-forced on held-out text: " + "  ".join(f"{k} {v:.3f}" for k, v in agreement.items()), flush=True)
    result.update(agreement)
    samples = []
    for prompt in demo_prompts(held_texts, 3):
        _, text = greedy(model, processor, prompt, args.eval_tokens)
        samples.append({"prompt": prompt, "greedy": text})
        print(f"--- greedy continuation of a held-out prompt (prompt, then <<<|>>>):\n{prompt}<<<|>>>{text}\n---")
    result["samples"] = samples
    prompts = held_out_prompts(held_texts, args.eval_prompts, 200)
    for block in (2, 3):
        acc = mtp_acceptance(model, processor, drafter, prompts, block, args.eval_tokens)
        print(
            f"MTP block {block}: {acc['accepted_per_round']:.3f} accepted drafts/round "
            f"(per draft {acc['accepted_per_draft']:.3f}, {acc['rounds']} rounds, {len(prompts)} prompts)  "
            f"base {acc['base_tok_s']:.0f} tok/s  mtp {acc['mtp_tok_s']:.0f} tok/s  "
            f"differs from greedy: {acc['mismatches']}",
            flush=True,
        )
        result[f"mtp_block{block}"] = acc
    result["eval_seconds"] = time.perf_counter() - t0
    return result


# --------------------------------------------------------------------------- train


def add_optimizer_args(p: argparse.ArgumentParser) -> None:
    """The optimizer's and the joint loss's flags, shared with train_agent_model.py
    (`learning_rate` reads --lr, --min-lr-ratio and --warmup)."""
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mtp-weight", type=float, default=1.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--stdlib", type=Path, default=None, help="corpus root (default: this Python's stdlib)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--intermediate", type=int, default=448)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--linear-head-dim", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    add_optimizer_args(p)
    p.add_argument("--corpus-bytes", type=int, default=0, help="training text cap (0: all of it)")
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=0, help="held-out loss every N steps (0: only at the end)")
    p.add_argument("--max-seconds", type=float, default=0.0, help="stop (and save) after this long; 0 = no limit")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--eval-only", action="store_true")
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--no-eval", action="store_true")
    p.add_argument("--metrics", type=Path, default=None, help="write the history and evaluation here (JSON)")
    p.add_argument("--no-compile", action="store_true", help="skip mx.compile (first compiled step JIT-builds C++)")
    p.add_argument("--no-blas-shim", action="store_true", help="do not preload the OpenBLAS sgemm shim")
    return p.parse_args(argv)


def learning_rate(args: argparse.Namespace, step: int, time_progress: float = 0.0) -> float:
    """Linear warmup over ``--warmup`` steps, then cosine decay to ``--min-lr-ratio`` of
    ``--lr``, driven by whichever of step count and ``time_progress`` (the fraction of the
    ``--max-seconds`` budget left after the first, compiling, step) is further along."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = max((step - args.warmup) / max(args.steps - args.warmup, 1), time_progress)
    low = args.lr * args.min_lr_ratio
    return low + 0.5 * (args.lr - low) * (1 + math.cos(math.pi * min(progress, 1.0)))


def save_train_state(model: TargetWithMTP, opt: optim.Optimizer, done: int, path: Path) -> None:
    flat = {f"p.{k}": v for k, v in tree_flatten(model.trainable_parameters())}
    flat.update({f"o.{k}": v for k, v in tree_flatten(opt.state)})
    flat["__step__"] = mx.array(done)
    mx.save_safetensors(str(path), flat)


def load_train_state(model: TargetWithMTP, opt: optim.Optimizer, path: Path) -> int:
    """Restore what `save_train_state` wrote into `model` and `opt`; returns the step it was at."""
    saved = mx.load(str(path))
    step = int(saved.pop("__step__").item())
    model.update(tree_unflatten([(k[len("p.") :], v) for k, v in saved.items() if k.startswith("p.")]))
    opt.init(model.trainable_parameters())
    opt.state = tree_unflatten([(k[len("o.") :], v) for k, v in saved.items() if k.startswith("o.")])
    return step


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out: Path = args.out
    spec = FixtureSpec("fp32", args.seed, args.hidden, args.intermediate, args.layers)
    config = small_config(spec, args.linear_head_dim)
    if not args.resume and not args.eval_only:
        build_fixture(out, spec)  # tokenizer, template, processor files (weights replaced below)
        (out / "mlx_relay_fixture.json").unlink(missing_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    print(f"device {mx.default_device()}, mlx {mx.__version__}, python {sys.version.split()[0]}", flush=True)
    tok_sha = hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()[:16]
    t0 = time.perf_counter()
    train_ids, held_ids, held_texts = load_corpus(out / "tokenizer.json", args.corpus_bytes, args.stdlib)
    print(
        f"corpus: {len(train_ids)} train / {len(held_ids)} held-out tokens, {len(held_texts)} held-out files "
        f"({time.perf_counter() - t0:.1f}s; tokenizer.json sha256 {tok_sha})",
        flush=True,
    )
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "train_tokens": len(train_ids)}
    if args.eval_only:
        result.update(evaluate(args, held_texts, held_ids))
        write_metrics(args, result)
        return result

    mx.random.seed(args.seed)
    model = TargetWithMTP(config)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    n_mtp = sum(v.size for _, v in tree_flatten(model.mtp.parameters()))
    print(f"params: {n_params / 1e6:.3f} M total, MTP head {n_mtp / 1e6:.3f} M", flush=True)
    result["params"] = n_params
    model.vlm.vision_tower.freeze()

    opt = optim.AdamW(learning_rate=learning_rate(args, 0), weight_decay=args.weight_decay)
    state_path = train_state_path(out)
    start_step = 0
    if args.resume and state_path.is_file():
        start_step = load_train_state(model, opt, state_path)
        print(f"resumed at step {start_step}")

    def loss_fn(m: TargetWithMTP, tokens: mx.array) -> tuple[mx.array, tuple[mx.array, mx.array]]:
        main_loss, mtp_loss = m.losses(tokens)
        return main_loss + args.mtp_weight * mtp_loss, (main_loss, mtp_loss)

    grad_fn = nn.value_and_grad(model, loss_fn)
    opt.init(model.trainable_parameters())
    state = [model.state, opt.state]

    def step(tokens: mx.array) -> tuple[mx.array, mx.array]:
        (_, (main_loss, mtp_loss)), grads = grad_fn(model, tokens)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return main_loss, mtp_loss

    if not args.no_compile:
        step = mx.compile(step, inputs=state, outputs=state)

    eval_tokens = held_out_windows(held_ids, 32, args.seq_len + 1)
    rng = np.random.default_rng([args.seed, start_step])
    n = len(train_ids) - args.seq_len - 1
    t_start = time.perf_counter()
    t_log = t_start
    t_first = 0.0  # when the first (compiling) step finished
    acc = [0.0, 0.0]
    history: list[tuple[int, float, float]] = []
    held_history: list[tuple[int, float, float]] = []
    done = start_step
    for it in range(start_step, args.steps):
        now = time.perf_counter()
        if args.max_seconds > 0 and now - t_start > args.max_seconds:
            break
        time_progress = 0.0
        if args.max_seconds > 0 and t_first:
            time_progress = (now - t_first) / max(args.max_seconds - (t_first - t_start), 1e-9)
        lr = learning_rate(args, it, time_progress)
        opt.learning_rate = lr
        starts = rng.integers(0, n, size=args.batch)
        batch = mx.array(np.stack([train_ids[s : s + args.seq_len + 1] for s in starts]))
        main_loss, mtp_loss = step(batch)
        mx.eval(state, main_loss, mtp_loss)
        acc[0] += main_loss.item()
        acc[1] += mtp_loss.item()
        done = it + 1
        if done == start_step + 1:
            t_first = time.perf_counter()
            print(f"first step done after {time.perf_counter() - t_start:.1f}s (includes compilation)", flush=True)
        if done % args.log_every == 0:
            now = time.perf_counter()
            k = done - history[-1][0] if history else done - start_step
            tps = k * args.batch * args.seq_len / (now - t_log)
            history.append((done, acc[0] / k, acc[1] / k))
            print(
                f"step {done}: loss {acc[0] / k:.3f} (ppl {math.exp(acc[0] / k):.1f})  mtp {acc[1] / k:.3f}  "
                f"lr {lr:.2e}  {tps:.0f} tok/s  {now - t_start:.0f}s  "
                f"epoch {done * args.batch * args.seq_len / len(train_ids):.2f}",
                flush=True,
            )
            acc = [0.0, 0.0]
            t_log = now
        if args.eval_every and done % args.eval_every == 0:
            main, mtp = held_out_loss(model.vlm, model.mtp, eval_tokens)
            held_history.append((done, main, mtp))
            print(f"step {done}: held-out loss {main:.3f}  mtp {mtp:.3f}", flush=True)
            t_log = time.perf_counter()
        if done % args.save_every == 0:
            save_checkpoint(model, out)
            save_train_state(model, opt, done, state_path)
    size = save_checkpoint(model, out)
    save_train_state(model, opt, done, state_path)
    train_seconds = time.perf_counter() - t_start
    print(f"saved step {done} ({size / 1e6:.2f} MB model.safetensors) after {train_seconds:.0f}s", flush=True)
    result.update(history=history, held_history=held_history, steps=done, train_seconds=train_seconds)
    result["tokens_seen"] = done * args.batch * args.seq_len
    if not args.no_eval:
        result.update(evaluate(args, held_texts, held_ids))
    write_metrics(args, result)
    return result


def write_metrics(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if args.metrics is not None:
        args.metrics.parent.mkdir(parents=True, exist_ok=True)
        args.metrics.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    if "--no-blas-shim" not in sys.argv[1:] and mx.default_device() == mx.cpu:
        reexec_with_blas_shim()
    main()
