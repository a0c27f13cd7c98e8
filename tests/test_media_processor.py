"""The front end's tokenizer and Qwen-VL processors (transformers and `media/qwen_vl.py`, no MLX)
give what mlx-vlm's give, which the engine and the server used before: the same token ids on the
fixtures and the embedded model, the same prompt vocabulary, and the same pixel values and grids,
bit for bit, for images and videos of many shapes (small ones scaled up, large ones down)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlx_relay.actors.normalizer import load_tokenizer
from mlx_relay.default_model import default_model_path
from mlx_relay.media.preprocess import VisionProcessor, load_vision_processor
from mlx_relay.testing.reference import vlm_processor

TEXTS = ["Hello, world!", "def f(x):\n    return x ** 2  # 平方", "<|im_start|>user\nhi<|im_end|>\n<think>\n",
         "  spaces\tand\ttabs\n\n\nand émojis 🚀 and <|vision_start|><|image_pad|><|vision_end|>"]


@pytest.fixture(scope="module", params=["fp32", "agent"])
def pair(request: pytest.FixtureRequest, fp32_model: Path) -> tuple[VisionProcessor, Any]:
    model = fp32_model if request.param == "fp32" else default_model_path()
    return load_vision_processor(model), vlm_processor(model)


def test_token_ids_the_chat_template_and_the_prompt_vocabulary_are_mlx_vlms(
        pair: tuple[VisionProcessor, Any]) -> None:
    ours, ref = pair
    normalizer = load_tokenizer(Path(ours.tokenizer.name_or_path))
    for text in TEXTS:
        ids = list(ref.tokenizer.encode(text, add_special_tokens=False))
        assert list(ours.tokenizer.encode(text, add_special_tokens=False)) == ids
        assert list(normalizer.encode(text, add_special_tokens=False)) == ids
    chat = [{"role": "system", "content": TEXTS[1]}, {"role": "user", "content": TEXTS[3]}]
    rendered = ref.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert normalizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == rendered
    vocab = ours.vocab
    assert (vocab.image_pad, vocab.video_pad, vocab.vision_start, vocab.vision_end) == (
        ref.image_token_id, ref.video_token_id, ref.vision_start_token_id, ref.vision_end_token_id)
    assert vocab.boundaries == frozenset(int(i) for i in ref.tokenizer.added_tokens_decoder)


@pytest.mark.parametrize("shape", [(48, 64), (224, 224), (17, 300), (1000, 700), (33, 35), (5, 900)])
def test_image_pixels_are_mlx_vlms(pair: tuple[VisionProcessor, Any], shape: tuple[int, int]) -> None:
    ours, ref = pair
    chw = np.random.default_rng(sum(shape)).integers(0, 256, (3, *shape), dtype=np.uint8)
    mine, theirs = ours.image_processor([chw]), ref.image_processor(images=[chw])
    assert np.array_equal(mine["image_grid_thw"], np.asarray(theirs["image_grid_thw"]))
    assert np.array_equal(mine["pixel_values"], np.asarray(theirs["pixel_values"]))


@pytest.mark.parametrize("shape", [(3, 48, 64), (4, 100, 80), (8, 480, 640), (2, 33, 300)])
def test_video_pixels_are_mlx_vlms(pair: tuple[VisionProcessor, Any], shape: tuple[int, int, int]) -> None:
    ours, ref = pair
    frames = np.random.default_rng(sum(shape)).integers(0, 256, (*shape, 3), dtype=np.uint8)
    mine, theirs = ours.video_processor([frames]), ref.video_processor(videos=[frames])
    assert np.array_equal(mine["video_grid_thw"], np.asarray(theirs["video_grid_thw"]))
    assert np.array_equal(mine["pixel_values_videos"], np.asarray(theirs["pixel_values_videos"]))
    assert ours.video_frame_bounds == (ref.video_processor.min_frames, ref.video_processor.max_frames)


def test_what_cannot_be_preprocessed_is_refused_alike(pair: tuple[VisionProcessor, Any]) -> None:
    ours, ref = pair
    wide = np.zeros((3, 2, 500), dtype=np.uint8)  # an aspect ratio past 200:1
    with pytest.raises(ValueError, match="aspect ratio"):
        ours.image_processor([wide])
    with pytest.raises(ValueError, match="aspect ratio"):
        ref.image_processor(images=[wide])
    tiny = np.zeros((2, 8, 8, 3), dtype=np.uint8)  # frames smaller than one merged patch
    with pytest.raises(ValueError, match="factor"):
        ours.video_processor([tiny])
    with pytest.raises(ValueError, match="factor"):
        ref.video_processor(videos=[tiny])


# --------------------------------------------------------------------------- Gemma 3


@pytest.fixture(scope="module")
def gemma3_pair() -> tuple[Any, Any]:
    from mlx_relay.media.served import load_media_processor
    from mlx_relay.testing.family_fixtures import family_fixture_path

    model = family_fixture_path("gemma3")
    return load_media_processor(model), vlm_processor(model)


@pytest.mark.parametrize("shape", [(32, 32), (48, 64), (17, 300), (300, 17), (1000, 700), (5, 5)])
def test_gemma3_image_pixels_are_mlx_vlms(gemma3_pair: tuple[Any, Any], shape: tuple[int, int]) -> None:
    """Resized to the processor's one size (PIL, its resample filter), rescaled and normalized in
    float32: bit for bit what mlx-vlm's Gemma 3 processor (transformers' PIL backend) gives."""
    from mlx_relay.media.gemma3 import Gemma3Processor

    ours, ref = gemma3_pair
    assert isinstance(ours, Gemma3Processor)
    hwc = np.random.default_rng(sum(shape)).integers(0, 256, (*shape, 3), dtype=np.uint8)
    mine = ours.image(hwc)
    theirs = np.asarray(ref.image_processor(images=[np.ascontiguousarray(hwc.transpose(2, 0, 1))])["pixel_values"][0])
    assert mine.dtype == np.float32 and theirs.dtype == np.float32
    assert mine.shape == theirs.shape == (3, ours.image.height, ours.image.width)
    assert np.array_equal(mine, theirs)


GEMMA_CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"},
                                  {"type": "text", "text": "and  say\n\nwhy."}]}],
    [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "image"}]},
     {"role": "assistant", "content": "ok"},
     {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " \n two \n"}, {"type": "image"}]}],
]


@pytest.mark.parametrize("chat", range(len(GEMMA_CHATS)))
def test_gemma3_image_tokens_expand_as_mlx_vlms_processor(gemma3_pair: tuple[Any, Any], chat: int) -> None:
    """Each `<start_of_image>` of the rendered prompt becomes "\\n\\n" + <start_of_image> + the image's
    soft tokens + <end_of_image> + "\\n\\n", tokenized with the text either side, on token ids: the
    ids equal the processor's on the text, and each span covers one image's soft tokens."""
    from mlx_relay.media.gemma3 import expand_images
    from mlx_relay.media.hashing import pixels_hash
    from mlx_relay.media.items import DecodedImage

    ours, ref = gemma3_pair
    normalizer = load_tokenizer(Path(ours.tokenizer.name_or_path))
    text = normalizer.apply_chat_template(GEMMA_CHATS[chat], add_generation_prompt=True, tokenize=False)
    prompt = list(normalizer.encode(text, add_special_tokens=False))
    n = text.count("<start_of_image>")
    rng = np.random.default_rng(chat)
    pictures = [rng.integers(0, 256, (20 + i, 40, 3), dtype=np.uint8) for i in range(n)]
    ours.check_placeholders(prompt, ["image"] * n)
    decoded = [DecodedImage(p, pixels_hash("image", p)) for p in pictures]
    tokens, vision = ours.process(decoded, [f"image {i}" for i in range(n)], prompt)
    theirs = ref(text=[text], images=[np.ascontiguousarray(p.transpose(2, 0, 1)) for p in pictures])
    assert tokens == np.asarray(theirs["input_ids"])[0].tolist()
    assert np.array_equal(vision.pixel_values.to_numpy(), np.asarray(theirs["pixel_values"]))
    assert vision.layout == "images" and vision.image_grid_thw is None
    soft = ref.image_token_id
    assert [tokens[a:b] for a, b in vision.spans] == [[soft] * ours.image_seq_length] * n
    assert sum(b - a for a, b in vision.spans) == tokens.count(soft)
    assert expand_images(prompt, ours.vocab, ours.image_seq_length) == tokens


def test_gemma3_refuses_video_and_stray_image_tokens(gemma3_pair: tuple[Any, Any]) -> None:
    from mlx_relay.media.errors import MediaKindNotServed, MediaPromptMismatch

    ours, _ref = gemma3_pair
    vocab = ours.vocab
    with pytest.raises(MediaKindNotServed, match="video"):
        ours.check_placeholders([1, vocab.start_of_image, 2], ["video"])
    with pytest.raises(MediaPromptMismatch):
        ours.check_placeholders([1, vocab.start_of_image, vocab.image_token, 2], ["image"])
    with pytest.raises(MediaPromptMismatch):
        ours.check_placeholders([1, vocab.start_of_image, 2], ["image", "image"])
