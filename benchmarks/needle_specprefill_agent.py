"""SpecPrefill's quality cost on the trained agent model (issue 19, point 4).

Offline benchmark on the in-process API (:class:`mlx_relay.relay.Relay`: the whole actor graph,
the SpecPrefillScorer and the engine's scoring stage), greedy, prefix cache off, MTP on.

Task: the held-out chat needles of ``tools/agent_curriculum.py`` (split 1, never trained on): a
user message of about L tokens of CPython stdlib source (PSF-2.0; held-out files) with one to six
``The code for <key> is <value>.`` lines, the asked one at a chosen depth (the share of the
filler before it), ending ``What is the code for <key>? Answer with the code only.`` A reply is
right when the text after ``</think>`` is exactly the value (``eval_agent_model.score_needle``).

Every prompt runs with SpecPrefill off and at each keep fraction of ``--keeps``, with each draft of
``--draft`` (default: the target itself; relay-tiny-coder, hidden 192 and trained on 256-token
windows, is the smaller one in the package). SpecPrefill is forced on per request
(``specprefill: true``), so the server's length threshold plays no part. Per cell: exact-match
rate, the mean tokens the target prefilled, and the mean time to the first token (on this
machine's CPU; the GPU TTFT gain is ``benchmarks/gpu/device_specprefill.sh``'s table).

    python benchmarks/needle_specprefill_agent.py --trials 10 --out benchmarks/results/DIR
    python benchmarks/needle_specprefill_agent.py --lengths 4096 --depths 0.5 --trials 2   # smoke

``--server-arg KEY=VALUE`` passes more server settings (``Relay.start`` overrides, e.g.
``specprefill_anchor_ngram=0``) to every server, and is written into the results.

On a Linux CPU the script first re-executes itself with the BLAS shim of
``tools/train_small_mtp.py`` preloaded (MLX's CPU wheel links the slow reference BLAS);
``--no-blas-shim`` skips it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / "tools"
AGENT = REPO / "mlx_relay" / "models" / "relay-tiny-agent"


@dataclass
class Cell:
    """One (draft, length, depth, setting) cell's tallies."""

    ok: int = 0
    n: int = 0
    prefilled: list[int] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {"ok": self.ok, "n": self.n, "rate": self.ok / self.n if self.n else float("nan"),
                "prefilled_mean": statistics.fmean(self.prefilled) if self.prefilled else None,
                "ttft_mean_s": statistics.fmean(self.ttft) if self.ttft else None}


def parse_value(text: str) -> Any:
    """A --server-arg value: JSON when it parses (numbers, booleans), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


async def run_draft(args: argparse.Namespace, draft: Path, with_off: bool) -> dict[str, Cell]:
    """Every prompt of the grid through one server whose SpecPrefill draft is ``draft``."""
    sys.path.insert(0, str(TOOLS))
    from agent_curriculum import HELD_OUT, Curriculum, Mix, StdlibFiller
    from eval_agent_model import score_needle

    from mlx_relay.messages.gpu import Finished, TokenDelta
    from mlx_relay.relay import Relay
    from mlx_relay.service import ChatRequest

    cur = Curriculum(args.model, StdlibFiller(args.stdlib), Mix(no_think=0.0), seed=args.seed)
    extra = dict(args.server_args)
    cells: dict[str, Cell] = {}
    settings: list[float | None] = ([None] if with_off else []) + list(args.keeps)
    async with Relay.start(args.model, prefix_cache=False, specprefill_draft_model=str(draft), **extra) as relay:
        for length in args.lengths:
            for depth in args.depths:
                for trial in range(args.trials):
                    ex = cur.example(HELD_OUT, trial, "needle", length, depth)
                    assert ex.answer is not None
                    for keep in settings:
                        sp = {"specprefill": False} if keep is None else {"specprefill": True, "specprefill_keep": keep}
                        req = msgspec.convert({"messages": msgspec.to_builtins(ex.prompt_messages()),
                                               "max_tokens": 48, "temperature": 0.0, "enable_thinking": True, **sp},
                                              ChatRequest)
                        t0 = time.perf_counter()
                        first: float | None = None
                        parts: list[str] = []
                        done: Finished | None = None
                        async with relay.generate(req) as events:
                            async for ev in events:
                                if isinstance(ev, TokenDelta):
                                    first = first if first is not None else time.perf_counter() - t0
                                    parts.append(ev.text)
                                elif isinstance(ev, Finished):
                                    done = ev
                        name = "off" if keep is None else f"keep {keep:g}"
                        cell = cells.setdefault(f"{length}|{depth:g}|{name}", Cell())
                        cell.n += 1
                        cell.ok += score_needle("".join(parts), ex.answer, True)
                        report = done.specprefill if done is not None else None
                        prompt = done.prompt_tokens if done is not None else length
                        ran = report is not None and report.ran
                        cell.prefilled.append(prompt - report.scored_tokens + report.kept_tokens if ran else prompt)
                        if first is not None:
                            cell.ttft.append(first)
                    print(f"  {draft.name} L={length} depth={depth:g} trial {trial}: "
                          + ", ".join(f"{k.split('|')[2]} {c.ok}/{c.n}" for k, c in cells.items()
                                      if k.startswith(f"{length}|{depth:g}|")), flush=True)
    return cells


def rate(cells: dict[str, Any], length: int, depth: float | str, name: str) -> str:
    """``ok/n`` over the cells of one length and setting, at one depth or ``"all"``."""
    picked = [c for key, c in cells.items() if key.startswith(f"{length}|") and key.endswith(f"|{name}")
              and (depth == "all" or key.split("|")[1] == f"{depth:g}")]
    ok, n = sum(c["ok"] for c in picked), sum(c["n"] for c in picked)
    return f"{ok}/{n}" if n else "-"


def table(results: dict[str, Any], keeps: list[float]) -> str:
    """Markdown: per length and depth, exact-match rate off and per draft and keep."""
    drafts = list(results["drafts"])
    heads = ["length", "depth", "off"] + [f"{d} keep {k:g}" for d in drafts for k in keeps]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    off = results["off"]
    for length in results["lengths"]:
        for depth in [*results["depths"], "all"]:
            row = [str(length), str(depth), rate(off, length, depth, "off")]
            row += [rate(results["drafts"][d], length, depth, f"keep {k:g}") for d in drafts for k in keeps]
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "| length | setting | tokens prefilled (mean) | TTFT mean, this CPU (s) |", "|---|---|---:|---:|"]
    settings = [("off", off)] + [(f"{d} keep {k:g}", results["drafts"][d]) for d in drafts for k in keeps]
    for length in results["lengths"]:
        for label, cells in settings:
            name = label.rsplit(" ", 2)[-2] + " " + label.rsplit(" ", 1)[-1] if label != "off" else "off"
            picked = [c for key, c in cells.items() if key.startswith(f"{length}|") and key.endswith(f"|{name}")]
            pre = [c["prefilled_mean"] for c in picked if c["prefilled_mean"] is not None]
            ttft = [c["ttft_mean_s"] for c in picked if c["ttft_mean_s"] is not None]
            lines.append(f"| {length} | {label} | {statistics.fmean(pre):.0f} | {statistics.fmean(ttft):.2f} |"
                         if pre and ttft else f"| {length} | {label} | - | - |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=AGENT)
    ap.add_argument("--draft", type=Path, action="append", default=None,
                    help="a SpecPrefill draft (repeatable; default: the target itself)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--keeps", type=float, nargs="+", default=[0.5, 0.3, 0.2])
    ap.add_argument("--trials", type=int, default=10, help="prompts per length and depth")
    ap.add_argument("--seed", type=int, default=0, help="the curriculum's seed (the model's training seed)")
    ap.add_argument("--stdlib", type=Path, default=None, help="the stdlib filler's root (default: this Python's)")
    ap.add_argument("--server-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", type=Path, default=None, help="write results.json and results.md here")
    ap.add_argument("--no-blas-shim", action="store_true")
    args = ap.parse_args(argv)
    args.server_args = {k: parse_value(v) for k, _, v in (a.partition("=") for a in args.server_arg)}
    drafts = args.draft or [args.model]
    t0 = time.perf_counter()
    per_draft: dict[str, dict[str, Cell]] = {}
    off: dict[str, Cell] = {}
    for i, draft in enumerate(drafts):
        cells = anyio.run(run_draft, args, draft, i == 0)
        off.update({k: c for k, c in cells.items() if k.endswith("|off")})
        per_draft[draft.name] = {k: c for k, c in cells.items() if not k.endswith("|off")}
    results: dict[str, Any] = {
        "model": str(args.model), "lengths": args.lengths, "depths": args.depths, "keeps": args.keeps,
        "trials": args.trials, "server_args": args.server_args, "seconds": round(time.perf_counter() - t0, 1),
        "off": {k: c.row() for k, c in off.items()},
        "drafts": {name: {k: c.row() for k, c in cells.items()} for name, cells in per_draft.items()},
    }
    md = table(results, args.keeps)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        (args.out / "results.md").write_text(md + "\n", encoding="utf-8")
    return results


if __name__ == "__main__":
    if "--no-blas-shim" not in sys.argv[1:] and sys.platform == "linux":
        sys.path.insert(0, str(TOOLS))
        from train_small_mtp import reexec_with_blas_shim

        reexec_with_blas_shim()
    main()
