"""``/tokenize`` counts what a chat request's prompt holds (tools included); ``/detokenize`` takes every id of the
model's vocabulary, as ``/v1/completions`` does."""

from __future__ import annotations

from types import SimpleNamespace

from tokenizers import processors

from agentserve.client import AgentClient
from agentserve.executor.builtin import build_tokenizer
from agentserve.executor.builtin_template import CHAT_TEMPLATE
from agentserve.gateway.backend import Backend, GatewayOptions
from agentserve.gateway.schemas import TokenizeRequest, decode_body
from agentserve.gateway.tokenize_routes import _token_ids
from agentserve.orchestrator.text.tokenization import Tokenizer
from agentserve.protocol.limits import Limits

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_messages_with_tools_count_as_the_chat_prompt(http) -> None:
    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    counted = http.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS}).json()
    assert counted["count"] == len(counted["tokens"]) == chat.json()["usage"]["prompt_tokens"]
    assert http.post("/tokenize", json={"messages": MESSAGES}).json()["count"] < counted["count"]


def test_add_special_tokens_on_messages() -> None:
    """The tokenizer's own special tokens (a BOS) on top of the template's, only when asked."""
    hf = build_tokenizer()
    bos = ("<|endoftext|>", 256)
    hf.post_processor = processors.TemplateProcessing(single=f"{bos[0]} $A", special_tokens=[bos])
    tokenizer = Tokenizer(hf, {}, {"default": CHAT_TEMPLATE}, [])

    def ids(add: bool) -> list[int]:
        body = f'{{"messages": [{{"role": "user", "content": "hi"}}], "add_special_tokens": {str(add).lower()}}}'
        return _token_ids(decode_body(body.encode(), TokenizeRequest), tokenizer, Limits())

    with_bos, without = ids(True), ids(False)
    assert with_bos == [256, *without] and without[0] != 256


def test_detokenize_takes_the_models_padded_ids(http) -> None:
    """The tiny model has 320 rows, its tokenizer 261 entries: ids in between are the model's, and read ""."""
    assert http.post("/v1/completions", json={"prompt": [104, 300, 105], "max_tokens": 1}).status_code == 200
    r = http.post("/detokenize", json={"tokens": [104, 300, 105, 319]})
    assert r.status_code == 200 and r.json()["prompt"] == "hi", r.text
    for bad in (320, -1):
        r = http.post("/detokenize", json={"tokens": [104, bad]})
        assert r.status_code == 400 and "[0, 320)" in r.json()["error"]["message"], r.text


def test_the_vocabulary_is_the_executors_as_welcome_says(http_server) -> None:
    """The server's welcome carries the vocabulary the executor loaded (the tiny model's 320 rows, its tokenizer 261
    entries); the gateway bounds ids by it, and by the tokenizer's size only for a server that does not say."""
    with AgentClient(http_server.endpoint) as client:
        assert client.server.vocab_size == 320
    backend = Backend(GatewayOptions(endpoint="ipc:///unused"))
    backend.tokenizer = SimpleNamespace(vocab_size=261)
    backend.welcome = SimpleNamespace(vocab_size=320)
    assert backend.vocab_size == 320
    backend.welcome = SimpleNamespace(vocab_size=0)
    assert backend.vocab_size == 261


def test_an_empty_system_message_stays_one_and_none_leaves_the_templates_default(http) -> None:
    """As ``apply_chat_template`` renders them: ``""`` is an empty system message, no system message gets the
    template's default (the built-in template has one), in ``/tokenize`` and in the chat prompt alike."""
    tokenizer = Tokenizer(build_tokenizer(), {}, {"default": CHAT_TEMPLATE}, [])
    user = {"role": "user", "content": "x"}
    for messages in ([{"role": "system", "content": ""}, user], [user]):
        expected = tokenizer.encode_chat(messages)
        counted = http.post("/tokenize", json={"messages": messages}).json()
        chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert chat.status_code == 200, chat.text
        assert counted["tokens"] == expected and chat.json()["usage"]["prompt_tokens"] == len(expected)
    empty, default = (tokenizer.encode_chat(m) for m in ([{"role": "system", "content": ""}, user], [user]))
    assert len(empty) < len(default)  # the two differ: the test tells them apart
