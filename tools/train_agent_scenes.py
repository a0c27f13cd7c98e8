"""Fine-tune ``relay-tiny-agent`` on the coding agents' own requests (issue 30, point 1).

A sibling of ``tools/train_agent_model.py`` (its model, losses, curriculum rows and checkpoint
writer): it starts from a trained checkpoint (``--init``, default the embedded model) and
alternates two kinds of step:

* a **scene step** (``tools/agent_scenes.py``): one example of an agent's real request and the
  turn the assistant should write (call the stock tool, load it through ``ToolSearch``, answer its
  result, answer a side request). The agents' prompts are 7-27K tokens; most of each is the
  agent's system prompt and tools, the same in every example of a scene. That prefix runs
  through the model without gradients into a cache (``mlx_vlm``'s own cache objects, refreshed
  every ``--refresh`` steps as the weights move), and the step trains on the suffix: the user's
  sentence, the generation prompt and the assistant turns (the loss on the assistant turns, the
  target's next token; attention and the recurrent layers read the prefix's cache as constants).
  This keeps a 27K-token prompt's step to a few hundred tokens of gradient, with the attention
  over the whole context;
* a **curriculum step** every ``--curriculum-every`` scene steps: a batch of the original
  curriculum's rows (``--curriculum-length`` tokens, ``--curriculum-rows`` of them), with the
  original loss (assistant turns, prompt text at ``--context-weight``, the MTP head), so what the
  model could do stays (``tests/test_relay_tiny_agent.py`` checks it).

The learning rate warms up over ``--warmup`` steps and follows a cosine to 10% by ``--steps``.
``--max-seconds`` stops early and saves. The checkpoint written to ``--out`` is complete (config,
tokenizer, template: copied from ``--init``; weights float32 in HF names, as the original).

CPU smoke (minutes; cut scenes)::

    python tools/train_agent_scenes.py --out /tmp/scenes-smoke --steps 4 --curriculum-every 2 \
        --curriculum-length 512 --curriculum-rows 1 --max-prefix 2048

On a GPU (``benchmarks/gpu/README.md``)::

    python3 tools/train_agent_scenes.py --out /root/run/relay-tiny-agent --steps 600 --lr 5e-4 \
        --curriculum-every 2 --curriculum-length 4096 --curriculum-rows 8 --workers 8 --max-seconds 540
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

sys.path.insert(0, str(Path(__file__).parent))
from agent_scenes import ROOT, SCENES, Encoded, SceneMaker
from train_agent_model import Rows, masked_losses, total_loss
from train_small_mtp import TargetWithMTP, save_checkpoint

from mlx_relay.testing.fixtures import _to_hf

DEFAULT_INIT = ROOT / "mlx_relay" / "models" / "relay-tiny-agent"


# --------------------------------------------------------------------------- checkpoint in


def _from_hf(mlx_name: str, hf: dict[str, np.ndarray]) -> np.ndarray:
    """The MLX-layout value of ``mlx_name`` from an HF checkpoint (``fixtures._to_hf`` inverted)."""
    if mlx_name.endswith("conv1d.weight"):
        hf_name, _ = _to_hf(mlx_name, np.zeros((1, 1, 1), np.float32))
        return np.ascontiguousarray(hf[hf_name].transpose(0, 2, 1))
    if mlx_name.endswith("patch_embed.proj.weight"):
        hf_name, _ = _to_hf(mlx_name, np.zeros((1, 1, 1, 1, 1), np.float32))
        return np.ascontiguousarray(hf[hf_name].transpose(0, 2, 3, 4, 1))
    hf_name, shifted = _to_hf(mlx_name, np.zeros((1,), np.float32))
    return hf[hf_name] - shifted  # _to_hf subtracts 1 from zero-centred norms: add it back


def load_init(model: TargetWithMTP, init: Path) -> None:
    hf = {k: np.array(v) for k, v in mx.load(str(init / "model.safetensors")).items()}
    params = []
    for name, value in tree_flatten(model.parameters()):
        mlx_name = name[len("vlm."):] if name.startswith("vlm.") else name
        arr = _from_hf(mlx_name, hf)
        if arr.shape != value.shape:
            raise ValueError(f"{name}: {arr.shape} in {init}, {value.shape} in the model")
        params.append((name, mx.array(arr.astype(np.float32))))
    model.update(tree_unflatten(params))


# --------------------------------------------------------------------------- scene steps


class PrefixCaches:
    """Each scene prefix's cache states (no gradient), recomputed every ``refresh`` steps."""

    def __init__(self, model: TargetWithMTP, chunk: int, refresh: int) -> None:
        self.model, self.chunk, self.refresh = model, chunk, refresh
        self.states: dict[str, tuple[int, list[Any]]] = {}

    def fresh_cache(self, prefix: np.ndarray, step: int) -> list[Any]:
        key = hashlib.sha1(prefix.tobytes()).hexdigest()
        held = self.states.get(key)
        if held is None or step - held[0] >= self.refresh:
            held = (step, self._compute(prefix))
            self.states[key] = held
        cache = self.model.vlm.language_model.make_cache()
        for c, state in zip(cache, held[1], strict=True):
            c.state = list(state) if isinstance(state, list) else state  # the cache mutates its list
        return cache

    def _compute(self, prefix: np.ndarray) -> list[Any]:
        lm = self.model.vlm.language_model
        cache = lm.make_cache()
        for start in range(0, len(prefix), self.chunk):
            piece = prefix[start: start + self.chunk]
            pos = mx.broadcast_to(mx.arange(start, start + len(piece), dtype=mx.int32)[None, None, :],
                                  (3, 1, len(piece)))
            lm.model(mx.array(piece)[None], cache=cache, position_ids=pos)
            mx.eval([c.state for c in cache])
        return [mx.stop_gradient(s) if isinstance(s, mx.array) else
                type(s)(mx.stop_gradient(x) if isinstance(x, mx.array) else x for x in s)
                for s in (c.state for c in cache)]


def scene_loss(model: TargetWithMTP, cache: list[Any], suffix: mx.array, mask: mx.array, start: int) -> mx.array:
    """Mean cross-entropy of the assistant turns' tokens in ``suffix`` (after the cached prefix)."""
    lm = model.vlm.language_model
    n = suffix.shape[1]
    pos = mx.broadcast_to(mx.arange(start, start + n, dtype=mx.int32)[None, None, :], (3, 1, n))
    h = lm.model(suffix, cache=cache, position_ids=pos)
    ce = nn.losses.cross_entropy(lm.lm_head(h[:, :-1]), suffix[:, 1:], reduction="none")
    m = mask[:, 1:].astype(mx.float32)
    return (ce * m).sum() / mx.maximum(m.sum(), 1.0)


def greedy_turn(model: TargetWithMTP, caches: PrefixCaches, enc: Encoded, step: int,
                tokenizer: Any = None) -> bool:
    """Whether greedy decoding from the example's prompt writes its target turn exactly (no
    grammar: the server's tool grammar only narrows what the model may write). With a
    ``tokenizer``, a miss prints what was written instead."""
    lm = model.vlm.language_model
    prefix = enc.ids[:enc.split]
    cache = caches.fresh_cache(prefix, step)
    rest = enc.ids[enc.split:enc.prompt_len]
    target = enc.ids[enc.prompt_len: enc.prompt_len + int(enc.mask[enc.prompt_len:].sum())]
    start = len(prefix)
    tokens = mx.array(rest)[None]
    written: list[int] = []
    for k in range(len(target) + 24):
        n = tokens.shape[1]
        pos = mx.broadcast_to(mx.arange(start, start + n, dtype=mx.int32)[None, None, :], (3, 1, n))
        h = lm.model(tokens, cache=cache, position_ids=pos)
        got = int(mx.argmax(lm.lm_head(h[:, -1]), axis=-1).item())
        written.append(got)
        if k < len(target) and got != int(target[k]) and tokenizer is None:
            return False
        if k == len(target) - 1 and written == [int(t) for t in target]:
            return True
        start += n
        tokens = mx.array([[got]])
    if tokenizer is not None:
        print("   wrote:", repr(tokenizer.decode(written)), flush=True)
    return False


def evaluate(model: TargetWithMTP, maker: SceneMaker, caches: PrefixCaches, n: int, seed: int,
             only: tuple[str, ...] = ()) -> dict[str, float]:
    """Exact greedy target turns per scene over ``n`` fresh examples (seeds the training never drew)."""
    out: dict[str, float] = {}
    for k, scene in enumerate(SCENES):
        rng = np.random.default_rng((seed, 10_000 + k))
        if only and scene.agent not in only:
            continue
        hits = sum(greedy_turn(model, caches, maker.encode(maker.example(scene, rng)), 1 << 30, maker.tokenizer)
                   for _ in range(n))
        out[f"{scene.agent}/{scene.target}/{Path(scene.file).name}"] = hits / n
        print(f"eval {scene.agent:15s} {scene.target:6s} {Path(scene.file).name}: {hits}/{n}", flush=True)
    return out


# --------------------------------------------------------------------------- loop


def lr_at(args: argparse.Namespace, step: int) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = min((step - args.warmup) / max(args.steps - args.warmup, 1), 1.0)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--init", type=Path, default=DEFAULT_INIT)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=600, help="scene steps")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--refresh", type=int, default=25, help="recompute a scene's prefix cache after this many steps")
    p.add_argument("--chunk", type=int, default=4096, help="prefix tokens per forward")
    p.add_argument("--max-prefix", type=int, default=0, help="cut prefixes to N tokens (0: whole)")
    p.add_argument("--curriculum-every", type=int, default=2, help="curriculum step every N (0: none)")
    p.add_argument("--curriculum-length", type=int, default=4096)
    p.add_argument("--curriculum-rows", type=int, default=8)
    p.add_argument("--context-weight", type=float, default=0.3)
    p.add_argument("--mtp-weight", type=float, default=1.0)
    p.add_argument("--filler", choices=("synthetic", "stdlib"), default="synthetic")
    p.add_argument("--stdlib", type=Path, default=None)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--max-seconds", type=float, default=0.0)
    p.add_argument("--cache-limit-gb", type=float, default=4.0)
    p.add_argument("--metrics", type=Path, default=None)
    p.add_argument("--eval", type=int, default=0, help="after training: greedy exact-turn rate on N examples a scene")
    p.add_argument("--eval-only", action="store_true", help="evaluate --init, no training")
    p.add_argument("--agents", nargs="*", default=[], help="train (and evaluate) these agents' scenes only")
    return p.parse_args(argv)


def prepare_out(init: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in init.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from mlx_relay.actors.normalizer import load_tokenizer

    if args.cache_limit_gb >= 0:
        mx.set_cache_limit(int(args.cache_limit_gb * (1 << 30)))
    config = json.loads((args.init / "config.json").read_text())
    model = TargetWithMTP(config)
    load_init(model, args.init)
    model.vlm.vision_tower.freeze()
    if args.out.resolve() != args.init.resolve():
        prepare_out(args.init, args.out)
    maker = SceneMaker(load_tokenizer(args.init))
    print(f"device {mx.default_device()}, mlx {mx.__version__}, {len(SCENES)} scenes", flush=True)

    opt = optim.AdamW(learning_rate=lr_at(args, 0), weight_decay=args.weight_decay)
    opt.init(model.trainable_parameters())
    caches = PrefixCaches(model, args.chunk, args.refresh)

    scene_grad = nn.value_and_grad(model, scene_loss)

    def curriculum_fn(m: TargetWithMTP, tokens: mx.array, kinds: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        losses = masked_losses(m.vlm, m.mtp, tokens, kinds)
        return total_loss(losses, args.context_weight, args.mtp_weight), losses

    curriculum_grad = nn.value_and_grad(model, curriculum_fn)
    rows = None
    batches = None
    if args.curriculum_every > 0:
        rows = Rows(args.out, args.filler, args.stdlib, args.seed, args.workers)
        n_cur = args.steps // args.curriculum_every + 1
        batches = rows.batches([(s, args.curriculum_length, args.curriculum_rows) for s in range(n_cur)])

    if args.eval_only:
        return {"eval": evaluate(model, maker, caches, args.eval, args.seed, tuple(args.agents))}
    rng = np.random.default_rng(args.seed)
    chosen = [s.weight if not args.agents or s.agent in args.agents else 0.0 for s in SCENES]
    weights = np.array(chosen) / sum(chosen)
    t0 = time.perf_counter()
    log: list[dict[str, Any]] = []
    acc: dict[str, list[float]] = {}
    step = 0
    try:
        for step in range(args.steps):
            if args.max_seconds and time.perf_counter() - t0 > args.max_seconds:
                print(f"stopping at step {step}: --max-seconds", flush=True)
                break
            opt.learning_rate = lr_at(args, step)
            scene = SCENES[int(rng.choice(len(SCENES), p=weights))]
            enc: Encoded = maker.encode(maker.example(scene, rng))
            split = enc.split
            prefix = enc.ids[:split]
            if args.max_prefix and len(prefix) > args.max_prefix:
                prefix = prefix[-args.max_prefix:]
            cache = caches.fresh_cache(prefix, step)
            suffix = mx.array(enc.ids[split:])[None]
            mask = mx.array(enc.mask[split:])[None]
            loss, grads = scene_grad(model, cache, suffix, mask, len(prefix))
            grads, _ = optim.clip_grad_norm(grads, 1.0)
            opt.update(model, grads)
            mx.eval(model.parameters(), opt.state, loss)
            acc.setdefault(f"{scene.agent}/{scene.target}", []).append(loss.item())
            if batches is not None and (step + 1) % args.curriculum_every == 0:
                ids, kinds = next(batches)
                (_, losses), grads = curriculum_grad(model, mx.array(ids), mx.array(kinds))
                grads, _ = optim.clip_grad_norm(grads, 1.0)
                opt.update(model, grads)
                mx.eval(model.parameters(), opt.state, losses)
                acc.setdefault("curriculum", []).append(losses["main"].item())
                del kinds
            if (step + 1) % args.log_every == 0:
                means = {k: float(np.mean(v)) for k, v in sorted(acc.items())}
                log.append({"step": step + 1, "seconds": time.perf_counter() - t0, **means})
                print(f"step {step + 1}  {time.perf_counter() - t0:.0f}s  lr {opt.learning_rate.item():.2e}  " +
                      "  ".join(f"{k} {v:.3f}" for k, v in means.items()), flush=True)
                acc = {}
    finally:
        if rows is not None:
            rows.close()
    size = save_checkpoint(model, args.out)
    seconds = time.perf_counter() - t0
    print(f"saved {args.out} ({size / 1e6:.1f} MB) after {step + 1} scene steps, {seconds:.0f}s", flush=True)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "steps": step + 1, "seconds": seconds, "log": log}
    if args.eval:
        caches.states.clear()  # the trained weights' prefixes
        result["eval"] = evaluate(model, maker, caches, args.eval, args.seed, tuple(args.agents))
    if args.metrics is not None:
        args.metrics.parent.mkdir(parents=True, exist_ok=True)
        args.metrics.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
