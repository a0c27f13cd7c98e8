"""Domain errors: each one knows the HTTP status and OpenAI error shape it maps to.

They are `Rejection`s for the actor runtime (an expected reply, not a crash), so an actor that
raises one answers the request and carries on.
"""

from __future__ import annotations

from mlx_relay.runtime.errors import Rejection


class RelayError(Rejection):
    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(RelayError):
    status = 400
    type = "invalid_request_error"


class DraftModelUnavailable(InvalidRequest):
    """The request asked for a draft model's drafts (`speculation.method: "draft"`), and this
    server has no draft model loaded (`--draft-model` is not available yet)."""

    code = "draft_model_unavailable"


class EmbeddingsUnavailable(InvalidRequest):
    """`/v1/embeddings` named a model that serves no embeddings (a chat model without
    `--embedding-model`)."""

    code = "model_not_embedding"


class UnprocessableRequest(RelayError):
    """The body is JSON but does not fit the schema (wrong types, out-of-range values)."""

    status = 422
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """The request does not fit the model's context. Its two kinds carry their numbers, so each
    wire format words the refusal its clients parse (Anthropic's exact sentences on `/v1/messages`,
    OpenAI's `context_length_exceeded` with this message elsewhere)."""

    code = "context_length_exceeded"


class PromptTooLong(ContextLengthExceeded):
    """The prompt alone does not fit: it has `prompt_tokens` tokens (at least, when counted
    before tokenizing), more than the `limit` a prompt may have."""

    def __init__(self, message: str, *, prompt_tokens: int, limit: int, param: str | None = "messages") -> None:
        super().__init__(message, param=param)
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class MaxTokensExceedContext(ContextLengthExceeded):
    """The prompt fits but `max_tokens` does not fit after it: prompt_tokens + max_tokens >
    context_length (raised only under `--max-tokens-policy error`)."""

    def __init__(self, message: str, *, prompt_tokens: int, max_tokens: int, context_length: int,
                 param: str | None = "max_tokens") -> None:
        super().__init__(message, param=param)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length


class Unauthorized(RelayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFound(RelayError):
    status = 404
    type = "not_found_error"


class ModelNotFound(NotFound):
    code = "model_not_found"

    def __init__(self, message: str, *, model: str | None = None, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.model = model  # the name the client asked for (the request log's `model`)


class Overloaded(RelayError):
    """Too many requests queued: try again later (429 with Retry-After)."""

    status = 429
    type = "rate_limit_error"
    code = "server_overloaded"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReady(RelayError):
    """The server is loading or warming its model, or shutting down (503 with Retry-After)."""

    status = 503
    type = "service_unavailable"
    code = "not_ready"

    def __init__(self, message: str, *, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServerShuttingDown(NotReady):
    """The server is draining (SIGTERM) and this request could not finish in time: retry."""

    code = "server_shutting_down"


class ModelLoading(NotReady):
    """A pooled model is loading (or unloading) and did not become ready within the request's wait
    (`--load-wait-s`): retry."""

    code = "model_loading"


class NoRoomForModel(NotReady):
    """A pooled model does not fit the memory budget beside the models in use or pinned now
    (`--contention fail`, or the wait ran out): retry once one of them is idle."""

    code = "model_memory_busy"


class ModelLoadFailed(NotReady):
    """A pooled model's last load failed moments ago (its reason in the message); it is tried again
    after the backoff."""

    code = "model_load_failed"


class InvalidModelPath(InvalidRequest):
    """`POST /v1/models/{name}/load` named a path that is not a model checkpoint."""

    code = "invalid_model_path"


class RequestTimeout(RelayError):
    """The client did not send its request (headers and body) within the read timeout."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class PayloadTooLarge(RelayError):
    """The request body is larger than `--max-request-bytes`."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class InternalError(RelayError):
    """Something failed inside the server while handling this request. The message names an
    incident id that the server logged with the details; it never carries internal text."""

    status = 500
    type = "server_error"
    code = "internal_error"


class GenerationFailed(RelayError):
    """The engine failed while generating this request; other requests are unaffected."""

    status = 500
    type = "server_error"
    code = "generation_failed"


class ClientDisconnected(RelayError):
    """The client went away before its answer was complete (nobody reads the answer; the request
    log shows nginx's 499 for a non-streamed request, the stream's 200 for a streamed one)."""

    status = 499
    type = "client_disconnected"
    code = "client_disconnected"


class ModelLoadError(Exception):
    """The model could not be found or loaded (a start-up failure, not a request's)."""


class UnsupportedModel(ModelLoadError):
    """The model is of no family the engine's steps serve, or not of its family's shape (raised by
    `engine/models/`; here so that it crosses the engine process's wire as itself)."""


class PipelineSetupError(ModelLoadError):
    """The pipeline's process group or its split of the model does not fit (`--pipeline`)."""


class PipelineRankLost(RuntimeError):
    """A pipeline rank died: the group cannot go on, and is not rejoined in the same process."""
