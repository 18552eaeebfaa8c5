"""The continuous-batching engine behind the OpenAI API, through the server (in-process aiohttp)
on a tiny Mixtral checkpoint built in code: concurrent completions decode together and each
equals the request generated alone; the bounded queue answers 429; a timed-out request answers
503 and frees its slot; gate swaps land between steps without dropping a request; the vLLM
gauges count queued and decoding requests; shutdown answers 503; --device; bad input is 400."""

import asyncio
import json

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from sparsegate_workload.admin import StaticToken
from sparsegate_workload.devices import DeviceError, resolve_device
from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document
from sparsegate_workload.hf import build_tiny_checkpoint
from sparsegate_workload.server import STATE, create_admin_app, create_app, main, wait_ready

TOKEN = "batch-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ONE = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 1, "maxExpertsPerToken": 1,
                     "capacityFactor": 8})
TWO = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 2, "maxExpertsPerToken": 2,
                     "capacityFactor": 8})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ck") / "tiny-mixtral-batch",
                                 family="mixtral")


async def _serve(app):
    client = TestClient(TestServer(app, host="127.0.0.1"), connector=aiohttp.TCPConnector(limit=0))
    await client.start_server()
    await wait_ready(app)
    return client


@pytest.fixture
async def serve(checkpoint):
    clients = []

    async def start(**kwargs):
        c = await _serve(create_app(**{"gate_doc": ONE, "model_path": str(checkpoint),
                                       **kwargs}))
        clients.append(c)
        return c
    yield start
    for c in clients:
        await c.close()


def _body(i, **extra):
    return {"prompt": f"request {i}: the gate keeps", "temperature": 0, "max_tokens": 12,
            **extra}


async def _text_of_stream(resp):
    assert resp.status == 200
    raw = (await resp.read()).decode()
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


async def test_concurrent_completions_decode_together_and_equal_each_alone(serve):
    client = await serve()
    state = client.server.app[STATE]
    bodies = [_body(i, max_tokens=8 + i, **({"temperature": 0.8, "seed": i} if i % 3 == 0 else {}))
              for i in range(8)]

    async def one(i):
        if i % 2:  # half of them streaming
            return await _text_of_stream(await client.post("/v1/completions",
                                                           json={**bodies[i], "stream": True}))
        resp = await client.post("/v1/completions", json=bodies[i])
        assert resp.status == 200
        return (await resp.json())["choices"][0]["text"]
    texts = await asyncio.gather(*[one(i) for i in range(8)])
    assert state.engine.max_batch >= 4  # decoded together, not one after another
    hf = state.hf
    for body, text in zip(bodies, texts):
        alone = hf.generate(hf.tokenizer(body["prompt"])["input_ids"],
                            max_tokens=body["max_tokens"], temperature=body["temperature"],
                            seed=body.get("seed", 0))
        assert text == hf.tokenizer.decode(alone.token_ids, skip_special_tokens=True)
    assert state.inflight == 0 and state.engine.running == 0 and state.engine.waiting == 0


async def test_chat_completions_batch_too(serve):
    client = await serve()
    msgs = [[{"role": "user", "content": f"hello {i}"}] for i in range(4)]
    resps = await asyncio.gather(*[client.post("/v1/chat/completions", json={
        "messages": m, "temperature": 0, "max_tokens": 10}) for m in msgs])
    assert [r.status for r in resps] == [200] * 4
    assert client.server.app[STATE].engine.max_batch >= 2


async def test_a_full_queue_answers_429_in_openai_shape(serve):
    client = await serve(max_inflight=3, max_num_seqs=1)
    resps = await asyncio.gather(*[client.post("/v1/completions", json=_body(i, max_tokens=40))
                                   for i in range(6)])
    statuses = sorted(r.status for r in resps)
    assert statuses == [200, 200, 200, 429, 429, 429]
    error = (await next(r for r in resps if r.status == 429).json())["error"]
    assert error["type"] == "rate_limit_error" and "limit 3" in error["message"]
    assert client.server.app[STATE].inflight == 0


async def test_a_timed_out_request_answers_503_and_frees_its_slot(serve):
    # One decoding at a time: the first times out while decoding (240 steps take ~0.3 s even
    # on a fast machine), the others while queued.
    client = await serve(request_timeout_s=0.1, max_num_seqs=1)
    state = client.server.app[STATE]
    resps = await asyncio.gather(
        client.post("/v1/completions", json=_body(0, max_tokens=240, prompt="a")),
        *[client.post("/v1/completions", json=_body(i, max_tokens=200)) for i in (1, 2)],
        client.post("/v1/completions", json=_body(3, max_tokens=200, stream=True)))
    for resp in resps[:3]:
        assert resp.status == 503
        assert "no result within 0.1 s" in (await resp.json())["error"]["message"]
    raw = (await resps[3].read()).decode()  # a stream ends with an error event, then [DONE]
    assert "no result within 0.1 s" in raw and raw.endswith("data: [DONE]\n\n")
    for _ in range(100):  # the decoding one leaves its batch at the next step boundary
        if state.inflight == 0 and state.engine.running == 0:
            break
        await asyncio.sleep(0.02)
    assert state.inflight == 0 and state.engine.running == 0 and state.engine.waiting == 0
    text = await (await client.get("/metrics")).text()
    assert 'vllm:num_requests_running{model_name="tiny-mixtral-batch"} 0.0' in text
    assert 'vllm:num_requests_waiting{model_name="tiny-mixtral-batch"} 0.0' in text
    # The stream had answered 200 before its error event: counted under the failure, as the others.
    served = state.gate.doc.version
    assert f'sparsegate_requests_total{{code="503",gate_version="{served}"}} 4.0' in text
    assert f'sparsegate_requests_total{{code="200",gate_version="{served}"}} 0.0' in text
    resp = await client.post("/v1/completions", json=_body(9, max_tokens=2))
    assert resp.status == 200


async def test_gate_swaps_land_between_steps_without_dropping_a_request(serve):
    client = await serve()
    state = client.server.app[STATE]
    experts = {ONE.version: 1.0, TWO.version: 2.0}
    loop = asyncio.get_running_loop()
    swapped: list[float] = []
    async with TestClient(TestServer(create_admin_app(client.server.app, auth=StaticToken(TOKEN)),
                                     host="127.0.0.1")) as admin:
        async def swap_midway():
            for _ in range(1000):  # until requests are decoding (not a guess of how long that takes)
                if state.engine.running:
                    break
                await asyncio.sleep(0.005)
            resp = await admin.put("/admin/gate", json=TWO.to_json(), headers=AUTH)
            swapped.append(loop.time())
            assert resp.status == 200

        async def request(i):
            await asyncio.sleep(0.05 * i)
            resp = await client.post("/v1/completions", json=_body(i, max_tokens=60))
            assert resp.status == 200
            return (await resp.json())["usage"]["sparsegate"], loop.time()
        results = await asyncio.gather(swap_midway(), *[request(i) for i in range(8)])
    usages = [u for u, _ in results[1:]]
    # The swap landed while a request was still decoding (answered after it), and none was dropped.
    assert any(done > swapped[0] for _, done in results[1:]) and usages[0]["gate_version"] == ONE.version
    for u in usages:  # each request ran wholly under the version it reports
        assert u["mean_experts_per_token"] == experts[u["gate_version"]]
    versions = [u["gate_version"] for u in usages]
    assert versions[0] == ONE.version and versions[-1] == TWO.version


async def test_gauges_count_queued_and_decoding_requests(serve):
    client = await serve(max_num_seqs=2)
    label = '{model_name="tiny-mixtral-batch"}'
    seen = set()

    async def scrape():
        for _ in range(400):
            text = await (await client.get("/metrics")).text()
            running = float(text.split(f"vllm:num_requests_running{label} ")[1].split()[0])
            waiting = float(text.split(f"vllm:num_requests_waiting{label} ")[1].split()[0])
            seen.add((running, waiting))
            if (2.0, 3.0) in seen:
                return
            await asyncio.sleep(0.005)
    reqs = [client.post("/v1/completions", json=_body(i, max_tokens=40)) for i in range(5)]
    resps = await asyncio.gather(scrape(), *reqs)
    assert all(r.status == 200 for r in resps[1:])
    assert (2.0, 3.0) in seen  # 2 decoding (max_num_seqs), 3 queued
    assert all(r <= 2.0 for r, _ in seen)
    text = await (await client.get("/metrics")).text()
    for line in (f"vllm:num_requests_running{label} 0.0", f"vllm:num_requests_waiting{label} 0.0",
                 f"vllm:time_to_first_token_seconds_count{label} 5.0",
                 f"vllm:e2e_request_latency_seconds_count{label} 5.0"):
        assert line in text, line


async def test_shutdown_answers_503_to_decoding_and_new_requests(serve):
    client = await serve()
    state = client.server.app[STATE]
    pending = asyncio.ensure_future(client.post("/v1/completions", json=_body(0, max_tokens=200)))
    for _ in range(200):
        if state.engine.running:
            break
        await asyncio.sleep(0.01)
    await state.engine.close("server is shutting down")
    resp = await pending
    assert resp.status == 503 and "shutting down" in (await resp.json())["error"]["message"]
    resp = await client.post("/v1/completions", json=_body(1))
    assert resp.status == 503 and "shutting down" in (await resp.json())["error"]["message"]
    assert state.inflight == 0


@pytest.mark.parametrize("raw, status, message", [
    (b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400, "not valid JSON"),
    (b'{"prompt": "hi", "max_tokens": 100000000000000000000000}', 400, "max_tokens"),
    (b'{"prompt": "hi", "seed": 18446744073709551616}', 400, "seed"),
    (b'{"prompt": "hi", "max_tokens": 1.5}', 400, "max_tokens"),
])
async def test_bad_generation_input_is_a_400_naming_it(serve, raw, status, message):
    client = await serve()
    resp = await client.post("/v1/completions", data=raw,
                             headers={"Content-Type": "application/json"})
    assert resp.status == status
    assert message in (await resp.json())["error"]["message"]


async def test_a_prompt_over_the_context_length_is_a_400(serve):
    client = await serve()
    resp = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "experts " * 300}], "max_tokens": 4})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert "maximum context length is 256 tokens" in error["message"]
    assert error["param"] == "messages"  # the prompt alone fills the context: max_tokens cannot help


async def test_the_checkpoint_is_placed_on_the_requested_device(serve):
    client = await serve(device="cpu")
    state = client.server.app[STATE]
    assert state.hf.device == torch.device("cpu")
    assert (await (await client.get("/v1/model")).json())["model"]["device"] == "cpu"


def test_device_resolution_names_why_cuda_is_unusable():
    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("cuda").type == resolve_device("auto").type == "cuda"
    else:
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(DeviceError, match="--device cuda was requested but CUDA is not "
                                              "available"):
            resolve_device("cuda")
    with pytest.raises(DeviceError, match="one of auto, cpu, cuda"):
        resolve_device("tpu")


def test_the_entry_point_refuses_cuda_it_cannot_use(checkpoint, capsys):
    if torch.cuda.is_available():
        argv = ["--device", "cuda"]  # the built-in model: CPU only, refused either way
        expected = "--device cuda needs --model-path"
    else:
        argv = ["--model-path", str(checkpoint), "--device", "cuda"]
        expected = "CUDA is not available"
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert expected in capsys.readouterr().err


def _pre_ampere_gpu(monkeypatch, *, emulated: bool) -> None:
    """Make torch see one GPU of compute capability 6.0 without bf16 (emulated: torch can only
    emulate it, as on a T4 or V100); nothing here touches a real device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla P100")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: emulated and including_emulation)


def test_bfloat16_on_a_gpu_without_it_is_refused_at_start_naming_the_flag(
        checkpoint, monkeypatch, capsys):
    """--model-dtype bfloat16 on a GPU where torch cannot run bf16 loaded (nothing checked) and
    then failed every request in its matmuls; now the entry point exits 2 naming the flag and
    the GPU before serving, and the loader refuses too. Where torch only emulates bf16 (no
    native support before compute capability 8.0) it runs, with a warning saying so."""
    from sparsegate_workload import hf_serving, server

    _pre_ampere_gpu(monkeypatch, emulated=False)
    monkeypatch.setattr(server, "create_app", lambda **_: pytest.fail("the server started"))
    with pytest.raises(SystemExit) as exit_:
        main(["--model-path", str(checkpoint), "--device", "cuda", "--model-dtype", "bfloat16"])
    assert exit_.value.code == 2
    assert ("--model-dtype bfloat16: Tesla P100 (compute capability 6.0) does not support "
            "bfloat16; use --model-dtype float16 or float32") in capsys.readouterr().err
    with pytest.raises(DeviceError, match="--model-dtype bfloat16: Tesla P100"):
        hf_serving.load(checkpoint, gate=ONE, dtype="bfloat16", device="cuda")
    from sparsegate_workload.devices import check_model_dtype

    cuda = torch.device("cuda")
    assert check_model_dtype(cuda, "float16") is None and check_model_dtype(cuda, "float32") is None
    assert check_model_dtype(torch.device("cpu"), "bfloat16") is None
    _pre_ampere_gpu(monkeypatch, emulated=True)
    assert "torch emulates it, slower than --model-dtype float16" in check_model_dtype(
        cuda, "bfloat16")


async def test_a_failing_model_step_fails_its_requests_with_500_and_the_engine_recovers(serve):
    client = await serve()
    state = client.server.app[STATE]
    engine = state.engine
    released = []
    # A token id outside the vocabulary makes the embedding lookup itself raise, on the model
    # thread, in the job that also carries the good request.
    good = engine.submit([1, 5, 6], max_tokens=50, on_leave=lambda: released.append("good"))
    bad = engine.submit([1, 10**6], max_tokens=5, on_leave=lambda: released.append("bad"))
    for handle in (good, bad):
        with pytest.raises(Exception) as failed:
            await handle.done
        assert failed.value.status == 500 and "generation failed" in failed.value.message
    assert sorted(released) == ["bad", "good"] and engine.running == 0
    resp = await client.post("/v1/completions", json=_body(0, max_tokens=3))
    assert resp.status == 200  # the decoder was reset; the next request decodes normally


async def test_an_out_of_memory_prefill_fails_only_its_own_request(serve, monkeypatch):
    """A prefill that runs out of memory (a long prompt) fails only its request, with 500 naming
    the error: the requests packed with it are prefilled alone and answer, and one already
    decoding never notices. Every running request failed with 500 before (the whole job failed
    and the decoder was reset)."""
    from sparsegate_workload.batch_decode import BatchDecoder

    client = await serve()
    engine = client.server.app[STATE].engine
    prefill = BatchDecoder._prefill

    def out_of_memory_on_long_prompts(self, reqs):
        if any(len(r.prompt_ids) >= 40 for r in reqs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return prefill(self, reqs)
    monkeypatch.setattr(BatchDecoder, "_prefill", out_of_memory_on_long_prompts)
    released = []
    decoding = engine.submit([1, 5, 6], max_tokens=60, on_leave=lambda: released.append("decoding"))
    await decoding.tokens.get()  # it is decoding
    short = engine.submit([1, 7, 8, 9], max_tokens=8, on_leave=lambda: released.append("short"))
    long = engine.submit([1, *range(10, 60)], max_tokens=8, on_leave=lambda: released.append("long"))
    with pytest.raises(Exception) as failed:
        await long.done
    assert failed.value.status == 500 and "OutOfMemoryError" in failed.value.message
    got = await decoding.done, await short.done
    alone = [await engine.submit([1, 5, 6], max_tokens=60).done,
             await engine.submit([1, 7, 8, 9], max_tokens=8).done]
    assert [g.token_ids for g in got] == [g.token_ids for g in alone]
    assert sorted(released) == ["decoding", "long", "short"] and engine.running == 0


async def test_a_prompt_outside_the_model_vocabulary_is_a_400(checkpoint, tmp_path):
    # A checkpoint whose model has fewer embeddings (256) than its tokenizer has ids (384).
    small = build_tiny_checkpoint(tmp_path / "small-vocab", family="mixtral", vocab_size=256)
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(small)
    client = await _serve(create_app(gate_doc=ONE, model_path=str(small)))
    try:
        tok = client.server.app[STATE].hf.tokenizer
        text = next(t for t in ("kubernetes rolls", "capacity factor", "hello world")
                    if max(tok(t)["input_ids"]) >= 256)
        resp = await client.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["param"] == "prompt" and "outside the model's vocabulary [0, 256)" in \
            error["message"]
    finally:
        await client.close()


async def test_a_vanishing_temperature_samples_the_greedy_token_without_failing_the_batch(serve):
    client = await serve()
    resps = await asyncio.gather(
        client.post("/v1/completions", json=_body(0, temperature=1e-300, seed=3)),
        client.post("/v1/completions", json=_body(0)))
    assert [r.status for r in resps] == [200, 200]
    tiny, greedy = [(await r.json())["choices"][0]["text"] for r in resps]
    assert tiny == greedy


async def test_a_job_runs_many_steps_yet_other_model_calls_wait_at_most_one(serve):
    # On the server's model thread a job keeps decoding while nothing else needs a step
    # boundary; a model call submitted meanwhile (a gate swap, a /v1/infer batch) runs after
    # at most one more step, while the generation is still decoding.
    client = await serve(max_num_seqs=1)
    state = client.server.app[STATE]
    engine = state.engine
    loop = asyncio.get_running_loop()
    jobs, steps = engine.jobs, engine.steps
    handle = engine.submit([1, 5, 6], max_tokens=200)
    await handle.tokens.get()  # the first token streams before the generation ends
    assert not handle.done.done()
    decoding_when_called = await loop.run_in_executor(state.executor,
                                                      lambda: engine.decoder.running)
    generation = await handle.done
    assert decoding_when_called == 1
    assert len(generation.token_ids) > 20  # long enough for the counts below to mean something
    run_jobs, run_steps = engine.jobs - jobs, engine.steps - steps
    assert run_steps >= len(generation.token_ids) - 1
    assert run_jobs <= 3  # admit + the job the call interrupted + maybe one more, not per step


async def test_token_counters_and_ttft_count_a_request_that_left_after_its_first_token(serve):
    """vllm:prompt_tokens_total / vllm:generation_tokens_total count tokens as the engine
    processes them (vLLM: "Number of prefill/generation tokens processed", per step, whatever
    the request's outcome), and vllm:time_to_first_token_seconds observes a first token when it
    comes. They counted only requests answered 200, at their end: a request that timed out or
    whose client left after decoding many tokens added nothing, so a throughput dashboard (rate
    of generation tokens) under-read a pod whose requests time out, and TTFT under load left out
    the long generations that then timed out."""
    client = await serve(max_num_seqs=1)
    state = client.server.app[STATE]
    task = asyncio.ensure_future(client.post("/v1/completions", json=_body(0, max_tokens=240, prompt="a")))
    handle = None
    for _ in range(2000):  # until it is decoding and has made a few tokens
        handle = next(iter(state.engine._running.values()), None)
        if handle is not None and handle.tokens.qsize() >= 3:
            break
        await asyncio.sleep(0.005)
    assert handle is not None and handle.tokens.qsize() >= 3
    state.engine.cancel(handle)  # as a timeout or a client that left does
    resp = await task
    assert resp.status == 499
    for _ in range(200):
        if state.engine.running == 0:
            break
        await asyncio.sleep(0.01)
    text = await (await client.get("/metrics")).text()
    label = '{model_name="tiny-mixtral-batch"}'

    def value(name):
        return float(text.split(f"{name}{label} ")[1].split()[0])
    made = handle.tokens.qsize()  # every token it got (nobody read them)
    assert value("vllm:prompt_tokens_total") == len(handle.request.prompt_ids)
    assert value("vllm:generation_tokens_total") >= made >= 3
    assert value("vllm:time_to_first_token_seconds_count") == 1.0
    assert value("vllm:e2e_request_latency_seconds_count") == 0.0  # answered 200 only
    # A request answered 200 is counted once, not again at its end.
    before = value("vllm:generation_tokens_total"), value("vllm:prompt_tokens_total")
    resp = await client.post("/v1/completions", json=_body(1, max_tokens=5))
    usage = (await resp.json())["usage"]
    text = await (await client.get("/metrics")).text()
    assert value("vllm:generation_tokens_total") == before[0] + usage["completion_tokens"]
    assert value("vllm:prompt_tokens_total") == before[1] + usage["prompt_tokens"]
    assert value("vllm:time_to_first_token_seconds_count") == 2.0
    assert value("vllm:e2e_request_latency_seconds_count") == 1.0
