"""Plain-HTTP calls of the test suite to the servers it starts on this machine (`http://127.0.0.1`).

    from mlx_relay.testing import local_http
    r = local_http.post(url + "/v1/chat/completions", json=body, timeout=60)

httpx's module-level `get` / `post` / `stream` / `delete`, with `verify=False`: each of httpx's calls
builds a client, and a client that verifies certificates loads certifi's CA bundle into a new SSL
context (about 20 ms of CPU a call: 8.5% of the suite's samples under py-spy, more than any engine
function). These URLs are plain HTTP, so nothing is verified either way; the calls are otherwise
httpx's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx


def get(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(url, verify=False, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(url, verify=False, **kwargs)


def delete(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.delete(url, verify=False, **kwargs)


@contextmanager
def stream(method: str, url: str, **kwargs: Any) -> Iterator[httpx.Response]:
    with httpx.stream(method, url, verify=False, **kwargs) as response:
        yield response
