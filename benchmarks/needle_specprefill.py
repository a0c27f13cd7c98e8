"""SpecPrefill's quality cost, measured: needle retrieval on the trained small model, with and without it.

Model: `models/relay-tiny-coder` (a raw-completion model of Python source, 8 hybrid
layers, trained on 256-token windows of the CPython 3.11 stdlib; its README). Requests are raw
completions (token ids, no chat template), greedy, through the in-process `Relay` with the
prefix cache and MTP off.

Task: a haystack of real Python source -- the stdlib files the model never trained on (the 5 %
held out by `tools/train_small_mtp.py`, by the SHA-256 of their path), read from a random line
of a random held-out file onwards -- with a needle line

    MAGIC_CONSTANT_<k> = "<identifier>"

planted at a line start at a chosen depth (share of the prompt before it), and the prompt ends
with the question

    assert MAGIC_CONSTANT_<k> == "

so the greedy continuation should copy the identifier: two words joined by `_` (e.g.
`rope_hidden`), each one token of the model's 1,026-token vocabulary (rarer words are spelled
almost letter by letter, and the model copied none of them in a first try). Prompts are exactly
L tokens. Scores: `exact` (the continuation starts with the identifier, not followed by more
identifier characters) and `chars` (the share of the identifier's characters matched before the
first difference); against the `off` run of the same prompt, `same_as_off` (the whole greedy
continuation unchanged) and `first_same` (its first token). `control` is the chance level: the
same kind of prompt with a decoy needle (another identifier) planted, scored against the
identifier that is not there.

1. Sweep (SpecPrefill off): every length of `--sweep-lengths` x depth, `--sweep-trials` trials,
   to see whether (and up to which length) the model retrieves at all.
2. Main: at `--lengths` (default: the longest swept length whose baseline beats the sweep's
   floor -- `exact` at least `--min-exact` or `chars` at least `--min-chars` -- and the next
   longer swept length, where retrieval is already lost), `--trials` seeded trials per depth,
   each prompt run with SpecPrefill off, with every keep fraction of `--keeps` (the draft is the
   same checkpoint unless `--draft`; chunks of `--chunk-size`; the threshold below every prompt
   length), and as its `control`. A cell's first sweep-trials prompts are the sweep's (greedy:
   the `off` result is reused).
3. Needle kept? The report gives only how many tokens were kept, not which. The draft's scores
   are recomputed offline for each main prompt (`mlx_relay.engine.scoring.draft_scorer`, the engine's
   own scorer, after the server is closed) and `select_chunks` applied (after the anchors of the
   same rule, `--anchor-ngram`, by default the server's: `specprefill/anchors.py`; the usage
   reports how many chunks were anchored, `anchored_chunks`): `needle_kept` means every
   token of the needle line was in a kept chunk (the line often straddles two chunks),
   `needle_share_kept` is the mean share of its tokens kept. The recomputed kept count is
   checked against the server's report (`kept_match`).

    python benchmarks/needle_specprefill.py [--sweep-trials 20] [--trials 40] [--out DIR]
    python benchmarks/needle_specprefill.py --no-specprefill      # the baseline sweep alone

On a Linux CPU the script first re-executes itself with the BLAS shim of
`tools/train_small_mtp.py` preloaded (MLX's CPU wheel links the slow reference BLAS; the shim
forwards `cblas_sgemm` to numpy's OpenBLAS, about 4x faster here); `--no-blas-shim` skips it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from mlx_relay.bench.tables import rows_markdown

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

# candidate words of the identifier; those that are not one token of the tokenizer are dropped
WORDS = ("array attention axis embed experts group head hidden image input keys layer model norm output prefix "
         "prompt range rank rope shape time type value").split()
NEEDLE_NAME = "MAGIC_CONSTANT_"


# --------------------------------------------------------------------------- prompts

def held_out_texts() -> list[str]:
    """The stdlib files the model never trained on (train_small_mtp's split and filters)."""
    from train_small_mtp import corpus_files, is_held_out, rejection, stdlib_root

    root = stdlib_root()
    texts = []
    for path in corpus_files(root):
        rel = path.relative_to(root).as_posix()
        if not is_held_out(rel):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if rejection(text, rel) is None:
            texts.append(text)
    return texts


@dataclass(frozen=True)
class Prompt:
    length: int
    depth: float
    trial: int
    ids: list[int]
    answer: str  # the identifier
    needle: tuple[int, int]  # token range [a, b) of the needle line

    @property
    def key(self) -> str:
        return f"{self.length}/{self.depth:g}/{self.trial}"


class PromptMaker:
    def __init__(self, tokenizer: Any, texts: list[str], seed: int) -> None:
        self.tok = tokenizer
        self.lines = [t.splitlines(keepends=True) for t in texts]
        self.seed = seed
        self.words = [w for w in WORDS if len(self.enc(w)) == 1] or list(WORDS)

    def enc(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def _haystack(self, rng: random.Random, n_tokens: int) -> str:
        """Lines of held-out source from a random line of a random file on, about `n_tokens` + margin."""
        f = rng.randrange(len(self.lines))
        i = rng.randrange(max(len(self.lines[f]) - 20, 1))
        out: list[str] = []
        chars = 0
        while chars < 6 * n_tokens + 400:  # more than 4 characters per token in this tokenizer
            if i >= len(self.lines[f]):
                f, i = (f + 1) % len(self.lines), 0
                out.append("\n\n")
                continue
            out.append(self.lines[f][i])
            chars += len(self.lines[f][i])
            i += 1
        return "".join(out)

    def make(self, length: int, depth: float, trial: int, decoy: bool = False) -> Prompt:
        """Trial `trial`'s prompt; `decoy`: another identifier is planted (the control)."""
        rng = random.Random(f"{self.seed}/{length}/{depth:g}/{trial}")
        k = rng.randrange(100, 1000)
        answer = self._identifier(rng)
        planted = answer
        while decoy and planted == answer:
            planted = self._identifier(rng)
        needle = self.enc(f'{NEEDLE_NAME}{k} = "{planted}"\n')
        query = self.enc(f'\nassert {NEEDLE_NAME}{k} == "')
        body = length - len(needle) - len(query)
        hay = self._haystack(rng, body)
        # the needle goes at the line start nearest to `depth` of the body
        hay_ids = self.enc(hay)
        cut_tok = min(round(depth * body), len(hay_ids))
        cut_char = len(self.tok.decode(hay_ids[:cut_tok]))
        line_start = hay.rfind("\n", 0, max(cut_char, 1)) + 1
        before = self.enc(hay[:line_start])
        after = self.enc(hay[line_start:])[:body - len(before)]
        ids = before + needle + after + query
        if len(ids) != length:
            raise RuntimeError(f"prompt of {len(ids)} tokens, not {length}")
        return Prompt(length, depth, trial, ids, answer, (len(before), len(before) + len(needle)))

    def _identifier(self, rng: random.Random) -> str:
        return f"{rng.choice(self.words)}_{rng.choice(self.words)}"


# --------------------------------------------------------------------------- scoring

def score(text: str, answer: str) -> dict[str, Any]:
    common = 0
    for a, b in zip(text, answer, strict=False):
        if a != b:
            break
        common += 1
    rest = text[len(answer):len(answer) + 1]
    exact = text.startswith(answer) and not (rest.isalnum() or rest == "_")
    return {"exact": exact, "chars": common / len(answer)}


async def run_prompt(relay: Any, p: Prompt, mode: str, max_tokens: int, specprefill: bool,
                     anchor_ngram: int | None = None) -> dict[str, Any]:
    """One greedy raw completion; `specprefill` False: the server has no draft (no such fields sent);
    `anchor_ngram`: SpecPrefill's anchor n-gram length (None: the server's, 0: no anchors)."""
    kw: dict[str, Any] = {}
    if mode in ("off", "control"):
        kw = {"specprefill": False} if specprefill else {}
    else:
        kw = {"specprefill": True, "specprefill_keep": float(mode.removeprefix("keep=")),
              "specprefill_anchor_ngram": anchor_ngram}
    res = await relay.chat([], prompt=p.ids, max_tokens=max_tokens, temperature=0.0, mtp=False, **kw)
    row: dict[str, Any] = {"key": p.key, "mode": mode, "text": res.raw_text, "ids": list(res.token_ids),
                           **score(res.raw_text, p.answer), "prompt_tokens": res.usage.prompt_tokens}
    report = getattr(res, "specprefill", None)
    if report is not None:
        row.update(ran=report.ran, scored_tokens=report.scored_tokens, kept_tokens=report.kept_tokens,
                   fallback=report.fallback, anchored_chunks=report.anchored_chunks,
                   anchors_rescued=report.anchors_rescued)
    return row


# --------------------------------------------------------------------------- phases

def modes_for(keeps: Sequence[float]) -> list[str]:
    return ["off", *(f"keep={k:g}" for k in keeps), "control"]


async def sweep(relay: Any, maker: PromptMaker, args: argparse.Namespace, cache: dict[str, dict[str, Any]],
                tic: float) -> list[dict[str, Any]]:
    rows = []
    for n in parse_ints(args.sweep_lengths):
        for d in parse_floats(args.depths):
            for t in range(args.sweep_trials):
                p = maker.make(n, d, t)
                cache[p.key] = {**await run_prompt(relay, p, "off", answer_tokens(maker, p),
                                                   not args.no_specprefill), "answer": p.answer}
                rows.append(cache[p.key])
            cell = [cache[maker.make(n, d, t).key] for t in range(args.sweep_trials)]
            print(f"sweep L={n} depth={d:g}: exact {mean(r['exact'] for r in cell):.3f} "
                  f"chars {mean(r['chars'] for r in cell):.3f} ({time.perf_counter() - tic:.0f}s)", flush=True)
    return rows


async def main_phase(relay: Any, maker: PromptMaker, lengths: list[int], args: argparse.Namespace,
                     cache: dict[str, dict[str, Any]], tic: float) -> tuple[list[dict[str, Any]], list[Prompt]]:
    rows: list[dict[str, Any]] = []
    prompts: list[Prompt] = []
    modes = modes_for(parse_floats(args.keeps))
    for n in lengths:
        for d in parse_floats(args.depths):
            for t in range(args.trials):
                p = maker.make(n, d, t)
                prompts.append(p)
                for m in modes:
                    if m == "off" and p.key in cache:
                        row = dict(cache[p.key])
                    else:
                        q = maker.make(n, d, t, decoy=True) if m == "control" else p
                        row = {**await run_prompt(relay, q, m, answer_tokens(maker, p), True, args.anchor_ngram),
                               "answer": p.answer}
                    rows.append({**row, "length": n, "depth": d, "trial": t, "needle": list(p.needle)})
            cell = [r for r in rows if r["length"] == n and r["depth"] == d]
            line = "  ".join(f"{m} {mean(r['exact'] for r in cell if r['mode'] == m):.3f}" for m in modes)
            print(f"main L={n} depth={d:g}: exact {line} ({time.perf_counter() - tic:.0f}s)", flush=True)
    return rows, prompts


def infer_kept(args: argparse.Namespace, tokenizer: Any, prompts: list[Prompt]) -> dict[str, dict[str, Any]]:
    """Per prompt and keep fraction: the chunks the server kept, recomputed with its own scorer."""
    from mlx_relay.config import SpecPrefillConfig
    from mlx_relay.engine.scoring.draft_scorer import DraftScorer
    from mlx_relay.specprefill.anchors import anchor_chunks, anchor_rule
    from mlx_relay.specprefill.selection import select_chunks

    scorer = DraftScorer.load(Path(args.draft or args.model), tokenizer)
    window = args.query_window or 16
    rule = anchor_rule(SpecPrefillConfig(), args.anchor_ngram)  # the server's rule, as the requests asked
    out: dict[str, dict[str, Any]] = {}
    for p in prompts:
        job = scorer.start(p.ids, chunk=args.prefill_step_size, window=window)
        scores = None
        while scores is None:
            scores = job.step()
        per: dict[str, Any] = {}
        anchors = frozenset() if rule is None else anchor_chunks(p.ids, start=0, chunk_size=args.chunk_size,
                                                                 rule=rule)
        for k in parse_floats(args.keeps):
            sparse = select_chunks(scores, start=0, chunk_size=args.chunk_size, keep_fraction=k,
                                   anchors=anchors).sparse
            a, b = p.needle
            inside = sum(min(b, y) - max(a, x) for x, y in sparse.ranges if y > a and x < b)
            per[f"keep={k:g}"] = {"kept": sparse.kept, "needle_kept": inside == b - a,
                                  "needle_share_kept": inside / (b - a)}
        out[p.key] = per
    return out


# --------------------------------------------------------------------------- summaries

def summarize_sweep(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cells: dict[tuple[int, float], list[dict[str, Any]]] = {}
    for r in rows:
        n, d, _ = r["key"].split("/")
        cells.setdefault((int(n), float(d)), []).append(r)
    return [{"length": n, "depth": d, "trials": len(rs), "exact": round(mean(r["exact"] for r in rs), 3),
             "chars": round(mean(r["chars"] for r in rs), 3)} for (n, d), rs in sorted(cells.items())]


def summarize_main(rows: list[dict[str, Any]], kept: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    off = {r["key"]: r for r in rows if r["mode"] == "off"}
    groups: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["length"], f"{r['depth']:g}", r["mode"]), []).append(r)
        groups.setdefault((r["length"], "all", r["mode"]), []).append(r)
    order = {"off": 0, "control": 2}
    for (n, d, m), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] == "all", kv[0][1],
                                                                order.get(kv[0][2], 1), kv[0][2])):
        row: dict[str, Any] = {"length": n, "depth": d, "mode": m, "trials": len(rs),
                               "exact": round(mean(r["exact"] for r in rs), 3),
                               "chars": round(mean(r["chars"] for r in rs), 3),
                               "same_as_off": round(mean(r["ids"] == off[r["key"]]["ids"] for r in rs), 3)
                               if m != "control" else "",
                               "first_same": round(mean(r["ids"][:1] == off[r["key"]]["ids"][:1] for r in rs), 3)
                               if m != "control" else ""}
        if m.startswith("keep="):
            row["kept_share"] = round(mean(r.get("kept_tokens", 0) / r["prompt_tokens"] for r in rs), 3)
            row["fallbacks"] = sum(1 for r in rs if r.get("fallback"))
            infos = [kept[r["key"]][m] for r in rs if r["key"] in kept]
            if infos:
                hit = [r for r in rs if r["key"] in kept and kept[r["key"]][m]["needle_kept"]]
                miss = [r for r in rs if r["key"] in kept and not kept[r["key"]][m]["needle_kept"]]
                row["needle_kept"] = round(mean(i["needle_kept"] for i in infos), 3)
                row["needle_share_kept"] = round(mean(i["needle_share_kept"] for i in infos), 3)
                row["exact_if_kept"] = round(mean(r["exact"] for r in hit), 3) if hit else ""
                row["exact_if_dropped"] = round(mean(r["exact"] for r in miss), 3) if miss else ""
                row["kept_match"] = round(mean(kept[r["key"]][m]["kept"] == r.get("kept_tokens") for r in rs
                                               if r["key"] in kept), 3)
        out.append(row)
    return out



def verdict(sweep_rows: list[dict[str, Any]], main_rows: list[dict[str, Any]]) -> str:
    best = max((r["exact"] for r in sweep_rows), default=0.0)
    by_len: dict[int, list[float]] = {}
    for r in sweep_rows:
        by_len.setdefault(r["length"], []).append(r["exact"])
    per_len = ", ".join(f"L={n}: {mean(xs):.3f}" for n, xs in sorted(by_len.items()))
    if best == 0.0:
        lines = ["**The baseline model does not retrieve the needle at any swept length or depth (exact 0).** "
                 "The SpecPrefill rows are then no measure of retrieval lost; only `chars` against the "
                 "control and `same_as_off` (how often the greedy output is unchanged) say anything."]
    else:
        lines = [f"Baseline retrieval (SpecPrefill off), exact by length over the depths: {per_len} "
                 f"(best cell {best:.3f})."]
    for r in main_rows:
        if r["depth"] == "all" and r["mode"].startswith("keep="):
            off, ctl = (next(o for o in main_rows if o["length"] == r["length"] and o["depth"] == "all"
                             and o["mode"] == m) for m in ("off", "control"))
            lines.append(f"L={r['length']} {r['mode']}: exact {r['exact']} / chars {r['chars']}; off {off['exact']} / "
                         f"{off['chars']}; chance (control) {ctl['exact']} / {ctl['chars']}; needle kept "
                         f"{r.get('needle_kept', '?')}, its tokens {r.get('needle_share_kept', '?')} (prompt kept "
                         f"{r.get('kept_share', '?')}); "
                         f"greedy output unchanged {r['same_as_off']}, first token unchanged {r['first_same']}.")
    return "\n".join(f"- {x}" for x in lines)


# --------------------------------------------------------------------------- helpers

def answer_tokens(maker: PromptMaker, p: Prompt) -> int:
    return len(maker.enc(p.answer + '"')) + 3


def per_prompt(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows regrouped by prompt: its answer, the needle's token range, each mode's greedy text
    and kept tokens (the scores follow from text and answer; keeps the JSON small)."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        p = out.setdefault(r["key"], {"key": r["key"], "answer": r["answer"], "needle": r.get("needle"),
                                      "text": {}, "kept_tokens": {}})
        p["text"][r["mode"]] = r["text"]
        if r.get("kept_tokens") is not None and r["mode"].startswith("keep="):
            p["kept_tokens"][r["mode"]] = r["kept_tokens"]
        if r.get("fallback"):
            p.setdefault("fallback", {})[r["mode"]] = r["fallback"]
    return list(out.values())


def dump_json(body: dict[str, Any]) -> str:
    """JSON with one line per list item at the top level."""
    parts = []
    for k, v in body.items():
        if isinstance(v, list):
            items = ",\n  ".join(json.dumps(x, default=str) for x in v)
            parts.append(f"{json.dumps(k)}: [\n  {items}\n ]")
        else:
            parts.append(f"{json.dumps(k)}: {json.dumps(v, indent=1, default=str)}")
    return "{\n " + ",\n ".join(parts) + "\n}\n"


def file_sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "absent"


def mean(xs: Any) -> float:
    xs = [float(x) for x in xs]
    return statistics.fmean(xs) if xs else float("nan")


def parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def parse_floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def pick_lengths(args: argparse.Namespace, sweep_rows: list[dict[str, Any]]) -> list[int]:
    """`--lengths`, or the longest swept length above the floor and the next longer one."""
    if args.lengths:
        return parse_ints(args.lengths)
    cells: dict[int, list[dict[str, Any]]] = {}
    for r in sweep_rows:
        cells.setdefault(r["length"], []).append(r)
    swept = sorted(cells)
    good = [n for n in swept if mean(r["exact"] for r in cells[n]) >= args.min_exact
            or mean(r["chars"] for r in cells[n]) >= args.min_chars]
    if not good:
        return swept[:2]
    i = swept.index(good[-1])
    return swept[i:i + 2]


# --------------------------------------------------------------------------- main

async def amain(args: argparse.Namespace) -> None:
    import mlx.core as mx
    from transformers import AutoTokenizer

    from mlx_relay.relay import Relay

    tic = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    maker = PromptMaker(tokenizer, held_out_texts(), args.seed)
    print(f"{len(maker.lines)} held-out files ({time.perf_counter() - tic:.0f}s)", flush=True)
    lengths = parse_ints(args.sweep_lengths) + parse_ints(args.lengths)
    overrides: dict[str, Any] = {"prefix_cache": False, "mtp": False, "max_num_seqs": 1, "warmup": True,
                                 "prefill_step_size": args.prefill_step_size}
    if not args.no_specprefill:
        overrides.update(specprefill_draft_model=str(args.draft or args.model),
                         specprefill_threshold=max(min(lengths) // 2, 1), specprefill_chunk_size=args.chunk_size)
        if args.query_window:
            overrides["specprefill_query_window"] = args.query_window
    cache: dict[str, dict[str, Any]] = {}
    main_rows: list[dict[str, Any]] = []
    prompts: list[Prompt] = []
    async with Relay.start(str(args.model), **overrides) as relay:
        sweep_rows = await sweep(relay, maker, args, cache, tic)
        sweep_summary = summarize_sweep(sweep_rows)
        main_lengths = pick_lengths(args, sweep_summary)
        if not args.no_specprefill:
            print(f"main phase at lengths {main_lengths}", flush=True)
            main_rows, prompts = await main_phase(relay, maker, main_lengths, args, cache, tic)
    kept: dict[str, dict[str, Any]] = {}
    if prompts and not args.no_infer_kept:
        try:
            kept = infer_kept(args, tokenizer, prompts)
        except Exception as exc:  # the engine's internals moved: the rest of the report stands
            print(f"note: could not recompute the kept chunks: {type(exc).__name__}: {exc}", file=sys.stderr)
    main_summary = summarize_main(main_rows, kept) if main_rows else []
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "model": str(args.model),
            "model_sha256": file_sha256(args.model / "model.safetensors"),
            "draft": None if args.no_specprefill else str(args.draft or args.model),
            "device": repr(mx.default_device()), "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": sys.version, "blas_shim": bool(os.environ.get("SMALL_MTP_BLAS_SHIM")),
            "relay_overrides": overrides, "main_lengths": main_lengths,
            "args": {k: str(v) for k, v in vars(args).items()}, "wall_s": round(time.perf_counter() - tic, 1)}
    text = (f"# Needle retrieval with and without SpecPrefill ({meta['date'][:10]}, {meta['device']})\n\n"
            f"{verdict(sweep_summary, main_summary)}\n\n"
            f"## Sweep (SpecPrefill off)\n\n{rows_markdown(sweep_summary)}\n\n"
            f"## Main (same prompts, every mode)\n\n{rows_markdown(main_summary)}\n")
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        body = {"meta": meta, "sweep": sweep_summary, "main": main_summary, "sweep_prompts": per_prompt(sweep_rows),
                "main_prompts": per_prompt(main_rows), "needle_kept": kept}
        (args.out / "needle.json").write_text(dump_json(body))
        (args.out / "needle.md").write_text(text)
        print(f"wrote {args.out}/needle.json and needle.md")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "relay-tiny-coder")
    ap.add_argument("--draft", type=Path, default=None, help="SpecPrefill's draft (default: the model itself)")
    ap.add_argument("--no-specprefill", action="store_true", help="the baseline sweep alone")
    ap.add_argument("--sweep-lengths", default="256,512,1024,2048,3500",
                    help="256 is the model's training window; the model's context is 4,096")
    ap.add_argument("--depths", default="0.1,0.5,0.9", help="share of the prompt before the needle")
    ap.add_argument("--sweep-trials", type=int, default=20)
    ap.add_argument("--lengths", default="", help="main-phase lengths (default: picked from the sweep)")
    ap.add_argument("--min-exact", type=float, default=0.05, help="the sweep's floor for a main length (exact)")
    ap.add_argument("--min-chars", type=float, default=0.1, help="... or (chars)")
    ap.add_argument("--trials", type=int, default=40, help="main-phase trials per length and depth")
    ap.add_argument("--keeps", default="0.3,0.5")
    ap.add_argument("--chunk-size", type=int, default=32)
    ap.add_argument("--query-window", type=int, default=0, help="0: the server's default (16)")
    ap.add_argument("--anchor-ngram", type=int, default=None,
                    help="SpecPrefill's anchor n-gram length, per request (default: the server's; 0: no anchors)")
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-infer-kept", action="store_true", help="skip recomputing which chunks were kept")
    ap.add_argument("--no-blas-shim", action="store_true")
    ap.add_argument("--out", type=Path,
                    default=REPO / "benchmarks" / "results" / f"needle-specprefill-cpu-{datetime.now().date()}")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    if not args.no_blas_shim:
        import mlx.core as mx

        if mx.default_device().type == mx.cpu:
            from train_small_mtp import reexec_with_blas_shim

            reexec_with_blas_shim()
    import anyio

    anyio.run(amain, args)


if __name__ == "__main__":
    main()
