"""Quality as a live metric (sparsegate_workload.quality): next-token NLL of served tokens, the
probe set and where its text comes from, and the server's /metrics per gate version — on the
built-in model (/v1/infer) and a tiny checkpoint (/v1/infer and the OpenAI API's prefill)."""

from __future__ import annotations

import math

import aiohttp
import pytest
import torch
import torch.nn.functional as F
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from sparsegate_workload import quality
from sparsegate_workload.admin import StaticToken
from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document
from sparsegate_workload.hf import build_tiny_checkpoint
from sparsegate_workload.server import STATE, create_admin_app, create_app, wait_ready

TOKEN = "quality-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
A = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 1, "maxExpertsPerToken": 1, "capacityFactor": 8})
B = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 2, "maxExpertsPerToken": 2, "capacityFactor": 8})


def test_score_rows_is_next_token_cross_entropy() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    s = quality.score_rows(logits, ids)
    want = sum(-F.log_softmax(logits[b, t - 1], -1)[ids[b, t]] for b in range(2) for t in range(1, 5))
    assert s.tokens == 8 and s.nll == pytest.approx(float(want), rel=1e-5)
    assert s.mean_logprob == pytest.approx(-s.nll / 8) and s.perplexity == pytest.approx(math.exp(s.nll / 8))
    assert quality.score_rows(logits[:, :1], ids[:, :1]) == quality.Score(0.0, 0)


def test_score_packed_never_scores_across_sequences() -> None:
    g = torch.Generator().manual_seed(1)
    lengths = [3, 1, 4]
    logits = torch.randn(8, 7, generator=g)
    ids = torch.randint(0, 7, (8,), generator=g)
    packed = quality.score_packed(logits, ids, lengths)
    alone, start = [], 0
    for n in lengths:
        alone.append(quality.score_rows(logits[start:start + n][None], ids[start:start + n][None]))
        start += n
    assert packed.tokens == sum(s.tokens for s in alone) == 2 + 0 + 3
    assert packed.nll == pytest.approx(sum(s.nll for s in alone), rel=1e-6)
    assert quality.score_packed(logits[:1], ids[:1], [1]).tokens == 0


def test_nonfinite_nll_counts_as_the_worst_never_nan() -> None:
    """A NaN or infinite logit (a broken gate version, an overflow) must not make the score NaN:
    added to a counter it would stay NaN for the pod's life. It counts NONFINITE_NLL per token."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    clean = quality.score_rows(logits, ids)
    broken = logits.clone()
    broken[0, 1] = math.nan                       # predicts ids[0, 2]
    broken[1, 2, ids[1, 3]] = -math.inf           # ids[1, 3] gets probability 0
    s = quality.score_rows(broken, ids)
    first = -F.log_softmax(logits[0, 1], -1)[ids[0, 2]] - F.log_softmax(logits[1, 2], -1)[ids[1, 3]]
    assert s.tokens == 8 and math.isfinite(s.nll)
    assert s.nll == pytest.approx(clean.nll - float(first) + 2 * quality.NONFINITE_NLL, rel=1e-6)
    assert s.perplexity == math.inf  # not OverflowError: the probe gauges publish it
    packed = quality.score_packed(torch.full((6, 11), math.nan), ids.reshape(-1)[:6], [2, 4])
    assert packed == quality.Score(4 * quality.NONFINITE_NLL, 4)


def test_score_packed_hidden_equals_score_packed_of_the_whole_logits() -> None:
    """The prefill's score from its hidden states and the LM head, a few positions at a time
    (never the [T, vocab] logits of all): the same score as from the whole logits, NaN rows
    counted as NONFINITE_NLL as there."""
    g = torch.Generator().manual_seed(3)
    lengths = [3, 1, 6, 2]
    hidden = torch.randn(12, 5, generator=g)
    hidden[7] = math.nan
    head = torch.nn.Linear(5, 9, bias=False)
    ids = torch.randint(0, 9, (12,), generator=g)
    rows = []
    head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
    with torch.inference_mode():
        want = quality.score_packed(head(hidden), ids, lengths)
        rows.clear()
        got = quality.score_packed_hidden(hidden, head, ids, lengths, chunk=2)
        assert quality.score_packed_hidden(hidden[:1], head, ids[:1], [1]) == quality.Score(0.0, 0)
    assert got.tokens == want.tokens == 2 + 0 + 5 + 1
    assert got.nll == pytest.approx(want.nll, rel=1e-6) and want.nll > quality.NONFINITE_NLL
    assert rows == [2, 2, 2, 2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("qck") / "tiny", family="mixtral", experts=4, top_k=2)


def test_probe_sources(checkpoint, tmp_path) -> None:
    from sparsegate_workload.hf import load_moe_checkpoint

    lm = load_moe_checkpoint(checkpoint)
    made = quality.checkpoint_probe(checkpoint, lm.tokenizer, vocab_size=384, context_length=512)
    assert made.source.startswith("synthetic corpus lines") and made.windows.shape[1] == quality.PROBE_SEQ_LEN
    again = quality.checkpoint_probe(checkpoint, lm.tokenizer, vocab_size=384, context_length=512)
    assert torch.equal(made.windows, again.windows)  # deterministic
    shipped = tmp_path / "ck"
    shipped.mkdir()
    (shipped / quality.PROBE_FILE).write_text("count 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15\n" * 20)
    from_file = quality.checkpoint_probe(shipped, lm.tokenizer, vocab_size=384, context_length=512)
    assert from_file.source == str(shipped / quality.PROBE_FILE) and not torch.equal(from_file.windows[:1], made.windows[:1])
    assert quality.checkpoint_probe(checkpoint, None, vocab_size=50, context_length=16).source.startswith("random token ids")
    with pytest.raises(ValueError, match="fewer than one window"):
        (shipped / quality.PROBE_FILE).write_text("a\n")
        quality.checkpoint_probe(shipped, lm.tokenizer, vocab_size=384, context_length=512)


def test_a_large_probe_file_is_tokenized_only_as_far_as_it_is_scored(checkpoint, tmp_path) -> None:
    """Only PROBE_MAX_TOKENS probe tokens are scored: a shipped file (a whole validation set) was
    read and tokenized to its end at each load, ~1 s per MB, while the model loaded."""
    from sparsegate_workload.hf import load_moe_checkpoint

    real = load_moe_checkpoint(checkpoint).tokenizer
    calls = []

    def tokenizer(text, **kwargs):
        calls.append(text)
        return real(text, **kwargs)

    line = "count 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15\n"
    big, small = tmp_path / "big", tmp_path / "small"
    big.mkdir()
    small.mkdir()
    (big / quality.PROBE_FILE).write_text(line * 50_000)
    (small / quality.PROBE_FILE).write_text(line * 1_000)
    got = quality.checkpoint_probe(big, tokenizer, vocab_size=384, context_length=512)
    per_line = len(real(line, add_special_tokens=False)["input_ids"])
    assert len(calls) == -(-quality.PROBE_MAX_TOKENS // per_line)  # just enough lines
    want = quality.checkpoint_probe(small, real, vocab_size=384, context_length=512)
    assert got.windows.shape == (quality.PROBE_MAX_TOKENS // quality.PROBE_SEQ_LEN, quality.PROBE_SEQ_LEN)
    assert torch.equal(got.windows, want.windows)  # the same probe set as before


def samples(text: str, name: str) -> dict[str, float]:
    return {s.labels.get("gate_version", ""): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


async def _metrics(client) -> str:
    return await (await client.get("/metrics")).text()


async def _admin(app):
    c = TestClient(TestServer(create_admin_app(app, auth=StaticToken(TOKEN)), host="127.0.0.1"))
    await c.start_server()
    return c


async def test_builtin_server_scores_infer_tokens_and_probe_per_version() -> None:
    app = create_app(gate_doc=A)
    async with TestClient(TestServer(app, host="127.0.0.1"), connector=aiohttp.TCPConnector(limit=0)) as client:
        await wait_ready(app)
        text = await _metrics(client)
        probe_a = samples(text, "sparsegate_probe_nll_per_token")
        assert list(probe_a) == [A.version] and math.isfinite(probe_a[A.version])
        assert samples(text, "sparsegate_probe_perplexity")[A.version] == pytest.approx(math.exp(probe_a[A.version]))
        tokens = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
        assert (await client.post("/v1/infer", json={"tokens": tokens})).status == 200
        # The same batch run directly gives the NLL the server counted.
        state = app[STATE]
        out = state.model(torch.tensor(tokens), gate=state.gate.params, precisions=state.gate.precisions)
        want = quality.score_rows(out.logits, torch.tensor(tokens))
        text = await _metrics(client)
        assert samples(text, "sparsegate_quality_tokens_total") == {A.version: 8.0}
        assert samples(text, "sparsegate_quality_nll_total")[A.version] == pytest.approx(want.nll, rel=1e-5)
        admin = await _admin(app)
        try:
            assert (await admin.put("/admin/gate", json=B.to_json(), headers=AUTH)).status == 200
        finally:
            await admin.close()
        text = await _metrics(client)
        probe_b = samples(text, "sparsegate_probe_nll_per_token")
        assert list(probe_b) == [B.version] and probe_b[B.version] != probe_a[A.version]
        assert (await client.post("/v1/infer", json={"tokens": tokens})).status == 200
        assert samples(await _metrics(client), "sparsegate_quality_tokens_total") == {A.version: 8.0, B.version: 8.0}


async def test_broken_canary_version_is_scored_worst_not_nan(monkeypatch) -> None:
    """A canary whose forward yields NaN logits: its probe and live NLL are finite and far worse
    than stable's (a NaN probe gauge is skipped as "no data" by the analysis, a NaN counter stays
    NaN, and Prometheus' NaN reads as nothing: the check could pass). The stable's are untouched."""
    from sparsegate_contracts.canary import gate_set_document, routes_to_canary
    from sparsegate_workload.model import TinyMoELM

    forward = TinyMoELM.forward

    def broken_b(self, tokens, *, gate, **kw):
        out = forward(self, tokens, gate=gate, **kw)
        if gate.min_experts_per_token == 2:  # B
            out.logits = torch.full_like(out.logits, math.nan)
        return out

    monkeypatch.setattr(TinyMoELM, "forward", broken_b)
    app = create_app(gate_doc=A)
    async with TestClient(TestServer(app, host="127.0.0.1"), connector=aiohttp.TCPConnector(limit=0)) as client:
        await wait_ready(app)
        admin = await _admin(app)
        try:
            both = gate_set_document(A.to_json(), B.to_json(), weight=0.5)
            resp = await admin.put("/admin/gate", json=both, headers=AUTH)
            assert resp.status == 200, await resp.text()
        finally:
            await admin.close()
        served = set()
        for i in range(8):
            rid = f"r{i}"
            resp = await client.post("/v1/infer", json={"tokens": [[1, 2, 3, 4, 5]]}, headers={"X-Request-Id": rid})
            assert resp.status == 200
            served.add(B.version if routes_to_canary(rid, 0.5) else A.version)
        assert served == {A.version, B.version}
        text = await _metrics(client)
        probe = samples(text, "sparsegate_probe_nll_per_token")
        assert all(math.isfinite(v) for v in probe.values()) and probe[B.version] == quality.NONFINITE_NLL
        assert probe[A.version] < 1000
        nll, tokens = samples(text, "sparsegate_quality_nll_total"), samples(text, "sparsegate_quality_tokens_total")
        assert all(math.isfinite(v) for v in nll.values())
        assert nll[B.version] / tokens[B.version] == quality.NONFINITE_NLL > nll[A.version] / tokens[A.version]


async def test_checkpoint_server_scores_prompts_of_the_openai_api_and_infer(checkpoint) -> None:
    app = create_app(gate_doc=A, model_path=str(checkpoint))
    async with TestClient(TestServer(app, host="127.0.0.1"), connector=aiohttp.TCPConnector(limit=0)) as client:
        await wait_ready(app)
        hf = app[STATE].hf
        assert A.version in samples(await _metrics(client), "sparsegate_probe_perplexity")
        prompt = "the gate keeps the experts busy"
        ids = hf.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0})
        assert resp.status == 200
        text = await _metrics(client)
        # Prompt tokens only (each scored by the position before it): generated ones are not.
        assert samples(text, "sparsegate_quality_tokens_total") == {A.version: float(len(ids) - 1)}
        want = quality.score_rows(hf.lm.forward(torch.tensor([ids])).logits, torch.tensor([ids]))
        assert samples(text, "sparsegate_quality_nll_total")[A.version] == pytest.approx(want.nll, rel=1e-4)
        assert (await client.post("/v1/infer", json={"tokens": [[5, 6, 7, 8]]})).status == 200
        assert samples(await _metrics(client), "sparsegate_quality_tokens_total") == {A.version: float(len(ids) - 1 + 3)}


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_probe_and_infer_batch_never_hold_the_logits_of_every_position(tmp_path, family) -> None:
    """The probe (PROBE_MAX_TOKENS tokens, scored at every gate install) and a checkpoint's
    /v1/infer batch (MAX_BATCH rows) used to run the whole model, whose LM head made the
    [tokens, vocab] logits of every position, plus float and log-softmax copies (GBs for a
    152k vocabulary). Now the head runs at each row's last position and on at most SCORE_CHUNK
    positions at a time for the score: the same scores, next tokens, logits, routing and
    tool-gate probabilities as the whole forward, under the installed or a pinned gate."""
    from sparsegate_workload.gating import tool_fires
    from sparsegate_workload.hf.tool_head import ToolHead
    from sparsegate_workload.hf_serving import load

    hf = load(build_tiny_checkpoint(tmp_path / "ck", family=family, tokenizer=False), gate=A, device="cpu")
    lm = hf.lm
    lm.tool_head = ToolHead(weight=0.05 * torch.randn(64, generator=torch.Generator().manual_seed(3)), bias=0.0)
    canary = lm.prepare_gate(B)
    ids = torch.randint(0, hf.vocab_size, (10, 64), generator=torch.Generator().manual_seed(1))
    head_rows = []
    hook = lm.model.get_output_embeddings().register_forward_hook(
        lambda _m, args, _out: head_rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0]))
    try:
        probe = quality.score_checkpoint_probe(lm, quality.ProbeSet(ids, "test"))
        probe_b = quality.score_checkpoint_probe(lm, quality.ProbeSet(ids, "test"), gate=canary)
        batch, version = hf.run_batch(ids.tolist(), return_logits=True, gate=canary,
                                      allowed_experts=[0, 2, 5])
    finally:
        hook.remove()
    assert max(head_rows) <= quality.SCORE_CHUNK < ids.numel()
    assert version == B.version
    for score, gate in ((probe, None), (probe_b, canary)):
        want = quality.score_rows(lm.forward(ids, gate=gate).logits, ids)
        assert score.tokens == want.tokens == 10 * 63
        assert score.nll == pytest.approx(want.nll, rel=1e-5)
    assert probe.nll != probe_b.nll  # each under its own gate
    whole = lm.forward(ids, gate=canary, allowed_experts=[0, 2, 5])
    want = quality.score_rows(whole.logits, ids)
    assert batch.prompt_score.tokens == want.tokens
    assert batch.prompt_score.nll == pytest.approx(want.nll, rel=1e-5)
    assert batch.next_tokens == whole.logits[:, -1].argmax(-1).tolist()
    torch.testing.assert_close(torch.tensor(batch.last_logits), whole.logits[:, -1].float())
    assert batch.expert_counts == [st.counts for st in whole.layers]
    assert batch.last_tool_prob == pytest.approx(whole.tool_prob[:, -1].tolist(), rel=1e-5)
    fired = tool_fires(whole.tool_prob, threshold=B.params.tool_gate_threshold)
    assert batch.tool_calls == [row.nonzero().squeeze(1).tolist() for row in fired]
