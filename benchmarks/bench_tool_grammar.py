"""What the lazy tool-call grammar (`tool_choice` "auto", issue 30.2) costs per generated token, on
the CPU, on the real Qwen3.5 vocabulary (248,077 ids: `mlx_relay.testing.qwen_vocab`).

A reply with tools declared decodes under `engine.processors.GrammarMask`: each token is consumed
by the llguidance matcher, the next token's bitmask is filled, and the mask is applied to the
logits. This times those steps over a fixed reply (free text, then a call, then free text),
token by token, as the GPU thread runs them:

  matcher   `consume_token` + `fill_next_token_bitmask` (llguidance alone)
  mask      the same plus the processor's whole step on a logits row (bitmask -> MLX mask, `where`)

separately for the free-text tokens and the tokens inside the call, next to the forced grammar's
tokens for the same call. The grammar is built and checked by the Normalizer's code path
(`chat.grammar.lazy_tool_grammar`); its build time is reported too.

    python benchmarks/bench_tool_grammar.py [--repeats 5] [--out out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
from transformers import AutoTokenizer

from mlx_relay.chat.grammar import OutputConstraint, build_grammar, lazy_tool_grammar
from mlx_relay.chat.types import FunctionDef, ToolDef
from mlx_relay.engine.sampling.processors import GrammarMask
from mlx_relay.testing.qwen_vocab import qwen35_tokenizer_path

TOOLS = [
    ToolDef(FunctionDef("read_file", "Read a file.", {
        "type": "object", "properties": {"path": {"type": "string"}, "offset": {"type": "integer"},
                                         "limit": {"type": "integer"}}, "required": ["path"]})),
    ToolDef(FunctionDef("run_shell", "Run a command.", {
        "type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"},
                                         "background": {"type": "boolean"},
                                         "mode": {"type": "string", "enum": ["safe", "full"]}},
        "required": ["command"]})),
]
TEXT = ("I'll look at the file first to see how the configuration is loaded, then run the tests. "
        "The loader reads `config.toml` from the working directory and falls back to defaults. ") * 3
CALL = ("<tool_call>\n<function=run_shell>\n<parameter=command>\npytest -q tests/test_config.py\n</parameter>\n"
        "<parameter=mode>\nsafe\n</parameter>\n</function>\n</tool_call>")


def time_tokens(tok: Any, llg: Any, grammar: str, ids: list[int], with_mask: bool) -> list[float]:
    """Seconds per token of one pass (the step that consumes token i and masks token i + 1)."""
    matcher = llguidance.LLMatcher(llg, grammar)
    vocab = len(tok)
    proc = GrammarMask(llguidance.LLMatcher(llg, grammar) if not with_mask else matcher,
                       tok.convert_tokens_to_ids("<|im_end|>"), vocab)
    logits = mx.zeros((1, vocab), dtype=mx.float32)
    mx.eval(logits)
    bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab)
    times = []
    for i, token in enumerate(ids):  # the processor's call i consumes token i - 1 (its first, none)
        t0 = time.perf_counter()
        if with_mask:
            mx.eval(proc.process_last_token(ids[i - 1] if i else token, logits))
        else:
            matcher.consume_token(token)
            llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        times.append(time.perf_counter() - t0)
    assert proc.error is None, proc.error
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    tok = AutoTokenizer.from_pretrained(qwen35_tokenizer_path())
    llg = llguidance.hf.from_tokenizer(tok, eos_token=tok.convert_tokens_to_ids("<|im_end|>"))
    special = frozenset(tok.get_added_vocab())
    t0 = time.perf_counter()
    lazy, loose = lazy_tool_grammar(OutputConstraint(tools=TOOLS), special, llg)
    build_s = time.perf_counter() - t0
    assert lazy is not None and not loose
    forced = build_grammar(OutputConstraint(tools=TOOLS, tool_choice="required"), special)
    assert forced is not None
    text_ids = tok.encode(TEXT, add_special_tokens=False)
    call_ids = tok.encode(CALL, add_special_tokens=False)
    ids = text_ids + call_ids + text_ids
    n_text, n_call = len(text_ids), len(call_ids)
    result: dict[str, Any] = {"vocab": len(tok), "lazy_build_and_check_s": round(build_s, 4),
                              "text_tokens": 2 * n_text, "call_tokens": n_call}
    for with_mask in (False, True):
        kind = "mask" if with_mask else "matcher"
        free, call, forced_call = [], [], []
        for _ in range(args.repeats):
            times = time_tokens(tok, llg, lazy, ids, with_mask)
            free.append(statistics.median(times[1:n_text] + times[n_text + n_call + 1:]))
            call.append(statistics.median(times[n_text + 1:n_text + n_call]))
            forced_call.append(statistics.median(time_tokens(tok, llg, forced, call_ids, with_mask)[1:]))
        result[kind] = {"free_text_us_per_token": round(1e6 * min(free), 1),
                        "in_call_us_per_token": round(1e6 * min(call), 1),
                        "forced_call_us_per_token": round(1e6 * min(forced_call), 1)}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
