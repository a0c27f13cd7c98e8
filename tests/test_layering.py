"""Layering that can be checked: the runtime, the HTTP layer, the policy actors and the request path
never import MLX (only the GPUExecutor and the engine do), and the product never imports
`mlx_relay.testing`."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import mlx_relay

PACKAGE = Path(mlx_relay.__file__).parent
MLX = ("mlx.core", "mlx_vlm", "mlx_lm")
NO_MLX = ["mlx_relay", "mlx_relay.runtime", "mlx_relay.service", "mlx_relay.config", "mlx_relay.messages.gpu",
          "mlx_relay.messages.prompt", "mlx_relay.messages.prefix_cache", "mlx_relay.messages.specprefill",
          "mlx_relay.messages.text_mtp", "mlx_relay.messages.vision", "mlx_relay.messages.admission",
          *(f"mlx_relay.actors.{p.stem}" for p in sorted((PACKAGE / "actors").glob("*.py"))
            if p.stem not in ("__init__", "gpu_executor")),
          *("mlx_relay." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts)
            for p in sorted((PACKAGE / "http").rglob("*.py")) if p.stem != "__init__"),
          *(f"mlx_relay.metrics.{p.stem}" for p in sorted((PACKAGE / "metrics").glob("*.py")) if p.stem != "__init__")]


def test_the_runtime_http_the_request_path_and_every_actor_but_the_gpu_executor_import_no_mlx() -> None:
    code = ("import importlib, json, sys\n"
            f"for m in {NO_MLX!r}: importlib.import_module(m)\n"
            f"print(json.dumps([k for k in {MLX!r} if k in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    assert "mlx_relay.actors.text_mtp_executor" in NO_MLX and "mlx_relay.http.app" in NO_MLX
    assert "mlx_relay.http.server" in NO_MLX and "mlx_relay.http.streaming" in NO_MLX
    assert "mlx_relay.http.formats.responses.routes" in NO_MLX


def test_the_gpu_executor_is_where_mlx_is() -> None:
    code = "import sys, mlx_relay.actors.gpu_executor; print('mlx.core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "True"


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
