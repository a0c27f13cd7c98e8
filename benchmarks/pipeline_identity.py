"""Greedy replies of two running servers, compared: one model on one device against the same
model as a pipeline (`serve --pipeline`, docs/pipeline.md), or any two servers that should agree.

    python benchmarks/pipeline_identity.py http://127.0.0.1:8100 http://127.0.0.1:8101 --out identity.json

Run against freshly started servers (default `--mtp-policy auto`): the first requests go out alone
while the head's acceptance is still unmeasured, so MTP drafts them on both servers (the report
says whether it did, from `mlx_relay:spec_decode_num_draft_tokens_total{source="mtp"}`). Then: two
at once on the plain lane (`mtp: false`: one batch of two rows), and a second turn after a system
prompt (a prefix-cache hit on both, `cached_tokens` > 0). Every case sends the same requests to
each server in the same order and compares the reply texts (temperature 0). Exit status 1 when
any case differs.
"""

from __future__ import annotations

import argparse
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


def mtp_drafts(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines()
               if ln.startswith("mlx_relay:spec_decode_num_draft_tokens_total") and 'source="mtp"' in ln)


def cases(url: str, max_tokens: int) -> dict[str, Any]:
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
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference")
    parser.add_argument("test")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ref, test = cases(args.reference, args.max_tokens), cases(args.test, args.max_tokens)
    report: dict[str, Any] = {"reference": args.reference, "test": args.test, "max_tokens": args.max_tokens,
                              "identical": {k: ref[k] == test[k] for k in ("alone", "together", "prefix_hit")},
                              "mtp_drafted": {"reference": ref["alone_mtp_drafts"], "test": test["alone_mtp_drafts"]},
                              "prefix_hit_cached": {"reference": ref["prefix_hit_cached_tokens"],
                                                    "test": test["prefix_hit_cached_tokens"],
                                                    "prompt": ref["prefix_hit_prompt_tokens"]},
                              "replies": {"reference": ref, "test": test}}
    for name, same in report["identical"].items():
        print(f"{name}: {'identical' if same else 'DIFFERENT'}")
    print(f"MTP drafts on the alone requests: {report['mtp_drafted']}")
    print(f"prefix hit, cached tokens: {report['prefix_hit_cached']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    sys.exit(0 if all(report["identical"].values()) else 1)


if __name__ == "__main__":
    main()
