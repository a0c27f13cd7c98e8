"""SpecPrefill's anchor rule, measured without a model: its cost, and which chunks it anchors.

No draft and no target run here; the rule reads token ids only (`mlx_relay/specprefill/anchors.py`).

1. Cost: `anchor_chunks` (rule 4-grams, query 64, cap 8) and `select_chunks` on a random prompt
   of `--time-tokens` token ids (default 128K and 256K, ids below Qwen3.5's 248,044) whose
   query's 4-grams are planted 3 times each in the context (so the exact checks and the budget
   run too), the median and the least of `--repeats` runs, on one core (numpy and Python), with
   the machine's load average (on a shared machine the least is the cost, the median the wait).
2. What it anchors, in Qwen3.5's real tokenizer (the cached build of `mlx_relay.testing.qwen_vocab`)
   and chat template, or `--tokenizer`'s, for each n-gram length x query tokens x occurrence cap x
   follow:
   * `needle`: the evaluation's key-value prompts (`tools/agent_curriculum.py`, held-out split,
     stdlib filler, "The code for ABC-12 is 123456." lines, then "What is the code for ABC-12?");
     `found`: the needle line's chunks (the key's and the value's) are all anchors;
   * `code`: a coding agent's turn: this repository's own source files in the user's first
     message (`# file: PATH` headers), an assistant reply, then a question naming a function
     defined in them and its file; `found`: the chunk of its `def NAME(` line is an anchor.
   `anchors` is the mean number of anchor chunks per prompt (chunks of 64 tokens, the first and
   last aside); the keep budget of a 0.3 selection is `budget`.

    python benchmarks/specprefill_anchors.py [--lengths 8192,32768] [--n 20] [--out FILE.json]
    python benchmarks/specprefill_anchors.py --tokenizer mlx_relay/models/relay-tiny-agent --lengths 4096,8192
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlx_relay.messages.specprefill import AnchorRule
from mlx_relay.specprefill.anchors import anchor_chunks
from mlx_relay.specprefill.selection import select_chunks

REPO = Path(__file__).resolve().parent.parent
CHUNK = 64


def time_rule(tokens: int, repeats: int) -> dict[str, float]:
    rng = random.Random(0)
    ids = [rng.randrange(0, 248_044) for _ in range(tokens)]
    query = ids[-64:]
    for k in range(61):
        for _ in range(3):
            at = rng.randrange(0, tokens - 256)
            ids[at:at + 4] = query[k:k + 4]
    scores = [rng.random() for _ in range(tokens)]
    rule = AnchorRule(4, 64, 8)
    anchor_s, select_s, plain_s = [], [], []
    anchors: frozenset[int] = frozenset()
    for _ in range(repeats):
        t0 = time.perf_counter()
        anchors = anchor_chunks(ids, start=0, chunk_size=CHUNK, rule=rule)
        t1 = time.perf_counter()
        select_chunks(scores, start=0, chunk_size=CHUNK, keep_fraction=0.3, anchors=anchors)
        t2 = time.perf_counter()
        select_chunks(scores, start=0, chunk_size=CHUNK, keep_fraction=0.3)
        t3 = time.perf_counter()
        anchor_s.append(t1 - t0)
        select_s.append(t2 - t1)
        plain_s.append(t3 - t2)
    ms = lambda xs: {"median": round(1e3 * statistics.median(xs), 2), "min": round(1e3 * min(xs), 2)}  # noqa: E731
    return {"tokens": tokens, "anchor_chunks_ms": ms(anchor_s), "select_with_anchors_ms": ms(select_s),
            "select_without_ms": ms(plain_s), "anchors": len(anchors), "load_average": os.getloadavg()[0]}


def token_span(tok: Any, ids: Sequence[int], piece: str, after: int = 0) -> tuple[int, int] | None:
    """The tokens [a, b) of `ids` that hold the first occurrence of `piece` at or after character
    `after` of their text (character offsets by decoding token by token)."""
    ends, size = [], 0
    for t in ids:
        size += len(tok.decode([t]))
        ends.append(size)
    text = tok.decode(list(ids))
    at = text.find(piece, after)
    if at < 0 or size != len(text):
        return None
    a = next(i for i, e in enumerate(ends) if e > at)
    b = next(i for i, e in enumerate(ends) if e >= at + len(piece)) + 1
    return a, b


def needle_cases(tokenizer: Path, lengths: list[int], n: int) -> list[tuple[str, list[int], set[int]]]:
    """(name, prompt ids, the needle line's chunk indices) per held-out needle prompt."""
    sys.path.insert(0, str(REPO / "tools"))
    from agent_curriculum import HELD_OUT, Curriculum, StdlibFiller

    cur = Curriculum(tokenizer, StdlibFiller())
    cases = []
    for length in lengths:
        for i in range(n):
            ex = cur.example(HELD_OUT, i, "needle", length)
            ids = cur.prompt_ids(ex, ex.prompt_messages())
            key = ex.prompt_messages()[-1].content.rsplit("What is the code for ", 1)[1].split("?")[0]
            span = token_span(cur.tokenizer, ids, f"The code for {key} is {ex.answer}.")
            if span is None:
                continue
            cases.append((f"needle@{length}", ids, set(range(span[0] // CHUNK, (span[1] - 1) // CHUNK + 1))))
    return cases


def code_cases(tokenizer: Path, lengths: list[int], n: int) -> list[tuple[str, list[int], set[int]]]:
    """(name, prompt ids, the chunk of the asked function's `def` line) per coding-agent prompt."""
    from mlx_relay.actors.normalizer import load_tokenizer
    from mlx_relay.chat.prompt_render import PromptRenderer
    from mlx_relay.chat.types import ChatMessage
    from mlx_relay.messages.prompt import Render

    tok = load_tokenizer(tokenizer)
    renderer = PromptRenderer(tok, "qwen3_coder")
    files = sorted((REPO / "mlx_relay").rglob("*.py"))
    cases = []
    for length in lengths:
        for i in range(n):
            rng = random.Random(f"{length}/{i}")
            order = rng.sample(files, len(files))
            parts, size = [], 0
            for f in order:
                text = f.read_text(encoding="utf-8")
                parts.append((f.relative_to(REPO).as_posix(), text))
                size += len(text) // 4
                if size > length * 0.9:
                    break
            defs = [(path, line.split("def ", 1)[1].split("(", 1)[0]) for path, text in parts
                    for line in text.splitlines() if line.startswith("def ") and "(" in line]
            path, name = rng.choice(defs)
            body = "".join(f"# file: {p}\n{t}\n" for p, t in parts)
            question = (f"In {path}, `{name}` is not doing what I expected. What does {name} return, and "
                        f"which callers depend on it? Answer briefly.")
            msgs = [ChatMessage("system", "You are a coding agent working in this repository."),
                    ChatMessage("user", f"Here are the files you asked for.\n\n{body}"),
                    ChatMessage("assistant", "I have read them. What should I look at?"),
                    ChatMessage("user", question)]
            ids = renderer.render(Render(msgs, None, {"enable_thinking": True})).token_ids
            text = tok.decode(ids)
            span = token_span(tok, ids, f"def {name}", max(text.find(f"# file: {path}\n"), 0))
            if span is None:
                continue
            cases.append((f"code@{length}", ids, set(range(span[0] // CHUNK, (span[1] - 1) // CHUNK + 1))))
    return cases


def study(cases: list[tuple[str, list[int], set[int]]], ngrams: list[int], queries: list[int],
          caps: list[int], follows: list[int]) -> list[dict[str, Any]]:
    rows = []
    for kind in sorted({c[0] for c in cases}):
        group = [c for c in cases if c[0] == kind]
        for n in ngrams:
            for q in queries:
                for cap, follow in ((c, f) for c in caps for f in follows):
                    rule = AnchorRule(n, q, cap, follow)
                    found, counts = [], []
                    for _, ids, target in group:
                        chunks = math.ceil(len(ids) / CHUNK)
                        got = {c for c in anchor_chunks(ids, start=0, chunk_size=CHUNK, rule=rule)
                               if 0 < c < chunks - 1}
                        counts.append(len(got))
                        found.append(target <= got | {0})
                    budget = max(2, math.ceil(0.3 * math.ceil(len(group[0][1]) / CHUNK))) - 2
                    rows.append({"prompts": kind, "n": len(group), "ngram": n, "query_tokens": q,
                                 "max_occurrences": cap, "follow": follow, "found": round(statistics.fmean(found), 3),
                                 "anchors": round(statistics.fmean(counts), 1), "anchors_max": max(counts),
                                 "budget": budget})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-tokens", default="131072,262144", help="prompt lengths of the cost measurement")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--n", type=int, default=20, help="prompts per kind and length")
    ap.add_argument("--ngrams", default="2,3,4,5,6,8")
    ap.add_argument("--query-tokens", default="32,64,128")
    ap.add_argument("--caps", default="4,8,16")
    ap.add_argument("--follows", default="0,8,16")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a checkpoint directory whose tokenizer and chat template to use (default: Qwen3.5's)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    timing = [time_rule(n, args.repeats) for n in ints(args.time_tokens)]
    for t in timing:
        print(json.dumps(t), flush=True)
    lengths = ints(args.lengths)
    if args.tokenizer is None:
        from mlx_relay.testing.qwen_vocab import qwen35_tokenizer_path

        args.tokenizer = qwen35_tokenizer_path()
    cases = needle_cases(args.tokenizer, lengths, args.n) + code_cases(args.tokenizer, lengths, args.n)
    rows = study(cases, ints(args.ngrams), ints(args.query_tokens), ints(args.caps),
                 ints(args.follows))
    from mlx_relay.bench.tables import rows_markdown

    print(rows_markdown(rows))
    if args.out is not None:
        args.out.write_text(json.dumps({"tokenizer": str(args.tokenizer), "timing": timing, "rows": rows},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
