"""OpenAI-compatible text API over a Hugging Face checkpoint: ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` → server-sent events),
and vLLM's ``POST /tokenize`` and ``POST /detokenize`` (`tokenized`, `detokenized`).

Text goes in and out through the checkpoint's own tokenizer. Chat prompts use the tokenizer's
chat template when it has one; otherwise each message becomes a ``"<role>: <content>"`` line and
a final ``"assistant:"`` line asks for the answer. Concurrent requests decode together in the
server's continuous-batching engine (`batch_engine`: one model step per token for all of them,
a KV cache per sequence, each request under one gate version): greedy at ``temperature`` 0,
else seeded sampling (``seed``: the same request gives the same text, batched or alone, as
long as the gate's capacity cap drops nothing, see `batch_decode`; without one a seed is drawn
at random per request, as OpenAI and vLLM sample anew each time), narrowed by
``top_p`` (0, 1] and vLLM's ``top_k`` (-1 or 0: off). Before the choice (greedy too) the logits
get ``logit_bias`` (token id -> [-100, 100]), vLLM's ``repetition_penalty`` (> 0) and OpenAI's
``frequency_penalty`` and ``presence_penalty`` ([-2, 2]) as vLLM applies them
(`hf_serving.adjust_logits`). The completions' ``prompt`` is a string, a list of token ids, or
a list of several of either kind, and ``n`` (1-8; ``best_of`` only equal to it) asks n choices
per prompt: choice i * n + j is prompt i's j-th, sampled with ``seed + j`` (vLLM's), each its
own sequence in the batches and its own admission slot (`server_state.take_slots`: 429 unless
all fit, 400 naming ``n`` or ``prompt`` beyond ``--max-inflight``); chunks carry their choice's
``index`` and usage sums the choices (each prompt's tokens once). It ends at the end-of-sequence token
(unless vLLM's ``ignore_eos``), at ``max_tokens``, at a token of vLLM's ``stop_token_ids``, or
once its text holds a string of ``stop`` (one, or a list of at most 4): ``finish_reason``
"stop", vLLM's ``stop_reason`` the string or id (null for end-of-sequence), and the text ends
before that string or token (after it, that token's text kept, with vLLM's
``include_stop_str_in_output``); the sequence leaves its batch at that step and usage counts the
tokens it made, the stopping one included. vLLM's ``min_tokens`` keeps the end-of-sequence and
stop tokens from being chosen, and stop strings from being looked for, before that many tokens.
A stream holds back text that may be the start of a stop string (the longest end of the text
that one starts with) and never sends the stop string or stop token (text is decoded without
``clean_up_tokenization_spaces``, so each token only appends to it, `hf_serving.decode`). ``/v1/completions``
takes ``logprobs`` (0-20; a stream sends each chunk's tokens' with it): per generated token its log probability
under the model's raw logits and that many most probable alternatives (`completion_logprobs`;
vLLM's ``return_tokens_as_token_ids`` names them ``"token_id:<id>"``), and ``echo``: the text
starts with the prompt (a token-id prompt's decoding), and with ``logprobs`` so do they, for the prompt's tokens (the first
one's null; not in a stream), as lm-evaluation-harness reads log-likelihoods.
Chat takes ``logprobs: true`` with ``top_logprobs`` (0-20) for the same, in chat's shape
(`chat_logprobs`). ``suffix`` and chat's ``echo`` are accepted only at their no-op values
(`_NEUTRAL`). A full queue answers 429, a
request past ``--request-timeout`` 503 (in a stream: an error event), and it leaves its batch.

``usage`` carries OpenAI's token counts plus ``usage.sparsegate``: ``mean_experts_per_token``
(kept expert assignments per token and MoE layer, over prompt and generated tokens),
``dropped_assignments`` (capacity cap), ``gate_version`` (the gate that routed its first choice) and
``tool_calls``: the tools the checkpoint's tool gate called while generating, whose results were
forced into the text (`generation_tools`: shape there; ``[]`` without a tool-gate head).
A request scoped to an expert group (header ``x-sparsegate-expert-group``, `request_guard`)
decodes in the shared batches with a per-sequence expert mask (`batch_decode`), and its usage
adds ``expert_group``, ``access_rule``, ``allowed_experts`` and ``experts_used`` (the experts its
tokens activated in any MoE layer, prompt and generated).
Errors answer OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``. The built-in
model has no tokenizer: ``/v1/models`` lists nothing and the two others answer 404.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import math
import secrets
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from aiohttp import web

from sparsegate_contracts.request_access import Scope

from . import request_guard
from .hf_serving import OFF, Generation, GrowingText, HFServedModel, Sampling, TokenLogprob
from .batch_engine import GenerationHandle
from .generation_tools import MAX_TOOL_CALLS_PER_REQUEST
from .server_state import (CLIENT_CLOSED, OPENAI_CHAT_COMPLETIONS, OPENAI_COMPLETIONS, STATE, ApiError, ServerState, admission,
                           choose_gate, free_slot, inject_fault, openai_error, read_json, take_slots)

log = logging.getLogger("sparsegate.workload.openai")

MAX_TOKENS_LIMIT = 512           # most tokens one request may generate (CPU-sized)
DEFAULT_COMPLETION_TOKENS = 16   # OpenAI's default max_tokens for /v1/completions
MAX_STOP_STRINGS = 4             # OpenAI's limit on ``stop``
MAX_LOGPROBS = 20                # most alternatives per token reported (vLLM's default max_logprobs)
MAX_N = 8                        # most choices per prompt (n)
MAX_PENALTY = 2.0                # OpenAI's range of presence_penalty and frequency_penalty: [-2, 2]
MAX_LOGIT_BIAS = 100.0           # OpenAI's range of a logit_bias value: [-100, 100]
# Fields accepted only at their no-op value: clients send them by default.
_NEUTRAL = {"logprobs": None, "echo": False, "suffix": None}
# OpenAI's top_p, stop, penalties and logit_bias, and vLLM's extensions of them (`Sampling`).
_SAMPLING = {"top_p", "top_k", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
             "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "logit_bias"}
_COMMON = {"model", "max_tokens", "temperature", "seed", "stream", "stream_options", "user",
           "return_tokens_as_token_ids", "n", "best_of"} | _SAMPLING


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated request: what to feed the model and how to answer."""

    prompts: tuple[tuple[int, ...], ...]  # the prompts' token ids (chat: its messages', one)
    max_tokens: int
    temperature: float
    seed: int
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    sampling: Sampling = OFF  # top_p / top_k and the stop conditions
    # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>", not by their text.
    tokens_as_ids: bool = False
    # The completions' echo: each answer's text starts with its prompt's (and its logprobs with
    # the prompt's tokens', `Sampling.prompt_logprobs`); None: no echo.
    echo: tuple[str, ...] | None = None
    n: int = 1  # choices per prompt: choice i * n + j is prompt i's j-th, seeded seed + j

    @property
    def sequences(self) -> int:
        """The sequences it decodes (and admission slots it holds): n per prompt."""
        return len(self.prompts) * self.n


class OpenAIError(ApiError):
    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(status, message)
        self.param = param


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _openai_errors(handler: Handler) -> Handler:
    """Answer every failure in OpenAI's error shape (the server's own endpoints keep theirs)."""
    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return openai_error(e.status, e.message, param=getattr(e, "param", None))
        except ConnectionError:
            raise  # the client went away (mid-stream): nobody to answer, nothing went wrong here
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return openai_error(500, "internal server error")
    return wrapped


def _text_model(state: ServerState) -> HFServedModel:
    if state.model_path is None:
        raise OpenAIError(404, "the built-in model has no tokenizer, so it serves no text API: "
                               "use POST /v1/infer with token ids, or serve a checkpoint "
                               "(--model-path)")
    if state.load_error is not None or state.hf is None or not state.loaded:
        raise OpenAIError(503, state.load_error or "model is still loading")
    if state.hf.tokenizer is None:
        raise OpenAIError(404, f"checkpoint {state.model_path} has no tokenizer files, so it "
                               "serves no text API: use POST /v1/infer with token ids")
    return state.hf


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    hf = state.hf
    created = int(state.started_wall)
    # vLLM's ModelCard: clients written for it read root, parent and permission too. Its
    # ModelPermission defaults.
    permission = {"id": f"modelperm-{uuid.uuid4().hex}",
                  "object": "model_permission", "created": created, "allow_create_engine": False,
                  "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False,
                  "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                  "group": None, "is_blocking": False}
    data = [] if hf is None or hf.tokenizer is None else [{
        "id": hf.name, "object": "model", "created": created,
        "owned_by": "sparsegate", "root": str(hf.lm.path), "parent": None,
        "max_model_len": hf.context_length, "permission": [permission]}]
    return web.json_response({"object": "list", "data": data})


def _int(body: dict[str, Any], name: str, *, default: int, low: int, high: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise OpenAIError(400, f"{name} must be an integer in [{low}, {high}], got {value!r}",
                          param=name)
    return value


def _seed(body: dict[str, Any]) -> int:
    """The request's ``seed``, or one drawn at random: a request without one samples anew each
    time (a regenerated chat answer differs), as OpenAI and vLLM do; with one it is reproducible."""
    return _int(body, "seed", default=secrets.randbits(63), low=0, high=2**63 - 1)


def _sampling(body: dict[str, Any], *, hf: HFServedModel, max_tokens: int, chat: bool,
              stream: bool) -> Sampling:
    """``top_p``, ``top_k``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
    ``include_stop_str_in_output``, ``logprobs`` (chat's with ``top_logprobs``), the completions'
    ``echo``, the penalties and ``logit_bias`` as vLLM reads them;
    a wrong type or range raises OpenAIError (400) naming the field."""
    logprobs = None
    if chat:  # a boolean, and top_logprobs the number of alternatives (above 0 only with it)
        top = _int(body, "top_logprobs", default=0, low=0, high=MAX_LOGPROBS)
        if _bool(body, "logprobs"):
            logprobs = top
        elif top:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    elif body.get("logprobs") is not None:  # a count
        logprobs = _int(body, "logprobs", default=0, low=0, high=MAX_LOGPROBS)
    echo = not chat and _bool(body, "echo")
    if logprobs is not None and stream and echo:
        raise OpenAIError(400, "logprobs with echo is not supported with stream: true here",
                          param="logprobs")
    top_p = body.get("top_p")
    top_p = 1.0 if top_p is None else top_p
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise OpenAIError(400, f"top_p must be a number in (0, 1], got {top_p!r}", param="top_p")
    top_k = body.get("top_k")
    top_k = 0 if top_k is None else top_k
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise OpenAIError(400, f"top_k must be an integer, -1 or 0 (off) or at least 1, got {top_k!r}",
                          param="top_k")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or not all(
            isinstance(x, str) and x for x in stop):
        raise OpenAIError(400, f"stop must be a non-empty string or a list of at most "
                               f"{MAX_STOP_STRINGS} non-empty strings, got {body.get('stop')!r}",
                          param="stop")
    ids = body.get("stop_token_ids")
    ids = [] if ids is None else ids
    if not isinstance(ids, list) or not all(
            not isinstance(t, bool) and isinstance(t, int) and 0 <= t < hf.vocab_size for t in ids):
        raise OpenAIError(400, f"stop_token_ids must be a list of token ids in [0, {hf.vocab_size}), "
                               f"got {body.get('stop_token_ids')!r}", param="stop_token_ids")
    ignore_eos = _bool(body, "ignore_eos")
    penalties = {name: _number(body, name, default=0.0, low=-MAX_PENALTY, high=MAX_PENALTY)
                 for name in ("presence_penalty", "frequency_penalty")}
    repetition = body.get("repetition_penalty")
    repetition = 1.0 if repetition is None else repetition
    if isinstance(repetition, bool) or not isinstance(repetition, (int, float)) \
            or not 0 < repetition < math.inf:
        raise OpenAIError(400, f"repetition_penalty must be a number above 0 (1: off), got {repetition!r}",
                          param="repetition_penalty")
    return Sampling(top_p=float(top_p), top_k=max(top_k, 0),
                    stop=tuple(dict.fromkeys(_unicode(x, "stop") for x in stop)),
                    stop_token_ids=frozenset(ids), ignore_eos=ignore_eos,
                    include_stop_str=_bool(body, "include_stop_str_in_output"),
                    min_tokens=_int(body, "min_tokens", default=0, low=0, high=max_tokens),
                    logprobs=logprobs, prompt_logprobs=logprobs if echo else None,
                    repetition_penalty=float(repetition), logit_bias=_logit_bias(body, hf), **penalties)


def _number(body: dict[str, Any], name: str, *, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise OpenAIError(400, f"{name} must be a number in [{low:g}, {high:g}], got {value!r}",
                          param=name)
    return float(value)


def _logit_bias(body: dict[str, Any], hf: HFServedModel) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: an object from token ids (as strings, JSON's keys) to a bias in
    [-100, 100] added to that token's logit."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise OpenAIError(400, f"logit_bias must be an object from token ids to numbers, got {bias!r}",
                          param="logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < hf.vocab_size or isinstance(value, bool) or not isinstance(
                value, (int, float)) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise OpenAIError(400, f"logit_bias maps token ids in [0, {hf.vocab_size}) to numbers in "
                                   f"[{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {key!r}: {value!r}",
                              param="logit_bias")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise OpenAIError(400, f"{name} must be a boolean, got {value!r}", param=name)
    return value


def _unicode(text: str, param: str) -> str:
    """``text`` when it is Unicode a tokenizer can read: JSON's ``\\ud800``-style escapes decode
    to lone surrogates, which no tokenizer encodes (it raised TypeError: a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise OpenAIError(400, f"{param} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                               "escape): not Unicode text", param=param) from None
    return text


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _prompts(body: dict[str, Any], hf: HFServedModel) -> list[tuple[list[int], str]]:
    """The completions' prompts, each as token ids and as text (what echo repeats), as vLLM reads
    ``prompt``: a non-empty string, a list of token ids, or a list of several of either kind
    (one choice each). Token ids are the prompt as given; their text is their decoding."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or isinstance(prompt, list) and prompt and all(map(_is_id, prompt)):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and (
            all(isinstance(p, str) for p in prompt)
            or all(isinstance(p, list) and p and all(map(_is_id, p)) for p in prompt)):
        items = prompt
    else:
        raise OpenAIError(400, "prompt must be a non-empty string, a non-empty list of token ids, "
                               "or a non-empty list of either kind", param="prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise OpenAIError(400, "prompt must not be an empty string", param="prompt")
            out.append((list(hf.tokenizer(_unicode(item, "prompt"))["input_ids"]), item))
        else:
            if not all(0 <= t < hf.vocab_size for t in item):
                raise OpenAIError(400, f"prompt holds token ids outside the model's vocabulary "
                                       f"[0, {hf.vocab_size})", param="prompt")
            out.append((list(item), hf.tokenizer.decode(item, clean_up_tokenization_spaces=False)))
    return out


def _prompt_text(body: dict[str, Any], *, chat: bool, hf: HFServedModel,
                 generation_prompt: bool = True) -> list[tuple[list[int], str]]:
    """The prompts' token ids and texts (chat: one, its messages rendered, ending with the
    assistant's turn unless not ``generation_prompt``)."""
    tok = hf.tokenizer
    if not chat:
        return _prompts(body, hf)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages):
        raise OpenAIError(400, "messages must be a non-empty list of {role, content} objects "
                               "with string content", param="messages")
    plain = [{"role": _unicode(m["role"], "messages"), "content": _unicode(m["content"], "messages")}
             for m in messages]
    if getattr(tok, "chat_template", None):
        from jinja2 import TemplateError, TemplateSyntaxError  # transformers renders templates with it

        try:
            ids = tok.apply_chat_template(plain, add_generation_prompt=generation_prompt, tokenize=True)
        except TemplateSyntaxError:
            raise  # the checkpoint's template itself is broken: a server fault (500)
        except TemplateError as e:
            # The template refused these messages (raise_exception, e.g. Mixtral's "roles must
            # alternate"): the client's input, not a server fault.
            raise OpenAIError(400, f"the model's chat template refuses these messages: {e}",
                              param="messages") from None
        ids = ids["input_ids"] if not isinstance(ids, list) else ids  # v5 may return a mapping
        return [(list(ids), "")]
    text = "".join(f"{m['role']}: {m['content']}\n" for m in plain) + (
        "assistant:" if generation_prompt else "")
    return [(list(tok(text)["input_ids"]), text)]


def parse_request(body: Any, *, chat: bool, hf: HFServedModel) -> Plan:
    """Validate an OpenAI request for ``hf``; raises OpenAIError (400/404) naming the field."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "body must be a JSON object")
    allowed = _COMMON | set(_NEUTRAL) | ({"messages", "max_completion_tokens", "top_logprobs"} if chat
                                         else {"prompt"})
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise OpenAIError(400, f"unsupported fields: {', '.join(unknown)}", param=unknown[0])
    for name, neutral in _NEUTRAL.items():
        if name == "logprobs" or name == "echo" and not chat:
            continue  # logprobs (chat's a boolean, the completions' a count) and echo: read below
        if body.get(name) not in (None, neutral):
            raise OpenAIError(400, f"{name} is only supported as {json.dumps(neutral)}",
                              param=name)
    model = body.get("model")
    if model is not None and model != hf.name:
        raise OpenAIError(404, f"the model {model!r} does not exist here (serving {hf.name!r})",
                          param="model")
    prompts = _prompt_text(body, chat=chat, hf=hf)
    prompt_param = "messages" if chat else "prompt"
    if not all(ids for ids, _ in prompts):
        # A tokenizer may drop every character (e.g. a normalizer that strips whitespace): an
        # empty prompt fails its prefill alone and, packed with others, reads another's logits.
        raise OpenAIError(400, "the prompt tokenizes to no tokens", param=prompt_param)
    if any(not 0 <= t < hf.vocab_size for ids, _ in prompts for t in ids):
        # A tokenizer larger than the model's embedding: refused here, since a bad id inside
        # a batched step would fail every request decoding with it.
        raise OpenAIError(400, f"the prompt tokenizes to ids outside the model's vocabulary "
                               f"[0, {hf.vocab_size})", param=prompt_param)
    prompt_ids = max((ids for ids, _ in prompts), key=len)  # the longest: the context it leaves
    room = hf.context_length - len(prompt_ids)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    default = DEFAULT_COMPLETION_TOKENS if not chat else max(1, min(MAX_TOKENS_LIMIT, room))
    max_tokens = _int(body, key, default=default, low=1, high=MAX_TOKENS_LIMIT)
    if len(prompt_ids) + max_tokens > hf.context_length:
        raise OpenAIError(400, f"This model's maximum context length is {hf.context_length} "
                               f"tokens. However, you requested {len(prompt_ids) + max_tokens} "
                               f"tokens ({len(prompt_ids)} in the prompt, {max_tokens} in the "
                               "completion). Please reduce the prompt or max_tokens.",
                          # A prompt that alone fills the context is the field to change.
                          param=key if room > 0 else prompt_param)
    temperature = _number(body, "temperature", default=1.0, low=0.0, high=2.0)  # OpenAI's default 1
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise OpenAIError(400, f"stream must be a boolean, got {stream!r}", param="stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        # As vLLM answers: the options only mean something for a stream.
        raise OpenAIError(400, "stream_options must be an object, and only with stream: true",
                          param="stream_options")
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):  # "no" read as true before
        raise OpenAIError(400, f"stream_options.include_usage must be a boolean, got {include_usage!r}",
                          param="stream_options")
    n = _int(body, "n", default=1, low=1, high=MAX_N)
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or best_of != n):  # no hidden candidates
        raise OpenAIError(400, f"best_of is only supported equal to n ({n})", param="best_of")
    return Plan(prompts=tuple(tuple(ids) for ids, _ in prompts), max_tokens=max_tokens,
                temperature=float(temperature),
                seed=_seed(body), stream=stream,
                include_usage=include_usage,
                sampling=_sampling(body, hf=hf, max_tokens=max_tokens, chat=chat, stream=stream),
                tokens_as_ids=_bool(body, "return_tokens_as_token_ids"),
                echo=tuple(text for _, text in prompts) if not chat and _bool(body, "echo") else None,
                n=n)


def _token_name(tokenizer: Any, token: int, tokens_as_ids: bool) -> str:
    return f"token_id:{token}" if tokens_as_ids else tokenizer.decode(
        [token], clean_up_tokenization_spaces=False)  # as `decode`: " ." stays " ."


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)  # JSON has no -inf


def chat_logprobs(tokenizer: Any, ids: Sequence[int], entries: Sequence[TokenLogprob | None], *,
                  tokens_as_ids: bool = False) -> dict[str, Any]:
    """Chat's ``logprobs`` object for generated ``ids`` and their `TokenLogprob`s, as OpenAI and
    vLLM shape it: ``content``, per token ``{token, logprob, bytes, top_logprobs: [{token,
    logprob, bytes}]}`` (the requested number of most probable alternatives; ``bytes`` the
    UTF-8 of ``token``). A token a tool forced has a null logprob and no alternatives; -inf
    reads -9999.0."""
    def entry(token: int, logprob: float | None) -> dict[str, Any]:
        text = _token_name(tokenizer, token, tokens_as_ids)
        return {"token": text, "logprob": None if logprob is None else _finite(logprob),
                "bytes": list(text.encode("utf-8", errors="replace"))}
    return {"content": [{**entry(token, None if lp is None else lp[0]),
                         "top_logprobs": [] if lp is None else [entry(t, v) for t, v in lp[1]]}
                        for token, lp in zip(ids, entries, strict=True)]}


def completion_logprobs(tokenizer: Any, ids: Sequence[int], entries: Sequence[TokenLogprob | None],
                        *, tokens_as_ids: bool = False, offset: int = 0) -> dict[str, Any]:
    """The legacy completions' ``logprobs`` object for ``ids`` and their `TokenLogprob`s, as
    vLLM builds it: per token its text (decoded alone; ``tokens_as_ids``: ``"token_id:<id>"``),
    log probability, ``top_logprobs`` (the requested number of most probable tokens, and the
    chosen one; tokens whose texts are the same, as byte-level tokens of one partial character
    all read "\ufffd", keep the most probable one's value) and ``text_offset`` (where its text
    starts: ``offset`` plus the previous tokens' lengths). A token a tool forced, or the first
    of an echoed prompt, has null log probabilities; -inf is reported as -9999.0."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token, entry in zip(ids, entries, strict=True):
        text = _token_name(tokenizer, token, tokens_as_ids)
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        chosen, top = entry
        token_logprobs.append(_finite(chosen))
        alternatives: dict[str, float] = {}
        for t, lp in (*top, (token, chosen)):  # most probable first
            alternatives.setdefault(_token_name(tokenizer, t, tokens_as_ids), _finite(lp))
        top_logprobs.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def usage(gens: Sequence[Generation], tool_calls: Sequence[Any] = (), scope: Scope | None = None,
          *, prompt_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage plus ours, over a request's generations (one per choice, as vLLM sums
    them: ``prompt_tokens`` counts each prompt once, default the first generation's; completion
    tokens are summed). ``tool_calls``: the handles' `GenerationToolCall`s; ``scope``: the
    request's access scope when it was narrowed to fewer experts (None: not scoped)."""
    completion = sum(len(g.token_ids) for g in gens)
    prompt = gens[0].prompt_tokens if prompt_tokens is None else prompt_tokens
    mean = gens[0].mean_experts_per_token
    if len(gens) > 1:  # over all their (token, MoE layer) pairs: each one's are its kept / its mean
        kept = [sum(map(sum, g.expert_counts)) for g in gens]
        pairs = sum(k / g.mean_experts_per_token for k, g in zip(kept, gens) if g.mean_experts_per_token)
        mean = sum(kept) / pairs if pairs else 0.0
    ours: dict[str, Any] = {"mean_experts_per_token": round(mean, 6),
                            "dropped_assignments": sum(g.dropped_assignments for g in gens),
                            "gate_version": gens[0].gate_version,
                            "tool_calls": [c.to_usage() for c in tool_calls]}
    if scope is not None and scope.experts is not None:
        ours.update(expert_group=scope.group, access_rule=scope.decision.rule,
                    allowed_experts=list(scope.experts),
                    experts_used=sorted({e for g in gens for layer in g.expert_counts
                                         for e, n in enumerate(layer) if n}))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "sparsegate": ours}


class _Call:
    """One request's identity, timing and metrics bookkeeping."""

    def __init__(self, state: ServerState, *, chat: bool, hf: HFServedModel, started: float,
                 plan: Plan, scope: Scope | None = None) -> None:
        self.state, self.chat, self.hf, self.plan = state, chat, hf, plan
        self.scope = scope  # the access scope the request runs under (None: unguarded)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        # When the request arrived (perf_counter): vLLM's e2e and TTFT count from arrival, so
        # its body read, tokenization and any injected fault latency are in them.
        self.started = started
        self.gate_version: str | None = None  # the version its prefill really ran under, once known
        # A stream's outcome for the metrics: its HTTP status (200) went out before the tokens, so
        # a generation that fails after it (a timeout, 503) ends as an event, counted as that code.
        self.stream_code = 200

    def chunk(self, *, text: str | None, finish: str | None, first: bool = False,
              stop_reason: str | int | None = None, logprobs: dict[str, Any] | None = None,
              index: int = 0) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else (
                {} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason  # vLLM's: the stop string or token id, or null
        if logprobs is not None:
            choice["logprobs"] = logprobs
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat
                else "text_completion", "created": self.created, "model": self.hf.name,
                "choices": [choice]}

    def usage(self, gens: Sequence[Generation], handles: Sequence[GenerationHandle]) -> dict[str, Any]:
        return usage(gens, [c for h in handles for c in h.tool_calls], self.scope,
                     prompt_tokens=sum(map(len, self.plan.prompts)))

    def choice(self, index: int, gen: Generation) -> dict[str, Any]:
        """Choice ``index``: prompt ``index // n``'s, as the non-streaming answer gives it."""
        plan = self.plan
        echo = None if plan.echo is None else plan.echo[index // plan.n]
        text = (echo or "") + gen.text(self.hf.tokenizer)
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": gen.finish_reason,
                                  "stop_reason": gen.stop_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if gen.logprobs is not None:
                choice["logprobs"] = chat_logprobs(self.hf.tokenizer, gen.token_ids, gen.logprobs,
                                                   tokens_as_ids=plan.tokens_as_ids)
        else:
            choice["text"] = text
            if gen.logprobs is not None:
                ids, entries = gen.token_ids, gen.logprobs
                if echo is not None:  # the prompt's tokens first (the first one's null)
                    ids = [*plan.prompts[index // plan.n], *ids]
                    entries = [*(gen.prompt_logprobs or ()), *entries]
                choice["logprobs"] = completion_logprobs(self.hf.tokenizer, ids, entries,
                                                         tokens_as_ids=plan.tokens_as_ids)
        return choice

    def full(self, gens: Sequence[Generation], handles: Sequence[GenerationHandle]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.hf.name,
                "choices": [self.choice(i, gen) for i, gen in enumerate(gens)],
                "usage": self.usage(gens, handles)}

    def observe(self, gens: Sequence[Generation]) -> None:
        self.gate_version = gens[0].gate_version
        m = self.state.metrics
        assert m is not None
        m.e2e.observe(time.perf_counter() - self.started)  # once per request, as vLLM's
        # vllm:time_to_first_token_seconds, vllm:prompt_tokens, vllm:generation_tokens: observed by
        # the engine as it makes them (also for a request that then times out or is abandoned).
        for gen in gens:
            m.observe_routing(num_tokens=gen.prompt_tokens + len(gen.token_ids),
                              expert_counts=gen.expert_counts, active=gen.mean_experts_per_token,
                              dropped=gen.dropped_assignments, entropy=gen.gate_entropy,
                              gate_version=gen.gate_version)


def _submit(request: web.Request, call: _Call, gate: Any) -> list[GenerationHandle]:
    """One engine sequence per choice (choice i * n + j: prompt i, seed + j), decoded together
    with every other in the continuous batches. Each holds one of the admission slots the
    caller took (``plan.sequences``) and frees it when it leaves; if a submit fails, the
    sequences already queued leave and the slots not handed to one are freed here."""
    state, plan = call.state, call.plan
    assert state.engine is not None
    handles: list[GenerationHandle] = []
    try:
        for prompt in plan.prompts:
            for j in range(plan.n):
                handles.append(state.engine.submit(
                    list(prompt), max_tokens=plan.max_tokens, temperature=plan.temperature,
                    seed=plan.seed + j, timeout_s=state.request_timeout_s,
                    on_leave=lambda: free_slot(state), gate=gate.hf_gate,
                    max_tool_calls=MAX_TOOL_CALLS_PER_REQUEST,
                    allowed_experts=request_guard.allowed_experts(request),
                    request_id=request.headers.get("X-Request-Id", "")[:64] or call.id,
                    arrived=call.started, sampling=plan.sampling))
    except BaseException:
        for handle in handles:
            state.engine.cancel(handle)  # queued: it leaves, and frees its slot, at once
        for _ in range(plan.sequences - len(handles)):
            free_slot(state)
        raise
    return handles


async def _complete(request: web.Request, *, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    started = time.perf_counter()
    code = 500
    served: str | None = None  # the gate version that served it (stable or canary)
    try:
        hf = _text_model(state)
        gate = choose_gate(state, request)  # the canary for the keys its weight selects
        assert gate is not None and state.engine is not None
        served = gate.doc.version
        body = await read_json(request)  # before admission, as /v1/infer (server.infer)
        async with admission(state) as keep:
            # --request-timeout bounds the wait for the one tokenizer thread too: it may be
            # queued behind other prompts (~1 s per MiB), and a request waited that out unbounded.
            try:
                plan = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                    state.tokenizer_thread, functools.partial(parse_request, body, chat=chat, hf=hf)),
                    timeout=state.request_timeout_s)
            except asyncio.TimeoutError:
                raise ApiError(503, f"no result within {state.request_timeout_s:g} s") from None
            if plan.sequences > state.max_inflight:  # it could never be admitted: not a 429
                raise OpenAIError(400, f"the request decodes {plan.sequences} sequences "
                                       f"({len(plan.prompts)} prompts, n {plan.n}), more than this "
                                       f"server admits at once (--max-inflight {state.max_inflight})",
                                  param="n" if plan.n > 1 else "prompt")
            await inject_fault(state, gate)
            call = _Call(state, chat=chat, hf=hf, started=started, plan=plan,
                         scope=request.get(request_guard.SCOPE))
            # One slot per sequence: 429 unless all of them fit now (none awaited from here on).
            take_slots(state, plan.sequences - 1)
            keep()  # the engine frees each slot when its sequence leaves its queue or batch
            handles = _submit(request, call, gate)
        if plan.stream:
            try:
                resp = await _stream(request, call, handles)
            except (asyncio.CancelledError, ConnectionError):
                code = CLIENT_CLOSED  # the client went away mid-stream
                raise
            finally:
                # A version installed after admission may have served it (its prefill's, known
                # also when the generation failed after it).
                served = call.gate_version or handles[0].gate_version or served
            code = call.stream_code
            return resp
        try:
            await asyncio.wait([h.done for h in handles], return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:  # the client went away: its sequences leave the batch
            for handle in handles:
                state.engine.cancel(handle)
            code = CLIENT_CLOSED
            raise
        finally:  # a 503 after its prefill counts under the version that prefilled it too
            served = handles[0].gate_version or served
        failed = next((h.done.exception() for h in handles
                       if h.done.done() and h.done.exception() is not None), None)
        if failed is not None:  # one failed (a timeout, 503): the others leave too
            for handle in handles:
                state.engine.cancel(handle)
            raise failed
        gens = [h.done.result() for h in handles]
        call.observe(gens)
        served = call.gate_version or served  # a version installed after admission may have served it
        code = 200
        return web.json_response(call.full(gens, handles))
    except ApiError as e:
        code = e.status
        raise
    except (asyncio.CancelledError, ConnectionError):
        # The client went away before its generation was submitted (reading its body, waiting
        # out an injected latency): 499 as later on, not a server error the rollout analysis counts.
        code = CLIENT_CLOSED
        raise
    finally:
        # The sparsegate series count these requests too: the rollout analysis reads them.
        if state.metrics is not None:
            state.metrics.observe_request(code=code, gate_version=served, seconds=time.perf_counter() - started)


async def _stream(request: web.Request, call: _Call,
                  handles: Sequence[GenerationHandle]) -> web.StreamResponse:
    try:
        return await _send_events(request, call, handles)
    except BaseException:
        # The client went away mid-stream: its sequences leave the batch at the next step.
        assert call.state.engine is not None
        for handle in handles:
            call.state.engine.cancel(handle)
        raise


async def _send_events(request: web.Request, call: _Call,
                       handles: Sequence[GenerationHandle]) -> web.StreamResponse:
    """The server-sent events of every choice, each as its tokens come (`_send_choice`: its
    chunks carry its ``index``), then the usage over all of them. A choice that fails ends the
    stream with an error event, and the others leave their batch."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    lock = asyncio.Lock()

    async def send(obj: Any) -> None:
        async with lock:  # one event at a time, whichever choice sends it
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())
    tasks = [asyncio.ensure_future(_send_choice(call, index, handle, send))
             for index, handle in enumerate(handles)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()  # no-op for those done
    failed = next((t.exception() for t in tasks if t.done() and not t.cancelled()
                   and t.exception() is not None), None)
    if isinstance(failed, ApiError):
        assert call.state.engine is not None
        for handle in handles:
            call.state.engine.cancel(handle)
        call.stream_code = failed.status
        await send({"error": {"message": failed.message, "type": "server_error", "param": None,
                              "code": None}})
    elif failed is not None:
        raise failed  # the client went away (ConnectionError)
    else:
        gens = [t.result() for t in tasks]
        call.observe(gens)
        if call.plan.include_usage:
            await send({**call.chunk(text=None, finish=None), "choices": [],
                        "usage": call.usage(gens, handles)})
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _send_choice(call: _Call, index: int, handle: GenerationHandle,
                       send: Callable[[Any], Awaitable[None]]) -> Generation:
    """Choice ``index``'s chunks as its tokens come, then its finish; its `Generation` (raises
    the handle's ApiError when it failed)."""
    hf, plan = call.hf, call.plan
    queue, task = handle.tokens, handle.done
    if call.chat:
        await send(call.chunk(text=None, finish=None, first=True, index=index))
    elif plan.echo is not None:
        await send(call.chunk(text=plan.echo[index // plan.n], finish=None, index=index))
    text_so_far = GrowingText(hf.tokenizer)
    ids = text_so_far.ids
    sent = ""
    stops = plan.sampling.stop
    # With logprobs, each text chunk carries those of the tokens received since the last one.
    lp_sent = lp_offset = 0

    def logprobs() -> dict[str, Any] | None:
        nonlocal lp_sent, lp_offset
        if plan.sampling.logprobs is None or lp_sent == len(ids):
            return None
        new, entries = ids[lp_sent:], handle.logprobs[lp_sent:len(ids)]
        lp_sent = len(ids)
        if call.chat:
            return chat_logprobs(hf.tokenizer, new, entries, tokens_as_ids=plan.tokens_as_ids)
        out = completion_logprobs(hf.tokenizer, new, entries, tokens_as_ids=plan.tokens_as_ids,
                                  offset=lp_offset)
        lp_offset += sum(map(len, out["tokens"]))
        return out
    async for token in _tokens(queue, task):
        text = text_so_far.extend([token])
        if (stops or plan.sampling.stop_token_ids) and task.done():
            # Its last token is queued: the text below cuts a stop string or stop token off.
            continue
        # Hold back a trailing partial UTF-8 character until its next byte arrives, and text
        # that may be the start of a stop string (at most its length - 1 characters, as vLLM).
        end = len(text) - _held(text, stops)
        if end > len(sent) and not text[:end].endswith("\ufffd"):
            await send(call.chunk(text=text[len(sent):end], finish=None, logprobs=logprobs(),
                                  index=index))
            sent = text[:end]
    gen = task.result()
    # The generation ended: what was held back (a partial character no byte will complete
    # now, the start of a stop string that did not come) goes out as the non-streaming
    # answer shows it: without the stop string or stop token that ended it.
    text = gen.text(hf.tokenizer)
    rest = logprobs()
    if len(text) > len(sent) or rest is not None:
        await send(call.chunk(text=text[len(sent):], finish=None, logprobs=rest, index=index))
    await send(call.chunk(text=None if call.chat else "", finish=gen.finish_reason,
                          stop_reason=gen.stop_reason, index=index))
    return gen


def _held(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of ``text`` a stream holds back: the longest end of it
    that a stop string starts with (shorter than that string), which the next tokens may
    complete."""
    return max((k for stop in stops for k in range(min(len(stop) - 1, len(text)), 0, -1)
                if text.endswith(stop[:k])), default=0)


async def _tokens(queue: asyncio.Queue[int], task: asyncio.Future[Any]) -> AsyncIterator[int]:
    """Tokens as the model thread makes them, until the generation ends (or fails)."""
    while True:
        getter = asyncio.ensure_future(queue.get())
        try:
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            # The client went away (the handler is cancelled here): no token will come for this
            # getter, which would stay pending until garbage-collected ("Task was destroyed but
            # it is pending!" logged once per stream left).
            getter.cancel()
            raise
        if getter in done:
            yield getter.result()
            continue
        getter.cancel()
        # The thread queued every token before its result: the queue holds the rest.
        while not queue.empty():
            yield queue.get_nowait()
        return


@_openai_errors
async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


@_openai_errors
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


def _check_fields(body: Any, allowed: set[str], hf: HFServedModel) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise OpenAIError(400, "body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise OpenAIError(400, f"unsupported fields: {', '.join(unknown)}", param=unknown[0])
    model = body.get("model")
    if model is not None and model != hf.name:
        raise OpenAIError(404, f"the model {model!r} does not exist here (serving {hf.name!r})",
                          param="model")
    return body


def tokenized(body: Any, hf: HFServedModel) -> dict[str, Any]:
    """vLLM's ``POST /tokenize`` answer: ``{count, max_model_len, tokens, token_strs}`` for a
    ``prompt`` string (``add_special_tokens``, default true: what /v1/completions feeds the
    model) or chat ``messages`` (rendered as /v1/chat/completions does; ``add_generation_prompt``,
    default true); ``token_strs`` (the tokenizer's token strings) with ``return_token_strs``."""
    chat = isinstance(body, dict) and "messages" in body
    body = _check_fields(body, {"model", "return_token_strs"} | (
        {"messages", "add_generation_prompt"} if chat else {"prompt", "add_special_tokens"}), hf)
    if chat:
        generation_prompt = body.get("add_generation_prompt") is None or _bool(body, "add_generation_prompt")
        [(ids, _)] = _prompt_text(body, chat=True, hf=hf, generation_prompt=generation_prompt)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise OpenAIError(400, f"prompt must be a string, got {prompt!r}", param="prompt")
        special = body.get("add_special_tokens") is None or _bool(body, "add_special_tokens")
        ids = list(hf.tokenizer(_unicode(prompt, "prompt"), add_special_tokens=special)["input_ids"])
    strs = hf.tokenizer.convert_ids_to_tokens(ids) if _bool(body, "return_token_strs") else None
    return {"count": len(ids), "max_model_len": hf.context_length, "tokens": ids, "token_strs": strs}


def detokenized(body: Any, hf: HFServedModel) -> dict[str, Any]:
    """vLLM's ``POST /detokenize`` answer: ``{prompt}``, the text of ``tokens`` (ids in the
    vocabulary; special tokens kept, as vLLM decodes a prompt)."""
    body = _check_fields(body, {"model", "tokens"}, hf)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_id(t) and 0 <= t < hf.vocab_size for t in tokens):
        raise OpenAIError(400, f"tokens must be a list of token ids in [0, {hf.vocab_size})",
                          param="tokens")
    return {"prompt": hf.tokenizer.decode(tokens, clean_up_tokenization_spaces=False)}


async def _on_tokenizer(request: web.Request, answer: Callable[[Any, HFServedModel], dict[str, Any]]
                        ) -> web.Response:
    """``answer(body, hf)`` on the tokenizer thread, holding an admission slot meanwhile (429
    when none is free, 503 past ``--request-timeout``), as the generation routes tokenize."""
    state = request.app[STATE]
    hf = _text_model(state)
    body = await read_json(request)
    async with admission(state):
        try:
            out = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                state.tokenizer_thread, functools.partial(answer, body, hf)),
                timeout=state.request_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(503, f"no result within {state.request_timeout_s:g} s") from None
    return web.json_response(out)


@_openai_errors
async def tokenize(request: web.Request) -> web.StreamResponse:
    return await _on_tokenizer(request, tokenized)


@_openai_errors
async def detokenize(request: web.Request) -> web.StreamResponse:
    return await _on_tokenizer(request, detokenized)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_post(OPENAI_COMPLETIONS, completions)
    app.router.add_post(OPENAI_CHAT_COMPLETIONS, chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
