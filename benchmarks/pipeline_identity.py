"""Greedy replies of two running servers, compared: one model on one device against the same
model as a pipeline (`serve --pipeline`, docs/pipeline.md), or any two servers that should agree.

    python benchmarks/pipeline_identity.py http://127.0.0.1:8100 http://127.0.0.1:8101 --out identity.json

Run against freshly started servers (default `--mtp-policy auto`): the first requests go out alone
while the head's acceptance is still unmeasured, so MTP drafts them on both servers (the report
says whether it did, from `mlx_relay:spec_decode_num_draft_tokens_total{source="mtp"}`). Then: two
at once on the plain lane (`mtp: false`: one batch of two rows), and a second turn after a system
prompt (a prefix-cache hit on both, `cached_tokens` > 0); a question about an image (a
generated 256x256 PNG: the vision tower on every rank); with `--specprefill-tokens N`, a prompt of
about N tokens that servers started with `--specprefill-draft-model` (threshold below N) prefill
sparsely (the report says whether they did, from `mlx_relay:specprefill_runs_total`). Every case
sends the same requests to each server in the same order and compares the reply texts
(temperature 0). Exit status 1 when any case differs.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

SYSTEM = ("You are a careful coding agent. Keep every module small, typed and tested. "
          + " ".join(f"Rule {k}: name things for what they are and write each thing once." for k in range(40)))
PROMPTS = ["Write a Python function that parses a CSV file.", "Explain what a prefix cache does.",
           "List three ways to make a decode step faster."]


def chat(url: str, model: str, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra})
    r.raise_for_status()
    body = r.json()
    return {"text": body["choices"][0]["message"]["content"], "usage": body["usage"]}


def counter(url: str, name: str, label: str = "") -> float:
    """The sum of `/metrics`' samples of `mlx_relay:NAME` (those whose labels hold `label`)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines()
               if ln.startswith(f"mlx_relay:{name}") and label in ln)


def mtp_drafts(url: str) -> float:
    return counter(url, "spec_decode_num_draft_tokens_total", 'source="mtp"')


def image_url() -> str:
    """A 256x256 PNG with shapes on it, as a data URL (the same bytes every call)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (256, 256), (240, 240, 230))
    draw = ImageDraw.Draw(img)
    draw.rectangle((30, 40, 120, 200), fill=(200, 40, 40))
    draw.ellipse((140, 60, 230, 150), fill=(40, 80, 200))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def long_prompt(tokens: int) -> str:
    """About `tokens` tokens of a code review log (~10 tokens a line) and a question at its end."""
    lines = [f"line {k}: function handler_{k % 97}(request) returns status {200 + k % 7}" for k in range(tokens // 12)]
    return "\n".join(lines) + "\nWhich handler returns status 204 most often? Answer briefly."


def cases(url: str, max_tokens: int, specprefill_tokens: int = 0) -> dict[str, Any]:
    """Every case against one server, in order."""
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    out: dict[str, Any] = {}
    drafts = mtp_drafts(url)
    out["alone"] = [chat(url, model, [{"role": "user", "content": p}], max_tokens)["text"] for p in PROMPTS[:2]]
    out["alone_mtp_drafts"] = mtp_drafts(url) - drafts
    pairs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}] for p in PROMPTS[1:]]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda m: chat(url, model, m, max_tokens, mtp=False), pairs))
    out["together"] = [r["text"] for r in together]
    turn = [*pairs[0], {"role": "assistant", "content": together[0]["text"]},
            {"role": "user", "content": "Now add its tests."}]
    second = chat(url, model, turn, max_tokens)
    out["prefix_hit"] = second["text"]
    out["prefix_hit_cached_tokens"] = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    out["prefix_hit_prompt_tokens"] = second["usage"]["prompt_tokens"]
    picture = [{"type": "text", "text": "What shapes are in this picture, and what colours?"},
               {"type": "image_url", "image_url": {"url": image_url()}}]
    out["image"] = chat(url, model, [{"role": "user", "content": picture}], max_tokens)["text"]
    if specprefill_tokens:
        runs = counter(url, "specprefill_runs_total")
        reply = chat(url, model, [{"role": "user", "content": long_prompt(specprefill_tokens)}], max_tokens)
        out["specprefill"] = reply["text"]
        out["specprefill_runs"] = counter(url, "specprefill_runs_total") - runs
        out["specprefill_prompt_tokens"] = reply["usage"]["prompt_tokens"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference")
    parser.add_argument("test")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--specprefill-tokens", type=int, default=0,
                        help="add a prompt of about this many tokens, for servers started with SpecPrefill")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ref = cases(args.reference, args.max_tokens, args.specprefill_tokens)
    test = cases(args.test, args.max_tokens, args.specprefill_tokens)
    compared = ("alone", "together", "prefix_hit", "image") + (("specprefill",) if args.specprefill_tokens else ())
    report: dict[str, Any] = {"reference": args.reference, "test": args.test, "max_tokens": args.max_tokens,
                              "identical": {k: ref[k] == test[k] for k in compared},
                              "mtp_drafted": {"reference": ref["alone_mtp_drafts"], "test": test["alone_mtp_drafts"]},
                              # the warm-up's measure that `auto` plans the head's drafts by (absent: 0, no warm-up)
                              "mtp_round_cost_steps": {"reference": counter(args.reference, "mtp_round_cost_steps"),
                                                       "test": counter(args.test, "mtp_round_cost_steps")},
                              "prefix_hit_cached": {"reference": ref["prefix_hit_cached_tokens"],
                                                    "test": test["prefix_hit_cached_tokens"],
                                                    "prompt": ref["prefix_hit_prompt_tokens"]},
                              "specprefill_runs": {"reference": ref.get("specprefill_runs"),
                                                   "test": test.get("specprefill_runs"),
                                                   "prompt": ref.get("specprefill_prompt_tokens")},
                              "replies": {"reference": ref, "test": test}}
    for name, same in report["identical"].items():
        print(f"{name}: {'identical' if same else 'DIFFERENT'}")
    print(f"MTP drafts on the alone requests: {report['mtp_drafted']} (a round in plain steps, "
          f"the warm-up's: {report['mtp_round_cost_steps']})")
    print(f"prefix hit, cached tokens: {report['prefix_hit_cached']}")
    if args.specprefill_tokens:
        print(f"SpecPrefill runs on the long prompt: {report['specprefill_runs']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    sys.exit(0 if all(report["identical"].values()) else 1)


if __name__ == "__main__":
    main()
