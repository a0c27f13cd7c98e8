"""Media handling for the vision path, off the GPU thread (used by the MediaRouter actor).

fetch (data: URLs, confined local files, guarded http(s)) -> decode with limits (images with PIL,
video frames with OpenCV) -> content hashes -> the checkpoint's numpy image/video processors ->
the prompt's placeholder tokens expanded to one per vision token. Everything here returns numpy
arrays or bytes; nothing touches MLX, which runs only on the GPU executor's thread.
"""

from mlx_relay.media.errors import (
    MediaDecodeError,
    MediaError,
    MediaFetchError,
    MediaKindNotServed,
    MediaPromptMismatch,
    MediaSourceNotAllowed,
    MediaTooLarge,
    TooManyMedia,
)
from mlx_relay.media.tensors import MediaTensor, VisionInputs

__all__ = [
    "MediaDecodeError",
    "MediaError",
    "MediaFetchError",
    "MediaKindNotServed",
    "MediaPromptMismatch",
    "MediaSourceNotAllowed",
    "MediaTensor",
    "MediaTooLarge",
    "TooManyMedia",
    "VisionInputs",
]
