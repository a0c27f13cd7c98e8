"""Gemma 3's image preprocessing and image-token expansion in numpy and PIL (the MediaRouter's worker
thread; no MLX).

A Gemma 3 checkpoint's processor (`preprocessor_config.json`: transformers' `Gemma3ImageProcessor`,
its PIL backend, which mlx-vlm's `Gemma3Processor` loads) resizes every image to one fixed size
(`size.height` x `size.width`, PIL's `resample` filter), rescales it (float64 times
`rescale_factor`, then float32) and normalizes it per channel in float32; `pixel_values` is
(images, 3, height, width). The text side replaces each `<start_of_image>` of the rendered prompt
with ``"\\n\\n<start_of_image>" + <image_soft_token> x image_seq_length + "<end_of_image>\\n\\n"``
and tokenizes the result. This does the same on token ids: the tokenizer splits text at every added
token, so only the text runs either side of a `<start_of_image>` change (re-tokenized with their
new line breaks, as the whole text would tokenize). Pan and scan (extra crops of wide images) is
not done: a checkpoint that turns it on is refused at load. tests/test_media_processor.py pins the
pixels and the ids to mlx-vlm's processor, bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mlx_relay.media.errors import MediaKindNotServed, MediaPromptMismatch
from mlx_relay.media.items import DecodedImage, DecodedMedia, MediaKind
from mlx_relay.media.tensors import MediaTensor, VisionInputs

__all__ = ["Gemma3ImageConfig", "Gemma3Processor", "Gemma3Vocab", "load_gemma3_processor"]

#: The text the processor puts either side of an image's tokens.
_AROUND = "\n\n"


@dataclass(frozen=True)
class Gemma3ImageConfig:
    """The image processor's settings, as the checkpoint gives them (transformers' defaults otherwise)."""

    height: int = 224
    width: int = 224
    resample: int = int(Image.Resampling.BILINEAR)
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def read(cls, raw: dict[str, Any]) -> Gemma3ImageConfig:
        if raw.get("do_pan_and_scan"):
            raise ValueError("Gemma 3's pan and scan (extra crops of wide images) is not implemented")
        fields: dict[str, Any] = {}
        size = raw.get("size") or {}
        if size.get("height") and size.get("width"):
            fields["height"], fields["width"] = int(size["height"]), int(size["width"])
        elif size:
            raise ValueError(f"Gemma 3 image size {size} is not a fixed height and width")
        for key in ("resample", "do_resize", "do_rescale", "rescale_factor", "do_normalize"):
            if raw.get(key) is not None:
                fields[key] = raw[key]
        for key in ("image_mean", "image_std"):
            value = raw.get(key)
            if value is not None:
                fields[key] = tuple(value) if isinstance(value, list | tuple) else (value,) * 3
        return cls(**fields)

    def __call__(self, image: np.ndarray) -> np.ndarray:
        """An (H, W, 3) uint8 RGB image -> its (3, height, width) float32 pixel values."""
        if self.do_resize and image.shape[:2] != (self.height, self.width):
            pil = Image.fromarray(np.ascontiguousarray(image))
            image = np.asarray(pil.resize((self.width, self.height), resample=self.resample))
        chw = np.ascontiguousarray(image.transpose(2, 0, 1))
        pixels = (chw.astype(np.float64) * self.rescale_factor).astype(np.float32) if self.do_rescale \
            else chw.astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.image_mean, dtype=np.float32)[:, None, None]
            std = np.array(self.image_std, dtype=np.float32)[:, None, None]
            pixels = (pixels - mean) / std
        return pixels


@dataclass(frozen=True)
class Gemma3Vocab:
    start_of_image: int
    end_of_image: int
    image_token: int
    #: Added-token ids: the tokenizer splits text at them, so a text run ends at each.
    boundaries: frozenset[int]
    #: The ids of `before + decode(run) + after`, tokenized as one piece of plain text.
    retokenize: Callable[[str, Sequence[int], str], list[int]]


def _runs(tokens: Sequence[int], boundaries: frozenset[int]) -> list[int | list[int]]:
    """The prompt as added tokens (ints) with a text run (a list, maybe empty) before, between and
    after them."""
    pieces: list[int | list[int]] = [[]]
    for t in tokens:
        if t in boundaries:
            pieces += [t, []]
        else:
            run = pieces[-1]
            assert isinstance(run, list)
            run.append(t)
    return pieces


def expand_images(tokens: Sequence[int], vocab: Gemma3Vocab, per_image: int,
                  spans: list[tuple[int, int]] | None = None) -> list[int]:
    """`tokens` with each `<start_of_image>` expanded as the processor expands it in text; `spans`,
    if given, receives each image's soft tokens' [start, end) in the result."""
    pieces = _runs(tokens, vocab.boundaries)
    out: list[int] = []
    spans = spans if spans is not None else []
    for i, piece in enumerate(pieces):
        if isinstance(piece, int):
            out.append(piece)
            if piece == vocab.start_of_image:
                spans.append((len(out), len(out) + per_image))
                out.extend([vocab.image_token] * per_image)
                out.append(vocab.end_of_image)
            continue
        before = _AROUND if i > 0 and pieces[i - 1] == vocab.start_of_image else ""
        after = _AROUND if i + 1 < len(pieces) and pieces[i + 1] == vocab.start_of_image else ""
        out.extend(vocab.retokenize(before, piece, after) if before or after else piece)
    return out


@dataclass(frozen=True)
class Gemma3Processor:
    """Gemma 3's media processor (the `MediaProcessor` the MediaRouter runs): images only, each one
    `image_seq_length` soft tokens, pixels as whole images of one size (`VisionInputs.layout`
    "images": the model's own embedding path encodes them)."""

    image: Gemma3ImageConfig
    image_seq_length: int
    tokenizer: Any
    vocab: Gemma3Vocab
    model_type: str = "gemma3"

    @property
    def video_frame_bounds(self) -> tuple[int, int | None]:
        return 1, None

    def check_placeholders(self, tokens: Sequence[int], kinds: Sequence[MediaKind]) -> None:
        """One `<start_of_image>` per image, no video, and no image soft token or `<end_of_image>`
        typed into the text (only the expansion writes those)."""
        if "video" in kinds:
            raise MediaKindNotServed(f"video is not served for model type {self.model_type!r}: its processor "
                                     f"takes images only")
        starts = sum(1 for t in tokens if t == self.vocab.start_of_image)
        stray = sum(1 for t in tokens if t in (self.vocab.image_token, self.vocab.end_of_image))
        if starts != len(kinds) or stray:
            raise MediaPromptMismatch(
                f"the prompt has placeholders for {starts} image(s) but the request carries {len(kinds)} "
                "(image placeholder tokens may not appear in message text)")

    def process(self, decoded: Sequence[DecodedMedia], labels: Sequence[str], prompt_tokens: Sequence[int]
                ) -> tuple[list[int], VisionInputs]:
        """Each image's pixels and the prompt with its images expanded (call `check_placeholders` first)."""
        images = [d for d in decoded if isinstance(d, DecodedImage)]
        if len(images) != len(decoded):
            raise MediaKindNotServed(f"video is not served for model type {self.model_type!r}")
        pixels = np.stack([self.image(d.pixels) for d in images])
        spans: list[tuple[int, int]] = []
        tokens = expand_images(prompt_tokens, self.vocab, self.image_seq_length, spans)
        return tokens, VisionInputs(pixel_values=MediaTensor.from_numpy(pixels), image_grid_thw=None,
                                    pixel_values_videos=None, video_grid_thw=None,
                                    content_hashes=tuple(d.content_hash for d in images), spans=tuple(spans),
                                    layout="images")


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def load_gemma3_processor(model_path: Path) -> Gemma3Processor:
    """The checkpoint's Gemma 3 processor (its tokenizer with transformers, as the Normalizer's). Worker thread."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    processor_config = _json(model_path / "processor_config.json")
    image_raw = _json(model_path / "preprocessor_config.json") | (processor_config.get("image_processor") or {})
    config = _json(model_path / "config.json")
    per_image = int(processor_config.get("image_seq_length") or config.get("mm_tokens_per_image") or 256)

    def token(name: str) -> int:
        value = tokenizer.convert_tokens_to_ids(name)
        if value is None or value == getattr(tokenizer, "unk_token_id", -1):
            raise ValueError(f"{model_path}: the tokenizer has no {name} token")
        return int(value)

    def retokenize(before: str, run: Sequence[int], after: str) -> list[int]:
        text = tokenizer.decode(list(run), skip_special_tokens=False, clean_up_tokenization_spaces=False) \
            if run else ""
        return list(tokenizer.encode(before + text + after, add_special_tokens=False))

    vocab = Gemma3Vocab(start_of_image=token("<start_of_image>"), end_of_image=token("<end_of_image>"),
                        image_token=token("<image_soft_token>"),
                        boundaries=frozenset(int(i) for i in tokenizer.added_tokens_decoder), retokenize=retokenize)
    return Gemma3Processor(image=Gemma3ImageConfig.read(image_raw), image_seq_length=per_image, tokenizer=tokenizer,
                           vocab=vocab, model_type=str(config.get("model_type", "gemma3")))
