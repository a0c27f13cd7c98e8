"""Several models in one server (`mlx_relay/pool/`): three tiny real models (the two embedded ones
and the fp32 random fixture), each loaded in an engine process of its own when a request names it,
unloaded under a memory budget. Counts and states, never times: loads from `/metrics`, the order
of states from `/v1/models`, what a stream received while another model loaded."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlx_relay.config import build_config
from mlx_relay.default_model import default_model_path
from mlx_relay.errors import ModelNotFound
from mlx_relay.pool.build import pool_config
from mlx_relay.pool.config import PoolConfig
from mlx_relay.pool.models_file import ModelEntry, ModelsConfigError, NamedEntry, read_models_file
from mlx_relay.pool.pool import ModelPool
from mlx_relay.pool.reservation import Resident, make_room
from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import LiveServer

# a reply that cannot end on its own for thousands of tokens (as test_drain's)
ENDLESS = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
    "type": "object", "properties": {"s": {"type": "string", "minLength": 20000}}, "required": ["s"]}}}
SETTINGS: dict[str, Any] = dict(warmup=False, max_num_seqs=2, max_model_len=2048, prefix_cache_bytes=8 << 20,
                                cache_limit_bytes=8 << 20, speculation="mtp")


def paths(fp32_model: Path, tiny_coder: Path) -> dict[str, Path]:
    return {"agent": default_model_path(), "coder": tiny_coder, "rand": fp32_model}


def build_pool(models: dict[str, Path], *, budget: int | None, pinned: tuple[str, ...] = (),
               idle_ttl_s: float | None = None, contention: str = "wait", drain_timeout_s: float = 30.0,
               **settings: Any) -> PoolConfig:
    entries = [NamedEntry(name, ModelEntry(path=str(path), pinned=name in pinned, idle_ttl_s=idle_ttl_s), name, name)
               for name, path in models.items()]
    return pool_config(entries, {**SETTINGS, **settings}, budget=budget, contention=contention,  # type: ignore[arg-type]
                       drain_timeout_s=drain_timeout_s, load_wait_s=300)


def serve(pool: PoolConfig) -> LiveServer:
    first = pool.models[0].config
    return LiveServer(build_config(first.model, served_model_name=first.served_model_name, **SETTINGS),
                      boot=ModelPool.boot(pool))


def ask(url: str, model: str, max_tokens: int = 4) -> httpx.Response:
    return local_http.post(url + "/v1/chat/completions", timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens})


def states(url: str) -> dict[str, str]:
    return {card["id"]: card["state"] for card in local_http.get(url + "/v1/models", timeout=30).json()["data"]}


def card(url: str, name: str) -> dict[str, Any]:
    return local_http.get(url + f"/v1/models/{name}", timeout=30).json()  # type: ignore[no-any-return]


def counter(url: str, name: str, **labels: str) -> float:
    text = local_http.get(url + "/metrics", timeout=30).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in text.splitlines():
        if line.startswith(f"mlx_relay:{name}{{"):
            got = ",".join(sorted(re.findall(r'(\w+="[^"]*")', line.split("}")[0])))
            if all(part in got.split(",") for part in want.split(",")):
                total += float(line.rsplit(" ", 1)[1])
    return total


def stream_chat(url: str, body: dict[str, Any], out: list[str]) -> None:
    with local_http.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as r:
        out.append(f"status {r.status_code}")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line)


@pytest.fixture(scope="module")
def roomy(fp32_model: Path, tiny_coder: Path) -> Iterator[LiveServer]:
    """Three models, no budget: nothing is unloaded to make room."""
    with serve(build_pool(paths(fp32_model, tiny_coder), budget=None)) as live:
        yield live


def test_a_model_keeps_streaming_while_another_loads(roomy: LiveServer) -> None:
    url = roomy.url
    local_http.post(url + "/v1/models/coder/unload", timeout=300).raise_for_status()
    out: list[str] = []
    reader = threading.Thread(target=stream_chat, args=(url, {
        "model": "rand", "messages": [{"role": "user", "content": "go"}], "max_tokens": 600,
        "response_format": ENDLESS}, out), daemon=True)
    reader.start()
    while sum(line.startswith("data: {") for line in out) < 3:  # rand is loaded and streaming
        assert reader.is_alive(), out
        reader.join(0.05)
    before = len(out)
    loaded = local_http.post(url + "/v1/models/coder/load", timeout=300)
    during = len(out) - before
    reader.join(300)
    assert loaded.status_code == 200 and loaded.json()["state"] == "ready"
    assert during > 0  # rand's tokens kept coming while coder loaded (its own process)
    assert out[0] == "status 200" and out[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in "".join(out[-3:])


def test_concurrent_first_requests_load_a_model_once(roomy: LiveServer) -> None:
    url = roomy.url
    local_http.post(url + "/v1/models/agent/unload", timeout=300).raise_for_status()
    assert states(url)["agent"] == "unloaded"
    loads = counter(url, "model_loads_total", model_name="agent")
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda _: ask(url, "agent"), range(6)))
    assert [r.status_code for r in replies] == [200] * 6
    assert counter(url, "model_loads_total", model_name="agent") == loads + 1
    assert states(url)["agent"] == "ready"


def test_unloading_a_model_ends_its_streams_with_their_terminal_events(fp32_model: Path) -> None:
    with serve(build_pool({"rand": fp32_model}, budget=None, drain_timeout_s=0.5)) as live:
        out: list[str] = []
        reader = threading.Thread(target=stream_chat, args=(live.url, {
            "model": "rand", "messages": [{"role": "user", "content": "go"}], "max_tokens": 4000,
            "response_format": ENDLESS}, out), daemon=True)
        reader.start()
        while sum(line.startswith("data: {") for line in out) < 3:
            assert reader.is_alive(), out
            reader.join(0.05)
        unloaded = local_http.post(live.url + "/v1/models/rand/unload", timeout=300)
        reader.join(60)
        assert unloaded.json()["state"] == "unloaded"
        assert not reader.is_alive()
        assert out[-1] == "data: [DONE]" and '"error"' in out[-2]  # the drain's retryable error, then [DONE]
        assert counter(live.url, "model_unloads_total", model_name="rand", reason="request") == 1
        assert ask(live.url, "rand").status_code == 200  # loaded again on demand
        assert counter(live.url, "model_loads_total", model_name="rand") == 2


def test_an_unloaded_model_frees_its_prefix_cache_and_keeps_its_disk_tier(fp32_model: Path, tmp_path: Path) -> None:
    system = "You are a careful coding agent. Keep changes small and run the tests first. " * 4

    def chat(url: str, question: str) -> dict[str, Any]:
        reply = local_http.post(url + "/v1/chat/completions", timeout=300, json={
            "model": "rand", "max_tokens": 4, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": question}]})
        return reply.json()["usage"]  # type: ignore[no-any-return]

    pool = build_pool({"rand": fp32_model}, budget=None, prefix_cache_dir=str(tmp_path), prefix_min_snapshot_tokens=8)
    with serve(pool) as live:
        assert chat(live.url, "Fix utils.py")["prompt_tokens_details"]["cached_tokens"] == 0
        assert local_http.post(live.url + "/v1/models/rand/unload", timeout=300).json()["state"] == "unloaded"
        assert list(tmp_path.rglob("*.safetensors"))  # the disk tier stays
        again = chat(live.url, "Now fix main.py")  # a new engine: its memory tier starts empty
        assert again["prompt_tokens_details"]["cached_tokens"] > 0  # the system prompt, from the disk tier
        assert counter(live.url, "model_loads_total", model_name="rand") == 2


def test_a_budget_for_two_of_three_unloads_the_least_recently_used(fp32_model: Path, tiny_coder: Path) -> None:
    models = paths(fp32_model, tiny_coder)
    sizes = {m.name: m.reservation.total for m in build_pool(models, budget=None).models}
    budget = sum(sizes.values()) - min(sizes.values())  # any two fit, all three do not
    with serve(build_pool(models, budget=budget)) as live:
        url = live.url
        for name in ("agent", "coder", "agent"):  # coder is now the least recently used
            assert ask(url, name).status_code == 200
        assert ask(url, "rand").status_code == 200
        assert states(url) == {"agent": "ready", "coder": "unloaded", "rand": "ready"}
        assert counter(url, "model_evictions_total", model_name="coder", reason="budget") == 1
        assert counter(url, "model_memory_reserved_peak_bytes") <= budget


def test_pinned_models_are_never_unloaded_for_room(fp32_model: Path, tiny_coder: Path) -> None:
    models = paths(fp32_model, tiny_coder)
    sizes = {m.name: m.reservation.total for m in build_pool(models, budget=None).models}
    budget = sum(sizes.values()) - min(sizes.values())
    with serve(build_pool(models, budget=budget, pinned=("agent",))) as live:
        url = live.url
        assert states(url)["agent"] == "ready"  # loaded at start
        for name in ("coder", "rand", "coder", "rand"):  # agent is the least recently used throughout
            assert ask(url, name).status_code == 200
            assert states(url)["agent"] == "ready"
        assert counter(url, "model_evictions_total", model_name="agent") == 0
        assert counter(url, "model_evictions_total", reason="budget") == 3


def test_two_loads_that_do_not_fit_together_are_serialized(fp32_model: Path, tiny_coder: Path) -> None:
    models = {k: v for k, v in paths(fp32_model, tiny_coder).items() if k != "agent"}
    sizes = {m.name: m.reservation.total for m in build_pool(models, budget=None).models}
    budget = max(sizes.values())  # one at a time
    with serve(build_pool(models, budget=budget)) as live:
        url = live.url
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda name: ask(url, name), ["coder", "rand", "coder", "rand"]))
        assert [r.status_code for r in replies] == [200] * 4
        assert counter(url, "model_memory_reserved_peak_bytes") <= budget
        assert counter(url, "model_evictions_total", reason="budget") >= 1
        assert list(states(url).values()).count("ready") == 1


def test_a_model_waiting_for_room_is_not_starved_by_a_steady_stream_to_another(fp32_model: Path,
                                                                               tiny_coder: Path) -> None:
    models = {k: v for k, v in paths(fp32_model, tiny_coder).items() if k != "agent"}
    sizes = {m.name: m.reservation.total for m in build_pool(models, budget=None).models}
    with serve(build_pool(models, budget=max(sizes.values()))) as live:
        url, done, out = live.url, [], []

        def run(name: str, body: dict[str, Any]) -> None:
            reply = local_http.post(url + "/v1/chat/completions", timeout=300, json={"model": name, **body})
            done.append((name, reply.status_code))

        long = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 300, "response_format": ENDLESS}
        first = threading.Thread(target=stream_chat, args=(url, {"model": "rand", **long}, out), daemon=True)
        first.start()
        while sum(line.startswith("data: {") for line in out) < 3:  # rand loaded and streaming
            first.join(0.05)
        short = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        waiter = threading.Thread(target=run, args=("coder", short), daemon=True)
        waiter.start()
        while card(url, "coder")["waiting"] < 1:  # coder waits for rand's room
            waiter.join(0.05)
        later = threading.Thread(target=run, args=("rand", short), daemon=True)
        later.start()  # rand is loaded, but yields to coder: this one waits for its turn
        for thread in (first, waiter, later):
            thread.join(300)
        assert out[-1] == "data: [DONE]"
        assert done == [("coder", 200), ("rand", 200)]  # coder before the later rand request
        assert counter(url, "model_loads_total", model_name="rand") == 2
        assert counter(url, "model_memory_reserved_peak_bytes") <= max(sizes.values())


def test_contention_fail_answers_503_with_retry_after(fp32_model: Path, tiny_coder: Path) -> None:
    models = {k: v for k, v in paths(fp32_model, tiny_coder).items() if k != "agent"}
    sizes = {m.name: m.reservation.total for m in build_pool(models, budget=None).models}
    with serve(build_pool(models, budget=max(sizes.values()), pinned=("coder",), contention="fail")) as live:
        refused = ask(live.url, "rand")
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "model_memory_busy"
        assert states(live.url) == {"coder": "ready", "rand": "unloaded"}


def test_an_idle_model_unloads_after_its_ttl(fp32_model: Path) -> None:
    with serve(build_pool({"rand": fp32_model}, budget=None, idle_ttl_s=0.2)) as live:
        assert ask(live.url, "rand").status_code == 200
        live.call_served(lambda pool: pool.slots["rand"].unloaded.wait())  # type: ignore[attr-defined]
        assert states(live.url)["rand"] == "unloaded"
        assert counter(live.url, "model_evictions_total", model_name="rand", reason="idle") == 1


def test_bad_input_gets_a_clear_4xx(roomy: LiveServer, tmp_path: Path) -> None:
    url = roomy.url
    unknown = ask(url, "gpt-9")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found" and "agent, coder, rand" in unknown.text
    anthropic = local_http.post(url + "/v1/messages", timeout=30, json={
        "model": "gpt-9", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert anthropic.status_code == 404 and anthropic.json()["type"] == "error"
    not_a_model = local_http.post(url + "/v1/models/extra/load", timeout=30, json={"path": str(tmp_path)})
    assert not_a_model.status_code == 400 and not_a_model.json()["error"]["code"] == "invalid_model_path"
    assert local_http.post(url + "/v1/models/gpt-9/load", timeout=30).status_code == 404
    assert local_http.post(url + "/v1/models/agent/load", timeout=30, json={"pinned": "yes"}).status_code in (400, 422)
    assert "extra" not in states(url)


def test_a_models_file_with_errors_names_the_line(tmp_path: Path) -> None:
    file = tmp_path / "models.toml"
    file.write_text('[models.a]\npath = "x"\n\n[models.b]\npath = "y"\npinnd = true\n')
    with pytest.raises(ModelsConfigError, match=r"models\.toml:6: models\.b: .*pinnd"):
        read_models_file(file)
    file.write_text('[models.a]\npath = "x"\nmax_num_seqs = "many"\n')
    with pytest.raises(ModelsConfigError, match=r"models\.toml:3: .*max_num_seqs"):
        read_models_file(file)
    file.write_text('[models.a]\npath = "x"\nmax_num_seqs = \n')
    with pytest.raises(ModelsConfigError, match=r"line 3"):
        read_models_file(file)
    file.write_text(f'[models.a]\npath = "{tmp_path}"\n')
    cli = subprocess.run([sys.executable, "-m", "mlx_relay.cli", "serve", "--models-config", str(file)],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and "models.toml:2: models.a:" in cli.stderr and "not a model checkpoint" in cli.stderr


def test_make_room_takes_idle_unpinned_models_least_recently_used_first() -> None:
    resident = [Resident("a", 40, True, 3.0), Resident("b", 30, True, 1.0), Resident("c", 20, False, 0.0)]
    assert make_room(10, resident, 100) == []
    assert make_room(30, resident, 100) == ["b"]
    assert make_room(60, resident, 100) == ["b", "a"]
    assert make_room(90, resident, 100) is None  # c is in use (or pinned)
    assert make_room(10**9, resident, None) == []


def test_a_models_file_gives_each_model_its_own_settings(tmp_path: Path, fp32_model: Path) -> None:
    file = tmp_path / "models.toml"
    file.write_text(f'[models.big]\npath = "{fp32_model}"\naliases = ["claude-*", "*"]\npinned = true\n'
                    'max_num_seqs = 3\nmax_model_len = 1024\nspeculation = "context"\nprefix_cache_gb = 0.01\n'
                    'warmup = false\n\n[models.small]\npath = "rel"\nidle_ttl_s = 60\n')
    (tmp_path / "rel").mkdir()
    big, small = read_models_file(file)
    assert (big.name, big.entry.pinned, big.entry.aliases) == ("big", True, ["claude-*", "*"])
    assert big.entry.overrides() == {"max_num_seqs": 3, "max_model_len": 1024, "speculation": "context",
                                     "warmup": False, "prefix_cache_bytes": int(0.01 * (1 << 30))}
    assert small.entry.path == str(tmp_path / "rel") and small.entry.idle_ttl_s == 60  # relative to the file
    pool = pool_config([big], {"max_num_seqs": 8, "warmup": True}, budget=None)
    engine = pool.models[0].config.engine
    assert (engine.max_num_seqs, engine.max_model_len, engine.speculation, engine.warmup) == (3, 1024, "context", False)
    assert engine.engine_process == "on" and pool.models[0].reservation.decode_bytes > 0


def test_loading_and_unloading_by_hand_need_the_api_key(fp32_model: Path) -> None:
    pool = build_pool({"rand": fp32_model}, budget=None)
    first = pool.models[0].config
    config = build_config(first.model, served_model_name="rand", api_keys=("k1",), **SETTINGS)
    with LiveServer(config, boot=ModelPool.boot(pool)) as live:
        for action in ("load", "unload"):
            refused = local_http.post(f"{live.url}/v1/models/rand/{action}", timeout=30)
            assert refused.status_code == 401
        done = local_http.post(f"{live.url}/v1/models/rand/unload", timeout=30, headers={"Authorization": "Bearer k1"})
        assert done.status_code == 200 and done.json()["state"] == "unloaded"
        assert local_http.get(live.url + "/health", timeout=30).json()["models"] == {"rand": "unloaded"}


async def test_the_in_process_api_chats_with_each_model_by_name(fp32_model: Path, tiny_coder: Path) -> None:
    models = {k: v for k, v in paths(fp32_model, tiny_coder).items() if k != "agent"}
    pool_cfg = build_pool(models, budget=None)
    first = pool_cfg.models[0].config
    async with ModelPool.run(pool_cfg, build_config(first.model, served_model_name="coder", **SETTINGS)) as pool:
        messages = [{"role": "user", "content": "hi"}]
        coder = await pool.chat("coder", messages, max_tokens=4, temperature=0)
        streamed = [event async for event in pool.stream_chat("rand", messages, max_tokens=4, temperature=0)]
        assert coder.usage.completion_tokens == 4 and coder.finish_reason == "length"
        assert type(streamed[0]).__name__ == "ReplyStarted" and type(streamed[-1]).__name__ == "ReplyDone"
        assert {name: slot.state for name, slot in pool.slots.items()} == {"coder": "ready", "rand": "ready"}
        with pytest.raises(ModelNotFound):
            await pool.chat("gpt-9", messages)
