"""SpecPrefill through the actors (issue 7.1, 7.3, 7.4): the scorer's threshold and per-request
overrides, composition with the prefix cache, the fallback on a broken draft, and the report on
the wire. The draft is a real fixture with the target's tokenizer."""

from __future__ import annotations

import math
import random
import shutil
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.numpy import load_file, save_file

from mlx_relay.config import SpecPrefillConfig
from mlx_relay.errors import InvalidRequest
from mlx_relay.relay import Relay
from mlx_relay.specprefill.anchors import anchor_chunks, anchor_rule
from mlx_relay.testing.live_server import LiveServer

WORDS = ("alpha beta gamma delta kernel buffer thread socket parser module import return yield "
         "lambda class object method value index offset stream cache token draft prompt").split()


def text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def counters(exposition: bytes) -> dict[str, float]:
    """The relay's Prometheus counters by name (`mlx_relay:` and `_total` left off)."""
    return {s.name.removeprefix("mlx_relay:").removesuffix("_total"): s.value
            for f in text_string_to_metric_families(exposition.decode()) if f.type == "counter"
            for s in f.samples if s.name.endswith("_total")}


SETTINGS = {"specprefill_threshold": 256, "specprefill_chunk_size": 16, "specprefill_keep_fraction": 0.3,
            "prefill_step_size": 64, "max_num_seqs": 4, "warmup": False}


async def test_threshold_overrides_and_exact_keep_all(fp32_model: Path) -> None:
    # prefix cache off: the same prompt again would be restored, leaving too little to score
    async with Relay.start(fp32_model, specprefill_draft_model=str(fp32_model), prefix_cache=False,
                           **SETTINGS) as relay:
        long_msg = user(text(400, 1))
        plain = await relay.chat(long_msg, max_tokens=12, temperature=0.0, specprefill=False)
        assert plain.specprefill is None and plain.prompt_tokens > 256

        due = await relay.chat(long_msg, max_tokens=12, temperature=0.0)  # above the threshold
        report = due.specprefill
        assert report is not None and report.ran and report.keep_fraction == 0.3
        assert report.scored_tokens == due.prompt_tokens == plain.prompt_tokens
        assert 0.25 * report.scored_tokens <= report.kept_tokens <= 0.35 * report.scored_tokens + 32

        full = await relay.chat(long_msg, max_tokens=12, temperature=0.0, specprefill_keep=1.0)
        assert full.specprefill is not None and full.specprefill.ran
        assert full.specprefill.kept_tokens == full.prompt_tokens
        assert full.token_ids == plain.token_ids  # keep 1.0: the sparse path is normal prefill

        short = await relay.chat(user("hi there"), max_tokens=4, temperature=0.0)
        assert short.specprefill is None  # under the threshold, not asked: nothing to report
        forced = await relay.chat(user("hi there"), max_tokens=4, temperature=0.0, specprefill=True)
        assert forced.specprefill is not None and not forced.specprefill.ran
        assert "two chunks" in (forced.specprefill.fallback or "")

        with pytest.raises(InvalidRequest):
            await relay.chat(long_msg, max_tokens=4, specprefill_keep=0.0)
        stats = await relay.specprefill_stats()
        assert stats["enabled"] and stats["sparse_requests"] == 2 and stats["fallbacks"] == 0
        assert stats["tokens_kept"] == report.kept_tokens + full.prompt_tokens
        scraped = counters(await relay.scrape())
        assert (scraped["specprefill_runs"], scraped["specprefill_fallbacks"]) == (2, 0)
        assert scraped["specprefill_tokens_kept"] == stats["tokens_kept"]


async def test_anchors_keep_what_the_question_names_and_the_usage_counts_them(fp32_model: Path) -> None:
    """Issue 19.4, through the actors: a raw prompt of random token ids whose question (its last
    tokens) repeats a run planted mid-context. The usage reports the chunks the anchor rule kept,
    exactly as the pure functions find them; per request the rule's n-gram is set or turned off."""
    rng = random.Random(11)
    ids = [rng.randrange(5, 1000) for _ in range(600)]
    ids[322:328] = ids[588:594] = [901, 902, 903, 904, 905, 906]  # "The code for ABC-12" ... "ABC-12?"
    chunk, scored = SETTINGS["specprefill_chunk_size"], math.ceil(len(ids) / SETTINGS["specprefill_chunk_size"])
    config = SpecPrefillConfig()

    def expected(ngram: int | None) -> int:
        rule = anchor_rule(config, ngram)
        assert rule is not None
        return sum(1 for c in anchor_chunks(ids, start=0, chunk_size=chunk, rule=rule) if 0 < c < scored - 1)

    assert expected(4) == 2  # 322..327 and the 16 tokens after them: chunks 20 and 21
    async with Relay.start(fp32_model, specprefill_draft_model=str(fp32_model), prefix_cache=False,
                           **SETTINGS) as relay:
        runs = {n: await relay.chat([], prompt=ids, max_tokens=4, temperature=0.0, specprefill_anchor_ngram=n)
                for n in (None, 4, 0)}
        stats = await relay.specprefill_stats()
        scraped = counters(await relay.scrape())
    for res in runs.values():
        report = res.specprefill
        assert res.prompt_tokens == len(ids) and report is not None and report.ran
        assert report.kept_tokens == runs[0].specprefill.kept_tokens  # type: ignore[union-attr]  # the same budget
    default, four, off = (runs[n].specprefill for n in (None, 4, 0))
    assert default is not None and four is not None and off is not None
    assert (default.anchor_ngram, default.anchored_chunks) == (config.anchor_ngram, expected(None))
    assert (four.anchor_ngram, four.anchored_chunks, four.anchors_dropped) == (4, 2, 0)
    assert four.anchors_rescued <= four.anchored_chunks
    assert (off.anchor_ngram, off.anchored_chunks) == (0, 0)
    assert "anchor_ngram" not in msgspec.to_builtins(off)  # off: the usage reads as before anchors
    assert stats["anchor_ngram"] == config.anchor_ngram
    assert stats["chunks_anchored"] == default.anchored_chunks + 2 == scraped["specprefill_chunks_anchored"]
    assert stats["anchors_rescued"] == default.anchors_rescued + four.anchors_rescued


async def test_only_the_uncached_suffix_is_scored(fp32_model: Path) -> None:
    system = {"role": "system", "content": text(350, 7)}  # above the prefix cache's 256-token minimum
    async with Relay.start(fp32_model, specprefill_draft_model=str(fp32_model), **SETTINGS) as relay:
        first = await relay.chat([system, *user(text(300, 8))], max_tokens=8, temperature=0.0)
        second = await relay.chat([system, *user(text(320, 9))], max_tokens=8, temperature=0.0)
    assert second.cached_tokens > 256  # the system prompt's snapshot was restored
    for r in (first, second):
        assert r.specprefill is not None and r.specprefill.ran
        # the system prompt (a snapshot point, then restored) is prefilled exactly, never scored
        assert r.specprefill.scored_tokens == r.prompt_tokens - second.cached_tokens


def broken_draft(src: Path, dest: Path) -> Path:
    """A copy of a checkpoint whose first layer norm is infinite: every score it gives is not
    finite (what an overflowing low-precision draft does)."""
    shutil.copytree(src, dest)
    weights = load_file(str(dest / "model.safetensors"))
    key = next(k for k in weights if k.endswith("layers.0.input_layernorm.weight"))
    weights[key] = np.full_like(weights[key], np.inf)
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


async def test_a_failing_draft_falls_back_to_normal_prefill(fp32_model: Path, tmp_path: Path) -> None:
    draft = broken_draft(fp32_model, tmp_path / "broken")
    async with Relay.start(fp32_model, specprefill_draft_model=str(draft), prefix_cache=False, **SETTINGS) as relay:
        msg = user(text(400, 3))
        got = await relay.chat(msg, max_tokens=12, temperature=0.0)
        plain = await relay.chat(msg, max_tokens=12, temperature=0.0, specprefill=False)
        stats = await relay.specprefill_stats()
        scraped = counters(await relay.scrape())
    assert (scraped["specprefill_runs"], scraped["specprefill_fallbacks"]) == (0, 1)
    assert got.specprefill is not None and not got.specprefill.ran
    assert "ScoringFailed" in (got.specprefill.fallback or "")
    assert got.token_ids == plain.token_ids  # served in full, as if SpecPrefill were off
    assert stats["fallbacks"] == 1 and stats["sparse_requests"] == 0 and stats["last_error"]


def test_wire_reports_and_rejects(server: LiveServer) -> None:
    """The shared server has no draft model: asking for SpecPrefill says so in the usage;
    a keep fraction outside (0, 1] or an anchor n-gram outside [0, 64] is a 400 in the OpenAI
    error shape."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        body = {"model": "tiny", "messages": user("hello"), "max_tokens": 2, "specprefill": True}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
        report = r.json()["usage"]["specprefill"]
        assert report["ran"] is False and "draft model" in report["fallback"]
        r = client.post("/v1/chat/completions", json={**body, "specprefill_keep": 1.5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "specprefill_keep"
        for bad in (-1, 65):
            r = client.post("/v1/chat/completions", json={**body, "specprefill_anchor_ngram": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "specprefill_anchor_ngram"
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 2,
                                                 "specprefill_anchor_ngram": "four"})
        assert r.status_code == 422 and "specprefill_anchor_ngram" in r.text  # a wrong type, as for any field
        r = client.post("/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": user("hello"),
                                              "specprefill": True})
        assert r.status_code == 200 and r.json()["usage"]["specprefill"]["ran"] is False
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": user("hello"), "max_tokens": 2})
        assert "specprefill" not in r.json()["usage"]
        assert client.get("/v1/specprefill/stats").json() == {"enabled": False}


async def test_a_request_that_leaves_while_scored_frees_its_job(fp32_model: Path) -> None:
    import anyio

    from mlx_relay.messages.gpu import EngineStats, GetEngineStats

    async with Relay.start(fp32_model, specprefill_draft_model=str(fp32_model), prefix_cache=False,
                           **{**SETTINGS, "prefill_step_size": 16}) as relay:
        with anyio.move_on_after(0.3):  # the client leaves while its 3000-token prompt is scored
            await relay.chat(user(text(1200, 4)), max_tokens=4, temperature=0.0)
        service = relay.service
        assert service is not None
        with anyio.fail_after(30):
            while True:
                stats: EngineStats = await service.gpu.ask(GetEngineStats())
                if stats.scoring == 0 and stats.running == 0:
                    break
                await anyio.sleep(0.05)
        after = await relay.chat(user(text(400, 5)), max_tokens=4, temperature=0.0)
        assert after.specprefill is not None and after.specprefill.ran
