"""/v1/completions on the float32 tiny model: raw prompts (text, token ids, several), n, echo,
logprobs, streaming, and 4xx for what the API does not allow."""

from __future__ import annotations

import openai
import pytest

from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import LiveServer


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def test_text_prompts_choices_echo_and_logprobs(client: openai.OpenAI) -> None:
    done = client.completions.create(model="tiny", prompt=["def add(a, b):", "import os"], max_tokens=6,
                                     temperature=0, n=2, logprobs=2, echo=True)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    assert done.choices[0].text.startswith("def add(a, b):") and done.choices[2].text.startswith("import os")
    assert done.choices[0].text == done.choices[1].text  # greedy: both choices agree
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset[0] == len("def add(a, b):")
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert done.usage.completion_tokens == 24


def test_raw_prompt_is_not_templated(client: openai.OpenAI, server: LiveServer) -> None:
    done = client.completions.create(model="tiny", prompt="def f():", max_tokens=4, temperature=0)
    assert done.usage.prompt_tokens < 8  # the bare text, no chat markup around it
    ids = local_http.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3},
                     timeout=60).json()
    assert ids["usage"]["prompt_tokens"] == 3 and ids["object"] == "text_completion"


def test_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kw = {"model": "tiny", "prompt": "class Foo:", "max_tokens": 8, "temperature": 0}
    whole = client.completions.create(**kw).choices[0].text
    parts, finishes = [], []
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            parts.append(c.text)
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert "".join(parts) == whole and finishes == ["length"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1, 2, 10**9]}, "prompt"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": [], "max_tokens": 2}, "prompt"),
    ({"prompt": [[1, 2], "mixed"]}, "prompt"),
    ({"prompt": [1, 2], "echo": True}, "echo"),
])
def test_bad_completions_are_400(server: LiveServer, body: dict, param: str) -> None:
    r = local_http.post(server.url + "/v1/completions", json={"model": "tiny", "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
