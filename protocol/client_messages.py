"""The client wire protocol: what agent clients and the ingress exchange over ZeroMQ.

Framing: a client uses a DEALER socket and sends one frame per message; the server's ROUTER
sees ``[client_id, payload]`` and answers ``[client_id, payload]``.  ``payload`` is a msgpack
array whose first element is the message tag (tagged ``msgspec.Struct``, ``array_like``).  An
empty payload from the server is a liveness probe and carries nothing: clients drop it.

Every client request carries ``req``, a number the client picks (unique per connection); every
server event names the ``req`` it answers.  The events of a turn all carry the ``req`` of the
:class:`Turn`.  A turn's stream ends with exactly one :class:`TurnDone` or :class:`Error`.

Client → server: :class:`Hello` (version handshake, optional), :class:`OpenSession`,
:class:`Turn`, :class:`Abort`, :class:`CloseSession`, :class:`GetStats`.
Server → client: :class:`Welcome`, :class:`SessionOpened`, :class:`TokenEvent`,
:class:`ToolCallEvent`, :class:`TurnDone`, :class:`SessionClosed`, :class:`StatsReply`,
:class:`Error`.

Tool results are not a message of their own: they are ``Message(role="tool", ...)`` entries in
the next :class:`Turn`, which is what starts the resume prefill anyway.  A session keeps its
conversation on the server: a turn sends only what is new since the last turn (the model's
own reply is already in the context).  A turn with ``token_ids`` appends those tokens raw, with
no chat template (benchmarks); a turn gives ``messages`` or ``token_ids``, never both, and a
session keeps to the mode of its first turn.

Versioning: ``PROTOCOL_VERSION`` is carried by :class:`Hello` and :class:`OpenSession`; a server
answers any other version with ``Error(code=UNSUPPORTED_VERSION)``.  New fields are only ever
added at the end with a default, so a version bump means an incompatible change.

This module must stay free of torch: the client SDK and the orchestrator import it.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from agentserve.protocol.base import WireStruct
from agentserve.protocol.sampling import SamplingError, SamplingParams

PROTOCOL_VERSION = 1

ROLES = ("system", "user", "assistant", "tool")


class ErrorCode(enum.StrEnum):
    MALFORMED_FRAME = "malformed_frame"  # not a decodable message of a known shape
    UNKNOWN_MESSAGE = "unknown_message"  # a well-formed array whose tag is not a request
    UNSUPPORTED_VERSION = "unsupported_version"
    INVALID_REQUEST = "invalid_request"  # decodable but meaningless (bad role, empty turn, ...)
    UNKNOWN_SESSION = "unknown_session"  # never opened, closed, or opened by another client
    PROMPT_TOO_LONG = "prompt_too_long"  # the session's context would exceed max_model_len
    TURN_IN_PROGRESS = "turn_in_progress"  # a session runs one turn at a time
    INVALID_SAMPLING = "invalid_sampling"
    LIMIT_EXCEEDED = "limit_exceeded"  # over a bound of configs/limits.toml (named in the message)
    BUSY = "busy"  # a bounded backlog of this connection is full for now (named in the message): retry shortly
    ABORTED = "aborted"  # the server dropped the turn (the client's own Abort ends in TurnDone)
    EXECUTOR_FAILED = "executor_failed"
    SERVER_SHUTDOWN = "server_shutdown"
    INTERNAL = "internal"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens reached
    TOOL_CALLS = "tool_calls"  # the model emitted tool calls and stopped
    ABORT = "abort"  # the client aborted the turn


# ---- payload pieces -------------------------------------------------------------------------


class Message(WireStruct):
    """One chat message.  ``tool_call_id`` links a ``tool`` message to the call it answers;
    ``tool_calls`` (assistant messages, OpenAI shape) are rendered by the chat template."""

    role: str
    content: str
    tool_call_id: str = ""
    name: str = ""
    tool_calls: list[dict[str, Any]] = []

    def as_dict(self) -> dict[str, Any]:
        """The message as a chat template takes it (empty optional fields left out)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out

    def text_bytes(self) -> int:
        """About what the chat template renders of it, in bytes: the content and the tool calls (as msgpack)."""
        calls = len(msgspec.msgpack.encode(self.tool_calls)) if self.tool_calls else 0  # any decoded value
        return len(self.content.encode()) + calls


class SessionOptions(WireStruct, frozen=True):
    name: str = ""  # a label shown by `agentserve top`
    parse_tool_calls: bool = True  # turn the model's tool-call markup into ToolCallEvents


class Usage(WireStruct, frozen=True):
    prompt_tokens: int = 0  # tokens this turn prefilled, cached ones included
    cached_tokens: int = 0  # of those, tokens served from the KV cache
    completion_tokens: int = 0


class Timings(WireStruct, frozen=True):
    queue_ms: float = 0.0  # arrival → first scheduled
    ttft_ms: float = 0.0  # arrival → first token
    tpot_ms: float = 0.0  # (e2e − ttft) / (completion_tokens − 1)
    e2e_ms: float = 0.0  # arrival → done


class Constraint(WireStruct, frozen=True):
    """Constrain a turn's output with a grammar; the server answers ``invalid_request`` when it cannot
    compile one.  ``json_schema``: a JSON schema's text (``{"type": "object"}`` for any object);
    ``tool_choice``: ``required`` (a call of one of the session's tools) or the name of one tool — the schema then
    does not apply (a forced call has no text to shape) — or ``auto`` beside a schema: the schema's JSON or calls of
    the session's tools."""

    json_schema: str = ""
    tool_choice: str = ""
    parallel_tool_calls: bool = True
    allowed_tools: tuple[str, ...] = ()  # the tools a call may name (all of the session's when empty)


# ---- client → server ------------------------------------------------------------------------


class Hello(WireStruct, tag="hello"):
    req: int
    version: int
    client: str = ""


class OpenSession(WireStruct, tag="open"):
    req: int
    version: int
    system: str | None = None  # None: no system message (the template's default, if it has one); "" an empty one
    tools: list[dict[str, Any]] = []  # JSON schemas, OpenAI function-tool shape
    options: SessionOptions = SessionOptions()


class Turn(WireStruct, tag="turn"):
    req: int
    session: int
    messages: list[Message] = []
    token_ids: list[int] = []
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    ignore_eos: bool = False
    constraint: Constraint | None = None
    logprobs: bool = False  # each TokenEvent carries its tokens' logprobs
    top_logprobs: int = 0  # ... and this many most likely alternatives per token (needs ``logprobs``)

    @property
    def input_param(self) -> str:
        """The OpenAI request field this turn's input stands for: ``prompt`` (raw token ids) or ``messages``."""
        return "prompt" if self.token_ids else "messages"

    def sampling_params(self, stop_token_ids: list[int] | None = None) -> SamplingParams:
        """The ring's sampling parameters for this turn (not yet validated)."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed,
            max_tokens=self.max_tokens,
            stop_token_ids=list(stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            top_logprobs=self.top_logprobs,
        )


class Abort(WireStruct, tag="abort"):
    """Abort the session's running turn; ``turn`` (its ``req``) guards against a late abort."""

    req: int
    session: int
    turn: int = 0


class CloseSession(WireStruct, tag="close"):
    req: int
    session: int


class GetStats(WireStruct, tag="stats"):
    req: int


# ---- server → client ------------------------------------------------------------------------


class Welcome(WireStruct, tag="welcome"):
    req: int
    version: int
    server: str = ""  # agentserve version
    model: str = ""
    max_model_len: int = 0
    run: str = ""  # the run name: `agentserve top --run` attaches its stats board
    pid: int = 0
    eos_token_ids: list[int] = []  # the ids that end a turn (a raw turn's session keeps its output without one)
    vocab_size: int = 0  # the model's vocabulary (its embedding rows, often padded past the tokenizer's)
    limits: dict[str, Any] = {}  # the request limits the ingress enforces, by name (protocol.limits.Limits)


class SessionOpened(WireStruct, tag="opened"):
    req: int
    session: int
    prompt_tokens: int = 0  # system prompt + tool schemas, templated


class TopLogprobs(WireStruct, frozen=True):
    """The most likely tokens at one position, most likely first, with their logprobs."""

    token_ids: list[int] = []
    logprobs: list[float] = []


class TokenEvent(WireStruct, tag="tok"):
    """New tokens of a turn.  ``text`` is the detokenized delta (may be empty mid-character).

    ``t_mono`` is the server's ``time.monotonic()``, ``t_wall`` its ``time.time()``.  When the turn asked
    for ``logprobs``, ``logprobs[i]`` belongs to ``token_ids[i]`` and so does ``top_logprobs[i]`` when it
    asked for alternatives too; both are empty otherwise.
    """

    req: int
    session: int
    token_ids: list[int]
    text: str = ""
    t_mono: float = 0.0
    t_wall: float = 0.0
    logprobs: list[float] = []
    top_logprobs: list[TopLogprobs] = []


class ToolCallEvent(WireStruct, tag="tool_call"):
    """A parsed tool call (Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``)."""

    req: int
    session: int
    call_id: str
    name: str
    arguments: dict[str, Any] = {}
    t_mono: float = 0.0
    t_wall: float = 0.0


class TurnDone(WireStruct, tag="done"):
    req: int
    session: int
    finish: FinishReason
    usage: Usage = Usage()
    timings: Timings = Timings()
    t_mono: float = 0.0
    t_wall: float = 0.0


class SessionClosed(WireStruct, tag="closed"):
    req: int
    session: int


class StatsReply(WireStruct, tag="stats_reply"):
    req: int
    snapshot: bytes  # an encoded agentserve.protocol.stats.Snapshot


class Error(WireStruct, tag="error"):
    """``req`` is 0 when the request could not be decoded far enough to know it.  ``param`` names the request
    field at fault in OpenAI's request terms (``temperature``, ``stop``, ``messages``, ``prompt`` for a raw-token
    turn, ``tools``, ``response_format``, ...), empty when the fault is not one field; a trailing field, so an
    older reader ignores it and an older writer's error reads as ``param=""``."""

    req: int
    code: ErrorCode
    message: str
    session: int = 0
    param: str = ""


ClientMessage = Hello | OpenSession | Turn | Abort | CloseSession | GetStats
ServerEvent = Welcome | SessionOpened | TokenEvent | ToolCallEvent | TurnDone | SessionClosed | StatsReply | Error

CLIENT_TAGS = frozenset(t.__struct_config__.tag for t in ClientMessage.__args__)
SERVER_TAGS = frozenset(t.__struct_config__.tag for t in ServerEvent.__args__)


class ProtocolError(ValueError):
    """A payload that is not a valid message; ``code`` says which kind of invalid, ``param`` which request field
    (OpenAI's name, as :class:`Error` carries it; empty when not one field)."""

    def __init__(self, code: ErrorCode, message: str, req: int = 0, session: int = 0, param: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.req = req
        self.session = session
        self.param = param

    def to_event(self) -> Error:
        return Error(req=self.req, code=self.code, message=str(self), session=self.session, param=self.param)


def _diagnose(data: bytes, tags: frozenset[str], err: str) -> ProtocolError:
    """Why a payload failed typed decoding: malformed, unknown tag, or a bad field.

    Reads only the head of the payload (never decodes the rest), so a hostile body costs nothing more.
    """
    tag, req = peek_head(data)
    if tag is None:
        why = f"payload must be a msgpack array [tag, ...] ({len(data)} bytes)"
        return ProtocolError(ErrorCode.MALFORMED_FRAME, why)
    if tag not in tags:
        return ProtocolError(ErrorCode.UNKNOWN_MESSAGE, f"unknown message type {tag[:64]!r}")
    return ProtocolError(ErrorCode.MALFORMED_FRAME, f"bad {tag!r} message: {err}", req=req)


_UINT = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
_INT = {0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}


def peek_head(data: bytes) -> tuple[str | None, int]:
    """``(tag, req)`` from the first two elements of a msgpack array, without decoding the rest.

    ``tag`` is None when the payload does not start with an array whose first element is a string;
    ``req`` is 0 when the second element is not an integer.
    """
    n = len(data)
    if n == 0 or not (0x91 <= data[0] <= 0x9F or data[0] in (0xDC, 0xDD)):
        return None, 0
    pos = 1 if data[0] <= 0x9F else (3 if data[0] == 0xDC else 5)
    if pos >= n:
        return None, 0
    head = data[pos]
    if 0xA0 <= head <= 0xBF:
        size, pos = head & 0x1F, pos + 1
    elif head in (0xD9, 0xDA, 0xDB):
        width = {0xD9: 1, 0xDA: 2, 0xDB: 4}[head]
        size, pos = int.from_bytes(data[pos + 1 : pos + 1 + width], "big"), pos + 1 + width
    else:
        return None, 0
    if pos + size > n:
        return None, 0
    tag = data[pos : pos + size].decode("utf-8", "replace")
    return tag, _peek_int(data, pos + size)


def _peek_int(data: bytes, pos: int) -> int:
    if pos >= len(data):
        return 0
    head = data[pos]
    if head <= 0x7F:
        return head
    width = _UINT.get(head) or _INT.get(head)
    if width is None or pos + 1 + width > len(data):
        return 0
    return int.from_bytes(data[pos + 1 : pos + 1 + width], "big", signed=head in _INT)


class _Codec:
    def __init__(self, union: Any, tags: frozenset[str], max_bytes: int = 0) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(union)
        self._tags = tags
        self.max_bytes = max_bytes  # 0: no bound

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes | memoryview) -> Any:
        """Decode one payload, or raise :class:`ProtocolError` with the right code.  Never raises anything else."""
        if self.max_bytes and len(data) > self.max_bytes:
            tag, req = peek_head(bytes(data[:64]))
            why = f"frame of {len(data)} bytes exceeds the limit of {self.max_bytes} (limits.request.max_frame_bytes)"
            raise ProtocolError(ErrorCode.LIMIT_EXCEEDED, why, req=req)
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise _diagnose(bytes(data), self._tags, str(e)) from None
        except RecursionError:
            raise _diagnose(bytes(data), self._tags, "nested too deeply") from None
        except Exception as e:  # noqa: BLE001 - a decoder bug must not reach the server loop
            raise _diagnose(bytes(data), self._tags, f"{type(e).__name__}: {e}") from None


class ClientCodec(_Codec):
    """What a client uses: encodes requests, decodes server events."""

    def __init__(self) -> None:
        super().__init__(ServerEvent, SERVER_TAGS)


class ServerCodec(_Codec):
    """What the ingress uses: decodes requests (at most ``max_bytes`` each), encodes server events."""

    def __init__(self, max_bytes: int = 0) -> None:
        super().__init__(ClientMessage, CLIENT_TAGS, max_bytes)


def validate(msg: Any) -> None:
    """Check what a decoder cannot: versions, roles, turn shape, sampling.  Raise ProtocolError."""
    if isinstance(msg, Hello | OpenSession) and msg.version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {msg.version} is not supported (server speaks {PROTOCOL_VERSION})",
            req=msg.req,
        )
    if isinstance(msg, Turn):
        _validate_turn(msg)


def _validate_turn(turn: Turn) -> None:
    def bad(code: ErrorCode, text: str, param: str = "") -> ProtocolError:
        return ProtocolError(code, text, req=turn.req, session=turn.session, param=param)

    if turn.req <= 0:  # a running turn's req 0 would read as "no turn running"
        raise bad(ErrorCode.INVALID_REQUEST, f"a turn's req must be positive, not {turn.req}")
    if turn.messages and turn.token_ids:
        raise bad(ErrorCode.INVALID_REQUEST, "a turn gives messages or token_ids, not both")
    if not turn.messages and not turn.token_ids:
        raise bad(ErrorCode.INVALID_REQUEST, "a turn needs messages or token_ids")
    for m in turn.messages:
        if m.role not in ROLES:
            raise bad(ErrorCode.INVALID_REQUEST, f"unknown role {m.role!r} (expected one of {ROLES})", "messages")
    if any(t < 0 for t in turn.token_ids):
        raise bad(ErrorCode.INVALID_REQUEST, "token ids must be >= 0", "prompt")
    if any(not s for s in turn.stop):
        raise bad(ErrorCode.INVALID_SAMPLING, "stop strings must not be empty", "stop")
    if turn.top_logprobs and not turn.logprobs:
        raise bad(ErrorCode.INVALID_SAMPLING, "top_logprobs needs logprobs", "top_logprobs")
    try:
        turn.sampling_params().validate()
    except SamplingError as e:
        raise bad(ErrorCode.INVALID_SAMPLING, str(e), e.param) from None
