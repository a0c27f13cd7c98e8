"""Train a small Qwen3.5-style hybrid model with an MTP head on CPU (issue 4, point 6).

The result is a complete Hugging Face-layout Qwen3.5 vision-language checkpoint (the same
layout, config, tokenizer, chat template and processor files as the fixtures of
:mod:`mlx_relay.testing.fixtures`, just larger and trained): ``mlx_vlm.load(out)`` loads it
strictly and ``mlx_vlm.speculative.drafters.load_drafter(out, kind="mtp")`` loads its head.

Corpus: the ``*.py`` files of the Python standard library that ships with the interpreter
(``sysconfig.get_paths()["stdlib"]``; ``test``/``tests`` folders, ``test_*.py``, ``idlelib``,
``lib2to3``, ``turtledemo``, ``site-packages`` and ``ensurepip`` excluded), licensed under the
Python Software Foundation License Version 2 (PSF-2.0, see ``LICENSE.txt`` in that folder).
Files are read in sorted order until ``--corpus-bytes`` (default 8 MB: on CPython 3.11 that
is ``__future__.py`` .. ``stat.py``); a deterministic ~5 % of the files (by SHA-256 of the
relative path) are held out for evaluation and never trained on. Documents are separated
by ``<|endoftext|>``.

Model: ``mlx_vlm.models.qwen3_5.Model`` (3 GatedDeltaNet + 1 gated-attention layers per 4,
text hidden size ``--hidden``) with MLX's default init, plus ``Qwen3_5MTPDraftModel`` bound
to the target's embedding and ``lm_head`` as in the library's ``bind()``. The vision tower
keeps its random init (it is tiny, as in the fixtures). The tokenizer is the fixture's
1026-token byte-level BPE.

Loss: next-token cross-entropy of the target plus ``--mtp-weight`` times the MTP head's
cross-entropy for token ``t+2`` from ``(h_t, embed(tok_{t+1}))``, where ``h_t`` is the hidden
state the library feeds the drafter (the output of ``language_model.model``, as returned by
``speculative_verify_hidden``), with positions ``0..L-2`` as in ``prefill_from_target_hidden``.

Usage::

    python tools/train_small_mtp.py --out /tmp/small-mtp/run --steps 3000 --seed 0
    python tools/train_small_mtp.py --out /tmp/small-mtp/run --eval-only

Init and batch order are fixed by ``--seed`` (float results can still differ slightly across
BLAS builds). ``--resume`` continues from ``<out>.train_state.safetensors`` (written beside
``<out>``, because mlx_vlm loads every ``*.safetensors`` inside it) with a batch stream
keyed by ``(seed, step)``, so a resumed run is not bit-identical to an uninterrupted one.

Speed: the Linux ``mlx-cpu`` wheel links netlib's reference BLAS (~5 GFLOP/s); unless
``--no-blas-shim`` is given, the script compiles a tiny ``cblas_sgemm`` forwarder to numpy's
bundled OpenBLAS under ``/tmp/small-mtp/blas-shim`` and re-executes itself with it in
``LD_PRELOAD`` (about 5x faster training).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlx_relay.testing.fixtures import FixtureSpec, _to_hf, build_fixture, save_safetensors
from mlx_relay.testing.tokenizer_builder import token_id

_EXCLUDED_PARTS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "ensurepip", "turtledemo"})


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


def reexec_with_blas_shim(build_dir: Path) -> None:
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


def corpus_files(root: Path | None = None) -> list[Path]:
    """The stdlib ``*.py`` files used as corpus, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _EXCLUDED_PARTS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        files.append(path)
    return files


def is_held_out(rel: str, percent: int = 5) -> bool:
    """Deterministic held-out split by file path."""
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:4], "little") % 100 < percent


def load_corpus(tokenizer_path: Path, max_bytes: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Token ids of the training and held-out files (each capped at ``max_bytes`` of text),
    plus the held-out texts."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    root = Path(sysconfig.get_paths()["stdlib"])
    eot = token_id("<|endoftext|>")
    texts: dict[bool, list[str]] = {False: [], True: []}
    sizes = {False: 0, True: 0}
    for path in corpus_files(root):
        held = is_held_out(str(path.relative_to(root)))
        cap = max_bytes if not held else max(max_bytes // 19, 1)
        if sizes[held] >= cap:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts[held].append(text)
        sizes[held] += len(text.encode())
    out = []
    for held in (False, True):
        ids: list[int] = []
        for enc in tok.encode_batch(texts[held], add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eot)
        out.append(np.asarray(ids, dtype=np.int32))
    return out[0], out[1], texts[True]


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
        lm = self.vlm.language_model
        seq = tokens.shape[1]
        text_pos = mx.broadcast_to(mx.arange(seq, dtype=mx.int32)[None, None, :], (3, 1, seq))
        h = lm.model(tokens, position_ids=text_pos)  # what speculative_verify_hidden hands the drafter
        main = nn.losses.cross_entropy(lm.lm_head(h[:, :-1]), tokens[:, 1:], reduction="mean")
        length = tokens.shape[1] - 1
        emb = lm.model.embed_tokens(tokens[:, 1:])
        pos = mx.arange(length, dtype=mx.int32)[None, :]
        mh = self.mtp._forward_hidden(emb, h[:, :-1], None, pos)
        mtp = nn.losses.cross_entropy(lm.lm_head(mh[:, :-1]), tokens[:, 2:], reduction="mean")
        return main, mtp


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


def greedy_sample(out: Path, prompt: str, max_tokens: int) -> str:
    import mlx_vlm

    model, processor = mlx_vlm.load(str(out))
    text = ""
    for r in mlx_vlm.stream_generate(model, processor, prompt, max_tokens=max_tokens, temperature=0.0):
        text += r.text
    return text


def mtp_acceptance(out: Path, prompts: list[str], block: int, max_tokens: int) -> tuple[float, float, float]:
    """(mean accepted drafts per round, base tok/s, MTP tok/s) over ``prompts``, greedy.

    At block size 2 (one draft per round) the mean is the acceptance rate."""
    import mlx_vlm
    from mlx_vlm.speculative.drafters import load_drafter

    model, processor = mlx_vlm.load(str(out))
    drafter, _ = load_drafter(str(out), kind="mtp")
    accepted = rounds = 0
    base_tok = base_t = mtp_tok = mtp_t = 0.0
    for prompt in prompts:
        t0 = time.perf_counter()
        base = [
            r.token for r in mlx_vlm.stream_generate(model, processor, prompt, max_tokens=max_tokens, temperature=0.0)
        ]
        base_t += time.perf_counter() - t0
        base_tok += len(base)
        t0 = time.perf_counter()
        spec = [
            r.token
            for r in mlx_vlm.stream_generate(
                model,
                processor,
                prompt,
                max_tokens=max_tokens,
                temperature=0.0,
                draft_model=drafter,
                draft_kind="mtp",
                draft_block_size=block,
            )
        ]
        mtp_t += time.perf_counter() - t0
        mtp_tok += len(spec)
        if spec != base:
            print(f"  note: MTP output differs from greedy for prompt {prompt[:30]!r}", file=sys.stderr)
        accepted += sum(drafter.accept_lens)
        rounds += len(drafter.accept_lens)
    return accepted / max(rounds, 1), base_tok / base_t, mtp_tok / mtp_t


def teacher_forced_agreement(out: Path, held_ids: np.ndarray, windows: int, length: int) -> dict[str, float]:
    """On held-out windows (ground-truth context): how often the MTP head's argmax for token
    ``t+2`` equals the target's argmax for it (the greedy acceptance of a 1-token draft when
    the context is real text), and the top-1 accuracies of both against the text."""
    import mlx_vlm
    from mlx_vlm.speculative.drafters import load_drafter

    model, _ = mlx_vlm.load(str(out))
    drafter, _ = load_drafter(str(out), kind="mtp")
    drafter.bind(model)
    lm = model.language_model
    step = max((len(held_ids) - length - 1) // windows, 1)
    tokens = mx.array(np.stack([held_ids[i * step : i * step + length] for i in range(windows)]))
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


# --------------------------------------------------------------------------- train


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--intermediate", type=int, default=576)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--linear-head-dim", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--mtp-weight", type=float, default=1.0)
    p.add_argument("--corpus-bytes", type=int, default=8_000_000)
    p.add_argument("--save-every", type=int, default=250)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop (and save) after this long; 0 = no limit")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--eval-only", action="store_true")
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--no-eval", action="store_true")
    p.add_argument("--no-compile", action="store_true", help="skip mx.compile (first compiled step JIT-builds C++)")
    p.add_argument("--no-blas-shim", action="store_true", help="do not preload the OpenBLAS sgemm shim")
    return p.parse_args(argv)


def demo_prompt(texts: list[str]) -> str:
    """A readable demo prompt: the first held-out top-level ``def`` line with a docstring,
    up to and including the docstring's first line."""
    for text in texts:
        start = text.find("\ndef ")
        while start >= 0:
            line_end = text.find("\n", start + 1)
            next_end = text.find("\n", line_end + 1)
            if text[line_end + 1 : next_end].lstrip().startswith('"""'):
                return text[start + 1 : next_end + 1]
            start = text.find("\ndef ", start + 1)
    return texts[0][:200]


def evaluate(args: argparse.Namespace, held_texts: list[str], held_ids: np.ndarray) -> dict[str, Any]:
    prompts = held_out_prompts(held_texts, args.eval_prompts, 200)
    demo = demo_prompt(held_texts)
    sample = greedy_sample(args.out, demo, args.eval_tokens)
    print(
        f"--- greedy continuation of a held-out prompt (prompt, then <<<|>>>):\n{demo}<<<|>>>{sample}\n---", flush=True
    )
    result: dict[str, Any] = {"prompt": demo, "greedy": sample}
    agreement = teacher_forced_agreement(args.out, held_ids, 16, 256)
    print("teacher-forced on held-out text: " + "  ".join(f"{k} {v:.3f}" for k, v in agreement.items()), flush=True)
    result.update(agreement)
    for block in (2, 3):
        mean, base_tps, mtp_tps = mtp_acceptance(args.out, prompts, block, args.eval_tokens)
        print(
            f"MTP block {block}: {mean:.3f} accepted drafts/round (per-draft rate {mean / (block - 1):.3f})  "
            f"base {base_tps:.0f} tok/s  mtp {mtp_tps:.0f} tok/s",
            flush=True,
        )
        result[f"accepted_per_round_block{block}"] = mean
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out: Path = args.out
    spec = FixtureSpec("fp32", args.seed, args.hidden, args.intermediate, args.layers)
    config = small_config(spec, args.linear_head_dim)
    if not args.resume and not args.eval_only:
        build_fixture(out, spec)  # tokenizer, template, processor files (weights replaced below)
        (out / "mlx_relay_fixture.json").unlink(missing_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    t0 = time.perf_counter()
    train_ids, held_ids, held_texts = load_corpus(out / "tokenizer.json", args.corpus_bytes)
    print(f"corpus: {len(train_ids)} train / {len(held_ids)} held-out tokens ({time.perf_counter() - t0:.1f}s)")
    if args.eval_only:
        return evaluate(args, held_texts, held_ids)

    mx.random.seed(args.seed)
    model = TargetWithMTP(config)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    n_mtp = sum(v.size for _, v in tree_flatten(model.mtp.parameters()))
    print(f"params: {n_params / 1e6:.2f} M total, MTP head {n_mtp / 1e6:.2f} M")
    model.vlm.vision_tower.freeze()

    schedule = optim.join_schedules(
        [
            optim.linear_schedule(1e-5, args.lr, args.warmup),
            optim.cosine_decay(args.lr, max(args.steps - args.warmup, 1), args.lr * 0.05),
        ],
        [args.warmup],
    )
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.01)
    state_path = train_state_path(out)
    start_step = 0
    if args.resume and state_path.is_file():
        saved = mx.load(str(state_path))
        start_step = int(saved.pop("__step__").item())
        model.update(tree_unflatten([(k[len("p.") :], v) for k, v in saved.items() if k.startswith("p.")]))
        opt.init(model.trainable_parameters())
        opt.state = tree_unflatten([(k[len("o.") :], v) for k, v in saved.items() if k.startswith("o.")])
        print(f"resumed at step {start_step}")

    def loss_fn(m: TargetWithMTP, tokens: mx.array) -> tuple[mx.array, tuple[mx.array, mx.array]]:
        main_loss, mtp_loss = m.losses(tokens)
        return main_loss + args.mtp_weight * mtp_loss, (main_loss, mtp_loss)

    grad_fn = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    def step(tokens: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        (_, (main_loss, mtp_loss)), grads = grad_fn(model, tokens)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return main_loss, mtp_loss

    if not args.no_compile:
        step = mx.compile(step, inputs=state, outputs=state)

    rng = np.random.default_rng([args.seed, start_step])
    n = len(train_ids) - args.seq_len - 1
    t_start = time.perf_counter()
    t_log = t_start
    acc = [0.0, 0.0]
    history: list[tuple[int, float, float]] = []
    for it in range(start_step, args.steps):
        starts = rng.integers(0, n, size=args.batch)
        batch = mx.array(np.stack([train_ids[s : s + args.seq_len + 1] for s in starts]))
        main_loss, mtp_loss = step(batch)
        mx.eval(state, main_loss, mtp_loss)
        acc[0] += main_loss.item()
        acc[1] += mtp_loss.item()
        done = it + 1
        if done % args.log_every == 0:
            now = time.perf_counter()
            tps = args.log_every * args.batch * args.seq_len / (now - t_log)
            k = args.log_every
            history.append((done, acc[0] / k, acc[1] / k))
            print(
                f"step {done}: loss {acc[0] / k:.3f} (ppl {math.exp(acc[0] / k):.1f})  mtp {acc[1] / k:.3f}  "
                f"lr {schedule(opt.step).item():.2e}  {tps:.0f} tok/s  {now - t_start:.0f}s",
                flush=True,
            )
            acc = [0.0, 0.0]
            t_log = now
        timed_out = args.max_minutes > 0 and time.perf_counter() - t_start > 60 * args.max_minutes
        if done % args.save_every == 0 or done == args.steps or timed_out:
            size = save_checkpoint(model, out)
            flat = {f"p.{k}": v for k, v in tree_flatten(model.trainable_parameters())}
            flat.update({f"o.{k}": v for k, v in tree_flatten(opt.state)})
            flat["__step__"] = mx.array(done)
            mx.save_safetensors(str(state_path), flat)
            print(f"saved step {done} ({size / 1e6:.2f} MB model.safetensors)", flush=True)
        if timed_out:
            break
    if args.no_eval:
        return {"history": history}
    return {"history": history, **evaluate(args, held_texts, held_ids)}


if __name__ == "__main__":
    if "--no-blas-shim" not in sys.argv[1:]:
        reexec_with_blas_shim(Path("/tmp/small-mtp/blas-shim"))
    main()
