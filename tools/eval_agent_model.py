"""Evaluate an agent model on held-out curriculum prompts (issue 19, point 2).

Offline tooling on top of the in-process API: the model is served by :class:`mlx_relay.relay.Relay`
(the whole actor graph: Normalizer, GPUExecutor with MTP, the reply grammar), prompts are the
held-out split of ``tools/agent_curriculum.py`` (split 1, never trained on), greedy decoding.

Measures (each the issue's):

* ``needle@N``: exact match of the answer after ``</think>`` on key-value retrieval prompts of
  about N tokens (SpecPrefill off per request; ``--specprefill-draft``/``--specprefill-keep``
  turn it on for issue 19.4, ``--specprefill-anchor-ngram`` sets its anchor rule per request,
  0 off; the chunks anchored are summed per measure in the output's ``specprefill.anchors``).
* ``tool_call``: with tools declared and a request that needs one (``tool_choice`` auto, nothing
  forced), the reply holds a well-formed call: our server's parser
  (:class:`mlx_relay.chat.reply_parser.ReplyParser`) reads it into a tool call to a declared tool
  whose arguments validate against its schema with ``jsonschema``; ``tool_call_exact`` also
  wants the expected tool and arguments. ``--tool-choice required`` forces the call instead (the
  grammar's values against the model's own writing of them).
* ``think_closed``: replies (thinking on: the prompt opens ``<think>``) that close it before the
  answer, over every prompt run.
* ``json_no_grammar`` / ``json_grammar``: the request asks for a JSON object in words; the
  content parses as a JSON object, without and with ``response_format: json_object`` (which the
  server enforces with a grammar from the end of the thinking block on; the prompt text is the
  same), over every reply. The budget, ``JSON_MAX_TOKENS``, is about four times the longest
  reference reply (thinking and answer), so a reply that ends at all ends within it. A reply cut by
  ``max_tokens`` (``finish_reason: length``) is a prefix of an object, not an object: it counts as
  invalid there and is also counted apart, ``json_*_cut`` (the share cut); ``json_*_finished`` is
  the rate over the replies the model ended itself, which the grammar makes 1.0 whatever the
  model (the 0.30 of the first H100 checkpoint was 21 of 30 replies cut at 96 tokens while the
  model repeated a key; every reply that finished was an object).
* ``mtp_acceptance_block2``: accepted / drafted MTP tokens over all replies (``usage.mtp``'s
  counts; the server runs with ``mtp_block_size`` 2 and the ``always`` policy).

``result["finish_reasons"]`` counts each measure's finish reasons; ``--only`` runs some
families of measures (``think_closed`` and the MTP counts then cover those replies only).

Usage::

    python tools/eval_agent_model.py --model DIR --n 20 --lengths 4096 8192 16384 --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import msgspec

from mlx_relay.chat.output import ToolCallEnd
from mlx_relay.chat.reply_parser import ReplyParser
from mlx_relay.chat.types import ToolDef
from mlx_relay.errors import RelayError

THINK_END = "</think>"


# --------------------------------------------------------------------------- scorers


def split_reply(text: str, think_open: bool) -> tuple[str, str, bool]:
    """(reasoning, content, thinking closed) of a reply whose prompt opened ``<think>`` when
    ``think_open`` (otherwise a block the reply itself opens counts)."""
    body = text
    if not think_open:
        stripped = text.lstrip()
        if not stripped.startswith("<think>"):
            return "", text.strip(), True
        body = stripped[len("<think>"):]
    i = body.find(THINK_END)
    if i < 0:
        return body, "", False
    return body[:i].strip(), body[i + len(THINK_END):].strip(), True


def score_needle(text: str, answer: str, think_open: bool) -> bool:
    _, content, closed = split_reply(text, think_open)
    return closed and content == answer


@dataclass
class ToolScore:
    well_formed: bool  # at least one call, parsed, declared, schema-valid arguments
    exact: bool  # the first call is the expected tool with the expected arguments
    error: str | None = None


def score_tool(text: str, tools: list[ToolDef], think_open: bool, expected: dict[str, Any] | None = None) -> ToolScore:
    invalid: list[str] = []
    parser = ReplyParser(tools=tools, tool_format="qwen3_coder", think_open=think_open,
                         on_invalid=lambda reason, what: invalid.append(f"{reason}: {what}"))
    events = parser.feed(text) + parser.finish("stop")
    if invalid:
        return ToolScore(False, False, invalid[0])
    calls = [ev for ev in events if isinstance(ev, ToolCallEnd)]
    if not calls:
        return ToolScore(False, False, "no tool call")
    schemas = {t.function.name: t.function.parameters or {"type": "object"} for t in tools}
    for call in calls:
        if call.name not in schemas:
            return ToolScore(False, False, f"undeclared tool {call.name}")
        try:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        except jsonschema.ValidationError as exc:
            return ToolScore(False, False, f"arguments: {exc.message}")
    first = calls[0]
    exact = expected is not None and first.name == expected["name"] and json.loads(first.arguments) == expected[
        "arguments"]
    return ToolScore(True, exact)


def score_json(text: str, think_open: bool, keys: list[str] | None = None) -> tuple[bool, bool]:
    """(the content is a JSON object, it has exactly the requested keys)."""
    _, content, closed = split_reply(text, think_open)
    if not closed:
        return False, False
    try:
        value = json.loads(content)
    except ValueError:
        return False, False
    if not isinstance(value, dict):
        return False, False
    return True, keys is None or sorted(value) == sorted(keys)


@dataclass
class JsonScore:
    valid: bool  # the content after the thinking block is a JSON object
    keys: bool  # ... with exactly the requested keys
    cut: bool  # the reply was cut by max_tokens (finish_reason "length")


def score_json_reply(text: str, finish_reason: str, think_open: bool, keys: list[str] | None = None) -> JsonScore:
    valid, exact = score_json(text, think_open, keys)
    return JsonScore(valid, exact, finish_reason == "length")


def think_closed(text: str, think_open: bool) -> bool:
    return split_reply(text, think_open)[2]


# --------------------------------------------------------------------------- runner

JSON_MAX_TOKENS = 256  # the longest held-out reference reply is 67 tokens (seed 0, 300 examples)
MEASURE_FAMILIES = ("needle", "tool", "json", "chat")


@dataclass
class Tally:
    n: int = 0
    ok: int = 0

    def add(self, good: bool) -> None:
        self.n += 1
        self.ok += int(good)

    @property
    def rate(self) -> float:
        return self.ok / self.n if self.n else float("nan")


async def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    from agent_curriculum import HELD_OUT, Curriculum, Example, Mix, StdlibFiller, SyntheticFiller

    from mlx_relay.relay import Relay

    filler = StdlibFiller(args.stdlib) if args.filler == "stdlib" else SyntheticFiller()
    cur = Curriculum(args.model, filler, Mix(no_think=0.0), seed=args.seed)
    overrides: dict[str, Any] = {"mtp_block_size": 2, "mtp_policy": "always", "prefix_cache": False}
    if args.max_model_len:
        overrides["max_model_len"] = args.max_model_len
    if args.specprefill_draft:
        overrides["specprefill_draft_model"] = str(args.specprefill_draft)
    tallies: dict[str, Tally] = {}
    samples: list[dict[str, Any]] = []
    mtp = [0, 0]  # drafted, accepted
    finishes: dict[str, dict[str, int]] = {}
    anchored: dict[str, dict[str, int]] = {}  # per measure: SpecPrefill's anchored chunks, summed

    def tally(name: str) -> Tally:
        return tallies.setdefault(name, Tally())

    async with Relay.start(args.model, **overrides) as relay:

        async def run(ex: Example, measure: str, max_tokens: int, **params: Any) -> tuple[str, str]:
            """(the reply's text, its finish reason; "error" when the request failed)."""
            tools = msgspec.to_builtins(ex.tools) if ex.tools else None
            sp: dict[str, Any] = {"specprefill": False}
            if args.specprefill_draft:
                sp = {"specprefill": True, "specprefill_keep": args.specprefill_keep,
                      "specprefill_anchor_ngram": args.specprefill_anchor_ngram}
            t0 = time.perf_counter()
            try:
                res = await relay.chat(ex.prompt_messages(), tools=tools, enable_thinking=True, temperature=0.0,
                                       max_tokens=max_tokens, **sp, **params)
            except RelayError as exc:
                samples.append({"measure": measure, "error": f"{type(exc).__name__}: {exc}"})
                tally("think_closed").add(False)
                finishes.setdefault(measure, {}).setdefault("error", 0)
                finishes[measure]["error"] += 1
                return "", "error"
            if res.specprefill is not None:
                counts = anchored.setdefault(measure, {"requests": 0, "anchored_chunks": 0, "anchors_rescued": 0})
                counts["requests"] += 1
                counts["anchored_chunks"] += res.specprefill.anchored_chunks
                counts["anchors_rescued"] += res.specprefill.anchors_rescued
            reasons = finishes.setdefault(measure, {})
            reasons[res.finish_reason] = reasons.get(res.finish_reason, 0) + 1
            mtp[0] += res.usage.mtp_drafted
            mtp[1] += res.usage.mtp_accepted
            tally("think_closed").add(think_closed(res.raw_text, True))
            if sum(1 for x in samples if x["measure"] == measure) < args.keep_samples:
                samples.append({"measure": measure, "prompt_tokens": res.usage.prompt_tokens,
                                "text": res.raw_text[:400], "finish_reason": res.finish_reason,
                                "completion_tokens": res.usage.completion_tokens,
                                "seconds": round(time.perf_counter() - t0, 3)})
            return res.raw_text, res.finish_reason

        for length in args.lengths if "needle" in args.only else ():
            for i in range(args.n):
                ex = cur.example(HELD_OUT, i, "needle", length)
                text, _ = await run(ex, f"needle@{length}", 48)
                assert ex.answer is not None
                tally(f"needle@{length}").add(score_needle(text, ex.answer, True))
        for i in range(args.n if "tool" in args.only else 0):
            ex = cur.example(HELD_OUT, i, "tool")
            assert ex.tools is not None
            forced = {"tool_choice": args.tool_choice} if args.tool_choice != "auto" else {}
            text, _ = await run(ex, "tool_call", 160, **forced)
            score = score_tool(text, ex.tools, True, ex.call)
            tally("tool_call").add(score.well_formed)
            tally("tool_call_exact").add(score.exact)
        for i in range(args.n if "json" in args.only else 0):
            ex = cur.example(HELD_OUT, i, "json")
            for name, fmt in (("json_no_grammar", None), ("json_grammar", {"type": "json_object"})):
                text, finish = await run(ex, name, JSON_MAX_TOKENS, response_format=fmt)
                score = score_json_reply(text, finish, True, ex.json_keys)
                tally(name).add(score.valid)
                tally(f"{name}_keys").add(score.keys)
                tally(f"{name}_cut").add(score.cut)
                finished = tally(f"{name}_finished")  # listed even when no reply finished (rate nan)
                if finish == "stop":
                    finished.add(score.valid)
        for i in range(args.n if "chat" in args.only else 0):
            for family in ("chat", "copy"):
                ex = cur.example(HELD_OUT, i, family, 512)
                text, _ = await run(ex, family, 256)
                tally(family).add(split_reply(text, True)[1] == ex.answer)
    result = {name: asdict(t) | {"rate": t.rate} for name, t in tallies.items()}
    result["mtp_acceptance_block2"] = {"drafted": mtp[0], "accepted": mtp[1],
                                       "rate": mtp[1] / mtp[0] if mtp[0] else float("nan")}
    return {"model": str(args.model), "filler": filler.name, "n": args.n,
            "specprefill": {"draft": str(args.specprefill_draft) if args.specprefill_draft else None,
                            "keep": args.specprefill_keep if args.specprefill_draft else None,
                            "anchor_ngram": args.specprefill_anchor_ngram if args.specprefill_draft else None,
                            "anchors": anchored},
            "measures": result, "finish_reasons": finishes, "samples": samples}


TARGETS = {"needle@4096": 0.9, "needle@8192": 0.9, "tool_call": 0.9, "think_closed": 0.95,
           "json_no_grammar": 0.8, "json_grammar": 1.0, "json_grammar_finished": 1.0, "mtp_acceptance_block2": 0.6}


def table(result: dict[str, Any]) -> str:
    lines = [f"{'measure':24s} {'ok/n':>10s} {'rate':>7s} {'target':>7s}"]
    for name, m in result["measures"].items():
        okn = f"{m.get('ok', m.get('accepted'))}/{m.get('n', m.get('drafted'))}"
        target = TARGETS.get(name)
        lines.append(f"{name:24s} {okn:>10s} {m['rate']:7.3f} {'' if target is None else f'{target:7.2f}'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--n", type=int, default=20, help="held-out prompts per measure")
    p.add_argument("--lengths", type=int, nargs="*", default=[4096, 8192, 16384], help="needle prompt tokens")
    p.add_argument("--seed", type=int, default=0, help="the curriculum's seed (the model's training seed)")
    p.add_argument("--filler", choices=("synthetic", "stdlib"), default="synthetic")
    p.add_argument("--stdlib", type=Path, default=None, help="the stdlib filler's root (default: this Python's)")
    p.add_argument("--max-model-len", type=int, default=0, help="cap the served context (0: the checkpoint's)")
    p.add_argument("--specprefill-draft", type=Path, default=None, help="SpecPrefill on, with this draft")
    p.add_argument("--specprefill-keep", type=float, default=0.3)
    p.add_argument("--specprefill-anchor-ngram", type=int, default=None,
                   help="SpecPrefill's anchor n-gram length, sent per request (default: the server's; 0: off; "
                        "4 suits this 1K-token vocabulary)")
    p.add_argument("--only", nargs="+", choices=MEASURE_FAMILIES, default=list(MEASURE_FAMILIES),
                   help="run these families of measures only (chat also runs copy)")
    p.add_argument("--tool-choice", choices=("auto", "required"), default="auto",
                   help="the tool measures' tool_choice (required: the call is forced by a grammar)")
    p.add_argument("--keep-samples", type=int, default=3, help="replies kept in the JSON, per measure")
    p.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    p.add_argument("--no-blas-shim", action="store_true", help="on a Linux CPU, keep MLX's reference BLAS")
    args = p.parse_args(argv)
    result = anyio.run(evaluate, args)
    print(table(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    if "--no-blas-shim" not in sys.argv[1:] and sys.platform == "linux":
        # MLX's Linux CPU wheel links the reference BLAS (one core, slow); the training script's
        # shim forwards cblas_sgemm to numpy's OpenBLAS (a no-op on a GPU, whose matmuls skip BLAS)
        sys.path.insert(0, str(Path(__file__).parent))
        from train_small_mtp import reexec_with_blas_shim

        reexec_with_blas_shim()
    main()
