"""Embedding models through mlx-embeddings (issue 47.1; `engine/embeddings/embedder.py`): a tiny
Qwen3-Embedding-layout checkpoint the project builds (`family_fixtures`, ``qwen3_embedding``:
float32, last-token pooling) gives, batched and padded as the engine runs it, each input's vector
as the library's own call on that input alone; unit norm; the checkpoint is told apart from a chat
model's, and a checkpoint whose pooling the library does not run is refused by name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlx_relay.testing.family_fixtures import family_fixture_path

INPUTS = [list(range(100, 112)), list(range(300, 303)), [7], list(range(40, 90))]


@pytest.fixture(scope="module")
def embed_path() -> Path:
    return family_fixture_path("qwen3_embedding")


def test_batched_vectors_are_the_library_s_alone(gpu: Callable, embed_path: Path) -> None:
    def run() -> dict[str, Any]:
        import mlx.core as mx
        import numpy as np
        from mlx_embeddings.utils import load

        from mlx_relay.engine.embeddings.embedder import Embedder

        embedder = Embedder.load(embed_path)
        batched = embedder.embed(INPUTS)
        model, _ = load(str(embed_path))
        alone = np.stack([np.array(model(mx.array([ids])).text_embeds[0]) for ids in INPUTS])
        return {"shape": batched.shape, "dtype": str(batched.dtype), "dims": embedder.dims,
                "diff": float(np.abs(batched - alone).max()), "norms": np.linalg.norm(batched, axis=1).tolist(),
                "distinct": float(np.abs(batched[0] - batched[1]).max())}

    got = gpu(run)
    assert got["shape"] == (len(INPUTS), got["dims"]) and got["dtype"] == "float32"
    assert got["diff"] <= 1e-5
    assert all(abs(n - 1.0) <= 1e-5 for n in got["norms"])
    assert got["distinct"] > 1e-3


def test_the_checkpoint_says_what_it_is(embed_path: Path) -> None:
    from mlx_relay.engine.models.checkpoint import embedding_pooling
    from mlx_relay.testing.fixtures import fixture_path

    assert embedding_pooling(embed_path) == "lasttoken"
    assert embedding_pooling(fixture_path()) is None
    assert embedding_pooling(family_fixture_path("qwen3")) is None


def test_a_pooling_the_library_does_not_run_is_refused(gpu: Callable, embed_path: Path, tmp_path: Path) -> None:
    mean = tmp_path / "mean"
    shutil.copytree(embed_path, mean)
    pooling = mean / "1_Pooling" / "config.json"
    flags = json.loads(pooling.read_text()) | {"pooling_mode_lasttoken": False, "pooling_mode_mean_tokens": True}
    pooling.write_text(json.dumps(flags))

    def run() -> str:
        from mlx_relay.engine.embeddings.embedder import Embedder
        from mlx_relay.errors import ModelLoadError

        try:
            Embedder.load(mean)
        except ModelLoadError as exc:
            return str(exc)
        return "loaded"

    said = gpu(run)
    assert "mean_tokens pooling are not served" in said and "qwen3 with lasttoken pooling" in said


def test_an_embedding_model_alone_is_refused_saying_how_to_serve_it(gpu: Callable, embed_path: Path) -> None:
    """As the model of a server (`load_model`) or a pool's entry of its own, an embedding checkpoint is
    refused at start, saying to serve it beside a chat model."""
    from mlx_relay.pool.build import pool_config
    from mlx_relay.pool.models_file import ModelEntry, ModelsConfigError, NamedEntry

    def run() -> str:
        from mlx_relay.engine.models.loader import load_model
        from mlx_relay.errors import ModelLoadError

        try:
            load_model(embed_path)
        except ModelLoadError as exc:
            return str(exc)
        return "loaded"

    assert "served beside a chat model: --embedding-model PATH" in gpu(run)
    with pytest.raises(ModelsConfigError, match=r"models.embed: an embedding model is served beside a chat model"):
        pool_config([NamedEntry("embed", ModelEntry(path=str(embed_path)), "f:3", "f:4")], {"warmup": False},
                    budget=None)


def test_an_embedding_request_runs_in_the_steps_prefill_share(gpu: Callable, embed_path: Path) -> None:
    """In the engine (`AddEmbedding`), beside a decoding row: its inputs run a batch a step within
    the step's prefill share (so over several steps here, where a step's budget is 16 tokens), the
    row emits a token every step meanwhile, and the vectors are the library's alone."""
    def run() -> dict[str, Any]:
        import mlx.core as mx
        import numpy as np
        from mlx_embeddings.utils import load

        from mlx_relay.engine.models.loader import load_model
        from mlx_relay.engine.protocol import AddEmbedding
        from mlx_relay.messages.gpu import EmbeddedVectors, Finished, Generate, SamplingParams, TokenDelta
        from mlx_relay.testing.engine_driver import Driver
        from mlx_relay.testing.fixtures import fixture_path

        d = Driver(load_model(fixture_path()), embedding_model=str(embed_path), speculation="none",
                   max_num_batched_tokens=16)
        d.add(Generate("chat", list(range(20, 30)), SamplingParams(max_tokens=40)))
        while len(d.tokens.get(0, [])) < 3:  # the row decodes first (past its first tokens)
            for sid, ev in d.engine.step().events:
                if isinstance(ev, TokenDelta):
                    d.tokens.setdefault(sid, []).extend(ev.token_ids)
        inputs = [list(range(100 + i, 106 + i)) for i in range(7)]  # 42 tokens: several steps' share
        d.engine.apply(AddEmbedding(rid=99, inputs=inputs))
        row_tokens, vectors, steps = [], None, 0
        while vectors is None:
            out = d.engine.step()
            steps += 1
            row_tokens.append(sum(len(ev.token_ids) for sid, ev in out.events
                                  if sid == 0 and isinstance(ev, TokenDelta)))
            for sid, ev in out.events:
                if sid == 99 and isinstance(ev, EmbeddedVectors):
                    vectors = np.frombuffer(ev.vectors, dtype="<f4").reshape(len(inputs), ev.dims)
                assert not isinstance(ev, Finished) or sid == 0
        model, _ = load(str(embed_path))
        ref = np.stack([np.array(model(mx.array([ids])).text_embeds[0]) for ids in inputs])
        d.engine.close()
        return {"steps": steps, "row_tokens": row_tokens, "diff": float(np.abs(vectors - ref).max())}

    got = gpu(run)
    assert got["steps"] >= 3 and all(n >= 1 for n in got["row_tokens"]), got
    assert got["diff"] <= 1e-5


def test_the_scores_memory_bounds_an_input_and_a_batch(gpu: Callable, embed_path: Path) -> None:
    """The library's attention holds heads x T x T float32 scores an input (about three copies): the
    served context is what fits `scores_bytes`, a batch's rows too (so no request runs the device out
    of memory: a longer input is refused by the route, naming the limit)."""
    def run() -> tuple[int, int, int, int]:
        from mlx_relay.engine.embeddings.embedder import Embedder

        roomy = Embedder.load(embed_path)
        tight = Embedder.load(embed_path, scores_bytes=4 * 12 * 1000 * 1000)  # 4 heads: 1,000 tokens
        return roomy.context, tight.context, tight.max_rows(1000), tight.max_rows(100)

    roomy, tight, rows_long, rows_short = gpu(run)
    assert roomy == 4096 and tight == 1000 and rows_long == 1 and rows_short == 100
