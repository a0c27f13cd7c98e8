"""What MTP buys a request under the lazy tool grammar (issue 30.2), end to end through the Relay,
on the embedded model (or MODEL_DIR), on whatever backend runs it (the CPU here).

An agent-shaped request (a system prompt, a user turn, two tools, `tool_choice` "auto", greedy)
decodes three ways, alternated over `--repeats` passes (a warm-up request each first):

  grammar_mtp    the default server: the lazy tool grammar, applied inside the MTP round
  grammar_plain  the same server, the request with `mtp: false` (the plain lane under the grammar)
  free_mtp       `--tool-grammar off`: MTP without the grammar (no guarantee on the calls)

Per pass: generated tokens, wall seconds, tokens per second, MTP drafts and accepts. The prompt is
cached after the warm-up, so the time is the decode's. Also checks that grammar_mtp's tokens equal
grammar_plain's (greedy; the float32 tests pin exactness, a bf16 model may round differently).

    python benchmarks/bench_mtp_grammar.py [MODEL_DIR] [--repeats 3] [--max-tokens 160] [--out out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from mlx_relay.default_model import default_model_path
from mlx_relay.relay import Relay

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file from the workspace.",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string"}, "limit": {"type": "integer"}},
                                          "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_shell", "description": "Run a shell command.",
                                      "parameters": {"type": "object", "properties": {
                                          "command": {"type": "string"}}, "required": ["command"]}}},
]
MESSAGES = [{"role": "system", "content": "You are a coding agent. Use the tools to inspect and change the project."},
            {"role": "user", "content": "Read README.md, then run the test suite and tell me what fails."}]


async def one(relay: Relay, max_tokens: int, mtp: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    reply = await relay.chat(MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=max_tokens, temperature=0,
                             mtp=mtp)
    wall = time.perf_counter() - t0
    n = reply.usage.completion_tokens
    return {"tokens": n, "wall_s": wall, "tok_s": n / wall, "drafted": reply.usage.mtp_drafted,
            "accepted": reply.usage.mtp_accepted, "tool_calls": [c.name for c in reply.tool_calls],
            "finish": reply.finish_reason, "token_ids": reply.token_ids}


async def main_async(model: Path, repeats: int, max_tokens: int) -> dict[str, Any]:
    passes: dict[str, list[dict[str, Any]]] = {"grammar_mtp": [], "grammar_plain": [], "free_mtp": []}
    kw: dict[str, Any] = {"max_num_seqs": 2, "mtp_policy": "always", "warmup": False}
    async with Relay.start(model, **kw) as lazy, Relay.start(model, tool_grammar="off", **kw) as free:
        runs = {"grammar_mtp": (lazy, True), "grammar_plain": (lazy, False), "free_mtp": (free, True)}
        for relay, mtp in runs.values():  # warm-up: compile, cache the prompt
            await one(relay, max_tokens, mtp)
        for _ in range(repeats):
            for name, (relay, mtp) in runs.items():
                passes[name].append(await one(relay, max_tokens, mtp))
    summary: dict[str, Any] = {}
    for name, ps in passes.items():
        rates = [p["tok_s"] for p in ps]
        summary[name] = {"tok_s_median": statistics.median(rates), "tok_s_min": min(rates), "tok_s_max": max(rates),
                         "tokens": ps[0]["tokens"], "drafted": ps[0]["drafted"], "accepted": ps[0]["accepted"],
                         "tool_calls": ps[0]["tool_calls"], "finish": ps[0]["finish"]}
    same = all(p["token_ids"] == q["token_ids"] for p, q in zip(passes["grammar_mtp"], passes["grammar_plain"],
                                                                 strict=True))
    for ps in passes.values():
        for p in ps:
            p.pop("token_ids")
    return {"model": str(model), "repeats": repeats, "max_tokens": max_tokens, "summary": summary,
            "grammar_mtp_tokens_equal_grammar_plain": same, "passes": passes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = Path(args.model) if args.model else default_model_path()
    result = asyncio.run(main_async(model, args.repeats, args.max_tokens))
    for name, s in result["summary"].items():
        print(f"{name:14s} {s['tok_s_median']:7.1f} tok/s (min {s['tok_s_min']:.1f}, max {s['tok_s_max']:.1f}); "
              f"{s['tokens']} tokens, drafted {s['drafted']}, accepted {s['accepted']}, calls {s['tool_calls']}, "
              f"{s['finish']}")
    print("grammar_mtp tokens == grammar_plain tokens:", result["grammar_mtp_tokens_equal_grammar_plain"])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
