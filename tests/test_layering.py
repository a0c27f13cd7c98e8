"""Layering that can be checked: a real server whose engine runs in a process of its own never loads
MLX (`mlx`, `mlx_lm`, `mlx_vlm`: not imported, no MLX library mapped) while its engine process does;
the runtime, the HTTP layer, the actors, the request path and the engine's protocol and process
host import no MLX, module by module; only the engine's thread host (and what it runs) does; and
the product never imports `mlx_relay.testing`."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import mlx_relay
from mlx_relay.bench.images import png_data_url
from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import free_port

PACKAGE = Path(mlx_relay.__file__).parent
MLX = ("mlx", "mlx.core", "mlx_vlm", "mlx_lm")
NO_MLX = ["mlx_relay", "mlx_relay.cli", "mlx_relay.relay", "mlx_relay.http.server", "mlx_relay.actors.gpu_executor",
          "mlx_relay.engine.protocol", "mlx_relay.engine.hosting.wire", "mlx_relay.engine.hosting.engine_process",
          "mlx_relay.engine.hosting.placement", "mlx_relay.engine.hosting.handle",
          "mlx_relay.engine.hosting.pipeline_watch", "mlx_relay.engine.models.checkpoint",
          "mlx_relay.engine.models", "mlx_relay.engine.scheduling.token_budget", "mlx_relay.engine.memory.cuda_memory",
          # the engine's role folders: importing a folder imports none of its modules
          *(f"mlx_relay.engine.{p.parent.name}" for p in sorted((PACKAGE / "engine").glob("*/__init__.py"))),
          "mlx_relay.media.preprocess",
          "mlx_relay.runtime", "mlx_relay.service", "mlx_relay.config", "mlx_relay.messages.gpu",
          "mlx_relay.messages.prompt", "mlx_relay.messages.prefix_cache", "mlx_relay.messages.specprefill",
          "mlx_relay.messages.text_mtp", "mlx_relay.messages.vision", "mlx_relay.messages.admission",
          *(f"mlx_relay.actors.{p.stem}" for p in sorted((PACKAGE / "actors").glob("*.py"))
            if p.stem != "__init__"),
          *("mlx_relay." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts)
            for p in sorted((PACKAGE / "http").rglob("*.py")) if p.stem != "__init__"),
          *(f"mlx_relay.metrics.{p.stem}" for p in sorted((PACKAGE / "metrics").glob("*.py")) if p.stem != "__init__"),
          # several models: the pool, its reservations (engine/models/footprint.py) and views
          "mlx_relay.engine.models.footprint", "mlx_relay.engine.models.kv_format",
          *(f"mlx_relay.pool.{p.stem}" for p in sorted((PACKAGE / "pool").glob("*.py")) if p.stem != "__init__")]


def test_the_runtime_http_the_request_path_and_every_actor_but_the_gpu_executor_import_no_mlx() -> None:
    code = ("import importlib, json, sys\n"
            f"for m in {NO_MLX!r}: importlib.import_module(m)\n"
            f"print(json.dumps([k for k in {MLX!r} if k in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    assert "mlx_relay.actors.text_mtp_executor" in NO_MLX and "mlx_relay.http.app" in NO_MLX
    assert "mlx_relay.http.server" in NO_MLX and "mlx_relay.http.streaming" in NO_MLX
    assert "mlx_relay.http.formats.responses.routes" in NO_MLX and "mlx_relay.pool.pool" in NO_MLX
    assert {"mlx_relay.engine.hosting", "mlx_relay.engine.lanes", "mlx_relay.engine.step"} <= set(NO_MLX)


def test_the_lanes_and_the_engine_step_import_nothing_of_each_other() -> None:
    """The step drives the lanes through their interface; what both use (the interface and its
    values, the sampling processors, the token budget) lives where both import it (`engine/lane.py`,
    `engine/sampling/`, `engine/scheduling/`), and which lanes run is chosen in `engine/lane_set.py`."""
    for package, other in (("lanes", "step"), ("step", "lanes")):
        for path in sorted((PACKAGE / "engine" / package).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [node.module] if isinstance(node, ast.ImportFrom) and node.module is not None else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                for name in names:
                    assert not name.startswith(f"mlx_relay.engine.{other}"), (package, path.name, name)


def test_nothing_outside_the_models_package_imports_a_family() -> None:
    """A family is reached through the registry (`engine/models/__init__.py`: `family_for`,
    `family_of`, `declared`), never by importing its package: adding a family edits no module
    outside `engine/models/`."""
    from mlx_relay.engine.models import FAMILY_PACKAGES

    models = PACKAGE / "engine" / "models"
    for path in sorted(PACKAGE.rglob("*.py")):
        if models in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module is not None else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                assert not any(name == p or name.startswith(p + ".") for p in FAMILY_PACKAGES), (str(path), name)


MAX_CLASS_LINES = 300  # small files with one job: no class of the product over this (ARCHITECTURE.md)


def test_no_class_of_the_product_is_over_300_lines() -> None:
    root = Path(mlx_relay.__file__).parent
    over = [(f"{path.relative_to(root)}:{node.name}", node.end_lineno - node.lineno + 1)
            for path in root.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert not over, over


def test_the_engines_thread_host_is_where_mlx_is() -> None:
    code = "import sys, mlx_relay.engine.hosting.local_engine; print('mlx.core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "True"


def _mlx_in_maps(pid: int) -> list[str]:
    """The MLX libraries (libmlx, the `mlx` package's extension modules) mapped into `pid`."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted({line.split()[-1] for line in lines if "libmlx" in line or f"{os.sep}mlx{os.sep}" in line})


def _engine_child(pid: int) -> int:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"mlx_relay.engine.hosting.process_main" in cmdline:
            return int(stat.parent.name)
    raise AssertionError(f"no engine process under {pid}")


def test_a_server_whose_engine_runs_in_its_own_process_never_loads_mlx(fp32_model: Path, tmp_path: Path) -> None:
    """`mlx-relay serve --engine-process on` as a real process (`-X importtime`: every module it
    imports is written to its stderr) serves a chat with an image and tools (the tokenizer, the
    chat template, the media processor, the tool-call parser), a streamed one with an output grammar,
    and a metrics scrape; its imports
    name no MLX package and no MLX library is mapped into it, while its engine process maps them."""
    port = free_port()
    log = tmp_path / "server.stderr"
    with log.open("wb") as err:
        server = subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", "mlx_relay.cli", "serve", str(fp32_model), "--port", str(port),
             "--engine-process", "on", "--no-warmup", "--served-model-name", "tiny", "--max-num-seqs", "2"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        assert server.stdout is not None
        ready = server.stdout.readline()  # the start-up line once ready (as test_cli reads it); "" if it exited
        assert ready.startswith("mlx-relay ready"), log.read_text(errors="replace")[-3000:]
        tools = [{"type": "function", "function": {"name": "run_tests", "description": "Run the test suite",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        content = [{"type": "text", "text": "What is in the picture? Then run the tests."},
                   {"type": "image_url", "image_url": {"url": png_data_url([1], 64, 48)}}]
        r = local_http.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": content}], "tools": tools, "max_tokens": 8,
            "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 64  # the image was expanded into the prompt
        body = {"model": "tiny", "messages": [{"role": "user", "content": "A JSON object, please."}], "max_tokens": 8,
                "response_format": {"type": "json_object"}, "stream": True}
        with local_http.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as streamed:
            assert streamed.status_code == 200
            assert [line for line in streamed.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
        assert local_http.get(url + "/metrics", timeout=30).status_code == 200
        engine = _engine_child(server.pid)
        served, engines = _mlx_in_maps(server.pid), _mlx_in_maps(engine)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    imported = [line.rsplit("|", 1)[1].strip() for line in log.read_text(errors="replace").splitlines()
                if line.startswith("import time:") and "|" in line]
    # the audit is live, and saw the request path's late imports (the output grammar's tokenizer)
    assert {"mlx_relay.relay", "mlx_relay.actors.gpu_executor", "llguidance.hf"} <= set(imported)
    assert [m for m in imported if m.split(".")[0] in ("mlx", "mlx_lm", "mlx_vlm")] == []
    assert served == []
    assert any(Path(p).name.startswith(("libmlx", "core.cpython")) for p in engines), engines


def test_the_product_does_not_import_the_testing_package() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "testing":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{rel}: {n}" for n in names if n.startswith("mlx_relay.testing")]
    assert offenders == []


def test_every_file_architecture_md_names_exists() -> None:
    """ARCHITECTURE.md stays true to the tree: each file or folder it names in backticks is there
    (a path with a folder under the repository, the package or its engine; a bare file name
    somewhere in the repository's code, tests or tools; checkpoint files aside)."""
    repo = Path(mlx_relay.__file__).parents[1]
    text = (repo / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`([A-Za-z0-9_./-]+\.(?:py|md|sh|jinja|toml))[`:]", text))
    named |= set(re.findall(r"`((?:mlx_relay|engine|actors|http|chat|cache|media|tests|benchmarks|tools|docs)/"
                            r"[A-Za-z0-9_./-]*)`", text))
    bases = (repo, repo / "mlx_relay", repo / "mlx_relay" / "engine", repo / "mlx_relay" / "engine" / "models")
    roots = [repo / d for d in ("mlx_relay", "tests", "benchmarks", "tools")]

    def there(name: str) -> bool:
        folder, _, last = name.rpartition("/")
        module, dot, symbol = last.partition(".")
        if dot and symbol.split(".")[0] not in ("py", "md", "sh", "jinja", "toml"):  # `pkg/module.Symbol`
            files = [base / folder / f"{module}.py" for base in bases]
            return any(f.exists() and re.search(rf"\b{symbol}\b", f.read_text()) for f in files)
        if any((base / name).exists() for base in bases):
            return True
        return not folder and any(next(r.rglob(name), None) for r in roots)

    missing = [name for name in sorted(named) if not there(name)]
    assert len(named) > 100 and not missing, missing
