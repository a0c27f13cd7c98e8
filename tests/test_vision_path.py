"""The vision path end to end on the float32 tiny VLM: images go through the MediaRouter and the
vision tower, join the same continuous batch as text requests, and reuse encoded features."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from PIL import Image

from mlx_relay.relay import Relay
from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import LiveServer


def png_data_url(seed: int, size: tuple[int, int] = (64, 48)) -> str:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(text: str, *urls: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def test_image_request_over_http(server: LiveServer) -> None:
    body = {"model": "tiny", "messages": image_message("What is in this picture?", png_data_url(1)),
            "max_tokens": 8, "temperature": 0}
    r = local_http.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    text_only = local_http.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "What is in this picture?"}], "max_tokens": 8})
    # the image's placeholder was expanded into its patch tokens
    assert r.json()["usage"]["prompt_tokens"] > text_only.json()["usage"]["prompt_tokens"] + 2
    bad = dict(body, messages=image_message("x", "data:image/png;base64,not-base64!"))
    r = local_http.post(server.url + "/v1/chat/completions", json=bad, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    remote = dict(body, messages=image_message("x", "http://127.0.0.1:1/cat.png"))
    r = local_http.post(server.url + "/v1/chat/completions", json=remote, timeout=60)
    assert r.status_code == 400 and "allow" in r.json()["error"]["message"]


async def test_mixed_batch_returns_what_each_returns_alone(relay: Relay) -> None:
    requests: list[tuple[str, list[dict[str, Any]]]] = [
        ("image-a", image_message("Describe the image.", png_data_url(2))),
        ("text-1", [{"role": "user", "content": "Write a haiku about batching"}]),
        ("image-b", image_message("Compare them.", png_data_url(3, (96, 64)), png_data_url(4))),
        ("text-2", [{"role": "user", "content": "def fib(n):"}]),
    ]
    alone = {name: (await relay.chat(msgs, max_tokens=16, temperature=0)).token_ids for name, msgs in requests}
    together: dict[str, list[int]] = {}
    drafted: dict[str, int] = {}

    async def one(name: str, msgs: list[dict[str, Any]]) -> None:
        result = await relay.chat(msgs, max_tokens=16, temperature=0)
        together[name], drafted[name] = result.token_ids, result.mtp_drafted

    async with anyio.create_task_group() as tg:
        for name, msgs in requests:
            tg.start_soon(one, name, msgs)
    assert together == alone
    # the text requests decoded with MTP, the image ones on the vision path, in the same batch
    assert drafted["text-1"] > 0 and drafted["text-2"] > 0
    assert drafted["image-a"] == 0 and drafted["image-b"] == 0


async def test_a_repeated_image_is_not_re_encoded(relay: Relay) -> None:
    url = png_data_url(5)
    before = (await relay.prefix_cache_stats())["vision_cache"]
    first = await relay.chat(image_message("one", url), max_tokens=4, temperature=0)
    mid = (await relay.prefix_cache_stats())["vision_cache"]
    second = await relay.chat(image_message("two", url, png_data_url(6)), max_tokens=4, temperature=0)
    after = (await relay.prefix_cache_stats())["vision_cache"]
    assert first.completion_tokens and second.completion_tokens
    assert mid["misses"] == before["misses"] + 1
    assert after["hits"] == mid["hits"] + 1  # the repeated image
    assert after["misses"] == mid["misses"] + 1  # only the new one is encoded
    # the VisionExecutor's index and the features the GPU thread holds agree
    held = await relay.engine_stats()
    assert held.features == after["entries"] and held.feature_bytes == after["bytes"]


# -- the per-image encoding behind the feature cache equals encoding all images at once --------

def test_per_image_encoding_equals_whole_batch_encoding(gpu: Callable, fp32_model: Path) -> None:
    from mlx_relay.media.preprocess import load_vision_processor

    processor = load_vision_processor(fp32_model)

    def run() -> float:
        import mlx.core as mx
        import mlx_vlm

        from mlx_relay.engine.memory.features import FeatureStore

        model, _ = mlx_vlm.load(str(fp32_model))
        from mlx_relay.media.items import DecodedImage

        images = [DecodedImage(np.asarray(Image.open(io.BytesIO(base64.b64decode(png_data_url(s, size).split(",")[1])))
                                          .convert("RGB")), str(s))
                  for s, size in ((7, (64, 48)), (8, (96, 64)))]
        pixels, grid, _ = processor.preprocess_images(images, ["a", "b"])
        px, gr = mx.array(pixels), mx.array(grid)
        whole, *_ = model.vision_tower(px, gr)
        per_image = FeatureStore()._encode(model, px, gr, ("a", "b"), [])
        return float(mx.abs(whole - per_image).max())

    assert gpu(run) < 1e-4


def mp4_data_url(tmp_path: Path, frames: int = 8, fps: float = 4.0) -> str:
    import cv2

    path = tmp_path / "clip.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (64, 48))
    rng = np.random.default_rng(0)
    for _ in range(frames):
        writer.write(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8))
    writer.release()
    return "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()


async def test_video_request_and_local_files(fp32_model: Path, tmp_path: Path) -> None:
    video = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": mp4_data_url(tmp_path)}},
                                          {"type": "text", "text": "What happens?"}]}]
    allowed = tmp_path / "media"
    allowed.mkdir()
    png = allowed / "cat.png"
    png.write_bytes(base64.b64decode(png_data_url(9).split(",")[1]))
    async with Relay.start(fp32_model, warmup=False, allowed_local_dir=str(allowed)) as relay:
        alone = await relay.chat(video, max_tokens=6, temperature=0)
        assert alone.completion_tokens == 6 and alone.prompt_tokens > 20
        local = await relay.chat(image_message("describe", str(png)), max_tokens=4, temperature=0)
        same_as_data = await relay.chat(image_message("describe", png_data_url(9)), max_tokens=4, temperature=0)
        assert local.token_ids == same_as_data.token_ids
        outside = tmp_path / "secret.png"
        outside.write_bytes(png.read_bytes())
        from mlx_relay.errors import InvalidRequest

        with pytest.raises(InvalidRequest):
            await relay.chat(image_message("describe", str(outside)), max_tokens=4)
