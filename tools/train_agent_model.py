"""Train ``relay-tiny-agent`` from the agent curriculum (issue 19, point 1).

A sibling of ``tools/train_small_mtp.py`` sharing its model code (:class:`TargetWithMTP`: the
Qwen3.5 VLM with its MTP head, trained jointly), its checkpoint writer (HF names and layouts,
float32, so ``mlx_vlm.load`` and our server load the result strictly), its learning-rate rule
and its optimizer-state file for ``--resume``. What differs:

* the data: rows of ``tools/agent_curriculum.py`` conversations (each rendered by the server's
  own prompt renderer and chat template), packed to the stage's sequence length and padded;
* the loss: cross-entropy over the assistant turns, for the target's next token and for the MTP
  head's token ``t+2``, plus the same over the prompts' text at ``--context-weight`` (0.3; the
  first H100 run trained on the assistant turns alone, one token in ten, and after 300 steps
  could not copy a key from the line above);
* a sequence-length schedule (``--schedule 1024:2000,4096:600,16384:200:2``: stages of
  ``length:steps[:rows]``), with the batch per stage ``rows`` or else ``--tokens-per-step // length``
  (at least 1; the long stages' attention scores need fewer rows to fit), so
  the model learns the template's shapes on short rows first, then retrieval over long ones;
* ``--max-position`` (the checkpoint's declared context, default 32768);
* the learning rate follows the steps of the whole schedule only; ``--max-seconds`` just stops
  (and saves), so a run split over ``--resume`` calls (a lent GPU's per-command limit) follows
  one warmup-and-cosine curve.

Memory: ``--cache-limit-gb`` (default 4) bounds MLX's buffer cache, which otherwise may grow to
the memory limit (on the CUDA backend the first H100 run held 60 of 80 GB from its first steps and
then failed a ``cudaMallocAsync`` instead of reclaiming cached buffers); ``--memory-limit-gb``
sets MLX's memory limit (0: MLX's default). Both are set before the model is built; each log line
shows MLX's active, cached and peak memory. A step that fails (an out-of-memory, an interrupt)
leaves its update unevaluated: the trainer puts back the state of the last step trained
(:class:`LastGoodStep`), saves it with its step, and re-raises, so ``--resume`` loses nothing.
``--save-every`` counts the steps trained in this call.

Rows are made by ``--workers`` processes (0: in this one), a few steps ahead of the optimizer;
row ``b`` of step ``s`` is example stream ``s * 1024 + b`` of the training split, so the data
depends only on ``--seed`` (the evaluation uses the held-out split, never trained on).

Toy CPU smoke (a minute; proves the loop, the checkpoint and the evaluation end to end)::

    python tools/train_agent_model.py --out /tmp/agent-smoke --hidden 64 --intermediate 128 \
        --layers 4 --schedule 512:20,1024:10 --tokens-per-step 2048 --warmup 5 --log-every 5
    python tools/eval_agent_model.py --model /tmp/agent-smoke --n 2 --lengths 1024 4096

Proposed run on one H200 (MLX's CUDA backend; ``benchmarks/gpu/README.md`` has the kit; the
stdlib filler travels as a tarball unpacked to ``/tmp/stdlib``, as for relay-tiny-coder). The
model: hidden 256, MLP 640, 8 layers (6 GatedDeltaNet + 2 gated attention), 32768 positions,
6.40 M parameters with the MTP head, 25.6 MB as float32. The schedule: 1,500 steps of 1K rows,
400 of 4K, 150 of 16K, 64K tokens a step (134 M tokens). The same call three times (a lent GPU
allows 10 minutes a command; the first call drops ``--resume``), then the evaluation::

    python3 tools/train_agent_model.py --out /root/run/relay-tiny-agent --filler stdlib \
        --stdlib /tmp/stdlib --hidden 256 --intermediate 640 --layers 8 --max-position 32768 \
        --schedule 1024:1500,4096:400,16384:150 --tokens-per-step 65536 --lr 3e-3 --warmup 150 \
        --workers 12 --log-every 50 --save-every 250 --max-seconds 480 --resume
    python3 tools/eval_agent_model.py --model /root/run/relay-tiny-agent --filler stdlib \
        --stdlib /tmp/stdlib --n 50 --lengths 4096 8192 16384 --out /root/run/agent-eval.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

sys.path.insert(0, str(Path(__file__).parent))
from agent_curriculum import TRAIN, Curriculum, Mix, StdlibFiller, SyntheticFiller
from train_small_mtp import (
    TargetWithMTP,
    add_optimizer_args,
    learning_rate,
    load_train_state,
    reexec_with_blas_shim,
    save_checkpoint,
    save_train_state,
    small_config,
    train_state_path,
)

from mlx_relay.testing.fixtures import FixtureSpec, build_fixture
from mlx_relay.testing.tokenizer_builder import token_id

ROWS_PER_STEP_MAX = 1024


class Stage(NamedTuple):
    """One stage of the schedule: ``steps`` steps of ``length``-token rows, ``rows`` a step (0:
    ``--tokens-per-step // length``)."""

    length: int
    steps: int
    rows: int = 0


def parse_schedule(text: str) -> list[Stage]:
    """``"1024:2000,4096:600:12"`` -> ``[Stage(1024, 2000), Stage(4096, 600, 12)]``."""
    stages = []
    for part in text.split(","):
        fields = [int(x) for x in part.split(":")]
        if len(fields) not in (2, 3):
            raise ValueError(f"bad --schedule stage {part!r} (length:steps[:rows])")
        stages.append(Stage(*fields))
    if not stages or any(st.length < 64 or st.steps < 1 or st.rows < 0 for st in stages):
        raise ValueError(f"bad --schedule {text!r}")
    return stages


PAD, CONTEXT, ASSISTANT = 0, 1, 2  # a row token's kind: padding, the prompt's text, an assistant turn's


def token_kinds(ids: np.ndarray, mask: np.ndarray, pad_id: int) -> np.ndarray:
    """Each token's kind (``int8``): ``ASSISTANT`` where the loss mask is set, ``PAD`` for the
    row's padding (the pad token, which no conversation holds), ``CONTEXT`` for the rest."""
    return np.where(mask, ASSISTANT, np.where(ids == pad_id, PAD, CONTEXT)).astype(np.int8)


def _mean_ce(ce: mx.array, kinds: mx.array, kind: int) -> mx.array:
    m = (kinds == kind).astype(mx.float32)
    return (ce * m).sum() / mx.maximum(m.sum(), 1.0)


def masked_losses(vlm: nn.Module, mtp: nn.Module, tokens: mx.array, kinds: mx.array) -> dict[str, mx.array]:
    """Mean cross-entropies of the target's next token and the MTP head's token ``t+2``, apart
    over the assistant turns (``main``, ``mtp``) and over the prompts' text (``context``,
    ``mtp_context``); padding counts nowhere (the same hidden states and positions as
    ``train_small_mtp.joint_losses``)."""
    lm = vlm.language_model
    seq = tokens.shape[1]
    text_pos = mx.broadcast_to(mx.arange(seq, dtype=mx.int32)[None, None, :], (3, 1, seq))
    h = lm.model(tokens, position_ids=text_pos)
    ce = nn.losses.cross_entropy(lm.lm_head(h[:, :-1]), tokens[:, 1:], reduction="none")
    emb = lm.model.embed_tokens(tokens[:, 1:])
    pos = mx.arange(seq - 1, dtype=mx.int32)[None, :]
    mh = mtp._forward_hidden(emb, h[:, :-1], None, pos)
    ce2 = nn.losses.cross_entropy(lm.lm_head(mh[:, :-1]), tokens[:, 2:], reduction="none")
    k1, k2 = kinds[:, 1:], kinds[:, 2:]
    return {"main": _mean_ce(ce, k1, ASSISTANT), "context": _mean_ce(ce, k1, CONTEXT),
            "mtp": _mean_ce(ce2, k2, ASSISTANT), "mtp_context": _mean_ce(ce2, k2, CONTEXT)}


def total_loss(losses: dict[str, mx.array], context_weight: float, mtp_weight: float) -> mx.array:
    """What the optimizer minimizes: the assistant turns' loss, plus the prompts' text at
    ``context_weight`` (next-token prediction over the filler, the tool declarations and the
    questions: the copying and look-up an assistant turn needs, learned from every token rather
    than the one in ten that an assistant turn holds), each with its MTP term at ``mtp_weight``."""
    return (losses["main"] + context_weight * losses["context"]
            + mtp_weight * (losses["mtp"] + context_weight * losses["mtp_context"]))


# --------------------------------------------------------------------------- rows (worker side)

_WORKER: dict[str, Any] = {}  # one Curriculum per worker process, set by its initializer only


def _init_worker(out: str, filler: str, stdlib: str | None, seed: int) -> None:
    chosen = StdlibFiller(Path(stdlib) if stdlib else None) if filler == "stdlib" else SyntheticFiller()
    _WORKER["cur"] = Curriculum(Path(out), chosen, Mix(), seed=seed)
    _WORKER["pad"] = token_id("<|endoftext|>")


def _make_row(task: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, token kinds) of one training row."""
    length, index = task
    enc = _WORKER["cur"].row(TRAIN, index, length, _WORKER["pad"])
    return enc.ids, token_kinds(enc.ids, enc.mask, _WORKER["pad"])


class Rows:
    """Batches of curriculum rows, made in worker processes (or inline) a few steps ahead."""

    def __init__(self, out: Path, filler: str, stdlib: Path | None, seed: int, workers: int, ahead: int = 4) -> None:
        self.pool = None
        init = (str(out), filler, str(stdlib) if stdlib else None, seed)
        if workers > 0:
            self.pool = multiprocessing.get_context("spawn").Pool(workers, _init_worker, init)
        else:
            _init_worker(*init)
        self.ahead = ahead

    def _submit(self, tasks: list[tuple[int, int]]) -> Any:
        if self.pool is None:
            return [_make_row(t) for t in tasks]
        return self.pool.map_async(_make_row, tasks)

    def batches(self, plan: list[tuple[int, int, int]]) -> Any:
        """``plan``: (step, length, batch) per step; yields (ids, kinds) arrays per step."""
        queue: deque[Any] = deque()  # this plan's jobs (a stage left early leaves its own behind)
        it = iter(plan)
        for step, length, batch in it:
            queue.append(self._submit([(length, step * ROWS_PER_STEP_MAX + b) for b in range(batch)]))
            if len(queue) >= self.ahead:
                break
        pending = deque(it)
        while queue:
            job = queue.popleft()
            if pending:
                step, length, batch = pending.popleft()
                queue.append(self._submit([(length, step * ROWS_PER_STEP_MAX + b) for b in range(batch)]))
            rows = job if isinstance(job, list) else job.get()
            yield np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None


# --------------------------------------------------------------------------- training

GiB = 1 << 30


def memory_limits(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """(cache limit, memory limit) in bytes for ``mx.set_cache_limit`` / ``mx.set_memory_limit``
    (None: leave MLX's default)."""
    cache = int(args.cache_limit_gb * GiB) if args.cache_limit_gb >= 0 else None
    memory = int(args.memory_limit_gb * GiB) if args.memory_limit_gb > 0 else None
    return cache, memory


def memory_note() -> str:
    return (f"mem {mx.get_active_memory() / GiB:.1f} GB active, {mx.get_cache_memory() / GiB:.1f} cached, "
            f"{mx.get_peak_memory() / GiB:.1f} peak")


class LastGoodStep:
    """The model's and the optimizer's state after the last step that was evaluated.

    MLX is lazy: a step assigns the updated parameters and moments as unevaluated arrays, and an
    out-of-memory surfaces in ``mx.eval``, after the assignment. ``hold`` keeps references to the
    evaluated arrays before a step (no copy: arrays are immutable), ``release`` drops them once the
    step is evaluated, and ``restore`` puts them back in place (the module's and the optimizer's
    own dicts, which a compiled step captured) when the step failed. Returns whether it did."""

    def __init__(self, model: nn.Module, opt: optim.Optimizer) -> None:
        self.model, self.opt = model, opt
        self.held: tuple[Any, dict[str, Any]] | None = None

    def hold(self) -> None:
        self.held = (tree_map(lambda a: a, self.model.parameters()), tree_map(lambda a: a, self.opt.state))

    def release(self) -> None:
        self.held = None

    def restore(self) -> bool:
        if self.held is None:
            return False
        params, opt_state = self.held
        self.model.update(params)
        self.opt.state.clear()
        self.opt.state.update(opt_state)
        self.held = None
        return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=640)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--linear-head-dim", type=int, default=32)
    p.add_argument("--max-position", type=int, default=32768)
    p.add_argument("--schedule", default="1024:2000,4096:600,16384:200", help="length:steps,...")
    p.add_argument("--tokens-per-step", type=int, default=65536)
    p.add_argument("--context-weight", type=float, default=0.3,
                   help="the weight of the prompts' text in the loss (0: the assistant turns only)")
    p.add_argument("--filler", choices=("synthetic", "stdlib"), default="synthetic")
    p.add_argument("--stdlib", type=Path, default=None, help="the stdlib filler's root (default: this Python's)")
    p.add_argument("--workers", type=int, default=0, help="row-making processes (0: inline)")
    add_optimizer_args(p)
    p.add_argument("--save-every", type=int, default=500, help="save every this many steps trained in this call")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--max-seconds", type=float, default=0.0, help="stop (and save) after this long; 0 = no limit")
    p.add_argument("--stage-time-shares", default=None,
                   help="with --max-seconds: each stage also ends once its share of the time is spent "
                        "(cumulative, e.g. 0.45,0.3,0.25), and the learning rate follows the time, so a "
                        "run of unknown speed still reaches every stage")
    p.add_argument("--cache-limit-gb", type=float, default=4.0,
                   help="MLX's buffer cache limit (mx.set_cache_limit; -1: MLX's default, the memory limit)")
    p.add_argument("--memory-limit-gb", type=float, default=0.0,
                   help="MLX's memory limit (mx.set_memory_limit; 0: MLX's default)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--metrics", type=Path, default=None)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-blas-shim", action="store_true")
    args = p.parse_args(argv)
    args.stages = parse_schedule(args.schedule)
    args.steps = sum(st.steps for st in args.stages)  # learning_rate() reads args.steps
    args.shares = None
    if args.stage_time_shares is not None:
        shares = [float(x) for x in args.stage_time_shares.split(",")]
        if len(shares) != len(args.stages) or any(x <= 0 for x in shares) or args.max_seconds <= 0:
            raise SystemExit("--stage-time-shares needs one positive share per stage and --max-seconds")
        args.shares = [x / sum(shares) for x in shares]
        args.steps = sys.maxsize  # the cosine follows the time alone (stages may end early)
    return args


def stage_plans(args: argparse.Namespace, start: int) -> list[list[tuple[int, int, int]]]:
    """Per stage, its (step, length, batch) from step `start` on (stages before it are empty)."""
    plans, step = [], 0
    for length, steps, rows in args.stages:
        batch = min(rows or max(args.tokens_per_step // length, 1), ROWS_PER_STEP_MAX)
        plans.append([(s, length, batch) for s in range(step, step + steps) if s >= start])
        step += steps
    return plans


def stage_deadlines(args: argparse.Namespace) -> list[float]:
    """Seconds into the run at which each stage ends (its cumulative time share; else only the cap)."""
    cap = args.max_seconds if args.max_seconds > 0 else math.inf
    if args.shares is None:
        return [cap] * len(args.stages)
    return [cap * sum(args.shares[:i + 1]) for i in range(len(args.shares))]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train with MLX's cache and memory limits set for the run (and put back after it)."""
    args = parse_args(argv)
    cache_limit, memory_limit = memory_limits(args)
    old_memory = mx.set_memory_limit(memory_limit) if memory_limit is not None else None
    old_cache = mx.set_cache_limit(cache_limit) if cache_limit is not None else None
    try:
        return train(args, cache_limit, memory_limit)
    finally:
        if old_cache is not None:
            mx.set_cache_limit(old_cache)
        if old_memory is not None:
            mx.set_memory_limit(old_memory)


def train(args: argparse.Namespace, cache_limit: int | None, memory_limit: int | None) -> dict[str, Any]:
    out: Path = args.out
    spec = FixtureSpec("fp32", args.seed, args.hidden, args.intermediate, args.layers, args.max_position)
    config = small_config(spec, args.linear_head_dim)
    if not args.resume:
        build_fixture(out, spec)  # tokenizer, chat template, processor files (weights replaced below)
        (out / "mlx_relay_fixture.json").unlink(missing_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    print(f"device {mx.default_device()}, mlx {mx.__version__}, stages {args.stages}, cache limit "
          f"{'default' if cache_limit is None else f'{cache_limit / GiB:g} GB'}, memory limit "
          f"{'default' if memory_limit is None else f'{memory_limit / GiB:g} GB'}", flush=True)

    mx.random.seed(args.seed)
    model = TargetWithMTP(config)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"params: {n_params / 1e6:.3f} M ({4 * n_params / 1e6:.1f} MB as float32)", flush=True)
    model.vlm.vision_tower.freeze()
    opt = optim.AdamW(learning_rate=learning_rate(args, 0), weight_decay=args.weight_decay)
    state_path = train_state_path(out)
    start = 0
    if args.resume and state_path.is_file():
        start = load_train_state(model, opt, state_path)
        print(f"resumed at step {start}", flush=True)

    def loss_fn(m: TargetWithMTP, tokens: mx.array, kinds: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        losses = masked_losses(m.vlm, m.mtp, tokens, kinds)
        return total_loss(losses, args.context_weight, args.mtp_weight), losses

    grad_fn = nn.value_and_grad(model, loss_fn)
    opt.init(model.trainable_parameters())
    state = [model.state, opt.state]

    def step(tokens: mx.array, kinds: mx.array) -> dict[str, mx.array]:
        (_, losses), grads = grad_fn(model, tokens, kinds)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return losses

    if not args.no_compile:
        step = mx.compile(step, inputs=state, outputs=state)

    rows = Rows(out, args.filler, args.stdlib, args.seed, args.workers)
    plans = stage_plans(args, start)
    last_step = sum(st.steps for st in args.stages)
    history: list[dict[str, float]] = []
    t_start = t_log = time.perf_counter()
    acc: dict[str, float] = {}
    n_acc = 0
    done = start
    trained_steps = trained_tokens = 0

    def trained() -> Any:
        """(step, length, batch), (ids, kinds) of every stage, each until its deadline."""
        for plan, deadline in zip(plans, stage_deadlines(args), strict=True):
            if time.perf_counter() - t_start > deadline:
                continue
            for item in zip(plan, rows.batches(plan), strict=True):
                if time.perf_counter() - t_start > deadline:
                    break
                yield item

    last_good = LastGoodStep(model, opt)
    losses: dict[str, mx.array] | None = None
    try:
        for (it, length, batch), (ids, kinds) in trained():
            if args.shares is None:  # by steps of the whole schedule: one curve across --resume calls
                lr = learning_rate(args, it)
            else:  # warm up by the schedule's steps (so a resumed call does not warm up again), then by the time
                lr = learning_rate(args, it, (time.perf_counter() - t_start) / args.max_seconds)
            opt.learning_rate = lr
            trained_steps += 1
            last_good.hold()
            losses = step(mx.array(ids), mx.array(kinds))
            mx.eval(state, losses)
            last_good.release()
            for name, value in losses.items():
                acc[name] = acc.get(name, 0.0) + value.item()
            n_acc += 1
            trained_tokens += int((kinds == ASSISTANT).sum())
            done = it + 1
            if trained_steps % args.log_every == 0 or done == last_step:
                now = time.perf_counter()
                mean = {name: total / n_acc for name, total in acc.items()}
                rec = {"step": done, "length": length, "batch": batch, "loss": mean["main"], "mtp_loss": mean["mtp"],
                       "context_loss": mean["context"], "mtp_context_loss": mean["mtp_context"],
                       "lr": lr, "seconds": now - t_start}
                history.append(rec)
                print(f"step {done} (len {length} x {batch}): loss {rec['loss']:.3f} (ppl {math.exp(rec['loss']):.1f})"
                      f"  mtp {rec['mtp_loss']:.3f}  context {rec['context_loss']:.3f}  lr {lr:.2e}  "
                      f"{n_acc / (now - t_log):.2f} steps/s  {now - t_start:.0f}s  {memory_note()}", flush=True)
                acc, n_acc = {}, 0
                t_log = now
            if trained_steps % args.save_every == 0:
                save_checkpoint(model, out)
                save_train_state(model, opt, done, state_path)
    except BaseException as exc:
        # an out-of-memory (or an interrupt) mid-step: save the last step trained, then fail as before
        rolled_back = last_good.restore()
        losses = None  # the failed step's graph, if any (frees its buffers)
        mx.clear_cache()
        print(f"failed after step {done} ({type(exc).__name__}: {exc}); "
              f"{'the failed step rolled back, ' if rolled_back else ''}saving step {done}", flush=True)
        rows.close()
        save_checkpoint(model, out)
        save_train_state(model, opt, done, state_path)
        print(f"saved step {done} after the failure  {memory_note()}", flush=True)
        raise
    finally:
        rows.close()
    size = save_checkpoint(model, out)
    save_train_state(model, opt, done, state_path)
    seconds = time.perf_counter() - t_start
    print(f"saved step {done} ({size / 1e6:.2f} MB model.safetensors) after {seconds:.0f}s; "
          f"{trained_tokens} assistant tokens trained", flush=True)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "params": n_params, "steps": done,
              "train_seconds": seconds, "history": history, "trained_tokens": trained_tokens}
    if args.metrics is not None:
        args.metrics.parent.mkdir(parents=True, exist_ok=True)
        args.metrics.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    if "--no-blas-shim" not in sys.argv[1:] and mx.default_device() == mx.cpu:
        reexec_with_blas_shim()
    main()
