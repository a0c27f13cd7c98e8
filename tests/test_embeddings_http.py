"""`POST /v1/embeddings` (issue 47.1) on a real server: the chat fixture with the tiny
Qwen3-Embedding-layout checkpoint beside it (`--embedding-model`). OpenAI's SDK
(`client.embeddings.create`, base64 by default) and plain JSON get each input's vector as the
library's own call on that input alone (float32); token-id inputs, `dimensions` (cut and
renormalized) and usage; a bad request is a 400 in OpenAI's shape saying why (empty input, too many
items, an input past the context, ids outside the vocabulary, bad `dimensions`, the chat model named,
or a server without an embedding model), an unknown model a 404; and an embedding request sent while
a chat reply streams is answered before that stream ends (the engine runs it within its steps'
prefill share)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlx_relay.relay import default_config
from mlx_relay.testing import local_http
from mlx_relay.testing.family_fixtures import family_fixture_path
from mlx_relay.testing.fixtures import fixture_path
from mlx_relay.testing.live_server import LiveServer

TEXTS = ["def add(a, b): return a + b", "the ocean is deep", "x"]


@pytest.fixture(scope="module")
def embed_path() -> Path:
    return family_fixture_path("qwen3_embedding")


@pytest.fixture(scope="module")
def live(embed_path: Path) -> Iterator[LiveServer]:
    config = default_config(fixture_path(), served_model_name="tiny", max_num_seqs=4, warmup=False,
                            embedding_model=str(embed_path), embedding_model_name="embed")
    with LiveServer(config) as server:
        yield server


def library_vectors(path: Path, inputs: list[list[int]]) -> np.ndarray:
    """The library's own call, each input alone (in a subprocess-free way: the CPU backend here)."""
    import mlx.core as mx
    from mlx_embeddings.utils import load

    model, _ = load(str(path))
    return np.stack([np.array(model(mx.array([ids])).text_embeds[0]) for ids in inputs])


def post(live: LiveServer, **body: Any) -> Any:
    return local_http.post(live.url + "/v1/embeddings", json=body, timeout=60)


def test_the_openai_sdk_gets_the_library_s_vectors(live: LiveServer, embed_path: Path) -> None:
    from openai import OpenAI
    from transformers import AutoTokenizer

    client = OpenAI(base_url=live.url + "/v1", api_key="none")
    got = client.embeddings.create(model="embed", input=TEXTS)
    tok = AutoTokenizer.from_pretrained(str(embed_path))
    ids = [tok(t)["input_ids"] for t in TEXTS]
    ref = library_vectors(embed_path, ids)
    vectors = np.array([d.embedding for d in got.data], dtype=np.float32)
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == "embed"
    assert np.abs(vectors - ref).max() <= 1e-5
    assert got.usage.prompt_tokens == sum(len(x) for x in ids) == got.usage.total_tokens


def test_token_ids_floats_and_dimensions(live: LiveServer, embed_path: Path) -> None:
    ids = [[5, 6, 7, 8], [900, 12]]
    r = post(live, model="embed", input=ids, encoding_format="float")
    assert r.status_code == 200, r.text
    body = r.json()
    full = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert np.abs(full - library_vectors(embed_path, ids)).max() <= 1e-5
    assert body["object"] == "list" and body["usage"]["prompt_tokens"] == 6
    r = post(live, model="embed", input=ids[0], dimensions=16, encoding_format="float")
    cut = np.array(r.json()["data"][0]["embedding"], dtype=np.float32)
    assert cut.shape == (16,) and abs(float(np.linalg.norm(cut)) - 1) <= 1e-5
    assert np.abs(cut - full[0, :16] / np.linalg.norm(full[0, :16])).max() <= 1e-5


@pytest.mark.parametrize(("body", "status", "says"), [
    ({"model": "embed", "input": []}, 400, "must not be empty"),
    ({"model": "embed", "input": [[1, 2], []]}, 400, "input 1 is empty"),
    ({"model": "embed", "input": ["a"] * 2049}, 400, "at most 2048"),
    ({"model": "embed", "input": [[3] * 4097]}, 400, "maximum context length is 4096"),
    ({"model": "embed", "input": [[1, 10**9]]}, 400, "outside [0,"),
    ({"model": "embed", "input": "a", "dimensions": 0}, 400, "'dimensions' must be in [1, 64]"),
    ({"model": "embed", "input": ["a", [1, 2]]}, 400, "mixes texts and token ids"),
    ({"model": "tiny", "input": "a"}, 400, "is a chat model and serves no embeddings; embedding models here: embed"),
    ({"model": "nope", "input": "a"}, 404, "does not exist"),
])
def test_bad_requests_say_why(live: LiveServer, body: dict[str, Any], status: int, says: str) -> None:
    r = post(live, **body)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]["message"]


def test_a_server_without_an_embedding_model_says_so() -> None:
    with LiveServer(default_config(fixture_path(), served_model_name="tiny", warmup=False)) as server:
        r = post(server, model="tiny", input="a")
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_embedding"
    assert "no embedding model (--embedding-model)" in r.json()["error"]["message"]


def test_an_embedding_request_is_answered_while_a_stream_runs(live: LiveServer) -> None:
    order: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "count"}], "max_tokens": 200,
                "temperature": 0, "stream": True, "ignore_eos": True}
        with local_http.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    started.set()
        order.append("stream ended")

    worker = threading.Thread(target=stream)
    worker.start()
    assert started.wait(60)
    r = post(live, model="embed", input=TEXTS)
    order.append("embedded")
    worker.join(120)
    assert r.status_code == 200 and order == ["embedded", "stream ended"]


def test_a_pool_model_serves_its_embedding_model(embed_path: Path) -> None:
    """In a pool (`--models-config`), a model's table names an embedding model beside it; requests
    naming that embedding model reach it (loaded with its chat model), and the pool reserves its weights."""
    from mlx_relay.config import build_config
    from mlx_relay.engine.models.footprint import weights_bytes
    from mlx_relay.pool.build import pool_config
    from mlx_relay.pool.models_file import ModelEntry, NamedEntry
    from mlx_relay.pool.pool import ModelPool

    entry = ModelEntry(path=str(fixture_path()), embedding_model=str(embed_path), embedding_model_name="embed")
    plain = ModelEntry(path=str(family_fixture_path("qwen3")))
    settings = {"warmup": False, "max_num_seqs": 2}
    pool = pool_config([NamedEntry("chat", entry, "chat", "chat"), NamedEntry("other", plain, "other", "other")],
                       settings, budget=None)
    alone = pool_config([NamedEntry("chat", ModelEntry(path=str(fixture_path())), "chat", "chat")], settings,
                        budget=None)
    assert (pool.models[0].reservation.weights_bytes - alone.models[0].reservation.weights_bytes
            == weights_bytes(embed_path))
    first = pool.models[0].config
    config = build_config(first.model, served_model_name=first.served_model_name, **settings)
    with LiveServer(config, boot=ModelPool.boot(pool)) as live:
        ok = post(live, model="embed", input="hello")
        chat_model = post(live, model="other", input="hello")
        ids = {c["id"] for c in local_http.get(live.url + "/v1/models", timeout=30).json()["data"]}
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 64 and ids == {"chat", "other", "embed"}
    assert chat_model.status_code == 400 and "embedding models here: embed" in chat_model.json()["error"]["message"]


def test_the_indexing_example_finds_a_piece_by_its_own_text(live: LiveServer) -> None:
    """docs/examples/index_repo.py against the server: it indexes a folder of this repository and,
    asked with a piece's own text (no instruction), ranks that piece first. (The fixture's weights
    are random: it finds nothing by meaning; docs/embeddings.md says which model does.)"""
    import importlib.util

    from openai import OpenAI

    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("index_repo", repo / "docs" / "examples" / "index_repo.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    found = example.pieces(repo / "mlx_relay" / "engine" / "embeddings", ["*.py"], 20)
    client = OpenAI(base_url=live.url + "/v1", api_key="none")
    index = example.embed(client, "embed", [text for _, text in found], 8)
    places = [place for place, _ in found]
    hits = example.search(client, "embed", index, places, found[2][1], 3, instruct=None)
    assert len(found) > 3 and index.shape == (len(found), 64)
    assert len(hits) == 3 and hits[0][1] == places[2] and abs(hits[0][0] - 1.0) <= 1e-4


def test_concurrent_requests_each_get_their_own_vectors(live: LiveServer, embed_path: Path) -> None:
    """Requests at once (8 inputs of 100 tokens each), queued in the engine first come, first
    served: each gets the vectors of its own inputs."""
    from concurrent.futures import ThreadPoolExecutor

    requests = [[[(7 * r + i) % 900 + 1, *range(1, 100)] for i in range(8)] for r in range(3)]
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda ids: post(live, model="embed", input=ids, encoding_format="float"), requests))
    assert all(a.status_code == 200 for a in answers)
    for ids, a in zip(requests, answers, strict=True):
        got = np.array([d["embedding"] for d in a.json()["data"]], dtype=np.float32)
        assert np.abs(got - library_vectors(embed_path, ids)).max() <= 1e-4


def test_the_embedding_model_is_listed_with_its_card(live: LiveServer) -> None:
    """`GET /v1/models` lists the embedding model beside the chat model (capabilities: embeddings),
    and `GET /v1/models/embed` answers its card; OpenAI's SDK lists it."""
    from openai import OpenAI

    cards = {c["id"]: c for c in local_http.get(live.url + "/v1/models", timeout=30).json()["data"]}
    assert set(cards) == {"tiny", "embed"}
    assert cards["embed"]["capabilities"] == {"vision": False, "tools": False, "reasoning": False, "embeddings": True}
    assert cards["embed"]["context_length"] == 4096 and "embeddings" not in cards["tiny"]["capabilities"]
    one = local_http.get(live.url + "/v1/models/embed", timeout=30)
    assert one.status_code == 200 and one.json()["id"] == "embed"
    assert local_http.get(live.url + "/v1/models/nope", timeout=30).status_code == 404
    assert {m.id for m in OpenAI(base_url=live.url + "/v1", api_key="none").models.list()} == {"tiny", "embed"}


async def test_the_in_process_api_embeds(embed_path: Path) -> None:
    """`Relay.embed`: the same vectors as the route's, without HTTP; a relay without an embedding
    model says so."""
    from mlx_relay.errors import EmbeddingsUnavailable
    from mlx_relay.relay import Relay

    ids = [[5, 6, 7, 8], [900, 12]]
    async with Relay.start(fixture_path(), warmup=False, embedding_model=str(embed_path)) as relay:
        got = await relay.embed(ids)
    assert got.prompt_tokens == 6 and np.abs(got.vectors - library_vectors(embed_path, ids)).max() <= 1e-5
    async with Relay.start(fixture_path(), warmup=False) as plain:
        with pytest.raises(EmbeddingsUnavailable):
            await plain.embed(ids)


def test_the_engine_process_carries_embeddings(embed_path: Path) -> None:
    """With the engine in a process of its own (a GPU's default), the request and its vectors cross
    the pipe (`engine/hosting/wire.py`: the stream's `Embedded` event): the same vectors."""
    config = default_config(fixture_path(), served_model_name="tiny", warmup=False, engine_process="on",
                            embedding_model=str(embed_path), embedding_model_name="embed")
    ids = [[5, 6, 7, 8], [900, 12]]
    with LiveServer(config) as server:
        r = post(server, model="embed", input=ids, encoding_format="float")
    assert r.status_code == 200, r.text
    got = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
    assert np.abs(got - library_vectors(embed_path, ids)).max() <= 1e-5
