"""What the wheel ships of the embedded models (issue 44.9): the package data `pyproject.toml`
declares expands, under `mlx_relay/`, to relay-tiny-agent's checkpoint alone; relay-tiny-coder
(the tests' and benchmarks' model) stays in the repository, outside the package. A wheel built at
`a45f1fe` (`pip wheel . --no-deps`) held 295 files, 27.4 MB, `mlx_relay/models/relay-tiny-agent/`
its only model."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _package_data() -> set[Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["mlx_relay"]
    return {p.relative_to(ROOT / "mlx_relay") for pattern in patterns for p in (ROOT / "mlx_relay").glob(pattern)
            if p.is_file()}


def test_only_relay_tiny_agent_ships_in_the_wheel() -> None:
    data = _package_data()
    models = {p.parts[1] for p in data if p.parts[0] == "models"}
    assert models == {"relay-tiny-agent"}
    assert Path("models/relay-tiny-agent/model.safetensors") in data
    assert Path("models/relay-tiny-agent/chat_template.jinja") in data


def test_relay_tiny_coder_stays_in_the_repository_outside_the_package() -> None:
    assert (ROOT / "models" / "relay-tiny-coder" / "config.json").is_file()
    assert not list((ROOT / "mlx_relay").rglob("relay-tiny-coder"))
