"""``logprobs`` / ``top_logprobs`` on both endpoints: OpenAI's shapes, streamed equal to whole, and the
figures themselves against transformers on the same checkpoint (fp32, greedy)."""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict

import pytest
import torch

from agentserve.client import TokenIds
from agentserve.executor.builtin import build_tokenizer, resolve_model
from agentserve.gateway.logprobs import LogprobLog
from agentserve.gateway.reply_stream import ReplyStreamer
from agentserve.orchestrator.text.tokenization import Tokenizer
from agentserve.orchestrator.text.tool_formats import HermesFormat

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 4


def chat_logprobs(openai_client, stream: bool, **extra):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Count with me: one, two"}], max_tokens=10,
                  temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}, **extra)
    if not stream:
        reply = openai_client.chat.completions.create(**kwargs)
        return reply.choices[0].logprobs.content, reply.usage.completion_tokens
    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True))
    return [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content], None


def test_chat_logprobs_shape_and_streamed_equal_whole(openai_client) -> None:
    whole, completion_tokens = chat_logprobs(openai_client, stream=False)
    assert len(whole) == completion_tokens == 10
    for entry in whole:
        assert entry.logprob <= 0 and (entry.token == "\ufffd" or entry.bytes == list(entry.token.encode("utf-8")))
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token and math.isclose(tops[0], entry.logprob, abs_tol=1e-5)
    streamed, _ = chat_logprobs(openai_client, stream=True)
    assert [e.token for e in streamed] == [e.token for e in whole]
    assert_same_logprobs([e.logprob for e in streamed], [e.logprob for e in whole])
    for s, w in zip(streamed, whole, strict=True):
        assert_same_logprobs([t.logprob for t in s.top_logprobs], [t.logprob for t in w.top_logprobs])


def assert_same_logprobs(again: list[float], first: list[float]) -> None:
    """A repeated request's logprobs against the first's.  The repeat finds the prompt's blocks cached and prefills
    only its tail, whose steps add up in another order; where prefill attends in bf16 through PyTorch (AMX CPUs)
    that rounds differently by a few thousandths, so equal within 0.01 rather than bitwise."""
    assert again == pytest.approx(first, abs=1e-2)


def test_no_logprobs_unless_asked(openai_client) -> None:
    reply = openai_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=3)
    assert reply.choices[0].logprobs is None


@pytest.mark.parametrize("body", [{"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21},
                                  {"logprobs": True, "top_logprobs": -1}, {"logprobs": 3}])
def test_bad_logprob_fields_are_400(http, body) -> None:
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("logprobs", "top_logprobs")


def hf_top(prompt: list[int], output: list[int], k: int) -> list[tuple[list[int], list[float]]]:
    """transformers' top-``k`` logprobs at each output position of ``prompt + output``."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = logits[len(prompt) - 1:len(prompt) - 1 + len(output)].log_softmax(-1)
    values, ids = logp.topk(k, dim=-1)
    return list(zip(ids.tolist(), values.tolist(), strict=True))


def test_completion_logprobs_match_transformers(http) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 4,
            "return_token_ids": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    out, lp = choice["token_ids"], choice["logprobs"]
    assert len(out) == len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert_offsets_index(choice["text"], lp["tokens"], lp["text_offset"])
    for (ids, values), chosen, got, tops in zip(hf_top(PROMPT, out, 4), out, lp["token_logprobs"],
                                                lp["top_logprobs"], strict=True):
        assert chosen == ids[0] and got == pytest.approx(values[0], abs=5e-3)
        assert sorted(tops.values(), reverse=True) == pytest.approx(values[:len(tops)], abs=5e-3)


def test_completion_logprobs_streamed_equal_whole(http) -> None:
    body = {"prompt": PROMPT[:20], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
    for key in ("tokens", "text_offset"):
        assert [v for p in parts for v in p[key]] == whole[key], key
    assert_same_logprobs([v for p in parts for v in p["token_logprobs"]], whole["token_logprobs"])


def completion(http, body: dict, stream: bool) -> tuple[str, dict[str, list]]:
    """The text and the logprobs object of a completion, a stream's joined."""
    if not stream:
        choice = http.post("/v1/completions", json=body).json()["choices"][0]
        return choice["text"], choice["logprobs"]
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        choices = [json.loads(line[6:])["choices"] for line in r.iter_lines() if line.startswith("data: {")]
    parts = [c[0]["logprobs"] for c in choices if c and c[0]["logprobs"]]
    return "".join(c[0]["text"] for c in choices if c), {k: [v for p in parts for v in p[k]] for k in parts[0]}


def spanning_stop(text: str, offsets: list[int]) -> str:
    """A stop string of two characters across two tokens (the last character of what one decodes to, the first of
    the next), where it first occurs in ``text``, past its start."""
    for k in range(2, len(offsets) - 1):
        stop = text[offsets[k] - 1:offsets[k] + 1]
        if offsets[k - 1] < offsets[k] < offsets[k + 1] and text.find(stop) == offsets[k] - 1:
            return stop
    pytest.skip(f"no stop string spans two tokens in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_leave_out_the_tokens_a_stop_string_cut(http, stream: bool) -> None:
    """A stop string across tokens: the tokens that start in the text it cut are not listed (they were, offsets
    past the returned text's end), so every offset indexes the returned text; streamed as whole."""
    body = {"prompt": PROMPT[:24], "max_tokens": 24, "temperature": 1.0, "seed": 0, "top_k": 40, "ignore_eos": True,
            "logprobs": 2}
    full, full_lp = completion(http, body, stream=False)
    stop = spanning_stop(full, full_lp["text_offset"])
    text, lp = completion(http, body | {"stop": [stop]}, stream)
    assert text == full[:full.find(stop)]
    kept = sum(o < len(text) for o in full_lp["text_offset"])
    assert lp == {k: v[:kept] for k, v in full_lp.items()} and all(o < len(text) for o in lp["text_offset"])


CHAT = {"messages": [{"role": "user", "content": "Count with me: one, two"}], "max_tokens": 24, "temperature": 1.0,
        "seed": 0, "top_k": 40, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer(), {}, {}, [])


def tiny_ids(entries: list[dict]) -> list[int]:
    """The ids of chat entries' tokens in tiny's tokenizer, found by their bytes (a token of none is an id past the
    tokenizer's, which decodes to nothing, as 300 does)."""
    tokenizer = tiny_tokenizer()
    by_bytes = {tokenizer.token_bytes(i): i for i in reversed(range(tokenizer.vocab_size))}
    by_bytes[b""] = 300
    return [by_bytes[bytes(e["bytes"])] for e in entries]


def starts(entries: list[dict]) -> list[int]:
    """Where each entry's token starts in the reply, from the bytes: the reply is the bytes of the tokens it shows
    (special ones skipped) decoded with a U+FFFD for each run of invalid ones, and a token starts in the character
    that its first byte is part of (a token that shows none, an eos, in the one the next byte is part of)."""
    tokenizer = tiny_tokenizer()
    shown = [tokenizer.token_bytes(t) if tokenizer.decode([t]) else b"" for t in tiny_ids(entries)]
    raw = b"".join(shown)
    chars = [*char_of_each_byte(raw), len(raw.decode(errors="replace"))]  # past the last byte: the text's end
    return [chars[sum(map(len, shown[:i]))] for i in range(len(shown))]


def char_of_each_byte(raw: bytes) -> list[int]:
    """The index of the character each byte of ``raw`` is part of when it is decoded with a U+FFFD for each run of
    invalid bytes (Python's rule and the tokenizers' alike)."""
    out: list[int] = []
    chars = 0
    while raw:
        try:
            good, bad, raw = raw.decode(), b"", b""
        except UnicodeDecodeError as e:
            good, bad, raw = raw[:e.start].decode(), raw[e.start:e.end], raw[e.end:]
        for char in good:
            out += [chars] * len(char.encode())
            chars += 1
        if bad:
            out += [chars] * len(bad)
            chars += 1
    return out


def joined(entries: list[dict]) -> str:
    """What the entries' tokens decode to together (special tokens skipped, as in the reply)."""
    return tiny_tokenizer().decode(tiny_ids(entries))


def chat(http, body: dict, stream: bool) -> tuple[str, list[dict], int]:
    """The content, the ``logprobs.content`` entries (a stream's joined) and the completion tokens of a chat
    reply; a stream's chunks each list only tokens that start in the content sent so far (see :func:`streamed`)."""
    if not stream:
        reply = http.post("/v1/chat/completions", json=body).json()
        choice = reply["choices"][0]
        return choice["message"]["content"], choice["logprobs"]["content"], reply["usage"]["completion_tokens"]
    content, entries, usage = streamed(http, body)
    return content[0], entries[0], usage


def streamed(http, body: dict, pause: float = 0.0) -> tuple[dict[int, str], dict[int, list[dict]], int]:
    """A streamed chat reply's content and ``logprobs.content`` entries by choice, and its completion tokens; each
    chunk of a choice lists only tokens that start in that choice's content sent so far (its last one aside).
    ``pause``: seconds to wait before each chunk is read, a slow client (the choices run ahead of it)."""
    content: dict[int, str] = defaultdict(str)
    entries: dict[int, list[dict]] = defaultdict(list)
    usage = 0
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            time.sleep(pause)
            event = json.loads(line[6:])
            usage = (event.get("usage") or {}).get("completion_tokens", usage)
            for choice in event["choices"]:
                i = choice["index"]
                content[i] += choice["delta"].get("content") or ""
                entries[i] += (choice["logprobs"] or {}).get("content", [])
                assert choice["finish_reason"] or all(o < len(content[i]) for o in starts(entries[i])), (
                    i, content[i], entries[i])
    return content, entries, usage


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_leave_out_the_tokens_a_stop_string_cut(http, stream: bool) -> None:
    """A stop string across tokens: ``logprobs.content`` lists the tokens that start in the returned content (the
    one the stop starts inside too), not those of the text it cut off (they were all listed); streamed as whole."""
    full, full_entries, _ = chat(http, CHAT, stream=False)
    offsets = starts(full_entries)
    stop = spanning_stop(full, offsets)
    content, entries, _ = chat(http, CHAT | {"stop": [stop]}, stream)
    assert content == full[:full.find(stop)]
    kept = sum(o < len(content) for o in offsets)
    assert_same_entries(entries, full_entries[:kept])
    assert all(o < len(content) for o in starts(entries))
    assert joined(entries).startswith(content)


def assert_same_entries(got: list[dict], want: list[dict]) -> None:
    """The same tokens; their logprobs equal as a repeated request's are (:func:`assert_same_logprobs`)."""
    assert [(e["token"], e["bytes"]) for e in got] == [(e["token"], e["bytes"]) for e in want]
    assert_same_logprobs([e["logprob"] for e in got], [e["logprob"] for e in want])


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_without_a_stop_list_every_token(http, stream: bool) -> None:
    """No stop string: every token the reply used is listed, its text the returned content."""
    content, entries, completion_tokens = chat(http, CHAT, stream)
    assert len(entries) == completion_tokens == CHAT["max_tokens"]
    assert joined(entries) == content


def test_streamed_choices_each_list_the_tokens_of_their_own_text_sent_so_far(http) -> None:
    """n=2 read slowly: while a choice's deltas wait for the client, its turn runs on; each chunk still lists only
    the tokens that start in that choice's content up to it (they listed those of text its later chunks sent)."""
    content, entries, usage = streamed(http, CHAT | {"n": 2, "max_tokens": 32}, pause=0.01)
    assert sorted(content) == [0, 1] and usage == 2 * 32
    for i in content:
        assert len(entries[i]) == 32 and joined(entries[i]) == content[i]


@pytest.mark.parametrize("then", ['_call>\n{"name": "f", "arguments": {}}', "!"])
def test_chat_tokens_wait_for_the_text_a_tool_call_tag_may_start(then: str) -> None:
    """Tools offered: content that may start ``<tool_call>`` is held back, and so are its tokens; once a call
    starts, or the reply ends with none, the rest are listed (a call's tokens too)."""
    streamer, log = ReplyStreamer(HermesFormat()), tiny_log([])
    log.add(TokenIds(list(b"Hi <tool"), 0.0, 0.0, [-1.0] * 8))
    streamer.feed("Hi <tool")
    assert [e["token"] for e in log.take_chat(streamer.sent_chars, final=False)["content"]] == ["H", "i"]
    log.add(TokenIds(list(then.encode()), 0.0, 0.0, [-1.0] * len(then)))
    streamer.feed(then)
    streamer.finish()
    rest = log.take_chat(streamer.sent_chars, final=True)["content"]
    assert "".join(e["token"] for e in rest) == " <tool" + then


def assert_offsets_index(text: str, tokens: list[str], offsets: list[int]) -> None:
    """Each offset points into ``text`` where its token's text is (a part of a character reads U+FFFD alone)."""
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets), (text, offsets)
    for token, offset in zip(tokens, offsets, strict=True):
        assert "\ufffd" in token or text[offset:offset + len(token)] == token, (text, token, offset)


def tiny_log(ids: list[int]) -> LogprobLog:
    log = LogprobLog(tiny_tokenizer())
    log.add(TokenIds(ids, 0.0, 0.0, [-1.0] * len(ids), [[(i, -1.0)] for i in ids]))
    return log


def test_text_offsets_index_the_text_past_split_characters() -> None:
    """A token inside a character decodes to U+FFFD alone; counted as one character each, every later offset
    drifted (and the last could be the text's length)."""
    ids = [*"aé b€!".encode(), 256, 300]  # byte-level ids: 2 + 3 tokens of split characters; then eos, a padded id
    log = LogprobLog(tiny_tokenizer())
    streamed: list[int] = []
    sent = [(ids[:2], "a"), (ids[2:5], "aé b"), (ids[5:7], "aé b"), (ids[7:], "aé b€!")]  # a partial character waits
    for i, (chunk, text) in enumerate(sent):
        log.add(TokenIds(chunk, 0.0, 0.0, [-1.0] * len(chunk)))
        streamed += log.take_legacy(len(text), final=i == len(sent) - 1)["text_offset"]
    whole = log.legacy(0, log.tokens)
    assert whole["text_offset"] == streamed == [0, 1, 1, 2, 3, 4, 4, 4, 5, 6, 6]
    assert_offsets_index("aé b€!", whole["tokens"][:-2], whole["text_offset"][:-2])


E4, B8, X80 = 0xE4, 0xB8, 0x80  # byte-level ids: 一 is E4 B8 80


@pytest.mark.parametrize(("ids", "text", "offsets"), [
    ([E4, *b"ab"], "\ufffdab", [0, 1, 2]),  # a character's first byte, then none of its others: "a" follows U+FFFD
    ([X80, *b"a"], "\ufffda", [0, 1]),  # a lone continuation byte
    ([E4, B8, *b"a"], "\ufffda", [0, 0, 1]),  # two bytes of one invalid sequence share its U+FFFD
    ([E4, E4, B8, X80, *b"a"], "\ufffd一a", [0, 1, 1, 1, 2]),  # an invalid byte, then a whole character
    ([*b"a", E4, E4], "a\ufffd\ufffd", [0, 1, 2]),  # bytes held back at the end: the text ends in their U+FFFD
    ([E4, 256, *b"a"], "\ufffda", [0, 1, 1]),  # the eos between them reads "" (skipped): it starts after U+FFFD
])
def test_text_offsets_count_the_replacement_characters_of_invalid_bytes(ids, text, offsets) -> None:
    """Bytes that never become a character are a U+FFFD in the returned text (the detokenizer releases it with the
    next token, or at the end): the tokens after them start past it, not where the held bytes began.  Whole and
    streamed (the text as the orchestrator sends it) alike."""
    assert detok_text(ids, final=True) == text
    whole, log, streamed = tiny_log(ids), tiny_log([]), []
    for i, token in enumerate(ids):
        log.add(TokenIds([token], 0.0, 0.0, [-1.0]))
        final = i == len(ids) - 1
        streamed += log.take_legacy(len(detok_text(ids[:i + 1], final)), final)["text_offset"]
    got = whole.take_legacy(len(text), final=True)
    assert got["text_offset"] == streamed == offsets
    shown = [(token, offset) for t, token, offset in zip(ids, got["tokens"], offsets, strict=True) if t != 256]
    assert_offsets_index(text, *map(list, zip(*shown, strict=True)))
    assert starts(whole.chat(whole.tokens)["content"]) == offsets  # the reference the server tests use


def detok_text(ids: list[int], final: bool) -> str:
    """The text the orchestrator has sent after ``ids`` (held-back bytes released as U+FFFD at the end)."""
    detok = tiny_tokenizer().detokenizer()
    return "".join(detok.add(t) for t in ids) + (detok.flush() if final else "")


def test_bytes_are_each_token_s_raw_bytes() -> None:
    """Joined, the bytes rebuild the split characters; the token text stays the lone decoding (U+FFFD)."""
    log = tiny_log([*"é€".encode(), 256, 300])
    content = log.chat(log.tokens)["content"]
    assert [e["token"] for e in content] == ["\ufffd"] * 5 + ["<|endoftext|>", ""]
    assert b"".join(bytes(e["bytes"]) for e in content) == "é€<|endoftext|>".encode()
    assert [e["top_logprobs"][0]["bytes"] for e in content[:2]] == [[0xC3], [0xA9]]


def test_token_bytes_of_byte_fallback_pieces() -> None:
    """SentencePiece checkpoints (Llama 2, Mistral) spell a character they lack as ``<0xNN>`` byte tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "▁caf": 3}
    hf = HFTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = Tokenizer(hf, {}, {}, [])
    assert tokenizer.decode([3, 1, 2]) == " café" and tokenizer.decode([1]) == "\ufffd"
    assert [tokenizer.token_bytes(i) for i in (3, 1, 2, 99)] == [b" caf", b"\xc3", b"\xa9", b""]


def test_a_token_a_stop_string_starts_inside_is_listed_and_those_after_it_are_not() -> None:
    """Tokens "Hel" "lo" " wor" "ld" "!" and the stop string "orl", which starts inside " wor" and ends inside "ld":
    the text is "Hello w"; " wor" is listed (at 5), "ld" and "!" are not.  Streamed: the text as the orchestrator
    sends it (" wor" held back while it may start the stop string), a chunk per delta, then the last one."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    pieces = ["Hel", "lo", " wor", "ld", "!"]
    hf = HFTokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="!"))
    hf.decoder = decoders.Fuse()  # the pieces joined as they are
    tokenizer = Tokenizer(hf, {}, {}, [])
    deltas = ["Hel", "lo", " w", "", ""]  # per token: " wor" releases " w" and holds "or"; "ld" completes "orl"
    whole = LogprobLog(tokenizer)
    streamed = LogprobLog(tokenizer)
    parts, text = [], ""
    for token, delta in enumerate(deltas):
        for log in (whole, streamed):
            log.add(TokenIds([token], 0.0, 0.0, [-0.5 * token]))
        text += delta
        if delta:
            parts.append(streamed.take_legacy(len(text), final=False))
    parts.append(streamed.take_legacy(len(text), final=True))
    expected = {"tokens": ["Hel", "lo", " wor"], "token_logprobs": [0.0, -0.5, -1.0], "top_logprobs": [{}, {}, {}],
                "text_offset": [0, 3, 5]}
    assert whole.take_legacy(len(text), final=True) == expected
    assert {k: [v for p in parts for v in p[k]] for k in expected} == expected
    assert [p["tokens"] for p in parts] == [["Hel"], ["lo"], [" wor"], []]
