"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes), with the checkpoint's own tokenizer.

``messages`` (with ``tools``) are rendered as a chat request's prompt is, so ``count`` is its ``prompt_tokens``;
``add_special_tokens`` adds the tokenizer's own (a BOS) on top of the template's, False by default there as in
vLLM.  ``/detokenize`` takes any id of the model's vocabulary, which may be padded past the tokenizer's: an id the
tokenizer does not know reads "".
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentserve.gateway.backend import Backend
from agentserve.gateway.body import read_body
from agentserve.gateway.chat_plan import tool_dicts
from agentserve.gateway.errors import bad_request
from agentserve.gateway.limits import check_conversation, check_prompt_text
from agentserve.gateway.messages import translate
from agentserve.gateway.schemas import DetokenizeRequest, TokenizeRequest, decode_body
from agentserve.orchestrator.text.chat_template import ChatTemplateError
from agentserve.orchestrator.text.tokenization import Tokenizer
from agentserve.protocol.client_messages import Message
from agentserve.protocol.limits import Limits


async def tokenize(request: Request) -> Response:
    backend: Backend = request.app.state.backend
    body = await read_body(request, backend.options.max_body_bytes)
    req = decode_body(body, TokenizeRequest)
    _, welcome, tokenizer = backend.require()
    backend.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give `prompt` or `messages`")
    ids = await backend.tokenizing.run(len(body), lambda: _token_ids(req, tokenizer, backend.limits))
    return JSONResponse({"count": len(ids), "max_model_len": welcome.max_model_len, "tokens": ids})


def _token_ids(req: TokenizeRequest, tokenizer: Tokenizer, limits: Limits) -> list[int]:
    """The prompt's ids, or the conversation's as a cold chat request's prompt, within the server's limits."""
    if req.prompt is not None:
        check_prompt_text(req.prompt, limits)
        return tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    t = translate(req.messages or [])
    tools = tool_dicts(req.tools)
    check_conversation(t, tools, limits)
    head = [Message("system", t.system)] if t.system is not None else []
    try:
        text = tokenizer.apply_chat_template([m.as_dict() for m in head + t.messages], tools or None,
                                             req.add_generation_prompt)  # tools as a chat request sends them
    except ChatTemplateError as e:
        raise bad_request(f"cannot render the conversation: {e}", param="messages") from None
    return tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))  # unset (None): False, as vLLM


async def detokenize(request: Request) -> Response:
    backend: Backend = request.app.state.backend
    req = decode_body(await read_body(request, backend.options.max_body_bytes), DetokenizeRequest)
    _, _, tokenizer = backend.require()
    backend.check_model(req.model)
    if any(t < 0 or t >= backend.vocab_size for t in req.tokens):
        raise bad_request(f"token ids must be in [0, {backend.vocab_size})", param="tokens")
    return JSONResponse({"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)})  # unknown ids: ""

