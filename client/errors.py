"""Typed client errors: one class per server error code, plus the client-side failures."""

from __future__ import annotations

from agentserve.protocol.client_messages import Error, ErrorCode


class AgentServeError(Exception):
    """Base of every error the SDK raises.  ``code`` is the server's error code (if any); ``param`` the request
    field at fault, in OpenAI's request terms (``temperature``, ``stop``, ``messages``, ...), "" when none."""

    code: ErrorCode | None = None

    def __init__(self, message: str, *, req: int = 0, session: int = 0, param: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.req = req
        self.session = session
        self.param = param


class MalformedFrame(AgentServeError):
    code = ErrorCode.MALFORMED_FRAME


class UnknownMessage(AgentServeError):
    code = ErrorCode.UNKNOWN_MESSAGE


class UnsupportedVersion(AgentServeError):
    code = ErrorCode.UNSUPPORTED_VERSION


class InvalidRequest(AgentServeError):
    code = ErrorCode.INVALID_REQUEST


class UnknownSession(AgentServeError):
    code = ErrorCode.UNKNOWN_SESSION


class PromptTooLong(AgentServeError):
    code = ErrorCode.PROMPT_TOO_LONG


class TurnInProgress(AgentServeError):
    code = ErrorCode.TURN_IN_PROGRESS


class InvalidSampling(AgentServeError):
    code = ErrorCode.INVALID_SAMPLING


class LimitExceeded(InvalidRequest):
    """A request over one of the server's bounds (``configs/limits.toml``); the message names it."""

    code = ErrorCode.LIMIT_EXCEEDED


class ServerBusy(AgentServeError):
    """A bounded backlog of this connection is full for now (the message names the limit): retry shortly."""

    code = ErrorCode.BUSY


class TurnAborted(AgentServeError):
    """The server dropped the turn (a client's own abort ends the turn normally instead)."""

    code = ErrorCode.ABORTED


class ExecutorFailed(AgentServeError):
    code = ErrorCode.EXECUTOR_FAILED


class ServerShutdown(AgentServeError):
    code = ErrorCode.SERVER_SHUTDOWN


class InternalError(AgentServeError):
    code = ErrorCode.INTERNAL


class InvalidEndpoint(AgentServeError, ValueError):
    """The endpoint is not one a client can connect to (``ipc:///absolute/path`` or ``tcp://HOST:PORT``)."""


class ServerUnavailable(AgentServeError):
    """No server answered at the endpoint in time (not started, wrong endpoint, or stuck)."""


class ServerDisconnected(ServerUnavailable):
    """The connection to the server dropped while a request was waiting for its answer."""


class ProtocolViolation(AgentServeError):
    """The server sent something this client cannot understand."""


_BY_CODE: dict[ErrorCode, type[AgentServeError]] = {
    cls.code: cls
    for cls in (
        MalformedFrame,
        UnknownMessage,
        UnsupportedVersion,
        InvalidRequest,
        UnknownSession,
        PromptTooLong,
        TurnInProgress,
        InvalidSampling,
        LimitExceeded,
        ServerBusy,
        TurnAborted,
        ExecutorFailed,
        ServerShutdown,
        InternalError,
    )
}


def from_event(event: Error) -> AgentServeError:
    """The exception for a server :class:`Error` event (a code this SDK does not know: a plain ``AgentServeError``)."""
    cls = _BY_CODE.get(event.code, AgentServeError)
    message = f"{getattr(event.code, 'value', event.code)}: {event.message}"
    return cls(message, req=event.req, session=event.session, param=event.param)
