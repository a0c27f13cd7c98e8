"""Expanding the prompt's media placeholders into one token per vision token (MediaRouter, worker thread).

The chat template renders one `<|image_pad|>` per image and one `<|video_pad|>` per video, each
wrapped in `<|vision_start|>…<|vision_end|>`, in message order. The model wants one pad token per
merged patch, and, for Qwen3-VL-style videos, one `<t.t seconds>` marker plus its own vision block
per temporal patch group. This does on token ids exactly what the checkpoint's processor does on
text, so the ids equal `processor(text=..., images=..., videos=...)["input_ids"]`: a timestamp
marker that follows plain text is tokenized together with that text (the processor tokenizes
them as one piece), via `PromptVocab.retokenize`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlx_relay.media.errors import MediaPromptMismatch
from mlx_relay.media.items import MediaKind

__all__ = ["MediaSlot", "PromptVocab", "check_placeholders", "expand_prompt", "video_group_timestamps"]


@dataclass(frozen=True)
class PromptVocab:
    image_pad: int
    video_pad: int
    vision_start: int
    vision_end: int
    #: Added-token ids: the tokenizer splits text at them, so a text run ends at each.
    boundaries: frozenset[int]
    #: The ids of `decode(run) + text`, tokenized as one piece of plain text.
    retokenize: Callable[[Sequence[int], str], list[int]]


@dataclass(frozen=True)
class MediaSlot:
    """One media item's share of the prompt: `tokens` pads per image, or per video group."""

    kind: MediaKind
    tokens: int
    timestamps: tuple[float, ...] = ()  # videos: seconds of each temporal group


def placeholder_kinds(tokens: Sequence[int], vocab: PromptVocab) -> list[MediaKind]:
    return [
        "image" if t == vocab.image_pad else "video" for t in tokens if t in (vocab.image_pad, vocab.video_pad)
    ]


def _describe(kinds: Sequence[MediaKind]) -> str:
    images = sum(1 for k in kinds if k == "image")
    return f"{images} image(s) and {len(kinds) - images} video(s)"


def check_placeholders(tokens: Sequence[int], kinds: Sequence[MediaKind], vocab: PromptVocab) -> None:
    """The prompt must hold exactly one placeholder per media item, of the same kinds in the same order
    (a stray `<|image_pad|>` typed into a message's text is refused here)."""
    found = placeholder_kinds(tokens, vocab)
    if found != list(kinds):
        raise MediaPromptMismatch(
            f"the prompt has placeholders for {_describe(found)} but the request carries {_describe(kinds)} "
            "(image/video placeholder tokens may not appear in message text)"
        )


def video_group_timestamps(frame_indices: Sequence[int], source_fps: float, temporal_patch_size: int
                           ) -> list[float]:
    """Seconds of each temporal patch group: the mean time of its first and last frame, the last frame
    repeated to fill the final group (as the processor pads it)."""
    indices = list(frame_indices)
    indices += indices[-1:] * (-len(indices) % temporal_patch_size)
    times = [i / source_fps for i in indices]
    return [
        (times[g] + times[g + temporal_patch_size - 1]) / 2 for g in range(0, len(times), temporal_patch_size)
    ]


def expand_prompt(tokens: Sequence[int], slots: Sequence[MediaSlot], vocab: PromptVocab,
                  spans: list[tuple[int, int]] | None = None) -> list[int]:
    """`tokens` with each placeholder expanded by its slot, in order. Call `check_placeholders` first.
    `spans`, if given, receives each item's [start, end) in the result (the prefix cache keys
    those positions by the item's content)."""
    check_placeholders(tokens, [s.kind for s in slots], vocab)
    spans = spans if spans is not None else []
    out: list[int] = []
    pending = iter(slots)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token == vocab.image_pad:
            begin = len(out)
            out.extend([vocab.image_pad] * next(pending).tokens)
            spans.append((begin, len(out)))
        elif token == vocab.video_pad:
            slot = next(pending)
            wrapped = bool(out) and out[-1] == vocab.vision_start and i < len(tokens) and tokens[i] == vocab.vision_end
            if not wrapped:
                begin = len(out)
                out.extend([vocab.video_pad] * (slot.tokens * len(slot.timestamps)))
                spans.append((begin, len(out)))
                continue
            out.pop()  # <|vision_start|>: re-emitted once per group
            start = len(out)
            while start > 0 and out[start - 1] not in vocab.boundaries:
                start -= 1
            run = out[start:]
            del out[start:]
            first_pad = -1
            for group, seconds in enumerate(slot.timestamps):
                out.extend(vocab.retokenize(run if group == 0 else (), f"<{seconds:.1f} seconds>"))
                out.append(vocab.vision_start)
                first_pad = len(out) if group == 0 else first_pad
                out.extend([vocab.video_pad] * slot.tokens)
                out.append(vocab.vision_end)
            # from the first pad: what follows it up to the last group is all the video's own
            spans.append((first_pad, len(out)))
            i += 1  # the original <|vision_end|>
        else:
            out.append(token)
    return out
