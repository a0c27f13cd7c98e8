"""Media errors raised by the MediaRouter actor: all are client errors (HTTP 400, OpenAI shape).

Each one is an `InvalidRequest`, so the runtime answers the asker with it and the actor carries on.
"""

from __future__ import annotations

from mlx_relay.errors import InvalidRequest


class MediaError(InvalidRequest):
    """Base of every image/video input error."""

    code = "invalid_media"

    def __init__(self, message: str, *, param: str | None = "messages", code: str | None = None) -> None:
        super().__init__(message, param=param, code=code)


class MediaSourceNotAllowed(MediaError):
    """The URL's kind (scheme, local path, host address) is not allowed by the operator's MediaConfig."""

    code = "media_source_not_allowed"


class MediaFetchError(MediaError):
    """An allowed source could not be read (malformed data URL, missing file, HTTP error, timeout)."""

    code = "media_fetch_failed"


class MediaTooLarge(MediaError):
    """Too many bytes, or too many pixels (the decompression-bomb guard)."""

    code = "media_too_large"


class MediaDecodeError(MediaError):
    """The bytes are not an image/video of an accepted type, or they are corrupt."""

    code = "invalid_media"


class TooManyMedia(MediaError):
    code = "too_many_media"


class MediaKindNotServed(MediaError):
    """The model's processor does not take this kind of media (e.g. video on an images-only VLM)."""

    code = "media_kind_not_served"


class MediaPromptMismatch(MediaError):
    """The prompt's image/video placeholders do not match the request's media items."""

    code = "media_placeholder_mismatch"
