"""Bench safety: load goes to loopback only, unless a host is named with --allow-host; a refused
target is refused before anything is sent."""

from __future__ import annotations

import pytest

from mlx_relay.bench.client import HttpDriver
from mlx_relay.bench.errors import TargetError, UnsafeTarget
from mlx_relay.bench.safety import check_target, is_loopback_address
from mlx_relay.cli import main


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:8000/v1", "http://[::1]:9",
                                 "https://127.9.8.7", "http://LOCALHOST"])
def test_loopback_targets_pass(url: str) -> None:
    assert check_target(url)


@pytest.mark.parametrize(("url", "host"), [
    ("http://10.0.0.1:8000", "10.0.0.1"), ("http://192.168.1.20", "192.168.1.20"), ("http://8.8.8.8/v1", "8.8.8.8"),
    ("http://[2001:db8::1]:80", "2001:db8::1"), ("http://0.0.0.0:8000", "0.0.0.0"),
])
def test_other_targets_are_refused_without_allow_host(url: str, host: str) -> None:
    with pytest.raises(UnsafeTarget, match="--allow-host"):
        check_target(url)
    assert check_target(url, allow_hosts=[host]) == host  # named explicitly: allowed


def test_unresolvable_hosts_and_bad_urls() -> None:
    with pytest.raises(UnsafeTarget, match="cannot resolve"):
        check_target("http://no-such-host.invalid:8000")
    for url in ("ftp://127.0.0.1", "127.0.0.1:8000", "http://:80", "http://127.0.0.1:99999"):
        with pytest.raises(TargetError):
            check_target(url)
    assert is_loopback_address("::ffff:127.0.0.1") and is_loopback_address("::1")
    assert not is_loopback_address("::ffff:10.0.0.1") and not is_loopback_address("nonsense")


async def test_the_driver_refuses_before_sending() -> None:
    with pytest.raises(UnsafeTarget):
        async with HttpDriver.open("http://10.255.255.1:8000"):
            pass


def test_the_cli_refuses_a_remote_target(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--target", "http://10.255.255.1:8000", "--requests", "1", "--duration", "5"])
    err = capsys.readouterr().err
    assert code == 1
    assert "refusing to load '10.255.255.1'" in err and "--allow-host 10.255.255.1" in err
    assert main(["bench", "--requests", "1"]) == 1
    assert "--target" in capsys.readouterr().err
