"""The AgentServe client SDK: ``AgentClient`` (blocking) and ``AsyncAgentClient`` (asyncio).

from agentserve.client import AgentClient
with AgentClient() as client, client.session(system="You are terse.") as s:
    for event in s.turn("Hi!"):
        ...
"""

from agentserve.client.aio import AsyncAgentClient, AsyncSession, AsyncTurnStream
from agentserve.client.errors import (
    AgentServeError,
    ExecutorFailed,
    InternalError,
    InvalidEndpoint,
    InvalidRequest,
    InvalidSampling,
    LimitExceeded,
    MalformedFrame,
    PromptTooLong,
    ProtocolViolation,
    ServerBusy,
    ServerDisconnected,
    ServerShutdown,
    ServerUnavailable,
    TurnAborted,
    TurnInProgress,
    UnknownMessage,
    UnknownSession,
    UnsupportedVersion,
)
from agentserve.client.events import Done, TextDelta, TokenIds, ToolCall, TurnEvent, TurnResult
from agentserve.client.sync import AgentClient, Session, TurnStream

__all__ = [
    "AgentClient",
    "AgentServeError",
    "AsyncAgentClient",
    "AsyncSession",
    "AsyncTurnStream",
    "Done",
    "ExecutorFailed",
    "InternalError",
    "InvalidRequest",
    "InvalidSampling",
    "LimitExceeded",
    "MalformedFrame",
    "PromptTooLong",
    "ProtocolViolation",
    "ServerBusy",
    "ServerDisconnected",
    "ServerShutdown",
    "InvalidEndpoint",
    "ServerUnavailable",
    "Session",
    "TextDelta",
    "TokenIds",
    "ToolCall",
    "TurnAborted",
    "TurnEvent",
    "TurnInProgress",
    "TurnResult",
    "TurnStream",
    "UnknownMessage",
    "UnknownSession",
    "UnsupportedVersion",
]
