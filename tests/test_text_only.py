"""Text-only checkpoints (issue 4.4): a `Qwen3_5ForCausalLM` checkpoint with no vision tower,
with and without its `mtp.*` head, loads and serves through the same actors.

The text-only fixtures carry exactly the VLM fixture's language-model weights under text-only
names, so their greedy output must equal the VLM checkpoint's, token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_relay.engine.lanes.mtp_head import load_mtp_drafter
from mlx_relay.engine.models.loader import load_model
from mlx_relay.relay import Relay, default_config
from mlx_relay.testing import local_http
from mlx_relay.testing.fixtures import FixtureSpec, fixture_path
from mlx_relay.testing.live_server import LiveServer

MESSAGES = [
    [{"role": "user", "content": "def fib(n):"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write a haiku about batching"}],
]


def _text_fixture(layout: str) -> Path:
    return fixture_path(FixtureSpec(variant="fp32", seed=0, layout=layout))  # type: ignore[arg-type]


@pytest.mark.parametrize(("layout", "has_mtp"), [("text", True), ("text_no_mtp", False)])
def test_text_only_checkpoint_loads_without_a_vision_tower(gpu: Callable, layout: str, has_mtp: bool) -> None:
    loaded = gpu(lambda: load_model(_text_fixture(layout)))
    assert loaded.info.model_type == "qwen3_5_text"
    assert not loaded.info.has_vision
    assert loaded.info.has_mtp is has_mtp


def test_text_only_mtp_head_is_the_vlm_checkpoints_head(gpu: Callable, fp32_model: Path) -> None:
    """Pins the adapter: `load_drafter` alone would load the whole target for `qwen3_5_text`."""

    def run() -> tuple[dict[str, mx.array], dict[str, mx.array]]:
        ours = dict(tree_flatten(load_mtp_drafter(_text_fixture("text")).parameters()))
        vlm = dict(tree_flatten(load_mtp_drafter(fp32_model).parameters()))
        return ours, vlm

    ours, vlm = gpu(run)
    assert ours.keys() == vlm.keys() and ours
    for name, value in vlm.items():
        assert mx.array_equal(ours[name], value).item(), name


async def test_text_only_checkpoints_give_the_vlm_checkpoints_tokens(fp32_model: Path) -> None:
    async def greedy(path: Path) -> list[tuple[list[int], int]]:
        # every round verifies the head (no timed weighing: the counts below are the head's own)
        async with Relay.start(path, max_num_seqs=4, mtp_max_batch=4, mtp_policy="always",
                               context_policy="always") as relay:
            out = []
            for msgs in MESSAGES:
                result = await relay.chat(msgs, max_tokens=16, temperature=0)
                out.append((result.token_ids, result.mtp_drafted))
            return out

    vlm = await greedy(fp32_model)
    text = await greedy(_text_fixture("text"))
    text_plain = await greedy(_text_fixture("text_no_mtp"))
    assert [t for t, _ in text] == [t for t, _ in vlm] == [t for t, _ in text_plain]
    assert all(d > 0 for _, d in text)  # the text-only checkpoint's own head drafted
    assert all(d == 0 for _, d in text_plain)


def test_text_only_checkpoint_serves_over_http_and_refuses_images() -> None:
    config = default_config(_text_fixture("text"), served_model_name="tiny-text", max_num_seqs=4, mtp_policy="always",
                            context_policy="always")
    with LiveServer(config) as live:
        r = local_http.post(live.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny-text", "messages": MESSAGES[0], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 8 and body["usage"]["mtp"]["draft_tokens"] > 0
        image = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            {"type": "text", "text": "what is this?"}]}]
        r = local_http.post(live.url + "/v1/chat/completions", timeout=60,
                       json={"model": "tiny-text", "messages": image, "max_tokens": 8})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages" and "vision" in r.json()["error"]["message"]
        models = local_http.get(live.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny-text"]
        assert models["data"][0]["capabilities"]["vision"] is False
