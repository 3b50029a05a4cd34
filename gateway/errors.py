"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status.

Bad input is always a 4xx (the OpenAI SDKs retry 408/409/429/5xx); a 5xx means the server side
failed (the executor crashed, the orchestrator is gone).
"""

from __future__ import annotations

from typing import Any

from agentserve.client.errors import (
    AgentServeError,
    ExecutorFailed,
    InternalError,
    InvalidRequest,
    InvalidSampling,
    PromptTooLong,
    ServerBusy,
    ServerShutdown,
    ServerUnavailable,
    TurnAborted,
    TurnInProgress,
)


class APIError(Exception):
    """An error answered to an HTTP client."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized() -> APIError:
    return APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                    type="authentication_error", code="invalid_api_key")


def not_found(message: str, param: str | None = None, code: str = "model_not_found") -> APIError:
    return APIError(404, message, type="not_found_error", param=param, code=code)


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")


def client_closed() -> APIError:
    """The answer to a client that closed the connection first (nginx's 499): counted in the metrics, never read."""
    return APIError(499, "the client closed the connection", type="client_closed_request")


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="unavailable")


def busy(message: str) -> APIError:
    """A bounded backlog is full for now: the OpenAI SDKs retry a 503."""
    return APIError(503, message, type="server_error", code="busy")


# client error class → (HTTP status, OpenAI error type)
_STATUS: list[tuple[type[AgentServeError], int, str]] = [
    (PromptTooLong, 400, "invalid_request_error"),
    (InvalidRequest, 400, "invalid_request_error"),
    (InvalidSampling, 400, "invalid_request_error"),
    (TurnInProgress, 409, "invalid_request_error"),
    (ServerBusy, 503, "server_error"),  # transient: the OpenAI SDKs retry it
    (TurnAborted, 500, "server_error"),
    (ExecutorFailed, 503, "server_error"),
    (ServerShutdown, 503, "server_error"),
    (ServerUnavailable, 503, "server_error"),
    (InternalError, 500, "server_error"),
]


def from_client_error(error: AgentServeError) -> APIError:
    """The HTTP answer for an error the orchestrator (or the SDK) raised.  A prompt over the context gets OpenAI's
    code, ``context_length_exceeded``, which clients look for to trim or summarise (langchain-openai's
    ``ContextOverflowError``).  ``param`` is the request field the orchestrator blamed, already in OpenAI's terms and
    the name the client sent: the fields the gateway renames (``max_completion_tokens`` sent on as ``max_tokens``,
    ``/v1/completions``' ``logprobs`` as ``top_logprobs``) are bounded by the gateway first, so the orchestrator
    never blames them."""
    code = error.code.value if error.code is not None else None
    if isinstance(error, PromptTooLong):
        code = "context_length_exceeded"
    param = error.param or None
    for cls, status, kind in _STATUS:
        if isinstance(error, cls):
            return APIError(status, error.message, type=kind, param=param, code=code)
    return APIError(500, error.message, type="server_error", param=param, code=code)
