"""BatchDecoder (continuous batching with a per-sequence KV cache) on a tiny Mixtral checkpoint
built in code: batched tokens and usage equal each request decoded alone (prompts prefilled
packed or two at a time), sequences join and leave between steps, and each step runs under one
gate version (groups keyed by version)."""

import dataclasses

import pytest
import torch

from sparsegate_workload.batch_decode import BatchDecoder, DecodeRequest
from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document
from sparsegate_workload.hf import build_tiny_checkpoint
from sparsegate_workload.hf_serving import HFServedModel, Sampling, load

# capacityFactor 8 caps nothing (capacity = assignments), so a step's sequences never compete.
DYNAMIC = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 1, "maxExpertsPerToken": 3,
                         "capacityFactor": 8})
ONE = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 1, "maxExpertsPerToken": 1,
                     "capacityFactor": 8})
TWO = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 2, "maxExpertsPerToken": 2,
                     "capacityFactor": 8})


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> HFServedModel:
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("ck") / "mixtral", family="mixtral")
    return load(path, gate=DYNAMIC, device="cpu")


def _requests(n, *, first=0):
    # Prompts of different lengths (so caches are left-padded), some greedy, some sampled.
    return [DecodeRequest(key=i, prompt_ids=[1] + [(7 * i + j) % 300 + 3 for j in range(2 + 3 * i % 11)],
                          max_tokens=6 + i % 5, temperature=0.0 if i % 3 else 0.9, seed=i)
            for i in range(first, first + n)]


def _drain(dec, pending, *, per_step=1, on_step=None):
    """Run jobs until every sequence ended; ``per_step`` requests join per job."""
    tokens, gens, sizes = {}, {}, []
    pending = list(pending)
    while pending or dec.running:
        admit, pending = pending[:per_step], pending[per_step:]
        if on_step is not None:
            on_step(len(sizes))
        for ev in dec.run(admit, []):
            tokens.setdefault(ev.key, []).append(ev.token)
            if ev.generation is not None:
                gens[ev.key] = ev.generation
        sizes.append(dec.group_sizes())
    return tokens, gens, sizes


def _solo(hf, req):
    return hf.generate(req.prompt_ids, max_tokens=req.max_tokens, temperature=req.temperature,
                       seed=req.seed)


@pytest.mark.parametrize("per_step", [2, 9])  # 9: all prompts packed into one prefill
def test_batched_tokens_and_usage_equal_each_request_alone(hf, per_step):
    reqs = _requests(9)
    tokens, gens, sizes = _drain(BatchDecoder(hf), reqs, per_step=per_step)
    assert max(sum(s.values()) for s in sizes) >= 5  # really decoded together
    for req in reqs:
        solo = _solo(hf, req)
        assert tokens[req.key] == gens[req.key].token_ids == solo.token_ids, req
        got = gens[req.key]
        assert got.finish_reason == solo.finish_reason
        assert got.expert_counts == solo.expert_counts
        assert got.mean_experts_per_token == pytest.approx(solo.mean_experts_per_token)
        assert got.gate_entropy == pytest.approx(solo.gate_entropy, rel=1e-5)
        assert got.dropped_assignments == solo.dropped_assignments == 0
        assert got.gate_version == DYNAMIC.version
    assert all(not s for s in sizes[-1:])  # every group gone once all ended


def _with_sampling(hf, reqs):
    """``reqs`` with a mix of sampling and stop parameters (`Sampling`): top_p / top_k on the
    sampled ones, a stop token id or a stop string taken from its own solo decode on others."""
    out = []
    for req in reqs:
        i = req.key
        plain = _solo(hf, req).token_ids
        text = hf.tokenizer.decode(plain[:3], skip_special_tokens=True)
        options = [Sampling(top_p=0.6, logprobs=2), Sampling(top_k=3, top_p=0.95, logprobs=0), Sampling(stop_token_ids=frozenset({plain[2]}), prompt_logprobs=2),
                   Sampling(stop=(text[-1],) if text and text[-1] != "\ufffd" else ()),
                   Sampling(min_tokens=2, stop_token_ids=frozenset({plain[0], plain[1]}))][i % 5]
        out.append(dataclasses.replace(req, sampling=options, max_tokens=req.max_tokens + 4))
    return out


@pytest.mark.parametrize("per_step", [2, 9])
def test_batched_sampling_and_stops_equal_each_request_alone(hf, per_step):
    """top_p / top_k draws, stop token ids, stop strings, min_tokens and (prompt) logprobs give each
    sequence in a batch what it gets alone (`HFServedModel.generate`), and a stopped sequence
    leaves at that step while the others go on."""
    reqs = _with_sampling(hf, _requests(10))
    tokens, gens, sizes = _drain(BatchDecoder(hf), reqs, per_step=per_step)
    assert max(sum(s.values()) for s in sizes) >= 5
    stopped = 0
    for req in reqs:
        solo = hf.generate(req.prompt_ids, max_tokens=req.max_tokens, temperature=req.temperature,
                           seed=req.seed, sampling=req.sampling)
        got = gens[req.key]
        assert tokens[req.key] == got.token_ids == solo.token_ids, req
        assert (got.finish_reason, got.stop_reason, got.text_end) == (
            solo.finish_reason, solo.stop_reason, solo.text_end), req
        assert got.expert_counts == solo.expert_counts
        assert (got.logprobs is None) == (solo.logprobs is None) == (req.sampling.logprobs is None)
        for (lp, top), (solo_lp, solo_top) in zip(got.logprobs or (), solo.logprobs or ()):
            assert lp == pytest.approx(solo_lp, abs=1e-5) and len(top) == req.sampling.logprobs
            assert [t for t, _ in top] == [t for t, _ in solo_top]
        assert (got.prompt_logprobs is None) == (solo.prompt_logprobs is None)
        if got.prompt_logprobs is not None:  # from the packed prefill's hidden states
            assert len(got.prompt_logprobs) == len(req.prompt_ids) and got.prompt_logprobs[0] is None
            for (lp, top), (solo_lp, solo_top) in zip(got.prompt_logprobs[1:], solo.prompt_logprobs[1:]):
                assert lp == pytest.approx(solo_lp, abs=1e-5) and len(top) == 2
        if got.stop_reason is not None:
            stopped += 1
            assert len(got.token_ids) < req.max_tokens
            text = got.text(hf.tokenizer)
            if isinstance(got.stop_reason, str):
                assert got.stop_reason not in text
            else:
                assert got.token_ids[-1] == got.stop_reason
    assert stopped >= 3


def test_sequences_join_and_leave_between_steps(hf):
    dec = BatchDecoder(hf)
    long = DecodeRequest(key="long", prompt_ids=[1, 5, 6], max_tokens=12)
    short = DecodeRequest(key="short", prompt_ids=[1] + list(range(10, 30)), max_tokens=3)
    events = dec.run([long], [])
    assert [e.key for e in events] == ["long", "long"]  # prefill token, then one step
    events = dec.run([short], [])
    assert dec.group_sizes() == {DYNAMIC.version: 2}
    # The short prompt is longer than the long one's cache: the group was padded to it.
    while dec.running == 2:
        events = dec.run([], [])
    assert dec.group_sizes() == {DYNAMIC.version: 1}
    removed = dec.run([], ["long"])
    assert removed == [] and dec.running == 0 and dec.group_sizes() == {}
    assert dec.remove("long") is False


def test_a_sequence_removed_mid_batch_leaves_the_others_unchanged(hf):
    reqs = _requests(4, first=20)
    dec = BatchDecoder(hf)
    tokens = {}
    for ev in dec.run(reqs, []):
        tokens.setdefault(ev.key, []).append(ev.token)
    dec.remove(reqs[1].key)
    while dec.running:
        for ev in dec.run([], []):
            tokens.setdefault(ev.key, []).append(ev.token)
    for req in (reqs[0], reqs[2], reqs[3]):
        assert tokens[req.key] == _solo(hf, req).token_ids


def test_a_gate_swap_between_steps_starts_a_new_group_and_keeps_the_old_version(hf):
    hf.set_gate(ONE)
    dec = BatchDecoder(hf)
    reqs = _requests(6, first=40)
    solo_one = {r.key: _solo(hf, r) for r in reqs[:3]}
    hf.set_gate(TWO)
    solo_two = {r.key: _solo(hf, r) for r in reqs[3:]}
    hf.set_gate(ONE)

    def swap(step):
        if step == 3:  # between two jobs, as the server's model thread does
            hf.set_gate(TWO)
    try:
        tokens, gens, sizes = _drain(dec, reqs, per_step=1, on_step=swap)
    finally:
        hf.set_gate(DYNAMIC)
    assert any(len(s) == 2 for s in sizes)  # both versions decoding side by side
    for r in reqs[:3]:
        assert gens[r.key].gate_version == ONE.version
        assert gens[r.key].mean_experts_per_token == 1.0
        assert gens[r.key].token_ids == solo_one[r.key].token_ids
    for r in reqs[3:]:
        assert gens[r.key].gate_version == TWO.version
        assert gens[r.key].mean_experts_per_token == 2.0
        assert gens[r.key].token_ids == solo_two[r.key].token_ids


def test_eos_and_max_tokens_end_a_sequence_at_its_prefill(hf):
    dec = BatchDecoder(hf)
    [ev] = dec.run([DecodeRequest(key="one", prompt_ids=[1, 9, 9], max_tokens=1)], [])
    assert ev.generation is not None and ev.generation.finish_reason in ("length", "stop")
    assert ev.generation.token_ids == [ev.token] and dec.running == 0
    # The first add is accepted (outside the raises block, so a decoder refusing every add fails here).
    dec.add(DecodeRequest(key="x", prompt_ids=[1, 2], max_tokens=5))
    assert dec.running == 1
    with pytest.raises(ValueError, match="already decoding"):
        dec.add(DecodeRequest(key="x", prompt_ids=[1, 2], max_tokens=5))
    dec.reset()
    assert dec.running == 0


def test_the_cache_holds_only_columns_some_row_uses(hf):
    dec = BatchDecoder(hf)
    dec.run([DecodeRequest(key="a", prompt_ids=[1] * 30, max_tokens=50),
             DecodeRequest(key="b", prompt_ids=[1, 2], max_tokens=50)], [])
    group = next(iter(dec._groups.values()))
    assert group.mask.shape == (2, 31) and group.keys[0].shape[2] == 31
    dec.remove("a")
    group = next(iter(dec._groups.values()))
    # b's own 2 prompt tokens + 2 generated-and-fed tokens; a's 30-token padding trimmed.
    assert group.mask.shape == (1, 3) and bool(group.mask.all())
    assert all(k.shape[2] == 3 for k in group.keys)
    assert torch.equal(group.mask, torch.ones(1, 3, dtype=torch.long))


def test_packed_prefill_splits_into_forwards_of_bounded_size(hf, monkeypatch):
    import sparsegate_workload.batch_decode as bd
    monkeypatch.setattr(bd, "MAX_PREFILL_TOKENS", 20)
    dec = BatchDecoder(hf)
    forwards = []
    original = dec._prefill
    monkeypatch.setattr(dec, "_prefill", lambda reqs: forwards.append(len(reqs)) or original(reqs))
    reqs = [DecodeRequest(key=i, prompt_ids=[1] + [5 + i] * 8, max_tokens=3) for i in range(5)]
    events = dec.add_many(reqs)
    assert forwards == [2, 2, 1]  # 9-token prompts, at most 20 tokens per forward
    for req, ev in zip(reqs, events):
        assert ev.token == _solo(hf, req).token_ids[0]


def test_generation_config_end_of_sequence_ids_stop_a_generation(tmp_path):
    """Chat checkpoints (Qwen's <|im_end|>) list their end-of-turn id in generation_config.json
    only, which transformers' generate() stops on; so do the server's decoders (they used to
    read config.json's eos_token_id alone and generate on to max_tokens)."""
    import json

    path = build_tiny_checkpoint(tmp_path / "ck", family="mixtral")
    prompt = [1, 9, 9]
    first = load(path, gate=TWO, device="cpu").generate(prompt, max_tokens=3).token_ids[0]
    assert first != 2  # config.json's eos: the one id that used to stop it
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, first]}))
    hf = load(path, gate=TWO, device="cpu")
    assert hf.eos_ids == {2, first}
    solo = hf.generate(prompt, max_tokens=3)
    assert (solo.token_ids, solo.finish_reason) == ([first], "stop")
    [ev] = BatchDecoder(hf).run([DecodeRequest(key="k", prompt_ids=prompt, max_tokens=3)], [])
    assert ev.generation is not None
    assert (ev.generation.token_ids, ev.generation.finish_reason) == ([first], "stop")


def test_qwen2_moe_without_sliding_window_packs_its_prompts(tmp_path, monkeypatch):
    """Qwen2-MoE's config sets sliding_window to 0 (not None) when use_sliding_window is off, as
    in every released Qwen2-MoE checkpoint; no layer slides (layer_types), so its prompts pack
    into one prefill like the other families' (they were prefilled one forward each)."""
    path = build_tiny_checkpoint(tmp_path / "ck", family="qwen2_moe", tokenizer=False)
    hf = load(path, gate=TWO, device="cpu")
    assert hf.lm.model.config.sliding_window == 0
    dec = BatchDecoder(hf)
    forwards = []
    original = dec._prefill
    monkeypatch.setattr(dec, "_prefill", lambda reqs: forwards.append(len(reqs)) or original(reqs))
    reqs = [DecodeRequest(key=i, prompt_ids=[1] + [5 + i] * (3 + 2 * i), max_tokens=4)
            for i in range(3)]
    tokens, gens, _ = _drain(dec, reqs, per_step=3)
    assert forwards == [3]
    for req in reqs:
        assert tokens[req.key] == gens[req.key].token_ids == _solo(hf, req).token_ids


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_prefill_never_holds_the_logits_of_every_prompt_position(tmp_path, monkeypatch, family):
    """A prefill used to run the whole model, whose LM head made the [T, vocab] logits of every
    packed prompt position (kept for the prompt-quality score, plus float and log-softmax
    copies: GBs for a 152k vocabulary at MAX_PREFILL_TOKENS, and a single prompt longer than
    that budget is prefilled alone in one forward, unbounded). Now the head runs at each
    prompt's last position (the first token) and on at most SCORE_CHUNK positions at a time
    for the score, which equals the prompts' scores each alone; the first tokens too."""
    import sparsegate_workload.batch_decode as bd
    from sparsegate_workload import quality

    path = build_tiny_checkpoint(tmp_path / "ck", family=family, tokenizer=False,
                                 max_positions=512)
    hf = load(path, gate=TWO, device="cpu")
    monkeypatch.setattr(bd, "MAX_PREFILL_TOKENS", 300)
    reqs = [DecodeRequest(key=i, prompt_ids=[1] + [(5 * i + 3 * j) % 300 + 3 for j in range(n - 1)],
                          max_tokens=2) for i, n in enumerate([120, 130, 400, 60])]
    dec = BatchDecoder(hf)
    scores, forwards, head_rows = [], [], []
    dec.on_prompts_scored = lambda version, score: scores.append(score)
    original = dec._prefill
    monkeypatch.setattr(dec, "_prefill", lambda rs: forwards.append(len(rs)) or original(rs))
    head = hf.lm.model.get_output_embeddings()
    hook = head.register_forward_hook(
        lambda _m, args, _out: head_rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0]))
    try:
        events = dec.add_many(reqs)
    finally:
        hook.remove()
    assert forwards == [2, 1, 1]  # 120+130 packed; the 400-token prompt alone, past the budget
    assert max(head_rows) <= quality.SCORE_CHUNK < 400
    alone = [quality.score_rows(hf.lm.forward(torch.tensor([r.prompt_ids])).logits,
                                torch.tensor([r.prompt_ids])) for r in reqs]
    assert sum(s.tokens for s in scores) == sum(s.tokens for s in alone) == 119 + 129 + 399 + 59
    assert sum(s.nll for s in scores) == pytest.approx(sum(s.nll for s in alone), rel=1e-5)
    for req, ev in zip(reqs, events):
        assert ev.token == _solo(hf, req).token_ids[0]


@pytest.mark.parametrize("per_step", [1, 9])  # one prompt a prefill; all nine packed in one
def test_a_prefill_padded_to_a_shape_bucket_equals_the_unpadded_one(hf, per_step):
    """In bf16 on CPU the prefill's length is rounded up to `experts.row_bucket` (oneDNN builds
    kernels per shape): the padding is its own block of the mask, last, and the MoE blocks route
    only the prompts' tokens. Forced on here (fp32, so both runs are exact): the same tokens,
    usage, prompt scores and routed token counts as without it."""
    from sparsegate_workload.experts import row_bucket

    reqs = _requests(9)
    runs = []
    for buckets in (False, True):
        dec = BatchDecoder(hf)
        dec._buckets = buckets
        scores, routed = [], []
        dec.on_prompts_scored = lambda version, score: scores.append(score)
        original, measure, seen = dec._prefill, dec._measure, []

        def prefill(rs, original=original, routed=routed, seen=seen):
            seen.clear()
            events = original(rs)
            routed.append((sum(len(r.prompt_ids) for r in rs), tuple(seen)))
            return events

        def measured(call, measure=measure, seen=seen):
            seen.append(call.layers[0].num_tokens)  # tokens the first MoE block routed
            return measure(call)

        dec._prefill, dec._measure = prefill, measured
        block = hf.lm.blocks[0]
        hook = block.register_forward_pre_hook(
            lambda _m, args, seen=seen: seen.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])
            if len(seen) < 1 else None)  # rows the forward ran, once per prefill (decode steps ignored)
        try:
            tokens, gens, _ = _drain(dec, reqs, per_step=per_step)
        finally:
            hook.remove()
        runs.append((tokens, gens, scores, routed))
    (tokens, gens, scores, plain), (tokens_b, gens_b, scores_b, padded) = runs
    assert tokens == tokens_b
    for key, gen in gens.items():
        assert gens_b[key].token_ids == gen.token_ids
        assert gens_b[key].expert_counts == gen.expert_counts
        assert gens_b[key].mean_experts_per_token == pytest.approx(gen.mean_experts_per_token)
    assert [s.tokens for s in scores] == [s.tokens for s in scores_b]
    assert [s.nll for s in scores_b] == pytest.approx([s.nll for s in scores], rel=1e-5)
    # (rows the forward ran, tokens routed) per prefill
    assert all(rows == (total, total) for total, rows in plain)
    assert all(rows == (row_bucket(total), total) for total, rows in padded)
    assert any(row_bucket(total) > total for total, _ in padded)  # some prefill really padded
