"""MediaRouter: prompt expansion against the checkpoint processor's own, and the actor end to end."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from PIL import Image

from mlx_relay.actors.media_router import MediaRouter
from mlx_relay.bench.images import image_pixels, png_bytes, png_data_url
from mlx_relay.chat.normalize import normalize_messages, to_template_messages
from mlx_relay.chat.types import ChatMessage, ImageUrl, ImageUrlPart, TextPart, VideoUrlPart
from mlx_relay.config import MediaConfig
from mlx_relay.media.errors import MediaFetchError, MediaPromptMismatch, TooManyMedia
from mlx_relay.media.expand import MediaSlot, PromptVocab, expand_prompt, video_group_timestamps
from mlx_relay.media.items import FetchedMedia
from mlx_relay.media.pipeline import prepare_vision
from mlx_relay.media.preprocess import VisionProcessor, load_vision_processor
from mlx_relay.messages.prompt import Route, Routed
from mlx_relay.runtime import ActorSystem
from mlx_relay.testing.reference import vlm_processor


@pytest.fixture(scope="module")
def vision(fp32_model: Path) -> VisionProcessor:
    return load_vision_processor(fp32_model)


@pytest.fixture(scope="module")
def reference(fp32_model: Path) -> Any:
    """mlx-vlm's processor itself: its __call__ is the reference expansion (it returns MLX arrays,
    which only this test thread converts back)."""
    return vlm_processor(fp32_model)


def render(vision: VisionProcessor, messages: list[ChatMessage]) -> tuple[str, list[int]]:
    """What the Normalizer does: normalize, apply the chat template, tokenize."""
    text = vision.tokenizer.apply_chat_template(
        to_template_messages(normalize_messages(messages)), add_generation_prompt=True, tokenize=False
    )
    return text, list(vision.tokenizer.encode(text, add_special_tokens=False))


def mp4_bytes(path: Path, frames: int = 12, fps: float = 4.0) -> bytes:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (64, 48))
    for i in range(frames):
        writer.write(np.full((48, 64, 3), (i * 20) % 256, np.uint8))
    writer.release()
    return path.read_bytes()


def image_item(pixels: np.ndarray, n: int = 1) -> FetchedMedia:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return FetchedMedia(kind="image", data=buf.getvalue(), source="data", label=f"media item {n} (image)")


def user(*parts: TextPart | ImageUrlPart | VideoUrlPart) -> ChatMessage:
    return ChatMessage(role="user", content=list(parts))


def ids(array: Any) -> list[int]:
    return np.array(array).reshape(-1).tolist()


# ---------------------------------------------------------------------------------------------------------
# Expansion
# ---------------------------------------------------------------------------------------------------------


def test_image_expansion_matches_processor(vision: VisionProcessor, reference: Any) -> None:
    pictures = [image_pixels([1], 96, 64), image_pixels([2], 40, 200), image_pixels([3], 300, 250)]
    messages = [
        ChatMessage(role="system", content="Be brief."),
        user(TextPart("Compare "), ImageUrlPart("x"), TextPart(" and "), ImageUrlPart("y")),
        ChatMessage(role="assistant", content="Sure."),
        user(ImageUrlPart("z"), TextPart("and this?")),
    ]
    text, prompt = render(vision, messages)
    items = [image_item(p, i + 1) for i, p in enumerate(pictures)]
    tokens, inputs = prepare_vision(vision, MediaConfig(), items, prompt)
    ref = reference(text=[text], images=[Image.fromarray(p) for p in pictures])
    assert tokens == ids(ref["input_ids"])
    assert inputs.image_grid_thw is not None and inputs.pixel_values is not None
    np.testing.assert_array_equal(inputs.image_grid_thw.to_numpy(), np.array(ref["image_grid_thw"]))
    np.testing.assert_array_equal(inputs.pixel_values.to_numpy(), np.array(ref["pixel_values"]))
    assert inputs.image_grid_thw.to_numpy()[0].tolist() == [1, 4, 6]  # 96x64: 6 image tokens
    assert tokens.count(vision.vocab.image_pad) == sum(int(np.prod(g)) // 4 for g in inputs.image_grid_thw.to_numpy())
    assert inputs.pixel_values_videos is None and inputs.video_grid_thw is None
    assert len(inputs.content_hashes) == 3 and len(set(inputs.content_hashes)) == 3


def test_video_expansion_matches_processor(vision: VisionProcessor, reference: Any, tmp_path: Path) -> None:
    from mlx_relay.media.decode import decode_video

    video = FetchedMedia(kind="video", data=mp4_bytes(tmp_path / "v.mp4"), source="data", label="media item 2 (video)")
    picture = image_pixels([5], 64, 64)
    # text right before the video: its timestamp marker is tokenized together with "Describe: "
    text, prompt = render(vision, [user(ImageUrlPart("a"), TextPart("Describe: "), VideoUrlPart("b"), TextPart("ok"))])
    tokens, inputs = prepare_vision(vision, MediaConfig(), [image_item(picture), video], prompt)
    decoded = decode_video(video, MediaConfig(), min_frames=2, max_frames=8)
    ref = reference(text=[text], images=[Image.fromarray(picture)], videos=[decoded.frames],
                    video_metadata=[{"frames_indices": list(decoded.frame_indices), "fps": decoded.source_fps}])
    assert tokens == ids(ref["input_ids"])
    assert inputs.video_grid_thw is not None and inputs.pixel_values_videos is not None
    np.testing.assert_array_equal(inputs.video_grid_thw.to_numpy(), np.array(ref["video_grid_thw"]))
    np.testing.assert_array_equal(inputs.pixel_values_videos.to_numpy(), np.array(ref["pixel_values_videos"]))
    decoded_text = vision.tokenizer.decode(tokens)
    assert "Describe: <0.2 seconds><|vision_start|>" in decoded_text and "<2.5 seconds>" in decoded_text


def test_expand_prompt_rules() -> None:
    vocab = PromptVocab(image_pad=90, video_pad=91, vision_start=80, vision_end=81,
                        boundaries=frozenset({80, 81, 90, 91}), retokenize=lambda run, text: [*run, len(text)])
    assert expand_prompt([1, 80, 90, 81, 2], [MediaSlot("image", 3)], vocab) == [1, 80, 90, 90, 90, 81, 2]
    assert expand_prompt([5, 80, 91, 81], [MediaSlot("video", 2, (0.5, 1.5))], vocab) == [
        5, 13, 80, 91, 91, 81, 13, 80, 91, 91, 81]
    assert expand_prompt([91], [MediaSlot("video", 2, (0.5, 1.5))], vocab) == [91] * 4  # unwrapped: no markers
    with pytest.raises(MediaPromptMismatch):
        expand_prompt([1, 90, 90], [MediaSlot("image", 3)], vocab)
    with pytest.raises(MediaPromptMismatch):
        expand_prompt([1, 91], [MediaSlot("image", 3)], vocab)
    assert video_group_timestamps([0, 2, 4, 7, 9], 4.0, 2) == [0.25, 1.375, 2.25]


# ---------------------------------------------------------------------------------------------------------
# The actor
# ---------------------------------------------------------------------------------------------------------


async def test_router_end_to_end(fp32_model: Path, vision: VisionProcessor, reference: Any, tmp_path: Path) -> None:
    config = MediaConfig(max_images_per_request=2)
    async with ActorSystem() as system:
        router = await system.spawn(MediaRouter, config, fp32_model, name="media")

        text_messages = [ChatMessage(role="user", content="Hello!")]
        _, text_prompt = render(vision, text_messages)
        routed = await router.ask(Route(text_messages, text_prompt))
        assert routed == Routed(path="text", prompt_tokens=text_prompt, vision=None)

        url = png_data_url([7], 96, 64)
        messages = [user(TextPart("What is this?"), ImageUrlPart(ImageUrl(url=url, detail="high")))]
        text, prompt = render(vision, messages)
        routed = await router.ask(Route(messages, prompt))
        assert routed.path == "vision" and routed.vision is not None
        ref = reference(text=[text], images=[Image.open(io.BytesIO(png_bytes([7], 96, 64)))])
        assert routed.prompt_tokens == ids(ref["input_ids"])
        assert routed.prompt_tokens.count(vision.vocab.image_pad) == 6
        assert routed.vision.pixel_values is not None and routed.vision.pixel_values.shape == (24, 1536)
        np.testing.assert_array_equal(routed.vision.pixel_values.to_numpy(), np.array(ref["pixel_values"]))

        # the same picture as another data URL (other PNG bytes) hashes the same
        buf = io.BytesIO()
        Image.fromarray(image_pixels([7], 96, 64)).save(buf, format="PNG", compress_level=0)
        other = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        again = await router.ask(Route([user(ImageUrlPart(other))], render(vision, [user(ImageUrlPart(other))])[1]))
        assert again.vision is not None and again.vision.content_hashes == routed.vision.content_hashes

        video_messages = [user(VideoUrlPart("data:video/mp4;base64," + base64.b64encode(
            mp4_bytes(tmp_path / "v.mp4")).decode()), TextPart("What happens?"))]
        video = await router.ask(Route(video_messages, render(vision, video_messages)[1]))
        assert video.path == "vision" and video.vision is not None and video.vision.video_grid_thw is not None
        assert video.vision.video_grid_thw.to_numpy().tolist() == [[3, 4, 4]]

        # client errors answer the asker with a 400 and leave the actor running
        bad = [user(ImageUrlPart("data:image/png;base64,@@@"))]
        with pytest.raises(MediaFetchError) as info:
            await router.ask(Route(bad, render(vision, bad)[1]))
        assert info.value.status == 400
        with pytest.raises(MediaPromptMismatch):
            await router.ask(Route(messages, text_prompt))  # an image but no placeholder
        three = [user(ImageUrlPart(url), ImageUrlPart(url), ImageUrlPart(url))]
        with pytest.raises(TooManyMedia):
            await router.ask(Route(three, render(vision, three)[1]))
        assert (await router.ask(Route(messages, prompt))).prompt_tokens == routed.prompt_tokens
        assert system.cell("media").restarts == 0
