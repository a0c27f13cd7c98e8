"""benchmarks/bench_prefill.py (issue 43.2), prefill side by side: its pieces (exact-length texts, the
cases, the order of the runs, the summary) and one whole run against the shared server (`--url`) and
the raw mlx-vlm worker on the float32 fixture. No timings are checked: only the report's shape."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import ModuleType

from mlx_relay.testing.live_server import LiveServer
from mlx_relay.testing.scripts import load_script

_SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_prefill.py"


def _bench() -> ModuleType:
    return load_script(_SCRIPT, "bench_prefill")


def test_texts_are_exactly_as_long_as_asked_and_never_share_a_start(fp32_model: Path) -> None:
    b = _bench()
    builder = b.TextBuilder(fp32_model)
    texts = [builder.text(n, random.Random(n), nonce) for nonce, n in enumerate((1, 7, 64, 333, 1500))]
    assert [builder.count(t) for t in texts] == [1, 7, 64, 333, 1500]
    starts = [builder.text(300, random.Random(0), nonce)[:12] for nonce in range(30)]
    assert len(set(starts)) == 30  # the same words, led by another nonce each time


def test_cases_waves_and_summary() -> None:
    b = _bench()
    cases = b.parse_cases("2048,8192", "28672+4096")
    assert [(c.tokens, c.cached, c.label) for c in cases] == [(2048, 0, "2048"), (8192, 0, "8192"),
                                                              (32768, 28672, "28672+4096")]
    assert b.parse_cases("512", "none") == [b.Case(512)]
    alternate = [(t, i, r) for t, i, _, r in b.waves(cases[:2], 2, ["ours", "raw"], "alternate")]
    assert alternate[:4] == [("ours", 0, 0), ("raw", 0, 0), ("ours", 0, 1), ("raw", 0, 1)]
    phases = [t for t, *_ in b.waves(cases, 3, ["ours", "raw"], "phases")]
    assert phases == ["ours"] * 9 + ["raw"] * 9
    # the 35B-A3B shape (38.6 GB 8-bit) at 128K: not twice on an H100, twice on an H200
    h100 = b.plan_order("auto", ["ours", "raw"], "NVIDIA H100 80GB HBM3", 85.5, int(38.6e9), 20480, 131072)
    h200 = b.plan_order("auto", ["ours", "raw"], "NVIDIA H200", 150.7, int(38.6e9), 20480, 131072)
    assert (h100[0], h200[0]) == ("phases", "alternate")
    runs = [{"target": t, "case_tokens": 2048, "case_cached": 0, "tokens": 2048, "cached_tokens": 0, "tok_s": v,
             "ttft_s": 2048 / v, "peak_gb": 1.0} for t, v in (("ours", 4000.0), ("raw", 1000.0), ("ours", 5000.0),
                                                              ("raw", 2000.0), ("ours", 6000.0), ("raw", 1500.0))]
    summary = {s["target"]: s for s in b.summarize(runs)}
    assert summary["ours"]["tok_s"] == {"median": 5000.0, "min": 4000.0, "max": 6000.0}
    assert summary["ours"]["ours_over_raw_tok_s"] == round(5000 / 1500, 3)
    assert "ours_over_raw_tok_s" not in summary["raw"]


def test_a_whole_run_against_our_server_and_the_raw_library(server: LiveServer, fp32_model: Path,
                                                            tmp_path: Path) -> None:
    b = _bench()
    out = tmp_path / "prefill.json"
    assert b.main([str(fp32_model), "--url", server.url, "--sizes", "32,128,9000", "--cached", "288+32",
                   "--repeats", "2", "--warmup-tokens", "32", "--order", "alternate", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["order"] == "alternate" and report["card"] and report["commit"] and report["model"]
    assert report["raw_prefill_step_size"] == 2048
    assert [s["tokens"] for s in report["skipped"]] == [9000]  # past the fixture's 4K context
    runs = report["runs"]
    assert len(runs) == 3 * 2 * 2
    assert [r["target"] for r in runs[:4]] == ["ours", "raw", "ours", "raw"]
    for r in runs:
        assert r.get("error") is None, r
        assert {"target", "tokens", "cached_tokens", "tok_s", "ttft_s", "peak_gb", "repeat"} <= set(r)
        assert r["tok_s"] > 0 and r["ttft_s"] > 0 and r["repeat"] in (0, 1)
        # what the server reported (ours) or fed (raw) is the size asked for
        assert (r["tokens"], r["cached_tokens"]) == (r["case_tokens"], r["case_cached"])
    assert {(r["tokens"], r["cached_tokens"]) for r in runs} == {(32, 0), (128, 0), (320, 288)}
    assert all(r["cached_tokens"] > 0 for r in runs if r["case_cached"])
    assert all(r["peak_gb"] is not None and r["peak_gb"] > 0 for r in runs if r["target"] == "raw")
    summary = report["summary"]
    assert len(summary) == 6
    assert all(s["runs"] == 2 and s["errors"] == 0 for s in summary)
    assert all("ours_over_raw_tok_s" in s for s in summary if s["target"] == "ours")
    assert "| tokens | cached | target |" in out.with_suffix(".md").read_text()
