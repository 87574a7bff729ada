"""regen's exception hierarchy: retryable versus terminal, and terminal for what.

Callers branch on these types (never on message text). The endpoint client maps HTTP status codes
and stream events onto them; the worker records terminal row errors on the row and moves on.
"""

from __future__ import annotations


class RegenError(Exception):
    """Base of every error regen raises on purpose."""


class ConfigError(RegenError):
    """Bad configuration or input given by the operator; the message says which field and how to fix it."""


class LengthDoesNotFitError(ConfigError):
    """A training step at the configured sequence length and batch size does not fit the GPU's memory;
    `largest_length` is the largest length (a multiple of 128) that does, 0 when none does."""

    def __init__(self, message: str, *, largest_length: int):
        super().__init__(message)
        self.largest_length = largest_length


class LedgerUnreachableError(RegenError):
    """Redis (ledger and broker) cannot be reached; the message names the URL and how to start one."""


class DataRootUnreachableError(RegenError):
    """The data root cannot be used (an object store that refuses the credentials, a bucket that does
    not exist, an endpoint that is no S3 API, a driver not installed); the message says which and how
    to fix it."""


class RetryableError(RegenError):
    """Worth another attempt (possibly on another endpoint): connection errors, timeouts, 5xx, stalls."""

    def __init__(self, message: str, *, status_code: int | None = None, endpoint: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.endpoint = endpoint


class TerminalError(RegenError):
    """Retrying cannot help."""


class RowTerminalError(TerminalError):
    """This row cannot be answered (prompt longer than the context, other 4xx): record it on the row."""

    def __init__(self, message: str, *, status_code: int | None = None):
        super().__init__(message)
        self.status_code = status_code


class ImageUnavailableError(RowTerminalError):
    """An image a prompt names cannot be sent: its file in the run's image store is missing, or its
    bytes no longer hash to the name the prompt holds (the store was pruned or written over)."""


class RequestImagesTooLargeError(RowTerminalError):
    """The images one request would carry exceed the worker's max_request_image_bytes."""


class EndpointTerminalError(TerminalError):
    """This endpoint must not be used again (401, wrong model served); other endpoints may still work."""

    def __init__(self, message: str, *, endpoint: str | None = None):
        super().__init__(message)
        self.endpoint = endpoint


class NoUsableEndpointError(EndpointTerminalError):
    """No endpoint of a worker could serve `model` at its start check (down, or serving another model);
    the worker stops consuming and checks them again with backoff."""

    def __init__(self, message: str, *, model: str):
        super().__init__(message)
        self.model = model


class NoEndpointAvailableError(RetryableError):
    """Every endpoint is ejected or unusable right now."""


class RetriesExhaustedError(RegenError):
    """A retryable failure that persisted past the configured attempts; `retry-failed` sends it again."""

    def __init__(self, message: str, *, attempts: int):
        super().__init__(message)
        self.attempts = attempts


class LeaseLostError(RegenError):
    """Another worker holds (or took over) the shard's lease; stop working on it without writing."""
