"""BatchDecoder parking a sequence on a tool (model thread side of tools on the OpenAI routes),
on a tiny Mixtral checkpoint with a tool-gate head that always fires (bias 10): the parked
sequence leaves its group while another keeps decoding; forced tokens extend its KV cache so
its continuation equals the model decoding prompt + forced alone; a failed tool keeps the
held-back token (plain decoding); the call budget bounds repeated firing; forced tokens stop at
max_tokens."""

import pytest
import torch

from sparsegate_workload.batch_decode import BatchDecoder, DecodeRequest, TokenEvent, ToolFire
from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document
from sparsegate_workload.hf import build_tiny_checkpoint
from sparsegate_workload.hf.tool_head import ToolHead
from sparsegate_workload.hf_serving import HFServedModel, Sampling, load

GATE = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 1, "maxExpertsPerToken": 3,
                      "capacityFactor": 8})
FORCED = [22, 20]  # '4', '2' in the tiny byte-level tokenizer


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> HFServedModel:
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("ck") / "mixtral", family="mixtral")
    served = load(path, gate=GATE, device="cpu")
    served.lm.tool_head = ToolHead(weight=torch.zeros(64), bias=10.0)  # fires everywhere
    return served


def _decoder(hf, selected):
    dec = BatchDecoder(hf)
    dec.tool_select = lambda ids: selected.append(list(ids)) or ("calculator", "40+2")
    return dec


def _collect(events, tokens, gens, fires):
    for ev in events:
        if isinstance(ev, ToolFire):
            fires.append(ev)
            continue
        tokens.setdefault(ev.key, []).append(ev.token)
        if ev.generation is not None:
            gens[ev.key] = ev.generation


def test_a_parked_sequence_resumes_with_forced_tokens_as_if_they_were_prompt(hf):
    tool_req = DecodeRequest(key="t", prompt_ids=[67, 70, 70, 223, 19, 20, 13, 21, 18, 31],
                             max_tokens=7, max_tool_calls=1)
    other = DecodeRequest(key="o", prompt_ids=[5, 6, 7], max_tokens=7)  # no tool budget
    selected: list[list[int]] = []
    dec = _decoder(hf, selected)
    tokens, gens, fires = {}, {}, []
    _collect(dec.run([tool_req, other], []), tokens, gens, fires)
    assert [f.key for f in fires] == ["t"] and fires[0].position == 9 and dec.parked == 1
    assert selected == [list(tool_req.prompt_ids)] and "t" not in tokens
    # While "t" waits for its tool, "o" goes on decoding alone (a job: its prefill + one step).
    for _ in range(2):
        _collect(dec.run([], []), tokens, gens, fires)
    assert len(tokens["o"]) == 4 and dec.group_sizes() == {GATE.version: 1}
    _collect(dec.run([], [], resume=[("t", FORCED)]), tokens, gens, fires)
    while dec.running:
        _collect(dec.run([], []), tokens, gens, fires)
    assert tokens["t"][:2] == FORCED and len(fires) == 1  # budget 1: it fired once
    ref = hf.generate([*tool_req.prompt_ids, *FORCED], max_tokens=5)
    assert tokens["t"][2:] == ref.token_ids, "forced tokens extended the cache like prompt tokens"
    assert gens["t"].token_ids == tokens["t"] and gens["t"].finish_reason == "length"
    assert gens["o"].token_ids == hf.generate(other.prompt_ids, max_tokens=7).token_ids


def test_a_failed_tool_keeps_the_held_back_token_and_the_budget_bounds_firing(hf):
    req = DecodeRequest(key=1, prompt_ids=[3, 4, 5, 6], max_tokens=6, max_tool_calls=4)
    dec = _decoder(hf, [])
    tokens, gens, fires = {}, {}, []
    _collect(dec.run([req], []), tokens, gens, fires)
    while dec.running or dec.parked:
        resume = [(f.key, None) for f in fires[len(fires) - dec.parked:]] if dec.parked else []
        _collect(dec.run([], [], resume=resume), tokens, gens, fires)
    assert len(fires) == 4  # fired at every position until the budget ran out
    assert gens[1].token_ids == hf.generate(req.prompt_ids, max_tokens=6).token_ids


def test_forced_tokens_stop_at_max_tokens(hf):
    req = DecodeRequest(key="m", prompt_ids=[3, 4, 5], max_tokens=1, max_tool_calls=1)
    dec = _decoder(hf, [])
    events = dec.run([req], [])
    assert isinstance(events[0], ToolFire)
    events = dec.run([], [], resume=[("m", FORCED)])
    assert events == [TokenEvent("m", FORCED[0], events[-1].generation)]
    assert events[0].generation.token_ids == FORCED[:1] and events[0].generation.finish_reason == "length"
    assert dec.running == 0 and dec.parked == 0


def test_a_parked_sequence_that_leaves_is_forgotten(hf):
    dec = _decoder(hf, [])
    dec.run([DecodeRequest(key="x", prompt_ids=[3, 4], max_tokens=4, max_tool_calls=1)], [])
    assert dec.parked == 1
    assert dec.run([], ["x"], resume=[("x", FORCED)]) == [] and dec.parked == 0


def test_a_parked_sequence_holds_only_its_own_cache(hf):
    # Parked from a group's step and from a packed prefill: its keys/values are its own
    # tensors, not views keeping the whole group's or prefill's cache alive while its tool runs.
    long = [DecodeRequest(key=f"o{i}", prompt_ids=list(range(3, 120)), max_tokens=20)
            for i in range(3)]
    dec = _decoder(hf, [])
    dec.run([*long, DecodeRequest(key="p", prompt_ids=[3, 4, 5], max_tokens=8, max_tool_calls=2)], [])
    # "p" fired at its prefill; back with no result, it joins the long ones and fires at the step.
    events = dec.run([DecodeRequest(key="q", prompt_ids=[6, 7], max_tokens=8, max_tool_calls=1),
                      *[DecodeRequest(key=f"r{i}", prompt_ids=list(range(9, 90)), max_tokens=4)
                        for i in range(2)]], [], resume=[("p", None)])
    assert sorted(e.key for e in events if isinstance(e, ToolFire)) == ["p", "q"]
    assert dec.parked == 2 and dec.running == 5
    for parked in dec._parked.values():
        for t in (*parked.keys, *parked.values):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), parked.seq.req.key


def test_tool_gate_reads_each_prompt_s_last_hidden_state_and_a_resume_only_its_last_logits(hf):
    """The packed prefill runs the base model and applies the LM head itself (never the
    [T, vocab] logits of every position): the tool gate still reads, per prompt, the hidden
    state the head reads at its last position (as a solo forward does); a resume feeding many
    forced tokens makes the logits of its last position only."""
    from sparsegate_workload.hf.tool_head import final_hidden

    # Probabilities about 0.9 (threshold 0.85): every prompt fires at its prefill, each at its
    # own value.
    weight = 0.05 * torch.randn(64, generator=torch.Generator().manual_seed(3))
    tool_head, hf.lm.tool_head = hf.lm.tool_head, ToolHead(weight=weight, bias=2.5)
    try:
        reqs = [DecodeRequest(key=k, prompt_ids=p, max_tokens=12, max_tool_calls=1)
                for k, p in (("a", [3, 4, 5, 6, 7]), ("b", [9, 8, 7]), ("c", [40, 41]))]
        dec = _decoder(hf, [])
        fires = {f.key: f for f in dec.run(reqs, []) if isinstance(f, ToolFire)}
        assert sorted(fires) == ["a", "b", "c"] and dec.parked == 3  # all at their prefill
        for req in reqs:
            with torch.inference_mode():
                _, hidden = final_hidden(hf.lm.model, input_ids=torch.tensor([req.prompt_ids]))
            alone = float(hf.lm.tool_head.probs(hidden[0, -1]))
            assert fires[req.key].gate_probability == pytest.approx(alone, rel=1e-5), req.key
        head_rows = []
        hook = hf.lm.model.get_output_embeddings().register_forward_hook(
            lambda _m, args, _out: head_rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0]))
        try:
            dec.run([], [], resume=[("a", [22, 20, 21, 19, 18, 17, 16, 15])])
        finally:
            hook.remove()
        assert head_rows[0] == 1  # the resume's forward: 8 forced tokens, logits of the last
    finally:
        hf.lm.tool_head = tool_head


@pytest.mark.parametrize("max_tokens", [2, 7])
def test_a_stop_string_in_forced_text_ends_the_sequence_there(hf, max_tokens):
    """The tool's text "42" holds the stop string "42": the sequence ends with it, "stop" (not
    "length" when it also reaches max_tokens), before the model samples on (it was found only at
    the next sampled token, and not at all when that one fired the tool again: a stream had sent
    the forced text by then, longer than the answer cut before the stop string)."""
    req = DecodeRequest(key="s", prompt_ids=[3, 4, 5], max_tokens=max_tokens, max_tool_calls=2,
                        sampling=Sampling(stop=("42",)))
    dec = _decoder(hf, [])
    assert isinstance(dec.run([req], [])[0], ToolFire)
    events = dec.run([], [], resume=[("s", FORCED)])
    assert [type(e) for e in events] == [TokenEvent, TokenEvent]
    gen = events[-1].generation
    assert gen is not None and gen.token_ids == FORCED
    assert (gen.finish_reason, gen.stop_reason, gen.text(hf.tokenizer)) == ("stop", "42", "")
    assert dec.running == 0 and dec.parked == 0
