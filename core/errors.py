"""The one exception hierarchy: client errors carry an HTTP status and a stable code."""

from __future__ import annotations

from typing import Any


class InferqError(Exception):
    """Root of every error inferq raises on purpose."""


class ClientError(InferqError):
    """The request cannot be served as sent; the caller can fix it."""

    status_code = 400
    error_type = "invalid_request_error"
    code = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.extra = extra


class InvalidRequest(ClientError):
    """The body or query does not validate."""


class ContextLengthExceeded(ClientError):
    """Prompt plus max_tokens does not fit the model's context."""

    code = "context_length_exceeded"


class TierLimitExceeded(ClientError):
    """The job asks for more than its key's tier allows."""

    code = "tier_limit_exceeded"


class AuthenticationFailed(ClientError):
    """No key, or a key that is unknown or revoked: one answer for all three."""

    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"

    def __init__(self) -> None:
        super().__init__("Missing or invalid API key.")


class NotFound(ClientError):
    """No such resource for this caller (other owners' resources look the same)."""

    status_code = 404
    error_type = "not_found_error"
    code = "not_found"


class ModelNotFound(NotFound):
    """The request names a model this server does not serve (OpenAI's `model_not_found`)."""

    error_type = "invalid_request_error"
    code = "model_not_found"


class ExperimentNotFound(NotFound):
    """The request names an experiment that is not configured."""

    code = "experiment_not_found"


class Conflict(ClientError):
    """The resource's state forbids the request."""

    status_code = 409
    error_type = "conflict_error"
    code = "conflict"


class JobAlreadyFinal(Conflict):
    """A cancel for a job that has already ended."""

    code = "job_already_final"


class IdempotencyKeyReused(Conflict):
    """The same Idempotency-Key was sent with a different body."""

    code = "idempotency_key_reused"


class PayloadTooLarge(ClientError):
    """The request body is over the configured limit."""

    status_code = 413
    code = "request_too_large"


class RateLimited(ClientError):
    """The key's quota is used up for now; `retry_after` says when to come back."""

    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"


class QueueFull(RateLimited):
    """The tier's backlog would make the job miss its queue deadline: come back later."""

    code = "queue_full"


class QuotaTooSmall(ClientError):
    """A request bigger than its key's whole quota: it could never be admitted."""

    code = "quota_exceeded"


class ServiceUnavailable(InferqError):
    """A backing service (Redis, database) cannot be reached; retrying later may work."""

    status_code = 503
    error_type = "service_unavailable"
    code = "service_unavailable"
