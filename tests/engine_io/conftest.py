"""Fixtures for the engine I/O tests.

``tiny_dir``: the built-in ``tiny`` checkpoint, written once per session to a temp cache.
``llama_style_dir``: a tokenizer folder of another shape — trained BPE merges, a BOS added by the
post-processor, a Llama-3.1-style chat template that uses ``bos_token``, ``namespace``,
``raise_exception``, ``tojson(indent=4)`` and loop controls.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from agentserve.executor.builtin import ensure_builtin

LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

LLAMA_STYLE_TEMPLATE = r"""{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- set ns = namespace(has_system=false) %}
{%- for m in messages %}
    {%- if m.role == 'system' %}{%- set ns.has_system = true %}{% break %}{%- endif %}
{%- endfor %}
{%- if ns.has_system %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, respond with a JSON function call.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping %}{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from a second thread, and on a shared 2-core box OpenMP's barrier
    waits turn each small matmul into tens of milliseconds. One thread keeps these tests fast."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_dir(cache_dir: Path) -> Path:
    return ensure_builtin("tiny", cache_dir)


@pytest.fixture(scope="session")
def llama_style_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder = tmp_path_factory.mktemp("llama_style")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=LLAMA_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    corpus = ["The quick brown fox jumps over the lazy dog.", "get_weather(city='Paris') is sunny",
              "héllo wörld ünïcödé 東京 🙂", "    indented code\n\tand tabs"] * 30
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
              "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": LLAMA_STYLE_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    return folder


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir: Path):
    from agentserve.cli.offline import LLM

    return LLM(tiny_dir, dtype="float32", device="cpu", num_blocks=272)  # 4352 tokens: one full-context sequence fits


@pytest.fixture(scope="session")
def hf_tiny_tokenizer(tiny_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(str(tiny_dir))


@pytest.fixture(scope="session")
def hf_llama_style_tokenizer(llama_style_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(str(llama_style_dir))
