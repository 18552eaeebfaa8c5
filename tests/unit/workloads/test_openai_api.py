"""The server on a Hugging Face checkpoint (--model-path): the OpenAI API (models, completions,
chat, SSE streaming, usage with experts per token), /v1/infer, gate hot swap, vLLM-named
metrics, and a malformed checkpoint (unready with the file named; the entry point exits 1).
A tiny random Mixtral checkpoint built in code (nothing downloaded), in-process aiohttp."""

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import threading

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from sparsegate_workload.admin import StaticToken
from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document
from sparsegate_workload.hf import build_tiny_checkpoint
from sparsegate_workload.hf_serving import Sampling
from sparsegate_workload.server import STATE, create_admin_app, create_app, wait_ready
from localcluster.ports import free_port

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NAME = "tiny-mixtral"
# capacityFactor 8: the cap cannot drop anything, so experts per token are exactly min = max.
ONE_EXPERT = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 1, "maxExpertsPerToken": 1,
                            "capacityFactor": 8})
TWO_EXPERTS = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 2, "maxExpertsPerToken": 2,
                             "capacityFactor": 8})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ck") / NAME, family="mixtral")


async def _serve(app):
    client = TestClient(TestServer(app, host="127.0.0.1"), connector=aiohttp.TCPConnector(limit=0))
    await client.start_server()
    await wait_ready(app)
    return client


@pytest.fixture
async def client(checkpoint):
    c = await _serve(create_app(gate_doc=ONE_EXPERT, model_path=str(checkpoint)))
    yield c
    await c.close()


def _complete(client, **body):
    return client.post("/v1/completions", json={"prompt": "the gate keeps", "temperature": 0,
                                                "max_tokens": 6, **body})


async def _sse(resp):
    """The data lines of an SSE answer, JSON-decoded except the final [DONE]."""
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    raw = (await resp.read()).decode()
    events = [block for block in raw.split("\n\n") if block]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


async def test_models_lists_the_checkpoint(client):
    body = await (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [
        (NAME, "model", 256)]
    # vLLM's ModelCard fields, which clients written for vLLM read.
    card = body["data"][0]
    assert card["parent"] is None and card["root"] and card["owned_by"] == "sparsegate"
    [perm] = card["permission"]
    assert perm["object"] == "model_permission" and perm["id"].startswith("modelperm-")
    assert perm["allow_sampling"] is True and perm["allow_logprobs"] is True
    assert perm["organization"] == "*" and perm["group"] is None and perm["is_blocking"] is False
    shape = (await (await client.get("/v1/model")).json())["model"]
    assert shape["family"] == "mixtral" and shape["experts"] == 8 and shape["tokenizer"] is True


async def test_completion_is_the_greedy_decode_with_usage(client):
    resp = await _complete(client)
    assert resp.status == 200
    body = await resp.json()
    hf = client.server.app[STATE].hf
    prompt = hf.tokenizer("the gate keeps")["input_ids"]
    direct = hf.generate(prompt, max_tokens=6)
    assert body["object"] == "text_completion" and body["model"] == NAME
    [choice] = body["choices"]
    assert choice["text"] == hf.tokenizer.decode(direct.token_ids, skip_special_tokens=True)
    assert choice["finish_reason"] == direct.finish_reason
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    assert usage["completion_tokens"] == len(direct.token_ids)
    assert usage["total_tokens"] == len(prompt) + len(direct.token_ids)
    # minExpertsPerToken = maxExpertsPerToken = 1 and nothing dropped: exactly one per token.
    assert usage["sparsegate"] == {"mean_experts_per_token": 1.0, "dropped_assignments": 0,
                                   "gate_version": ONE_EXPERT.version,
                                   "tool_calls": []}  # no tool-gate head: no calls


async def test_sampling_is_seeded(client):
    texts = [(await (await _complete(client, temperature=1.0, seed=seed)).json()
              )["choices"][0]["text"] for seed in (7, 7, 8)]
    assert texts[0] == texts[1]
    greedy = (await (await _complete(client)).json())["choices"][0]["text"]
    assert {texts[0], texts[2]} != {greedy}  # sampling is not silently greedy


async def test_sampling_without_a_seed_draws_anew_each_request(client):
    """As OpenAI and vLLM: no seed, no reproducibility (it was seed 0 for every request, so a
    regenerated answer was always the same text)."""
    texts = [(await (await _complete(client, temperature=1.0, max_tokens=12)).json()
              )["choices"][0]["text"] for _ in range(4)]
    assert len(set(texts)) > 1, texts


async def test_chat_without_a_template_joins_role_and_content(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    resp = await client.post("/v1/chat/completions",
                             json={"model": NAME, "messages": messages, "temperature": 0,
                                   "max_tokens": 4})
    assert resp.status == 200
    body = await resp.json()
    hf = client.server.app[STATE].hf
    prompt = hf.tokenizer("system: be brief\nuser: hello\nassistant:")["input_ids"]
    direct = hf.generate(prompt, max_tokens=4)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": hf.tokenizer.decode(direct.token_ids, skip_special_tokens=True)}
    assert body["usage"]["prompt_tokens"] == len(prompt)


async def test_chat_uses_the_tokenizer_template_when_it_has_one(client):
    hf = client.server.app[STATE].hf
    hf.tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                                  "{% endfor %}<assistant>")
    try:
        body = await (await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "temperature": 0})).json()
        assert body["usage"]["prompt_tokens"] == len(hf.tokenizer("<user>hi<assistant>")["input_ids"])
    finally:
        hf.tokenizer.chat_template = None


async def test_a_chat_template_refusing_the_messages_is_a_400(client):
    """A template's raise_exception (Mixtral-Instruct's: roles must alternate) refuses the
    client's messages: 400 naming messages, not a 500."""
    hf = client.server.app[STATE].hf
    hf.tokenizer.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}")
    try:
        resp = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            "max_tokens": 1})
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["param"] == "messages" and "roles must alternate" in error["message"]
    finally:
        hf.tokenizer.chat_template = None


async def test_a_prompt_that_tokenizes_to_nothing_is_a_400(client):
    """A tokenizer whose normalizer strips whitespace turns "   " into no ids: refused up front
    (alone its prefill raised, a 500; packed with another prompt it read that one's logits)."""
    from tokenizers import normalizers

    client.server.app[STATE].hf.tokenizer.backend_tokenizer.normalizer = normalizers.Strip()
    resp = await _complete(client, prompt="   ")
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"


async def test_a_prompt_alone_over_the_context_names_the_prompt(client):
    """No max_tokens fits after it: the field to change is the prompt (messages), not max_tokens."""
    resp = await _complete(client, prompt="experts " * 300, max_tokens=1)
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"
    resp = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "experts " * 300}], "max_tokens": 1})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "messages"


async def test_streaming_sends_openai_chunks_then_done(client):
    whole = (await (await _complete(client)).json())
    chunks = await _sse(await _complete(client, stream=True,
                                        stream_options={"include_usage": True}))
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({c["id"] for c in chunks}) == 1
    text_chunks = [c for c in chunks if c["choices"]]
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == \
        whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


async def test_chat_streaming_starts_with_the_role_and_sends_no_usage_unasked(client):
    resp = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
        "temperature": 0, "stream": True})
    chunks = await _sse(resp)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert not any("usage" in c for c in chunks)


async def test_over_the_context_length_is_a_400_in_openai_shape(client):
    resp = await _complete(client, prompt="experts " * 300)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert "maximum context length is 256 tokens" in error["message"]
    # A short prompt whose max_tokens would run past the context: also refused up front.
    resp = await _complete(client, prompt="x " * 200, max_tokens=100)
    assert resp.status == 400 and "maximum context length" in (await resp.json())["error"]["message"]


@pytest.mark.parametrize("body, status, param", [
    ({"model": "gpt-4"}, 404, "model"),
    ({"n": 9}, 400, "n"),  # more than MAX_N choices
    ({"temperature": 3}, 400, "temperature"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 100_000}, 400, "max_tokens"),
    ({"prompt": ""}, 400, "prompt"),
    ({"logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"stream": "yes"}, 400, "stream"),
    ({"stream": 1}, 400, "stream"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),  # as vLLM: not without a stream
    ({"stream": True, "stream_options": {"include_usage": "no"}}, 400, "stream_options"),
    ({"stream": True, "stream_options": []}, 400, "stream_options"),
])
async def test_bad_requests_name_the_parameter(client, body, status, param):
    resp = await _complete(client, **body)
    assert resp.status == status
    assert (await resp.json())["error"]["param"] == param


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "the gate \ud800 keeps"}, "prompt"),
    ("/v1/completions", {"prompt": ["\udfff"]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud83d"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "us\udc00er", "content": "hi"}]}, "messages"),
])
@pytest.mark.parametrize("template", [False, True])
async def test_a_lone_surrogate_escape_is_a_400_not_a_500(client, path, body, param, template):
    """JSON may escape half a UTF-16 pair ("\\ud800"): json.loads gives a str no tokenizer encodes
    (it raised TypeError, answered 500 as a server fault). The client's text: 400 naming it."""
    hf = client.server.app[STATE].hf
    if template:
        hf.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}{{ m['content'] }}{% endfor %}"
    try:
        resp = await client.post(path, json={**body, "max_tokens": 2, "temperature": 0})
        assert resp.status == 400, await resp.text()
        error = (await resp.json())["error"]
        assert error["param"] == param and "surrogate" in error["message"]
        # A real character outside the BMP (a valid surrogate pair in JSON) is text as any other.
        resp = await client.post("/v1/completions", json={"prompt": "fox \U0001f98a", "max_tokens": 2})
        assert resp.status == 200
    finally:
        hf.tokenizer.chat_template = None


async def test_default_valued_fields_clients_send_are_accepted(client):
    """Chat's logprobs is a boolean whose default, false, clients send explicitly; the completions'
    logprobs is a count (null: none), so false is refused there, naming it."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    resp = await client.post("/v1/chat/completions", json={**chat, "logprobs": False, "n": 1, "top_p": 1,
                                                           "top_logprobs": 0})
    assert resp.status == 200, await resp.text()
    resp = await client.post("/v1/chat/completions", json={**chat, "logprobs": "yes"})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "logprobs"
    assert (await _complete(client, logprobs=None, echo=False)).status == 200
    resp = await _complete(client, logprobs=False)  # not a count
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "logprobs"


def _greedy_texts(hf, prompt="the gate keeps", max_tokens=6):
    """The greedy decode of ``prompt`` alone: its ids and the text after each of its tokens."""
    ids = hf.generate(hf.tokenizer(prompt)["input_ids"], max_tokens=max_tokens).token_ids
    return ids, [hf.tokenizer.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]


def _stop_at(texts):
    """A token k >= 2 of the greedy text whose own text is whole characters, with a character not
    seen before it: (k, the text before it, the text up to it)."""
    for k in range(2, len(texts)):
        before, after = texts[k - 1], texts[k]
        added = after[len(before):]
        if (after.startswith(before) and added.strip() and "\ufffd" not in after
                and added.strip()[0] not in before):
            return k, before, after
    pytest.skip("the greedy text of the tiny checkpoint has no token to stop at")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_string_cuts_the_text_and_ends_the_sequence_early(client, stream):
    """The text ends before the stop string (not included, as OpenAI and vLLM), finish "stop",
    vLLM's stop_reason names it, and the sequence stopped there: usage counts k tokens of 6."""
    hf = client.server.app[STATE].hf
    _, texts = _greedy_texts(hf)
    k, before, after = _stop_at(texts)
    stop = after[len(before):].strip()
    expected = after[:after.index(stop)]
    body = {"stop": [stop, "never in this text \u2603"]}
    if not stream:
        resp = await _complete(client, **body)
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
        [choice] = answer["choices"]
        text, usage = choice["text"], answer["usage"]
    else:
        chunks = await _sse(await _complete(client, stream=True, stream_options={"include_usage": True},
                                            **body))
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        choice, usage = chunks[-2]["choices"][0], chunks[-1]["usage"]
    assert text == expected and stop not in text
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert usage["completion_tokens"] == k < 6
    engine = client.server.app[STATE].engine
    assert engine.running == 0 and engine.decoder.running == 0  # it left the batch
    # A single string is a stop too; chat answers the same way.
    resp = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 6,
        "stop": "\u2603"})
    assert resp.status == 200 and (await resp.json())["choices"][0]["stop_reason"] is None


async def test_a_stream_holds_back_the_start_of_a_stop_string_split_across_tokens(client):
    """A stop string whose first character ends token k-1 and whose rest starts token k: the
    stream must not send that first character (it may be a stop's start) and never sends the
    stop string; a held-back start that no stop completes goes out after all."""
    hf = client.server.app[STATE].hf
    _, texts = _greedy_texts(hf)
    k, before, after = _stop_at(texts)
    stop = before[-1] + after[len(before):][:2]
    assert stop not in before and "\ufffd" not in stop
    chunks = await _sse(await _complete(client, stream=True, stop=stop))
    pieces = [c["choices"][0]["text"] for c in chunks]
    assert "".join(pieces) == after[:after.index(stop)] == before[:-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # The same start held back, then released when the next token does not complete it.
    whole = (await (await _complete(client)).json())["choices"][0]["text"]
    unmatched = before[-1] + "\u2603\u2603"
    chunks = await _sse(await _complete(client, stream=True, stop=unmatched))
    pieces = [c["choices"][0]["text"] for c in chunks]
    assert "".join(pieces) == whole and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert before not in itertools.accumulate(pieces)  # its last character was held back


def test_decoded_text_is_never_cleaned_up_so_a_stream_s_text_starts_the_whole():
    """A tokenizer config with clean_up_tokenization_spaces (forced even for BPE) dropped the
    space before "," once "," came: the text of the first k tokens, which a stream sends, did not
    start the whole answer's. Decoded without clean-up, as vLLM's detokenizer."""
    from sparsegate_workload.hf import build_tiny_tokenizer
    from sparsegate_workload.hf_serving import decode
    from sparsegate_workload.openai_api import completion_logprobs

    tok = build_tiny_tokenizer()
    tok.clean_up_tokenization_spaces = True
    tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    ids = tok("a , b .")["input_ids"]
    assert decode(tok, ids) == "a , b ."
    assert all(decode(tok, ids).startswith(decode(tok, ids[:k])) for k in range(len(ids)))
    assert "".join(completion_logprobs(tok, ids, [None] * len(ids))["tokens"]) == "a , b ."


def test_a_stream_holds_back_only_what_may_start_a_stop_string():
    from sparsegate_workload.openai_api import _held

    assert _held("the end", ()) == 0
    assert _held("the en", ("end",)) == 2 and _held("the e", ("end",)) == 1
    assert _held("the x", ("end",)) == 0
    assert _held("ab", ("abc", "bcd", "b")) == 2  # the longest wins; a 1-character stop holds nothing
    assert _held("e", ("end",)) == 1 and _held("", ("end",)) == 0


async def _one_choice(client, stream: bool, **body):
    """A one-choice completion's (text, choice, usage), streamed (chunks joined) or not."""
    resp = await _complete(client, stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}),
                           **body)
    assert resp.status == 200, await resp.text()
    if stream:
        chunks = await _sse(resp)
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        return text, chunks[-2]["choices"][0], chunks[-1]["usage"]
    answer = await resp.json()
    return answer["choices"][0]["text"], answer["choices"][0], answer["usage"]


async def test_stop_token_ids_end_the_sequence_without_their_text(client):
    hf = client.server.app[STATE].hf
    ids, texts = _greedy_texts(hf)
    stop_id = ids[2]
    k = ids.index(stop_id) + 1
    for stream in (False, True):
        text, choice, usage = await _one_choice(client, stream, stop_token_ids=[stop_id, 5])
        assert text == texts[k - 1]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id)
        assert usage["completion_tokens"] == k


@pytest.mark.parametrize("stream", [False, True])
async def test_include_stop_str_in_output_keeps_the_stop_string_or_token_text(client, stream):
    """vLLM's include_stop_str_in_output: the answer ends after the stop string (text past it in
    the same token still cut) and keeps a stop token id's text; the sequence ends where it would."""
    hf = client.server.app[STATE].hf
    ids, texts = _greedy_texts(hf)
    k, before, after = _stop_at(texts)
    stop = after[len(before):].strip()
    stop_id = ids[2]
    cases = [({"stop": [stop]}, after[:after.index(stop) + len(stop)], stop, k),
             ({"stop_token_ids": [stop_id]}, texts[ids.index(stop_id) + 1], stop_id, ids.index(stop_id) + 1)]
    for body, expected, reason, tokens in cases:
        text, choice, usage = await _one_choice(client, stream, include_stop_str_in_output=True, **body)
        assert text == expected, body
        assert (choice["finish_reason"], choice["stop_reason"], usage["completion_tokens"]) == ("stop", reason, tokens)


async def test_ignore_eos_and_min_tokens(client):
    """With the greedy first token made an end-of-sequence id: it ends the generation at once,
    unless ignore_eos; min_tokens keeps it from being chosen before that many tokens."""
    hf = client.server.app[STATE].hf
    ids, texts = _greedy_texts(hf)
    eos = hf.eos_ids
    hf.eos_ids = frozenset({ids[0]})
    try:
        answer = await (await _complete(client)).json()
        assert answer["choices"][0]["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] == 1
        assert answer["choices"][0]["stop_reason"] is None
        answer = await (await _complete(client, ignore_eos=True)).json()
        assert answer["choices"][0]["text"] == texts[6] and answer["usage"]["completion_tokens"] == 6
        answer = await (await _complete(client, min_tokens=3, max_tokens=8)).json()
        prompt = hf.tokenizer("the gate keeps")["input_ids"]
        direct = hf.generate(prompt, max_tokens=8, sampling=Sampling(min_tokens=3))
        assert ids[0] not in direct.token_ids[:3] and direct.token_ids[0] != ids[0]
        assert answer["usage"]["completion_tokens"] == len(direct.token_ids)
        assert answer["choices"][0]["text"] == direct.text(hf.tokenizer)
    finally:
        hf.eos_ids = eos


async def test_top_k_1_and_a_tiny_top_p_are_greedy_at_temperature_1(client):
    greedy = (await (await _complete(client, max_tokens=12)).json())["choices"][0]["text"]
    for seed in (1, 2, 3):
        sampled = (await (await _complete(client, max_tokens=12, temperature=1, seed=seed)).json())
        assert sampled["choices"][0]["text"] != greedy  # sampling is not greedy by itself
        for body in ({"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "top_p": 0.5}):
            resp = await _complete(client, max_tokens=12, temperature=1, seed=seed, **body)
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["choices"][0]["text"] == greedy, body


async def test_seeded_top_p_and_top_k_sampling_is_the_same_batched_or_alone(client):
    """Each request sampled with top_p / top_k gives the same text alone and batched with the
    others, equal to the solo reference (hf.generate), and differs from unnarrowed sampling."""
    hf = client.server.app[STATE].hf
    prompt = hf.tokenizer("the gate keeps")["input_ids"]
    bodies = [{"seed": s, "top_p": p, "top_k": k} for s in (1, 2, 3) for p, k in ((0.5, -1), (0.9, 5))]
    alone = [(await (await _complete(client, max_tokens=10, temperature=1, **b)).json())["choices"][0]["text"]
             for b in bodies]
    together = await asyncio.gather(*[_complete(client, max_tokens=10, temperature=1, **b) for b in bodies])
    assert [(await r.json())["choices"][0]["text"] for r in together] == alone
    for b, text in zip(bodies, alone):
        direct = hf.generate(prompt, max_tokens=10, temperature=1, seed=b["seed"],
                             sampling=Sampling(top_p=b["top_p"], top_k=max(b["top_k"], 0)))
        assert text == direct.text(hf.tokenizer)
    plain = [(await (await _complete(client, max_tokens=10, temperature=1, seed=s)).json())["choices"][0]["text"]
             for s in (1, 2, 3)]
    assert plain != alone[0::2]  # top_p 0.5 narrowed the draws


@pytest.mark.parametrize("body", [
    {"stop": "x"}, {"stop": ["a", "b", "c", "d"]}, {"stop": []}, {"stop": None},
    {"top_p": 0.3}, {"top_p": 1}, {"top_k": -1}, {"top_k": 0}, {"top_k": 400},
    {"stop_token_ids": []}, {"stop_token_ids": [0, 383]}, {"ignore_eos": False},
    {"ignore_eos": True}, {"min_tokens": 0}, {"min_tokens": 6}, {"logprobs": 0}, {"logprobs": 20},
    {"echo": True}, {"echo": True, "logprobs": 2}, {"echo": False},
    {"include_stop_str_in_output": False}, {"include_stop_str_in_output": True, "stop": "x"},
])
async def test_sampling_and_stop_fields_are_accepted(client, body):
    resp = await _complete(client, temperature=0.7, **body)
    assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("body, param", [
    ({"stop": ""}, "stop"),
    ({"stop": ["a", ""]}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop": {"a": 1}}, "stop"),
    ({"stop": "a \ud800"}, "stop"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": "0.5"}, "top_p"),
    ({"top_p": True}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [384]}, "stop_token_ids"),  # the tiny vocabulary is 384
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": ["5"]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 7}, "min_tokens"),  # over max_tokens (6)
    ({"min_tokens": 1.0}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": 2, "stream": True, "echo": True}, "logprobs"),  # the prompt's: not in a stream
    ({"return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids"),
    ({"echo": 1}, "echo"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
])
async def test_bad_sampling_and_stop_values_name_the_parameter(client, body, param):
    resp = await _complete(client, **body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


@pytest.mark.parametrize("temperature", [0, 1])
async def test_completion_logprobs_are_the_model_s_log_softmax(client, temperature):
    """logprobs n: per generated token its log probability under the model's raw logits (one
    forward over prompt + generated text recomputes them), its n most probable alternatives
    plus itself, and its text and offset, as vLLM's legacy completions answer (tokens named
    "token_id:<id>" with return_tokens_as_token_ids, as vLLM: byte-level tokens of a partial
    character all read "\ufffd")."""
    hf = client.server.app[STATE].hf
    body = {"logprobs": 3, "temperature": temperature, "seed": 4, "max_tokens": 8}
    answer = await (await _complete(client, return_tokens_as_token_ids=True, **body)).json()
    lp = answer["choices"][0]["logprobs"]
    n = answer["usage"]["completion_tokens"]
    assert n == 8 and all(len(lp[k]) == n for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
    prompt = hf.tokenizer("the gate keeps")["input_ids"]
    direct = hf.generate(prompt, max_tokens=8, temperature=temperature, seed=4,
                         sampling=Sampling(logprobs=3))
    ids = direct.token_ids
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    with torch.inference_mode():
        logits = hf.lm.model(input_ids=torch.tensor([prompt + ids])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    for i, t in enumerate(ids):
        assert lp["token_logprobs"][i] == pytest.approx(float(expected[i, t]), abs=1e-4)
        top = lp["top_logprobs"][i]
        assert 3 <= len(top) <= 4 and top[f"token_id:{t}"] == lp["token_logprobs"][i]
        best = expected[i].topk(3)
        for tok, value in zip(best.indices.tolist(), best.values.tolist()):
            assert top[f"token_id:{tok}"] == pytest.approx(value, abs=1e-4)
        if temperature == 0:  # greedy chose the most probable token
            assert lp["token_logprobs"][i] == max(top.values())
    # By text (the default): each token decoded alone, offsets summing their lengths.
    texts = (await (await _complete(client, **body)).json())["choices"][0]["logprobs"]
    assert texts["token_logprobs"] == lp["token_logprobs"]
    assert texts["tokens"] == [hf.tokenizer.decode([t]) for t in ids]
    assert texts["text_offset"] == list(itertools.accumulate([0] + [len(t) for t in texts["tokens"][:-1]]))
    # logprobs 0: the chosen token only; without logprobs: null as before.
    zero = (await (await _complete(client, logprobs=0)).json())["choices"][0]["logprobs"]
    assert all(len(top) == 1 for top in zero["top_logprobs"])
    assert (await (await _complete(client)).json())["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stop", [None, "\u2603"])
async def test_streamed_logprobs_are_the_non_streamed_ones_chunk_by_chunk(client, chat, stop):
    """Each text chunk carries the logprobs of the tokens received since the one before; joined,
    they are the non-streamed answer's (text offsets continuing across chunks)."""
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                              "logprobs": True, "top_logprobs": 2}
    else:
        path, body = "/v1/completions", {"prompt": "the gate keeps", "logprobs": 2}
    body = {**body, "max_tokens": 10, "temperature": 1, "seed": 3, "stop": stop}
    whole = (await (await client.post(path, json=body)).json())["choices"][0]["logprobs"]
    chunks = await _sse(await client.post(path, json={**body, "stream": True}))
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0].get("logprobs")]
    if chat:
        assert [t for p in parts for t in p["content"]] == whole["content"]
    else:
        assert {k: [x for p in parts for x in p[k]] for k in whole} == whole
    assert len(parts) > 1 or stop  # really streamed (with a stop string: all at the end)


async def test_chat_logprobs_in_chat_s_shape(client):
    """Chat's logprobs: true with top_logprobs n: content[] per generated token with its token,
    logprob, bytes and n alternatives; the same values as /v1/completions gives the same prompt."""
    hf = client.server.app[STATE].hf
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}
    answer = await (await client.post("/v1/chat/completions",
                                      json={**chat, "logprobs": True, "top_logprobs": 2})).json()
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == answer["usage"]["completion_tokens"] == 5
    prompt = hf.tokenizer("user: hi\nassistant:")["input_ids"]
    direct = hf.generate(prompt, max_tokens=5, sampling=Sampling(logprobs=2))
    for item, token, (lp, top) in zip(content, direct.token_ids, direct.logprobs):
        text = hf.tokenizer.decode([token])
        assert item["token"] == text and item["bytes"] == list(text.encode())
        assert item["logprob"] == pytest.approx(lp, abs=1e-5)
        assert [a["token"] for a in item["top_logprobs"]] == [hf.tokenizer.decode([t]) for t, _ in top]
        assert item["logprob"] == pytest.approx(item["top_logprobs"][0]["logprob"])  # greedy
    plain = await (await client.post("/v1/chat/completions", json=chat)).json()
    assert plain["choices"][0]["logprobs"] is None
    for body, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                        ({"logprobs": "yes"}, "logprobs")):
        resp = await client.post("/v1/chat/completions", json={**chat, **body})
        assert resp.status == 400 and (await resp.json())["error"]["param"] == param, body


async def test_echo_with_logprobs_gives_the_prompt_s_log_likelihood(client):
    """lm-evaluation-harness's log-likelihood request (echo, logprobs 1, max_tokens 1): the text
    starts with the prompt and the logprobs with the prompt's tokens (the first one's null), each
    its log probability given the ones before it; batched (packed prefills) as alone."""
    hf = client.server.app[STATE].hf
    prompts = ["the gate keeps", "experts route tokens to the few that fit", "a"]
    body = {"echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    alone = [await (await _complete(client, prompt=p, **body)).json() for p in prompts]
    together = await asyncio.gather(*[_complete(client, prompt=p, **body) for p in prompts])
    for p, one, resp in zip(prompts, alone, together):
        ids = hf.tokenizer(p)["input_ids"]
        [choice] = one["choices"]
        gen = hf.generate(ids, max_tokens=1)
        assert choice["text"] == p + hf.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        lp = choice["logprobs"]
        assert lp["tokens"] == [hf.tokenizer.decode([t]) for t in ids + gen.token_ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        with torch.inference_mode():
            logits = hf.lm.model(input_ids=torch.tensor([ids + gen.token_ids])).logits[0].float()
        expected = torch.log_softmax(logits[:-1], dim=-1)
        want = [float(expected[i, t]) for i, t in enumerate((ids + gen.token_ids)[1:])]
        assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
        assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"][1:])
        batched = (await resp.json())["choices"][0]
        assert batched["text"] == choice["text"]
        assert batched["logprobs"]["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)
    # Echo alone (no logprobs), streamed: the prompt first, then the generated text.
    whole = (await (await _complete(client, echo=True)).json())["choices"][0]["text"]
    chunks = await _sse(await _complete(client, echo=True, stream=True))
    assert chunks[0]["choices"][0]["text"] == "the gate keeps"
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert whole.startswith("the gate keeps") and len(whole) > len("the gate keeps")
    # Chat has no echo here.
    resp = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "echo": True})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "echo"


# -- vLLM's fan-out: token-id prompts, several prompts, n choices ------------------------------


async def test_a_prompt_of_token_ids_is_its_text_s_prompt(client):
    """vLLM reads prompt as token ids too (refused with 400 before): the same answer as the text
    they tokenize from; echo repeats their decoding."""
    hf = client.server.app[STATE].hf
    ids = hf.tokenizer("the gate keeps")["input_ids"]
    by_text = await (await _complete(client)).json()
    resp = await _complete(client, prompt=ids)
    assert resp.status == 200, await resp.text()
    by_ids = await resp.json()
    assert by_ids["choices"] == by_text["choices"] and by_ids["usage"] == by_text["usage"]
    echoed = await (await _complete(client, prompt=ids, echo=True)).json()
    assert echoed["choices"][0]["text"] == "the gate keeps" + by_text["choices"][0]["text"]


async def test_several_prompts_give_one_choice_each_decoded_together(client):
    """A list of prompts (strings, or token-id lists): choice i is prompt i's answer alone, all
    decoded in the same batches; usage sums them (vLLM's). With echo and logprobs (as
    lm-evaluation-harness batches its log-likelihood requests) each choice is its prompt's."""
    hf = client.server.app[STATE].hf
    engine = client.server.app[STATE].engine
    prompts = ["the gate keeps", "experts route tokens to the few that fit", "a"]
    alone = [await (await _complete(client, prompt=p)).json() for p in prompts]
    assert engine.max_batch < 3
    resp = await _complete(client, prompt=prompts)
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    assert engine.max_batch == 3  # decoded together
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert [c["text"] for c in answer["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert [c["finish_reason"] for c in answer["choices"]] == [a["choices"][0]["finish_reason"] for a in alone]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert answer["usage"][key] == sum(a["usage"][key] for a in alone)
    ids = [hf.tokenizer(p)["input_ids"] for p in prompts]
    by_ids = await (await _complete(client, prompt=ids)).json()
    assert by_ids["choices"] == answer["choices"] and by_ids["usage"] == answer["usage"]
    body = {"echo": True, "logprobs": 1, "max_tokens": 1}
    many = await (await _complete(client, prompt=ids, **body)).json()
    for i, p in enumerate(prompts):
        one = (await (await _complete(client, prompt=p, **body)).json())["choices"][0]
        assert many["choices"][i]["text"] == one["text"] and one["text"].startswith(p)
        got, want = many["choices"][i]["logprobs"], one["logprobs"]
        assert got["tokens"] == want["tokens"] and got["token_logprobs"][0] is None
        assert got["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=1e-5)


async def test_a_stream_of_several_prompts_tags_each_chunk_with_its_choice(client):
    prompts = ["the gate keeps", "experts route tokens", "a"]
    body = {"prompt": prompts, "temperature": 1, "seed": 2, "max_tokens": 8}
    whole = await (await _complete(client, **body)).json()
    chunks = await _sse(await _complete(client, **body, stream=True,
                                        stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for c in chunks[:-1]:
        [choice] = c["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finish[choice["index"]] = choice["finish_reason"]
    assert texts == {i: c["text"] for i, c in enumerate(whole["choices"])}
    assert finish == {i: c["finish_reason"] for i, c in enumerate(whole["choices"])}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


@pytest.mark.parametrize("prompt", [
    [], [[]], ["a", [1]], [[1], "a"], [1, "a"], [-1], [384], [True], [1.0], [""], ["a", ""],
    [[1, 2], [384]], [[1, 2], []], {"a": 1}, 5,
])
async def test_bad_prompts_name_the_prompt(client, prompt):
    resp = await _complete(client, prompt=prompt)
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "prompt"


async def test_n_choices_per_prompt_each_seeded_with_seed_plus_its_index(client):
    """n: n choices per prompt (index i * n + j), drawn independently: choice j is the request
    alone with seed + j (vLLM's), so reproducible; greedy gives n equal choices. Usage counts
    the prompt once and sums the completions (vLLM's)."""
    body = {"temperature": 1, "max_tokens": 8}
    singles = [await (await _complete(client, seed=5 + j, **body)).json() for j in range(3)]
    resp = await _complete(client, n=3, seed=5, **body)
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert [c["text"] for c in answer["choices"]] == [s["choices"][0]["text"] for s in singles]
    assert len({c["text"] for c in answer["choices"]}) > 1  # independent draws
    assert answer["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
    assert answer["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    assert (await (await _complete(client, n=3, seed=5, **body)).json())["choices"] == answer["choices"]
    one = (await (await _complete(client)).json())["choices"][0]["text"]
    greedy = await (await _complete(client, n=2, best_of=2)).json()
    assert [c["text"] for c in greedy["choices"]] == [one, one]
    # Two prompts, n 2: choice i * 2 + j is prompt i's with seed 5 + j.
    two = await (await _complete(client, prompt=["the gate keeps", "a"], n=2, seed=5, **body)).json()
    a = [(await (await _complete(client, prompt="a", seed=5 + j, **body)).json())["choices"][0]["text"]
         for j in range(2)]
    assert [c["text"] for c in two["choices"]] == [s["choices"][0]["text"] for s in singles[:2]] + a
    # Chat, streamed: each choice's role chunk, then its content, tagged with its index.
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 1,
            "seed": 3, "n": 2}
    whole = await (await client.post("/v1/chat/completions", json=chat)).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    chunks = await _sse(await client.post("/v1/chat/completions", json={**chat, "stream": True}))
    assert sorted(c["choices"][0]["index"] for c in chunks if "role" in c["choices"][0]["delta"]) == [0, 1]
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content", "")
    assert texts == {i: c["message"]["content"] for i, c in enumerate(whole["choices"])}


async def test_each_sequence_of_a_request_holds_an_admission_slot(checkpoint):
    """--max-inflight counts sequences: a request of k takes k slots (429 unless all fit now), each
    freed as its sequence leaves; one needing more than --max-inflight could never be admitted:
    400 naming n (or prompt), not a 429 to retry."""
    app = create_app(gate_doc=ONE_EXPERT, model_path=str(checkpoint), max_inflight=4)
    c = await _serve(app)
    try:
        state = app[STATE]
        body = {"prompt": "a", "max_tokens": 3, "temperature": 1}
        resp = await c.post("/v1/completions", json={**body, "n": 5})
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "n"
        resp = await c.post("/v1/completions", json={**body, "prompt": ["a"] * 5})
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"
        state.inflight = 2  # two other sequences hold theirs
        resp = await c.post("/v1/completions", json={**body, "n": 3})
        assert resp.status == 429 and state.inflight == 2
        resp = await c.post("/v1/completions", json={**body, "n": 2})
        assert resp.status == 200 and state.inflight == 2
        state.inflight = 0
        chunks = await _sse(await c.post("/v1/completions", json={**body, "n": 4, "stream": True}))
        assert {ch["choices"][0]["index"] for ch in chunks} == {0, 1, 2, 3} and state.inflight == 0
    finally:
        await c.close()


# -- logit_bias and the penalties -------------------------------------------------------------


def test_adjust_logits_is_vllm_s_order_and_formula():
    from sparsegate_workload.hf_serving import adjust_logits

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    sampling = Sampling(logit_bias=((1, 1.0),), repetition_penalty=2.0, frequency_penalty=0.5,
                        presence_penalty=0.25)
    out = adjust_logits(logits, sampling, [0, 4], [2, 2, 3])
    # bias [2, 0, .5, 3, -2]; repetition over {0, 4} (prompt) and {2, 3} (generated): positive
    # halved, negative doubled [1, 0, .25, 1.5, -4]; then 0.5 x counts [0, 0, 2, 1, 0] and 0.25
    # for each generated token subtracted.
    assert out.tolist() == pytest.approx([1.0, 0.0, -1.0, 0.75, -4.0])
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]  # a copy
    assert not Sampling().adjusts and Sampling(logit_bias=((1, 0.0),)).adjusts


async def test_logit_bias_steers_greedy_and_sampled_choices(client):
    hf = client.server.app[STATE].hf
    [x] = hf.tokenizer("x")["input_ids"]
    for temperature in (0, 1):
        resp = await _complete(client, logit_bias={str(x): 100}, temperature=temperature, max_tokens=4)
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["choices"][0]["text"] == "xxxx"
    ids, _ = _greedy_texts(hf)
    answer = await (await _complete(client, logit_bias={str(ids[0]): -100})).json()
    direct = hf.generate(hf.tokenizer("the gate keeps")["input_ids"], max_tokens=6,
                         sampling=Sampling(logit_bias=((ids[0], -100.0),)))
    assert direct.token_ids[0] != ids[0] and answer["choices"][0]["text"] == direct.text(hf.tokenizer)


async def test_penalties_are_the_solo_decode_s_batched_or_alone(client):
    """presence, frequency and repetition penalties (and logit_bias) per sequence: each request
    alone, batched with the others, and the solo reference (hf.generate) give the same text."""
    hf = client.server.app[STATE].hf
    prompt = hf.tokenizer("the gate keeps")["input_ids"]
    bodies = [{"presence_penalty": 2}, {"frequency_penalty": 1.5}, {"repetition_penalty": 1.8},
              {"frequency_penalty": -2, "presence_penalty": -1},
              {"repetition_penalty": 0.5, "temperature": 1, "seed": 4},
              {"presence_penalty": 1, "logit_bias": {"5": 3}, "temperature": 0.8, "seed": 9}]
    alone = [await (await _complete(client, max_tokens=12, **b)).json() for b in bodies]
    together = await asyncio.gather(*[_complete(client, max_tokens=12, **b) for b in bodies])
    assert [(await r.json())["choices"] for r in together] == [a["choices"] for a in alone]
    for b, a in zip(bodies, alone):
        sampling = Sampling(presence_penalty=b.get("presence_penalty", 0),
                            frequency_penalty=b.get("frequency_penalty", 0),
                            repetition_penalty=b.get("repetition_penalty", 1),
                            logit_bias=tuple((int(k), float(v)) for k, v in b.get("logit_bias", {}).items()))
        direct = hf.generate(prompt, max_tokens=12, temperature=b.get("temperature", 0),
                             seed=b.get("seed", 0), sampling=sampling)
        assert a["choices"][0]["text"] == direct.text(hf.tokenizer), b
    plain = (await (await _complete(client, max_tokens=12)).json())["choices"][0]["text"]
    assert any(a["choices"][0]["text"] != plain for a in alone[:4])  # greedy changed


@pytest.mark.parametrize("body", [
    {"n": 2}, {"n": 2, "best_of": 2}, {"best_of": 1}, {"presence_penalty": -2}, {"frequency_penalty": 2},
    {"repetition_penalty": 1.3}, {"logit_bias": {}}, {"logit_bias": {"5": -100, "7": 100}},
    {"prompt": [1, 2, 3]}, {"prompt": ["a", "b"]}, {"prompt": [[1, 2], [3]]}, {"prompt": ["a"]},
])
async def test_fan_out_and_penalty_fields_are_accepted(client, body):
    resp = await _complete(client, temperature=0.7, **body)
    assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("body, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"presence_penalty": "1"}, "presence_penalty"), ({"presence_penalty": True}, "presence_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"), ({"frequency_penalty": [1]}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"repetition_penalty": "2"}, "repetition_penalty"), ({"repetition_penalty": True}, "repetition_penalty"),
    ({"logit_bias": []}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"384": 1}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"n": 0}, "n"), ({"n": 9}, "n"), ({"n": "2"}, "n"), ({"n": True}, "n"), ({"n": 1.0}, "n"),
    ({"best_of": 2}, "best_of"), ({"n": 2, "best_of": 3}, "best_of"), ({"n": 1, "best_of": True}, "best_of"),
])
async def test_bad_fan_out_and_penalty_values_name_the_parameter(client, body, param):
    resp = await _complete(client, **body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


async def test_tokenize_and_detokenize_as_vllm(client):
    """vLLM's POST /tokenize (a prompt as /v1/completions tokenizes it, chat messages as
    /v1/chat/completions renders them) and POST /detokenize (404 before: no such routes)."""
    hf = client.server.app[STATE].hf
    ids = hf.tokenizer("the gate keeps")["input_ids"]
    resp = await client.post("/tokenize", json={"prompt": "the gate keeps"})
    assert resp.status == 200, await resp.text()
    assert await resp.json() == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    resp = await client.post("/tokenize", json={"model": NAME, "prompt": "the gate keeps", "return_token_strs": True})
    assert (await resp.json())["token_strs"] == hf.tokenizer.convert_ids_to_tokens(ids)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    tokens = (await (await client.post("/tokenize", json=chat)).json())["tokens"]
    assert tokens == hf.tokenizer("user: hi\nassistant:")["input_ids"]
    answer = await (await client.post("/v1/chat/completions", json={**chat, "max_tokens": 1})).json()
    assert answer["usage"]["prompt_tokens"] == len(tokens)
    bare = await (await client.post("/tokenize", json={**chat, "add_generation_prompt": False})).json()
    assert bare["tokens"] == hf.tokenizer("user: hi\n")["input_ids"]
    resp = await client.post("/detokenize", json={"tokens": ids})
    assert resp.status == 200 and await resp.json() == {"prompt": "the gate keeps"}
    for path, body, status, param in (
            ("/tokenize", {"prompt": 5}, 400, "prompt"), ("/tokenize", {"prompt": "a", "n": 1}, 400, "n"),
            ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, 400, "add_special_tokens"),
            ("/tokenize", {"prompt": "a", "model": "x"}, 404, "model"),
            ("/tokenize", {"messages": []}, 400, "messages"),
            ("/detokenize", {"tokens": [384]}, 400, "tokens"), ("/detokenize", {"tokens": "1"}, 400, "tokens"),
            ("/detokenize", {"tokens": [True]}, 400, "tokens")):
        resp = await client.post(path, json=body)
        assert resp.status == status, (path, body)
        assert (await resp.json())["error"]["param"] == param, (path, body)


async def test_infer_keeps_its_shape_on_a_checkpoint(client):
    hf = client.server.app[STATE].hf
    prompt = hf.tokenizer("the gate keeps")["input_ids"]
    resp = await client.post("/v1/infer", json={"tokens": [prompt], "returnLogits": True})
    assert resp.status == 200
    body = await resp.json()
    assert set(body) == {"gateVersion", "checksum", "nextTokens", "expertCounts",
                         "activeExpertsPerToken", "selectedExpertsPerToken",
                         "droppedAssignments", "gateEntropy", "toolCalls", "toolGateFireRate",
                         "toolResults", "precisions", "numTokens", "logits"}
    assert body["nextTokens"] == [hf.generate(prompt, max_tokens=1).token_ids[0]]
    assert body["gateVersion"] == ONE_EXPERT.version and body["activeExpertsPerToken"] == 1.0
    assert [sum(c) for c in body["expertCounts"]] == [len(prompt)] * 2
    assert body["toolCalls"] == [[]] and body["toolGateFireRate"] == 0.0
    assert body["toolResults"] == [None]  # no tool-gate head: no tool is called
    assert len(body["logits"][0]) == 384
    resp = await client.post("/v1/infer", json={"tokens": [[384]]})
    assert resp.status == 422 and "outside the vocabulary [0, 384)" in (await resp.json())["error"]


async def test_gate_hot_swap_changes_what_usage_reports(client):
    async with TestClient(TestServer(create_admin_app(client.server.app, auth=StaticToken(TOKEN)),
                                     host="127.0.0.1")) as admin:
        resp = await admin.put("/admin/gate", json=TWO_EXPERTS.to_json(), headers=AUTH)
        assert resp.status == 200 and (await resp.json())["applied"] is True
        usage = (await (await _complete(client)).json())["usage"]["sparsegate"]
        assert usage["gate_version"] == TWO_EXPERTS.version
        assert usage["mean_experts_per_token"] == 2.0
        too_many = make_document({**DEFAULT_PARAMS, "maxExpertsPerToken": 9}, num_experts=None)
        resp = await admin.put("/admin/gate", json=too_many.to_json(), headers=AUTH)
        assert resp.status == 422 and "8 experts" in (await resp.json())["error"]
        assert (await (await admin.get("/admin/gate", headers=AUTH)).json())["version"] == \
            TWO_EXPERTS.version


async def test_metrics_use_vllm_names_and_keep_sparsegate_ones(client):
    await _complete(client)
    await _sse(await _complete(client, stream=True))
    text = await (await client.get("/metrics")).text()
    label = f'{{model_name="{NAME}"}}'
    for line in (f"vllm:num_requests_running{label} 0.0", f"vllm:num_requests_waiting{label} 0.0",
                 f"vllm:e2e_request_latency_seconds_count{label} 2.0",
                 f"vllm:time_to_first_token_seconds_count{label} 2.0",
                 f"vllm:generation_tokens_total{label} 12.0",
                 f'sparsegate_requests_total{{code="200",gate_version="{ONE_EXPERT.version}"}} 2.0',
                 f'sparsegate_gate_config_info{{checksum="{ONE_EXPERT.checksum}",'
                 f'version="{ONE_EXPERT.version}"}} 1.0'):
        assert line in text, line
    prompt = len(client.server.app[STATE].hf.tokenizer("the gate keeps")["input_ids"])
    assert f"vllm:prompt_tokens_total{label} {2 * prompt}.0" in text
    assert "sparsegate_active_experts_per_token 1.0" in text


def test_vllm_latency_histograms_have_vllm_s_buckets():
    """vllm:time_to_first_token_seconds and vllm:e2e_request_latency_seconds use vLLM's buckets
    (dashboards sum vLLM and sparsegate pods by ``le``). They stopped at 10 s and 60 s: a TTFT of
    20 s spent queued (within the default 30 s --request-timeout) fell in +Inf, and
    histogram_quantile read any p99 there as 10 s."""
    from prometheus_client import generate_latest

    from sparsegate_workload.metrics import ServerMetrics
    m = ServerMetrics(n_layers=1, num_experts=2, model_name="m")
    m.ttft.observe(20.0)
    m.e2e.observe(90.0)
    text = generate_latest(m.registry).decode()

    def buckets(name):
        return [ln.split('le="')[1].split('"')[0] for ln in text.splitlines()
                if ln.startswith(f"{name}_bucket")]
    assert buckets("vllm:time_to_first_token_seconds") == [str(float(b)) for b in (
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)] + ["+Inf"]
    assert buckets("vllm:e2e_request_latency_seconds") == [str(float(b)) for b in (
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
        240.0, 480.0, 960.0, 1920.0, 7680.0)] + ["+Inf"]
    assert 'vllm:time_to_first_token_seconds_bucket{le="20.0",model_name="m"} 1.0' in text
    assert 'vllm:e2e_request_latency_seconds_bucket{le="120.0",model_name="m"} 1.0' in text


@pytest.mark.parametrize("stream", [False, True])
async def test_vllm_inter_token_latency_and_time_per_output_token(checkpoint, monkeypatch, stream):
    """vllm:inter_token_latency_seconds (one observation per token after a request's first: the
    time since its previous token) and vllm:request_time_per_output_token_seconds (one per finished
    request: first to last token over the tokens after the first), on vLLM's names and buckets,
    streamed or not. The server had neither: a dashboard or SLO on vLLM's decode speed read
    nothing from a sparsegate pod."""
    from sparsegate_workload import batch_decode

    step = batch_decode.BatchDecoder._step

    def slow_step(self):  # each decode step takes >= 20 ms, so each gap is measurably that
        import time
        time.sleep(0.02)
        return step(self)
    monkeypatch.setattr(batch_decode.BatchDecoder, "_step", slow_step)
    c = await _serve(create_app(gate_doc=ONE_EXPERT, model_path=str(checkpoint)))
    try:
        counts = []
        for _ in range(2):
            resp = await _complete(c, stream=stream, max_tokens=6,
                                   **({"stream_options": {"include_usage": True}} if stream else {}))
            body = (await _sse(resp))[-1] if stream else await resp.json()
            counts.append(body["usage"]["completion_tokens"])
        text = await (await c.get("/metrics")).text()
        label = f'{{model_name="{NAME}"}}'

        def value(name):
            return float(text.split(f"{name}{label} ")[1].split()[0])

        def buckets(name):
            return [ln.split('le="')[1].split('"')[0] for ln in text.splitlines()
                    if ln.startswith(f"{name}_bucket")]
        vllm_buckets = [str(float(b)) for b in (
            0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0)] + ["+Inf"]
        assert buckets("vllm:inter_token_latency_seconds") == vllm_buckets
        assert buckets("vllm:request_time_per_output_token_seconds") == vllm_buckets
        assert counts == [6, 6]
        assert value("vllm:inter_token_latency_seconds_count") == sum(n - 1 for n in counts)
        itl = value("vllm:inter_token_latency_seconds_sum")
        assert 0.02 * 10 <= itl < 5.0  # each gap is a >= 20 ms step
        # No gap under 10 ms (the model's steps are 20 ms apart, however the loop got them).
        assert f'vllm:inter_token_latency_seconds_bucket{{le="0.01",model_name="{NAME}"}} 0.0' in text
        assert value("vllm:request_time_per_output_token_seconds_count") == 2.0
        # Each request's mean gap, summed: the same gaps, over 5 each.
        assert value("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(itl / 5)
    finally:
        await c.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_vllm_latencies_count_from_the_request_s_arrival(checkpoint, stream):
    """vLLM's e2e latency and TTFT run from arrival (their help says so): a gate's injected
    latency (and the body read, tokenization) before the request reaches the engine is in them, as
    in sparsegate_request_duration_seconds. They started after all that (~0.03 s for 0.3 s here)."""
    slow = make_document({**DEFAULT_PARAMS, "faultInjection": {"errorRate": 0.0, "addedLatencyMs": 300}})
    c = await _serve(create_app(gate_doc=slow, model_path=str(checkpoint)))
    try:
        resp = await _complete(c, stream=stream, max_tokens=2)
        if stream:
            await _sse(resp)
        assert resp.status == 200
        text = await (await c.get("/metrics")).text()

        def total(name):
            return float(text.split(f'{name}_sum{{model_name="{NAME}"}} ')[1].split()[0])
        assert total("vllm:e2e_request_latency_seconds") >= 0.3
        assert total("vllm:time_to_first_token_seconds") >= 0.3
    finally:
        await c.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_is_counted_under_the_version_its_prefill_ran_under(client, monkeypatch, stream):
    """A gate installed between a request's admission and its prefill serves it: the request
    series name that version, streamed or not (the admission-time choice is a guess)."""
    import dataclasses

    from sparsegate_workload import openai_api

    real = openai_api.choose_gate

    def admitted_under_an_older_version(state, request):
        gate = real(state, request)  # the installed gate (hf_gate None: prefill reads what is installed)
        return dataclasses.replace(gate, doc=dataclasses.replace(gate.doc, version="g-admitted"))

    monkeypatch.setattr(openai_api, "choose_gate", admitted_under_an_older_version)
    resp = await _complete(client, stream=stream)
    assert resp.status == 200
    if stream:
        await _sse(resp)
    text = await (await client.get("/metrics")).text()
    assert f'sparsegate_requests_total{{code="200",gate_version="{ONE_EXPERT.version}"}} 1.0' in text
    assert 'gate_version="g-admitted"' not in text.split("sparsegate_requests_total", 1)[1].split("# HELP", 1)[0]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_failing_after_its_prefill_is_counted_under_the_version_that_prefilled_it(
        checkpoint, monkeypatch, stream):
    """A gate installed between admission and prefill serves the request; when its generation
    then fails (here: it times out mid-way, 503), the error is that version's, streamed or not.
    It was counted under the admission-time version: a new version's timeouts went to the old."""
    import dataclasses
    import time

    from sparsegate_workload import batch_decode, openai_api

    real, step = openai_api.choose_gate, batch_decode.BatchDecoder._step_group

    def admitted_under_an_older_version(state, request):
        gate = real(state, request)
        return dataclasses.replace(gate, doc=dataclasses.replace(gate.doc, version="g-admitted"))

    def slow_step(self, group):  # 200 tokens take 10 s: it times out well after its first token
        time.sleep(0.05)
        return step(self, group)

    monkeypatch.setattr(openai_api, "choose_gate", admitted_under_an_older_version)
    monkeypatch.setattr(batch_decode.BatchDecoder, "_step_group", slow_step)
    c = await _serve(create_app(gate_doc=ONE_EXPERT, model_path=str(checkpoint), request_timeout_s=1.5))
    try:
        resp = await _complete(c, stream=stream, max_tokens=200)
        if stream:
            assert "no result within" in str(await _sse(resp))
        else:
            assert resp.status == 503
        text = await (await c.get("/metrics")).text()
        requests = text.split("sparsegate_requests_total", 1)[1].split("# HELP", 1)[0]
        assert f'{{code="503",gate_version="{ONE_EXPERT.version}"}} 1.0' in requests
        assert 'gate_version="g-admitted"' not in requests
    finally:
        await c.close()


async def test_the_builtin_model_serves_no_text_api():
    app = create_app()
    c = await _serve(app)
    try:
        assert (await (await c.get("/v1/models")).json())["data"] == []
        resp = await c.post("/v1/completions", json={"prompt": "hi"})
        assert resp.status == 404 and "no tokenizer" in (await resp.json())["error"]["message"]
        assert 'vllm:num_requests_running{model_name="builtin"}' in \
            await (await c.get("/metrics")).text()
    finally:
        await c.close()


@pytest.fixture
def missing_shard(tmp_path):
    path = build_tiny_checkpoint(tmp_path / "broken", family="mixtral", max_shard_size="200KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (path / shard).unlink()
    return path, shard


@pytest.fixture
def dense_config(tmp_path):
    """A config.json of a dense (non-MoE) family."""
    path = tmp_path / "dense"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 32}))
    return path, "config.json"


@pytest.mark.parametrize("broken", ["missing_shard", "dense_config"])
async def test_a_malformed_checkpoint_is_unready_naming_the_file(broken, request):
    path, shard = request.getfixturevalue(broken)
    app = create_app(model_path=str(path))
    c = await _serve(app)
    try:
        health = await c.get("/healthz")
        assert health.status == 500 and shard in (await health.json())["error"]
        ready = await c.get("/readyz")
        assert ready.status == 503 and shard in (await ready.json())["reason"]
        resp = await c.post("/v1/completions", json={"prompt": "hi"})
        assert resp.status == 503 and shard in (await resp.json())["error"]["message"]
    finally:
        await c.close()


def test_the_entry_point_exits_nonzero_naming_the_file(missing_shard):
    path, shard = missing_shard
    env = {**os.environ, "SPARSEGATE_TORCH_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "sparsegate_workload.server", "--port",
                           str(free_port()), "--model-path", str(path)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1
    assert f"{shard}: missing shard" in proc.stderr.splitlines()[-1]


async def test_a_failure_after_the_weights_loaded_is_unready_naming_it(checkpoint, monkeypatch):
    """Not only the weights: any step of the load that fails (here wiring the decoder) answers
    /healthz 500 and /readyz 503 with the reason, and the entry point then exits 1, rather than
    leaving the server alive, unready ("still loading") and silent."""
    from sparsegate_workload import server

    def broken(hf):
        raise RuntimeError("decoder wiring broke")

    monkeypatch.setattr(server, "BatchDecoder", broken)
    app = create_app(model_path=str(checkpoint))
    c = await _serve(app)
    try:
        health = await c.get("/healthz")
        assert health.status == 500 and "decoder wiring broke" in (await health.json())["error"]
        ready = await c.get("/readyz")
        assert ready.status == 503 and "decoder wiring broke" in (await ready.json())["reason"]
    finally:
        await c.close()


async def test_probes_are_answered_while_the_probe_set_is_read(checkpoint, monkeypatch):
    """The probe set (a shipped sparsegate_probe.txt, read and tokenized) is made off the event
    loop: made on it, a large file held /healthz and /readyz past the kubelet's 1 s timeout for
    as long as it took (~9 s for 8 MB), and liveness killed the pod while it loaded. Here the probe
    set is held until /healthz has been answered; on the loop it would hold the loop instead."""
    from sparsegate_workload import quality

    real, entered, release, held = quality.checkpoint_probe, threading.Event(), threading.Event(), []

    def slow(*args, **kwargs):
        entered.set()
        held.append(release.wait(3))
        return real(*args, **kwargs)

    monkeypatch.setattr(quality, "checkpoint_probe", slow)
    app = create_app(gate_doc=ONE_EXPERT, model_path=str(checkpoint))
    c = TestClient(TestServer(app, host="127.0.0.1"))
    await c.start_server()
    try:
        assert await asyncio.to_thread(entered.wait, 30)
        assert (await c.get("/healthz")).status == 200
        ready = await c.get("/readyz")
        assert ready.status == 503 and (await ready.json())["reason"] == "model is still loading"
        release.set()
        await wait_ready(app)
        assert held == [True]  # answered while the probe set was being made
        assert app[STATE].metrics.quality.probe is not None
        assert (await c.get("/readyz")).status == 200
    finally:
        release.set()
        await c.close()


async def test_a_probe_file_the_server_cannot_read_serves_without_a_probe_set(checkpoint, monkeypatch):
    """An unreadable sparsegate_probe.txt (an OSError, e.g. a file this user may not read) is
    treated as a probe file too short to use: served, quality not reported."""
    from sparsegate_workload import quality

    def unreadable(model_dir, *args, **kwargs):
        raise PermissionError(13, "Permission denied", f"{model_dir}/{quality.PROBE_FILE}")

    monkeypatch.setattr(quality, "checkpoint_probe", unreadable)
    app = create_app(gate_doc=ONE_EXPERT, model_path=str(checkpoint))
    c = await _serve(app)
    try:
        assert (await c.get("/readyz")).status == 200
        assert app[STATE].metrics.quality.probe is None
        assert (await _complete(c)).status == 200
    finally:
        await c.close()


async def test_a_prompt_being_tokenized_does_not_stall_other_requests(client):
    """Tokenizing runs off the event loop: a 1 MiB prompt took ~0.8 s there, and every other
    request and stream waited that long. Here the tokenizer holds one prompt until the test
    has been answered another request; on the loop it would hold the loop and time out (500)."""
    hf = client.server.app[STATE].hf
    real, entered, release = hf.tokenizer, threading.Event(), threading.Event()

    class Held:
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, text, *args, **kwargs):
            if text == "held prompt":
                entered.set()
                if not release.wait(3):
                    raise TimeoutError("the tokenizer held the event loop")
            return real(text, *args, **kwargs)

    hf.tokenizer = Held()
    try:
        pending = asyncio.create_task(_complete(client, prompt="held prompt"))
        assert await asyncio.to_thread(entered.wait, 5)
        assert (await client.get("/v1/models")).status == 200  # answered while the prompt is held
        release.set()
        assert (await pending).status == 200
    finally:
        hf.tokenizer = real


async def test_a_request_queued_behind_the_tokenizer_times_out(checkpoint):
    """--request-timeout bounds a request from its admission, also while it waits for the one
    tokenizer thread (a 1 MiB prompt holds it ~1 s): a request queued behind a held prompt
    waited for as long as it was held (seconds past the timeout), then answered 200."""
    c = await _serve(create_app(gate_doc=ONE_EXPERT, model_path=str(checkpoint), request_timeout_s=0.5))
    hf = c.server.app[STATE].hf
    real, entered, release = hf.tokenizer, threading.Event(), threading.Event()

    class Held:
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, text, *args, **kwargs):
            if text == "held prompt":
                entered.set()
                release.wait(5)
            return real(text, *args, **kwargs)

    hf.tokenizer = Held()
    try:
        held = asyncio.create_task(_complete(c, prompt="held prompt"))
        assert await asyncio.to_thread(entered.wait, 5)
        started = asyncio.get_running_loop().time()
        queued = await _complete(c, prompt="queued")
        waited = asyncio.get_running_loop().time() - started
        release.set()
        assert queued.status == 503 and "no result within 0.5 s" in (await queued.json())["error"]["message"]
        assert waited < 2.0, waited
        assert (await held).status == 503
        assert _requests_total(await (await c.get("/metrics")).text()) == {"503": 2.0}
        assert c.server.app[STATE].inflight == 0
    finally:
        release.set()
        hf.tokenizer = real
        await c.close()


async def test_a_client_leaving_mid_stream_frees_its_slot(client):
    state = client.server.app[STATE]
    resp = await _complete(client, stream=True, max_tokens=200, prompt="a")
    assert resp.status == 200
    await resp.content.readline()  # the first event has been sent
    resp.close()
    for _ in range(200):  # the generation finishes on the model thread, then frees the slot
        if state.inflight == 0:
            break
        await asyncio.sleep(0.05)
    assert state.inflight == 0
    assert (await _complete(client)).status == 200


async def test_a_stream_left_mid_way_leaves_no_pending_task_behind(client):
    """The handler, cancelled while it waits for the next token, also cancels its wait on the
    token queue: left pending, each such wait was collected later with asyncio's ERROR "Task was
    destroyed but it is pending!", once per client that left a stream."""
    import gc

    state = client.server.app[STATE]
    gc.disable()  # the leftover would otherwise vanish at a random collection
    try:
        for _ in range(3):
            resp = await _complete(client, stream=True, max_tokens=200, prompt="a")
            await resp.content.readline()
            resp.close()
        for _ in range(200):
            if state.inflight == 0:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.05)
        pending = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "Queue.get"]
        assert state.inflight == 0 and pending == []
    finally:
        gc.enable()


def _requests_total(scrape: str) -> dict[str, float]:
    """sparsegate_requests_total by code (summed over gate versions), non-zero ones only."""
    out: dict[str, float] = {}
    for line in scrape.splitlines():
        if line.startswith("sparsegate_requests_total{"):
            code = line.split('code="', 1)[1].split('"', 1)[0]
            out[code] = out.get(code, 0.0) + float(line.rsplit(" ", 1)[1])
    return {k: v for k, v in out.items() if v}


async def test_a_stream_that_fails_after_its_status_counts_under_its_failure(checkpoint):
    """A stream's 200 goes out before the tokens, so a timeout arrives as an error event; the
    request series (what canary analysis reads) counts it as 503, as the same non-streamed request."""
    client = await _serve(create_app(gate_doc=ONE_EXPERT, model_path=str(checkpoint), request_timeout_s=0.02))
    try:
        events = await _sse(await _complete(client, stream=True, max_tokens=200, prompt="a"))
        assert "no result within" in events[-1]["error"]["message"]
        assert (await _complete(client, max_tokens=200, prompt="a")).status == 503
        assert _requests_total(await (await client.get("/metrics")).text()) == {"503": 2.0}
    finally:
        await client.close()


async def test_a_client_leaving_before_its_answer_is_counted_499_not_a_server_error(client):
    state = client.server.app[STATE]
    with pytest.raises(asyncio.TimeoutError):
        await client.post("/v1/completions", json={"prompt": "a", "temperature": 0, "max_tokens": 250},
                          timeout=aiohttp.ClientTimeout(total=0.05))
    for _ in range(200):
        if state.inflight == 0 and "499" in _requests_total(await (await client.get("/metrics")).text()):
            break
        await asyncio.sleep(0.05)
    assert _requests_total(await (await client.get("/metrics")).text()) == {"499": 1.0}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_leaving_before_its_generation_started_is_counted_499(checkpoint, stream):
    """Gone while the gate's injected latency runs (before the engine has its request): 499, as
    /v1/infer counts it, not a 500 that the rollout analysis would take for the version's error."""
    slow = make_document({**DEFAULT_PARAMS, "faultInjection": {"errorRate": 0.0, "addedLatencyMs": 300}})
    c = await _serve(create_app(gate_doc=slow, model_path=str(checkpoint)))
    state = c.server.app[STATE]
    try:
        with pytest.raises(asyncio.TimeoutError):
            await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": stream},
                         timeout=aiohttp.ClientTimeout(total=0.1))
        for _ in range(100):
            if _requests_total(await (await c.get("/metrics")).text()):
                break
            await asyncio.sleep(0.02)
        assert _requests_total(await (await c.get("/metrics")).text()) == {"499": 1.0}
        assert state.inflight == 0
    finally:
        await c.close()


async def test_a_client_stalling_its_body_holds_no_slot(checkpoint):
    """Headers sent, body stalled: the request took a --max-inflight slot before its body was
    read and held it while the connection stayed open (every other request 429). Now it holds
    none, and its body read ends after --request-timeout with a 408 in OpenAI's shape."""
    c = await _serve(create_app(gate_doc=ONE_EXPERT, model_path=str(checkpoint), max_inflight=1,
                                request_timeout_s=0.5))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", c.server.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"pro")
        await writer.drain()
        await asyncio.sleep(0.1)
        assert (await _complete(c, max_tokens=2)).status == 200
        head = await asyncio.wait_for(reader.readline(), 5)
        assert b" 408 " in head, head
        writer.close()
        assert _requests_total(await (await c.get("/metrics")).text()) == {"200": 1.0, "408": 1.0}
    finally:
        await c.close()


async def _until_ready(session: aiohttp.ClientSession, base: str) -> None:
    """Wait (60 s at most) for a server process started by a test to answer /readyz 200."""
    for _ in range(600):
        try:
            async with session.get(base + "/readyz") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("the server did not become ready")


def test_the_entry_point_stops_generating_for_a_client_that_left(tmp_path):
    """``python -m sparsegate_workload.server`` (aiohttp, whose default is not to cancel a
    handler whose client disconnects): a non-streamed request abandoned after 0.5 s leaves the
    batch then, frees its slot, and is counted 499, instead of decoding all its tokens for nobody."""
    slow = build_tiny_checkpoint(tmp_path / "slow", family="mixtral", hidden_size=512, layers=6,
                                 expert_ffn=1024, max_positions=512, tokenizer=True)
    port = free_port()
    env = {**os.environ, "SPARSEGATE_TORCH_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "sparsegate_workload.server", "--host", "127.0.0.1",
                             "--port", str(port), "--model-path", str(slow), "--max-inflight", "1",
                             "--request-timeout", "120"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"

    async def scenario() -> tuple[dict[str, float], float, float]:
        async with aiohttp.ClientSession() as s:
            await _until_ready(s, base)
            with pytest.raises(asyncio.TimeoutError):
                await s.post(base + "/v1/completions", json={"prompt": "a", "temperature": 0, "max_tokens": 480},
                             timeout=aiohttp.ClientTimeout(total=0.5))
            for _ in range(100):
                async with s.get(base + "/metrics") as r:
                    scrape = await r.text()
                running = next(float(ln.rsplit(" ", 1)[1]) for ln in scrape.splitlines()
                               if ln.startswith("vllm:num_requests_running{"))
                if running == 0:
                    break
                await asyncio.sleep(0.1)
            tokens = next(float(ln.rsplit(" ", 1)[1]) for ln in scrape.splitlines()
                          if ln.startswith("vllm:generation_tokens_total{"))
            async with s.post(base + "/v1/completions", json={"prompt": "b", "max_tokens": 2}) as r:
                assert r.status == 200  # the slot (--max-inflight 1) is free again
            return _requests_total(scrape), running, tokens

    try:
        codes, running, tokens = asyncio.run(scenario())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert running == 0 and codes == {"499": 1.0}, (codes, running, proc.stderr.read()[-2000:])
    assert tokens < 480


def test_sigterm_turns_unready_first_then_refuses_new_requests_and_finishes_a_stream_in_flight(tmp_path):
    """A pod's SIGTERM (``python -m sparsegate_workload.server``): /readyz answers 503 at once while
    requests are still served for the shutdown delay (endpoints may still route here); then a new
    request gets 503 "shutting down" on a live listener (not a refused connection), while a stream
    admitted before finishes all its tokens (no error event); then the server exits 0. Before, the
    listener closed at once and the stream in flight ended with a 503 error event."""
    slow = build_tiny_checkpoint(tmp_path / "slow", family="mixtral", hidden_size=512, layers=6,
                                 expert_ffn=1024, max_positions=512, tokenizer=True)
    port = free_port()
    # The delay as the operator sets it, in the environment.
    env = {**os.environ, "SPARSEGATE_TORCH_THREADS": "1", "SPARSEGATE_SHUTDOWN_DELAY": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "sparsegate_workload.server", "--host", "127.0.0.1",
                             "--port", str(port), "--model-path", str(slow), "--request-timeout", "120"],
                            env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"

    async def scenario() -> dict:
        seen: dict = {}
        async with aiohttp.ClientSession() as s:
            await _until_ready(s, base)
            async with s.post(base + "/v1/completions", json={"prompt": "a", "temperature": 0, "max_tokens": 300,
                                                              "stream": True}) as stream:
                lines = [await stream.content.readline()]  # its first token went out
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
                async with aiohttp.ClientSession() as other:
                    async with other.get(base + "/readyz") as r:
                        seen["readyz"] = r.status
                    async with other.get(base + "/healthz") as r:
                        seen["healthz"] = r.status
                    await asyncio.sleep(1.5)  # past --shutdown-delay: draining
                    async with other.post(base + "/v1/completions", json={"prompt": "b", "max_tokens": 2}) as r:
                        seen["late"] = (r.status, (await r.json())["error"]["message"],
                                        r.headers.get("Connection", "").lower())
                async for line in stream.content:
                    lines.append(line)
            events = [json.loads(ln[6:]) for ln in lines if ln.startswith(b"data: {")]
            seen["stream"] = (stream.status, lines[-2:], sum(1 for e in events if "choices" in e),
                              [e for e in events if "error" in e])
        return seen

    try:
        seen = asyncio.run(scenario())
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert seen["readyz"] == 503 and seen["healthz"] == 200, seen
    assert seen["late"] == (503, "server is shutting down", "close"), seen
    status, tail, chunks, errors = seen["stream"]
    assert status == 200 and tail[0] == b"data: [DONE]\n" and not errors and chunks > 1, seen["stream"][:2]
    assert rc == 0, proc.stderr.read()[-2000:]


# The entry point with a checkpoint load that takes 120 s (as a large checkpoint on slow storage).
_SLOW_LOAD_ENTRY = """
import time
from sparsegate_workload import hf_serving, server
load = hf_serving.load
def slow_load(*args, **kwargs):
    time.sleep(120)
    return load(*args, **kwargs)
hf_serving.load = slow_load
server.main()
"""


def test_sigterm_while_the_checkpoint_loads_exits_at_once(checkpoint):
    """A pod's SIGTERM during a load of minutes: the process exits 0 at once, saying so, rather
    than waiting (Python joins the model thread at exit) for the load to end, past the pod's
    termination grace period (the kubelet then SIGKILLs it, and a rollout waits all that time)."""
    port = free_port()
    env = {**os.environ, "SPARSEGATE_TORCH_THREADS": "1", "SPARSEGATE_SHUTDOWN_DELAY": "5"}
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_LOAD_ENTRY, "--host", "127.0.0.1",
                             "--port", str(port), "--model-path", str(checkpoint)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"

    async def unready_while_loading() -> int:
        async with aiohttp.ClientSession() as s:
            for _ in range(600):
                try:
                    async with s.get(base + "/readyz") as r:
                        return r.status
                except aiohttp.ClientError:
                    await asyncio.sleep(0.1)
        raise AssertionError("the server did not answer /readyz")

    try:
        assert asyncio.run(unready_while_loading()) == 503
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            raise AssertionError("SIGTERM during the load: still running 20 s later") from None
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert rc == 0, err[-2000:]
    assert "stopped before the model finished loading" in err, err[-2000:]


async def test_each_concurrent_request_reports_the_gate_that_routed_all_of_it(client):
    """Completions in flight while gates swap: every one ran wholly under the version it reports
    (one expert per token under ONE_EXPERT, two under TWO_EXPERTS; never a mix)."""
    experts = {ONE_EXPERT.version: 1.0, TWO_EXPERTS.version: 2.0}
    async with TestClient(TestServer(create_admin_app(client.server.app, auth=StaticToken(TOKEN)),
                                     host="127.0.0.1")) as admin:
        async def swaps():
            await asyncio.sleep(0.05)
            for doc in (TWO_EXPERTS, ONE_EXPERT, TWO_EXPERTS):
                assert (await admin.put("/admin/gate", json=doc.to_json(), headers=AUTH)).status == 200
                await asyncio.sleep(0.1)

        async def request(i):  # staggered, so swaps fall between queued generations
            await asyncio.sleep(0.03 * i)
            return await _complete(client, max_tokens=20, prompt=f"request {i}")
        results = await asyncio.gather(swaps(), *[request(i) for i in range(12)])
    versions = []
    for resp in results[1:]:
        usage = (await resp.json())["usage"]["sparsegate"]
        assert usage["mean_experts_per_token"] == experts[usage["gate_version"]]
        versions.append(usage["gate_version"])
    # The first request ran before any swap; later ones queued behind a swap to TWO_EXPERTS.
    assert versions[0] == ONE_EXPERT.version and TWO_EXPERTS.version in versions


async def test_a_gate_that_does_not_fit_the_checkpoint_is_unready_naming_the_gate(checkpoint):
    too_many = make_document({**DEFAULT_PARAMS, "maxExpertsPerToken": 9}, num_experts=None)
    app = create_app(gate_doc=too_many, model_path=str(checkpoint))
    c = await _serve(app)
    try:
        reason = (await (await c.get("/readyz")).json())["reason"]
        assert f"gate {too_many.version} (--gate-config)" in reason and "8 experts" in reason
    finally:
        await c.close()


async def test_a_checkpoint_serves_in_bfloat16(checkpoint):
    app = create_app(gate_doc=ONE_EXPERT, model_path=str(checkpoint), model_dtype="bfloat16")
    c = await _serve(app)
    try:
        assert next(app[STATE].hf.lm.model.parameters()).dtype == torch.bfloat16
        resp = await _complete(c)
        assert resp.status == 200
        assert (await resp.json())["usage"]["sparsegate"]["mean_experts_per_token"] == 1.0
    finally:
        await c.close()
