"""One model over two processes (`serve --pipeline`, docs/pipeline.md): replies equal the
unsharded server's, greedy and seeded-sampled through MTP (the head on every rank, the verify
pipelined), two at once on the plain lane (continuous batching), on a second turn that restores
from the prefix cache, with an image (the vision tower on every rank) and prefilled sparsely by
SpecPrefill (the draft on every rank); and the library behaviour the stages rely on.

The ranks run on loopback with MLX's ring backend, started as `mlx.launch` starts them (each rank
`MLX_RANK` and `MLX_HOSTFILE`, a hostfile this test writes with free ports). The model is the fp32
fixture with 8 layers: the 4-layer one has a single attention layer, and every stage needs one.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import pytest
from PIL import Image

from mlx_relay.config import PipelineConfig
from mlx_relay.engine.memory.batch_caches import as_batch_caches, batched
from mlx_relay.engine.models.loader import load_model
from mlx_relay.engine.models.pipeline_stage import UnsupportedSplit, shard_language_model, split_layers
from mlx_relay.relay import default_config
from mlx_relay.testing import local_http
from mlx_relay.testing.family_fixtures import family_fixture_path
from mlx_relay.testing.fixtures import FixtureSpec, fixture_path
from mlx_relay.testing.live_server import LiveServer, free_port_range

NAME = "tiny8"
# both servers: the prefix cache snapshots system prompts from 16 tokens on; MTP wherever it can
# run; SpecPrefill (the 4-layer fixture as the draft) from 160 uncached tokens on
FLAGS: dict[str, Any] = {"max_num_seqs": 4, "prefix_min_snapshot_tokens": 16, "mtp_policy": "always",
                         "specprefill_threshold": 160, "specprefill_chunk_size": 16}
SYSTEM = "You are a careful assistant who answers in short sentences about the Python standard library."


@pytest.fixture(scope="module")
def eight_layers() -> Path:
    return fixture_path(FixtureSpec(variant="fp32", seed=0, num_hidden_layers=8))


@pytest.fixture(scope="module")
def reference(eight_layers: Path, fp32_model: Path) -> Iterator[LiveServer]:
    config = default_config(eight_layers, served_model_name=NAME, warmup=False,
                            specprefill_draft_model=str(fp32_model), **FLAGS)
    with LiveServer(config) as live:
        yield live


def _launch(model: Path, tmp: Path, flags: list[str]) -> Iterator[tuple[str, dict[int, subprocess.Popen[bytes]]]]:
    """`mlx-relay serve --pipeline` as two ranks (rank 0 serves HTTP), started as mlx.launch does;
    yields once rank 0 is ready; kills what is left at the end."""
    hostfile = tmp / "hosts.json"
    base = free_port_range(3)  # the ring's two ports and rank 0's HTTP port, below the ephemeral range
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    port = base + 2
    cmd = [sys.executable, "-m", "mlx_relay.cli", "serve", str(model), "--pipeline", "--pipeline-backend",
           "ring", "--served-model-name", NAME, "--port", str(port), "--log-level", "warning", *flags]
    ranks: dict[int, subprocess.Popen[bytes]] = {}
    for rank in (1, 0):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), "HF_HUB_OFFLINE": "1"}
        log = (tmp / f"rank{rank}.log").open("wb")
        ranks[rank] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in ranks.values()):
                raise RuntimeError(f"a rank exited during start-up: {(tmp / 'rank0.log').read_text()[-2000:]}"
                                   f"{(tmp / 'rank1.log').read_text()[-2000:]}")
            try:
                if local_http.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        else:
            raise TimeoutError("the pipeline did not get ready")
        yield url, ranks
    finally:
        for p in ranks.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.fixture(scope="module", params=["p2p", "collective"])
def pipeline(request: pytest.FixtureRequest, eight_layers: Path, fp32_model: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[int, subprocess.Popen[bytes]]]]:
    """The two ranks with the reference's flags; warm-up on, so that the warm-up runs in lockstep too.
    Both transfers: send/recv, and the all_sum per boundary that NCCL runs (here on the ring)."""
    yield from _launch(eight_layers, tmp_path_factory.mktemp("pipeline"), [
        "--max-num-seqs", "4", "--prefix-min-snapshot-tokens", "16", "--mtp-policy", "always",
        "--specprefill-draft-model", str(fp32_model), "--specprefill-threshold", "160",
        "--specprefill-chunk-size", "16", "--pipeline-transfer", request.param])


def _chat(url: str, messages: list[dict[str, Any]], max_tokens: int = 16, **extra: Any) -> tuple[str, int]:
    r = local_http.post(url + "/v1/chat/completions", timeout=120, json={
        "model": NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _completion_tokens(url: str, messages: list[dict[str, Any]], max_tokens: int) -> int:
    """A greedy reply's completion tokens (a 200 with its usage, else the assertion's message)."""
    r = local_http.post(url + "/v1/chat/completions", timeout=120, json={
        "model": NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["completion_tokens"])


def _red_png() -> str:
    out = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def test_split_layers_is_mlx_lms_even_split() -> None:
    assert split_layers(8, 2) == [4, 4]
    assert split_layers(9, 2) == [5, 4]  # the low ranks take the extra layers
    assert split_layers(8, 2, (6, 2)) == [6, 2]
    with pytest.raises(UnsupportedSplit):
        split_layers(8, 2, (4, 3))


def test_mlx_vlms_forward_runs_exactly_the_layers_it_is_given(
        gpu: Callable[[Callable[[], Any]], Any], eight_layers: Path, fp32_model: Path) -> None:
    """What `shard_language_model` relies on: after the layer list and the mask indices are cut
    to a stage, mlx-vlm's forward (batched, as the prefill calls it) and `make_cache` run only
    those layers, a later stage takes the earlier one's hidden states as `inputs_embeds`, and the
    two stages give exactly the whole model's hidden states."""
    def run() -> None:
        ids = mx.array([[5, 9, 13, 2, 7, 30]])
        pos = mx.broadcast_to(mx.arange(6, dtype=mx.int32)[None, None, :], (3, 1, 6))
        whole = load_model(eight_layers).model.language_model
        out = whole(ids, cache=as_batch_caches(whole.make_cache()),
                    **batched(position_ids=pos, return_hidden=True, skip_logits=True, capture_layer_ids=[3]))
        middle, final = out.hidden_states[0], out.hidden_states[-1]
        front, back = load_model(eight_layers, lazy=True), load_model(eight_layers, lazy=True)
        assert shard_language_model(front.model.language_model, 1, 2) == (0, 4)
        assert shard_language_model(back.model.language_model, 0, 2) == (4, 8)
        first, last = front.model.language_model, back.model.language_model
        assert len(first.make_cache()) == len(last.make_cache()) == 4
        a = first(ids, cache=as_batch_caches(first.make_cache()),
                  **batched(position_ids=pos, return_hidden=True, skip_logits=True, capture_layer_ids=[3]))
        b = last(ids, inputs_embeds=a.hidden_states[0], cache=as_batch_caches(last.make_cache()),
                 **batched(position_ids=pos, return_hidden=True, skip_logits=True))
        assert mx.array_equal(a.hidden_states[0], middle).item()
        assert mx.array_equal(b.hidden_states[-1], final).item()
        # the 4-layer fixture has one attention layer: no two stages can each have one
        with pytest.raises(UnsupportedSplit, match="attention"):
            shard_language_model(load_model(fp32_model, lazy=True).model.language_model, 1, 2)

    gpu(run)


def test_two_ranks_reply_as_the_unsharded_server(
        pipeline: tuple[str, dict[int, subprocess.Popen[bytes]]], reference: LiveServer) -> None:
    url, ranks = pipeline
    prompts = ["Name three modules for files.", "What does itertools.chain do?"]
    for prompt in prompts:  # alone, greedy: MTP's compiled round
        messages = [{"role": "user", "content": prompt}]
        assert _chat(url, messages) == _chat(reference.url, messages)
    # sampled with a seed: MTP's eager round (the batched verify through the stages)
    messages = [{"role": "user", "content": prompts[0]}]
    sampled = {"temperature": 0.8, "seed": 3}
    assert _chat(url, messages, 24, **sampled) == _chat(reference.url, messages, 24, **sampled)
    drafted = [line for line in local_http.get(url + "/metrics").text.splitlines()
               if line.startswith("mlx_relay:spec_decode_num_draft_tokens_total") and 'source="mtp"' in line]
    assert drafted and float(drafted[0].split()[-1]) > 0  # MTP ran over the two ranks
    # two at once on the plain lane (MTP off for them): they decode together in one batch
    pairs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}] for p in prompts]
    with ThreadPoolExecutor(2) as pool:
        sharded = list(pool.map(lambda m: _chat(url, m, 24, mtp=False), pairs))
    assert [text for text, _ in sharded] == [_chat(reference.url, m, 24, mtp=False)[0] for m in pairs]
    # the next turn of the first conversation restores from the prefix cache on both servers
    turn = [*pairs[0], {"role": "assistant", "content": sharded[0][0]}, {"role": "user", "content": "And json?"}]
    text, cached = _chat(url, turn)
    ref_text, ref_cached = _chat(reference.url, turn)
    assert text == ref_text and cached > 0 and ref_cached > 0
    # an image: every rank encodes it, the first stage takes the merged embeddings
    image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                          {"type": "image_url", "image_url": {"url": _red_png()}}]}]
    assert _chat(url, image) == _chat(reference.url, image)
    # a long prompt: the draft scores it, the stages prefill the kept chunks
    long = [{"role": "user", "content": " ".join(f"line {i} of the log." for i in range(40))}]
    assert _chat(url, long) == _chat(reference.url, long)
    runs = [line for line in local_http.get(url + "/metrics").text.splitlines()
            if line.startswith("mlx_relay:specprefill_runs_total")]
    assert runs and float(runs[0].split()[-1]) == 1
    # SIGTERM to rank 0 drains the server and stops the other rank too
    ranks[0].send_signal(signal.SIGTERM)
    assert ranks[0].wait(30) == 0 and ranks[1].wait(30) == 0


def test_a_qwen3_model_over_two_ranks_replies_as_the_unsharded_server(tmp_path: Path) -> None:
    """The dense Qwen3 family (mlx-lm's model) split over two ranks (a layer each, the collective
    transfer NCCL runs): its stages run the family's prefill and decode step over their layers, so
    greedy replies equal the unsharded server's: alone, two at once behind a system prompt (one
    batch), and a next turn restored from the prefix cache on both."""
    model = family_fixture_path("qwen3")
    config = default_config(model, served_model_name=NAME, warmup=False, max_num_seqs=4,
                            prefix_min_snapshot_tokens=16)
    prompts = ["Name three modules for files.", "What does itertools.chain do?"]
    pairs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}] for p in prompts]
    with LiveServer(config) as reference, ThreadPoolExecutor(2) as pool:
        alone = [_chat(reference.url, [{"role": "user", "content": p}], 24) for p in prompts]
        together = [_chat(reference.url, m, 24)[0] for m in pairs]
        turn = [*pairs[0], {"role": "assistant", "content": together[0]}, {"role": "user", "content": "And json?"}]
        ref_text, ref_cached = _chat(reference.url, turn)
        for url, ranks in _launch(model, tmp_path, ["--no-warmup", "--max-num-seqs", "4",
                                                     "--prefix-min-snapshot-tokens", "16",
                                                     "--pipeline-transfer", "collective"]):
            assert [_chat(url, [{"role": "user", "content": p}], 24) for p in prompts] == alone
            assert [text for text, _ in pool.map(lambda m, at=url: _chat(at, m, 24), pairs)] == together
            text, cached = _chat(url, turn)
            assert text == ref_text and cached > 0 and ref_cached > 0
            ranks[0].send_signal(signal.SIGTERM)
            assert ranks[0].wait(30) == 0 and ranks[1].wait(30) == 0


def test_bf16_rows_joining_a_prefill_keep_the_stages_in_step(tmp_path: Path) -> None:
    """The bfloat16 fixture over two ranks (the collective transfer NCCL runs) against the same
    model unsharded: two requests at once behind a long system prompt, so that the second row
    joins the first's prefill batch mid-prompt. mlx-vlm's `BatchKVCache.extend` turned the batch's
    keys float32 there (`batch_caches.extend_caches` keeps their dtype), the stages then disagreed
    on the hidden state's dtype and the collective broke (two H200s: an illegal memory access; here
    a stage now fails by name, `layers.forward_block`, and the request with it). So: every reply
    completes on the two ranks (a 200 with its tokens), as on the unsharded server. (Not token for token:
    in bfloat16 a random-weight model's near ties part after a few tokens whenever the two
    requests' arrival, which neither server controls, puts their chunks at other lengths.)"""
    model = fixture_path(FixtureSpec(variant="bf16", seed=0, num_hidden_layers=8))
    config = default_config(model, served_model_name=NAME, warmup=False, max_num_seqs=4, mtp=False)
    system = "You are a careful coding agent. " + " ".join(
        f"Rule {k}: name things for what they are and write each thing once." for k in range(30))
    pairs = [[{"role": "system", "content": system}, {"role": "user", "content": f"Task {i}: add a parser."}]
             for i in range(2)]
    with LiveServer(config) as reference, ThreadPoolExecutor(2) as pool:
        assert all(n > 0 for n in pool.map(lambda m: _completion_tokens(reference.url, m, 12), pairs))
        for url, _ in _launch(model, tmp_path, ["--no-warmup", "--no-mtp", "--max-num-seqs", "4",
                                                 "--pipeline-transfer", "collective"]):
            assert all(n > 0 for n in pool.map(lambda m, at=url: _completion_tokens(at, m, 12), pairs))


def test_two_ranks_with_a_quantized_kv_cache_reply_as_the_unsharded_one(eight_layers: Path, tmp_path: Path) -> None:
    """`--kv-bits 8` over two ranks (issue 47.2): each stage keeps its attention layers' keys and values
    quantized (the prefill through the library's forward over its `QuantizedKVCache`, the decode
    steps over quantized buffers) and replies as the unsharded server with `--kv-bits 8`, greedy,
    two requests at once in one batch, and the next turn restores from the quantized prefix cache."""
    config = default_config(eight_layers, served_model_name=NAME, warmup=False, max_num_seqs=4, mtp=False,
                            kv_bits=8, prefix_min_snapshot_tokens=16)
    pairs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}]
             for p in ("Name three modules for files.", "What does itertools.chain do?")]
    with LiveServer(config) as reference, ThreadPoolExecutor(2) as pool:
        expected = [_chat(reference.url, m, 24)[0] for m in pairs]
        turn = [*pairs[0], {"role": "assistant", "content": expected[0]}, {"role": "user", "content": "And json?"}]
        ref_text, ref_cached = _chat(reference.url, turn)
        for url, _ in _launch(eight_layers, tmp_path, ["--no-warmup", "--no-mtp", "--max-num-seqs", "4",
                                                        "--kv-bits", "8", "--prefix-min-snapshot-tokens", "16"]):
            sharded = list(pool.map(lambda m, at=url: _chat(at, m, 24), pairs))
            assert [text for text, _ in sharded] == expected
            text, cached = _chat(url, turn)
            assert text == ref_text and cached > 0 and ref_cached > 0


# every rank: a toy pipeline of three stages (rank 2 first), each stage h -> h * (rank + 2) + rank,
# by the transfer named in argv: eager, compiled, and compiled again on that output; every rank
# prints what the last stage gave
_THREE_STAGES = """
import sys, mlx.core as mx
from mlx_relay.engine.models.pipeline_stage import Stage
group = mx.distributed.init(strict=True, backend="ring")
rank, size = group.rank(), group.size()
stage = Stage(group, rank, size, 0, 1, sys.argv[1])
def step(x):
    h = x if stage.first else stage.receive(x)
    h = h * (rank + 2) + rank
    return stage.share(h if stage.last else stage.send(h))
x = mx.array([[1.0, -2.0, 0.5]])
eager = step(x)
mx.eval(eager)
compiled = mx.compile(step)(x)
mx.eval(compiled)
twice = mx.compile(step)(compiled)  # a second step, on the first one's output
mx.eval(twice)
print(rank, eager.tolist(), compiled.tolist(), twice.tolist(), flush=True)
"""


@pytest.mark.parametrize("transfer", ["p2p", "collective"])
def test_three_stages_pass_hidden_states_in_order(transfer: str, tmp_path: Path) -> None:
    """The transfers over three ranks: a middle stage receives and sends, the collective one has
    every rank join each boundary in the pipeline's order (chained), eager and inside mx.compile."""
    hostfile = tmp_path / "hosts.json"
    base = free_port_range(3)
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(3)]))
    procs = [subprocess.Popen([sys.executable, "-c", _THREE_STAGES, transfer], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env={**os.environ, "MLX_RANK": str(r),
                                                             "MLX_HOSTFILE": str(hostfile)})
             for r in range(3)]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out.decode()
        outs.append(out.decode().split(maxsplit=1)[1].strip())
    x = [1.0, -2.0, 0.5]
    once = [((v * 4 + 2) * 3 + 1) * 2 for v in x]  # rank 2, then 1, then 0
    twice = [((v * 4 + 2) * 3 + 1) * 2 for v in once]
    assert outs == [f"{[once]} {[once]} {[twice]}"] * 3  # the same on every rank


def test_pipeline_flags_reach_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_relay.cli import build_parser, config_from_args

    monkeypatch.setenv("MLX_RANK", "1")
    args = build_parser().parse_args(["serve", "m", "--pipeline", "--pipeline-backend", "ring",
                                      "--pipeline-split", "5,3"])
    assert config_from_args(args).engine.pipeline == PipelineConfig(True, "ring", (5, 3), rank=1)
    args = build_parser().parse_args(["serve", "m", "--pipeline", "--pipeline-transfer", "collective"])
    assert config_from_args(args).engine.pipeline.transfer == "collective"
    assert not config_from_args(build_parser().parse_args(["serve", "m"])).engine.pipeline.enabled
    with pytest.raises(ValueError, match="disk tier"):  # each rank's snapshot would be a file of its own
        config_from_args(build_parser().parse_args(["serve", "m", "--pipeline", "--prefix-cache-dir", "/tmp/x"]))
    monkeypatch.delenv("MLX_RANK")
    with pytest.raises(SystemExit, match=r"mlx\.launch"):
        config_from_args(build_parser().parse_args(["serve", "m", "--pipeline"]))


def test_a_dead_rank_fails_the_server_instead_of_hanging_it(
        eight_layers: Path, tmp_path: Path) -> None:
    """SIGKILL rank 1 with a stream in flight: rank 0's GPU thread is stuck in a collective that
    never returns, but rank 0 watches rank 1 outside MLX (pipeline_watch.py): the stream ends with
    an error event, /health says failed, new requests get 503, and rank 0 exits 1 (its engine is
    not restarted in-process)."""
    for url, ranks in _launch(eight_layers, tmp_path, ["--no-warmup", "--no-mtp"]):
        events: list[dict[str, Any]] = []
        body = {"model": NAME, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 1000,
                "temperature": 0, "stream": True}
        with local_http.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[6:]))
                if len(events) == 3:  # tokens are flowing over both ranks: kill the follower
                    ranks[1].kill()
        assert ranks[1].wait(10) == -signal.SIGKILL
        assert "error" in events[-1] and all("error" not in e for e in events[:-1]), events[-1]
        assert events[-1]["error"]["type"] == "server_error"
        health = None
        try:
            health = local_http.get(url + "/health", timeout=5)
        except httpx.TransportError:  # rank 0 has already exited
            pass
        if health is not None:
            assert health.status_code == 503 and health.json()["status"] in ("failed", "degraded"), health.text
        assert ranks[0].wait(30) == 1
