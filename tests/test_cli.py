"""`mlx-relay serve` as a user runs it: a real process, its startup line, /health, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import free_port


def test_help_lists_the_serving_flags() -> None:
    out = subprocess.run([sys.executable, "-m", "mlx_relay.cli", "serve", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for flag in ("--host", "--port", "--max-num-seqs", "--max-queue", "--api-key", "MODEL"):
        assert flag in out


def test_serve_without_a_model_serves_the_embedded_relay_tiny_agent() -> None:
    """`make serve` runs `mlx-relay serve` with no MODEL: the trained agent checkpoint shipped in the
    package, served under its own name (the name the README's curl and openai examples send)."""
    from mlx_relay.cli import build_parser, config_from_args

    config = config_from_args(build_parser().parse_args(["serve"]))
    assert config.served_model_name == "relay-tiny-agent"
    assert Path(config.model).name == "relay-tiny-agent" and (Path(config.model) / "model.safetensors").is_file()


def test_memory_limit_flags_reach_the_engine_config() -> None:
    from mlx_relay.cli import build_parser, config_from_args

    args = build_parser().parse_args(["serve", "m", "--memory-limit-gb", "60", "--cache-limit-gb", "0.5"])
    engine = config_from_args(args).engine
    assert engine.memory_limit_bytes == 60 << 30 and engine.cache_limit_bytes == 512 << 20
    args = build_parser().parse_args(["serve", "m"])
    assert config_from_args(args).engine.memory_limit_bytes is None


def test_log_flags_reach_the_config() -> None:
    from mlx_relay.cli import build_parser, config_from_args

    config = config_from_args(build_parser().parse_args(["serve", "m", "--log-format", "json", "--log-prompts"]))
    assert config.log_format == "json" and config.log_prompts
    config = config_from_args(build_parser().parse_args(["serve", "m"]))
    assert config.log_format == "text" and not config.log_prompts and config.drain_timeout_s == 30.0


def test_prefix_disk_flags_reach_the_engine_config() -> None:
    from mlx_relay.cli import build_parser, config_from_args

    args = build_parser().parse_args([
        "serve", "m", "--prefix-cache-dir", "/ssd/relay", "--prefix-cache-disk-gb", "2.5",
        "--prefix-cache-preload", "0.25"])
    engine = config_from_args(args).engine
    assert engine.prefix_cache_dir == "/ssd/relay" and engine.prefix_cache_disk_bytes == 5 << 29
    assert engine.prefix_cache_preload == 0.25
    engine = config_from_args(build_parser().parse_args(["serve", "m"])).engine
    assert engine.prefix_cache_dir is None and engine.prefix_cache_disk_bytes == 20 << 30
    assert engine.prefix_cache_preload == 0.5


def test_specprefill_anchor_flags_reach_the_specprefill_config() -> None:
    from mlx_relay.cli import build_parser, config_from_args

    sp = config_from_args(build_parser().parse_args(["serve", "m"])).specprefill
    assert (sp.anchor_ngram, sp.anchor_query_tokens, sp.anchor_max_occurrences, sp.anchor_follow,
            sp.anchor_max_share) == (2, 64, 4, 16, 0.5)
    args = build_parser().parse_args([
        "serve", "m", "--specprefill-anchor-ngram", "0", "--specprefill-anchor-query-tokens", "32",
        "--specprefill-anchor-max-occurrences", "8", "--specprefill-anchor-follow", "0",
        "--specprefill-anchor-max-share", "1"])
    sp = config_from_args(args).specprefill
    assert (sp.anchor_ngram, sp.anchor_query_tokens, sp.anchor_max_occurrences, sp.anchor_follow,
            sp.anchor_max_share) == (0, 32, 8, 0, 1.0)


@pytest.mark.parametrize("value", ["1.5", "-0.1", "half"])
def test_a_preload_fraction_outside_0_to_1_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from mlx_relay.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "m", "--prefix-cache-preload", value])
    assert exited.value.code == 2 and "--prefix-cache-preload" in capsys.readouterr().err


def test_engine_process_flag_reaches_the_engine_config_and_auto_is_the_thread_on_cpu() -> None:
    from mlx_relay.cli import build_parser, config_from_args
    from mlx_relay.engine.hosting.placement import wants_process

    engine = config_from_args(build_parser().parse_args(["serve", "m", "--engine-process", "on"])).engine
    assert engine.engine_process == "on" and wants_process(engine)
    engine = config_from_args(build_parser().parse_args(["serve", "m"])).engine
    assert engine.engine_process == "auto" and not wants_process(engine)  # these tests run on MLX's CPU backend


def test_serve_starts_announces_and_stops(fp32_model: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_relay.cli", "serve", str(fp32_model), "--port", str(port),
         "--served-model-name", "tiny", "--max-num-seqs", "2", "--memory-limit-gb", "8", "--cache-limit-gb", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("mlx-relay ready: model tiny"), line
        assert "CPU backend" in line or "METAL backend" in line or "CUDA backend" in line
        assert f"http://127.0.0.1:{port}" in line
        assert local_http.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ready"
        r = local_http.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    assert proc.returncode == 0
    _, err = proc.communicate()
    assert "loading" in err and "warming kernels" in err  # the progress display


def test_serve_fails_cleanly_on_a_missing_model(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    missing.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_relay.cli", "serve", str(missing), "--port", str(free_port())],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert "could not load" in proc.stderr
