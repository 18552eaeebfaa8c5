"""Hugging Face MoE checkpoints (built here, tiny, random) loaded with the dynamic gate.

The proof the patch is right: with the gate set to the family's own top-k (min = max = k, no
capacity cap) the logits equal the unpatched transformers model's. Then the dynamic knobs, hot
swap, capacity drops, and every malformed-checkpoint case naming its file.
"""

import json
import os
import shutil

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from sparsegate_contracts.gate import GateParams, GateParamsError, make_document  # noqa: E402
from sparsegate_workload.batch_decode import BatchDecoder, DecodeRequest  # noqa: E402
from sparsegate_workload.hf import (  # noqa: E402
    CheckpointError, SparseGatedMoEBlock, build_tiny_checkpoint, load_moe_checkpoint)
from sparsegate_workload.hf_serving import HFServedModel  # noqa: E402

import transformers  # a dependency: missing, this module fails to import (never skips)

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {f: build_tiny_checkpoint(tmp_path_factory.mktemp(f), family=f, seed=1)
            for f in FAMILIES}


def _tokens(batch=2, seq=12, seed=0):
    return torch.randint(0, 384, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _upstream_logits(path, ids):
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    with torch.no_grad():
        return ref(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_family_topk_gate_reproduces_upstream_logits(checkpoints, family):
    lm = load_moe_checkpoint(checkpoints[family])  # default gate: the family's own top-k
    assert sum(isinstance(m, SparseGatedMoEBlock) for m in lm.model.modules()) == 2
    ids = _tokens()
    out = lm.forward(ids)
    ref = _upstream_logits(checkpoints[family], ids)
    assert out.logits.shape == ref.shape
    torch.testing.assert_close(out.logits, ref, rtol=1e-5, atol=1e-5)
    assert out.mean_active_experts == pytest.approx(lm.top_k) and out.dropped == 0
    # Not vacuous: one expert per token must change the logits.
    lm.set_gate(GateParams(min_experts_per_token=1, max_experts_per_token=1), dropless=True)
    assert (lm.forward(ids).logits - ref).abs().max() > 1e-3


def test_explicit_gate_document_with_min_max_k_matches_upstream(checkpoints):
    path = checkpoints["qwen3_moe"]  # renormalises (norm_topk_prob) on top of top-k
    doc = make_document({"minExpertsPerToken": 2, "maxExpertsPerToken": 2,
                         "confidenceThreshold": 0.3, "capacityFactor": 8,  # cf = E: never caps
                         "precisionPolicy": "fp32"})
    lm = load_moe_checkpoint(path, gate=doc)
    ids = _tokens(seed=3)
    out = lm.forward(ids)
    torch.testing.assert_close(out.logits, _upstream_logits(path, ids), rtol=1e-5, atol=1e-5)
    assert out.gate.version == doc.version and out.dropped == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_config_output_router_logits_serves_and_gives_upstream_router_logits_and_aux_loss(
        checkpoints, family, tmp_path):
    """A checkpoint saved with ``output_router_logits: true`` (as training with the aux loss
    saves it) asked every forward for router logits and the load-balancing loss: the patched
    blocks left the tuple empty, so every forward, the server's included, raised IndexError
    (and upstream's loss cannot take a batched decode step's cache-wide mask). Served, it is
    not asked for; asked per call, the patched blocks give upstream's logits and loss."""
    path = tmp_path / family
    shutil.copytree(checkpoints[family], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "output_router_logits": True}))
    lm = load_moe_checkpoint(path)
    ids = _tokens(batch=2, seq=10, seed=6)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    out = lm.forward(ids, attention_mask=mask)  # the server's paths
    hf = HFServedModel(lm, name=family)
    hf.generate([1, 5, 6], max_tokens=2)
    prompts = [[1, *range(3, 3 + n)] for n in (2, 5, 9)]  # left-padded in one decode group
    dec = BatchDecoder(hf)
    pending = [DecodeRequest(key=i, prompt_ids=p, max_tokens=3) for i, p in enumerate(prompts)]
    while pending or dec.running:
        dec.run(pending, [])
        pending = []
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    with torch.no_grad():
        ref = ref_model.eval()(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
        with lm.pinned_gate():
            got = lm.model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False,
                           output_router_logits=True)
    keep = mask.bool()
    torch.testing.assert_close(out.logits[keep], ref.logits[keep], rtol=1e-5, atol=1e-5)
    assert len(got.router_logits) == len(ref.router_logits) == len(lm.blocks)
    for mine, theirs in zip(got.router_logits, ref.router_logits):
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.aux_loss, ref.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_threshold_and_max_experts_steer_experts_per_token(checkpoints, family):
    lm = load_moe_checkpoint(checkpoints[family])
    ids = _tokens(batch=4, seq=16)
    means = {}
    for threshold in (0.3, 0.6, 0.95):
        lm.set_gate(GateParams(confidence_threshold=threshold, min_experts_per_token=1,
                               max_experts_per_token=8), dropless=True)
        means[threshold] = lm.forward(ids).mean_active_experts
    assert 1.0 <= means[0.3] < means[0.6] < means[0.95] <= 8.0
    lm.set_gate(GateParams(confidence_threshold=0.95, max_experts_per_token=1), dropless=True)
    out = lm.forward(ids)
    assert out.mean_active_experts == 1.0
    assert all(sum(st.counts) == ids.numel() for st in out.layers)


def test_hot_swap_takes_effect_on_next_forward_and_never_mid_call(checkpoints):
    lm = load_moe_checkpoint(checkpoints["olmoe"])
    ids = _tokens()
    wide = make_document({"minExpertsPerToken": 3, "maxExpertsPerToken": 3})
    narrow = make_document({"minExpertsPerToken": 1, "maxExpertsPerToken": 1})
    lm.set_gate(wide)  # default capacityFactor 1.25 may cap: count choices before the cap
    assert lm.forward(ids).mean_selected_experts == 3.0
    with torch.inference_mode(), lm.pinned_gate() as call:
        lm.model(input_ids=ids, use_cache=False)
        lm.set_gate(narrow)  # arrives while a call is in flight
        lm.model(input_ids=ids, use_cache=False)
    assert call.gate.version == wide.version and len(call.layers) == 4
    assert all(st.mean_selected == 3.0 for st in call.layers)
    out = lm.forward(ids)
    assert out.gate.version == narrow.version and out.mean_selected_experts == 1.0


def test_capacity_cap_drops_are_reported(checkpoints):
    lm = load_moe_checkpoint(checkpoints["mixtral"],
                             gate=GateParams(min_experts_per_token=2, max_experts_per_token=2,
                                             capacity_factor=0.5))
    out = lm.forward(_tokens(batch=4, seq=16))
    assert out.dropped > 0
    assert out.mean_active_experts < out.mean_selected_experts == 2.0
    for st in out.layers:
        assert st.dropped == 2 * st.num_tokens - sum(st.counts)
        assert max(st.counts) <= -(-0.5 * 2 * st.num_tokens // 8)  # ceil(cf * A / E)


def test_gate_asking_for_more_experts_than_exist_is_refused(checkpoints):
    lm = load_moe_checkpoint(checkpoints["mixtral"])
    with pytest.raises(GateParamsError, match="maxExpertsPerToken"):
        lm.set_gate(GateParams(max_experts_per_token=9))
    with pytest.raises(GateParamsError, match="must not exceed"):
        lm.set_gate(GateParams(min_experts_per_token=3, max_experts_per_token=2))
    assert lm.gate.params == lm.upstream_gate_params()  # a refused gate leaves the old one


def test_precision_auto_after_calibration_and_forced_int8(checkpoints):
    lm = load_moe_checkpoint(checkpoints["qwen2_moe"], calibrate=True)
    assert len(lm.gate_sensitivity) == 2 and all(s >= 0 for s in lm.gate_sensitivity)
    lm.set_gate(GateParams(precision_policy="auto"))
    assert lm.gate.precisions == tuple("bf16" if s > 1e-3 else "int8"
                                       for s in lm.gate_sensitivity)
    lm.set_gate(GateParams(precision_policy="int8"))
    out = lm.forward(_tokens())
    assert out.gate.precisions == ("int8", "int8") and torch.isfinite(out.logits).all()


def test_tokenizer_saved_with_checkpoint_round_trips(checkpoints):
    lm = load_moe_checkpoint(checkpoints["mixtral"])
    ids = lm.tokenizer("sparse experts, hello world")["input_ids"]
    assert lm.tokenizer.decode(ids) == "sparse experts, hello world"
    assert max(ids) < lm.model.config.vocab_size
    out = lm.forward(torch.tensor([ids]))
    assert out.logits.shape == (1, len(ids), lm.model.config.vocab_size)


def test_bf16_load_routes_and_runs(checkpoints):
    lm = load_moe_checkpoint(checkpoints["mixtral"], dtype=torch.bfloat16)
    out = lm.forward(_tokens())
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits.float()).all()
    assert out.mean_active_experts == 2.0


# --- malformed checkpoints: one exception type, message names the file or field -------------

def test_missing_shard_names_the_file(tmp_path):
    path = build_tiny_checkpoint(tmp_path / "ck", family="mixtral", max_shard_size="200KB",
                                 tokenizer=False)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (path / shard).unlink()
    with pytest.raises(CheckpointError, match=f"{shard}: missing shard") as err:
        load_moe_checkpoint(path)
    assert err.value.file == path / shard


def test_single_file_saved_over_a_sharded_checkpoint_loads_as_transformers_loads_it(tmp_path):
    """save_pretrained into a directory that held a sharded save removes the old shards but
    leaves the old model.safetensors.index.json beside the new model.safetensors; transformers
    loads model.safetensors. The checks must look at that file too (they used to follow the
    stale index and refuse the checkpoint: "missing shard")."""
    path = build_tiny_checkpoint(tmp_path / "ck", family="mixtral", max_shard_size="200KB",
                                 tokenizer=False)
    build_tiny_checkpoint(path, family="mixtral", seed=7, tokenizer=False)  # unsharded, over it
    assert (path / "model.safetensors").is_file()
    assert (path / "model.safetensors.index.json").is_file()  # the sharded save's, left behind
    lm = load_moe_checkpoint(path)
    ids = _tokens(seed=8)
    torch.testing.assert_close(lm.forward(ids).logits, _upstream_logits(path, ids),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_index_naming_a_shard_outside_the_directory_is_refused_naming_the_index(tmp_path, where):
    """model.safetensors.index.json is input: a shard name that leaves the checkpoint directory
    (``..`` or an absolute path) is refused before anything reads that file, naming the index
    (it used to be opened and parsed, and only transformers refused it later, naming no file)."""
    path = build_tiny_checkpoint(tmp_path / "ck", family="mixtral", max_shard_size="200KB",
                                 tokenizer=False)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (path / shard).rename(outside / shard)  # a valid shard, just not in the checkpoint
    name = f"../elsewhere/{shard}" if where == "relative" else str(outside / shard)
    index["weight_map"] = {k: name if v == shard else v for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: tensor .* maps to "
                                              ".*not a file name inside") as err:
        load_moe_checkpoint(path)
    assert err.value.file == index_path


def test_unreadable_tokenizer_config_is_a_checkpoint_error(tmp_path):
    """Any tokenizer file transformers cannot read (here tokenizer_config.json holding a list,
    which raised AttributeError) fails as a CheckpointError naming the directory and files."""
    path = build_tiny_checkpoint(tmp_path / "ck", family="olmoe")
    (path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="tokenizer files present but unreadable "
                                              r"\(tokenizer.json, tokenizer_config.json: ") as err:
        load_moe_checkpoint(path)
    assert err.value.file == path


def test_truncated_shard_names_the_file(tmp_path):
    path = build_tiny_checkpoint(tmp_path / "ck", family="olmoe", tokenizer=False)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="model.safetensors: truncated") as err:
        load_moe_checkpoint(path)
    assert err.value.file == weights


def test_stored_dtype_not_accepted_names_the_file(tmp_path):
    path = build_tiny_checkpoint(tmp_path / "ck", family="qwen3_moe", dtype=torch.float64,
                                 tokenizer=False)
    with pytest.raises(CheckpointError, match="model.safetensors: tensor .* stored as F64"):
        load_moe_checkpoint(path)


def test_requested_dtype_not_accepted(checkpoints):
    with pytest.raises(CheckpointError, match="dtype torch.int8 is not accepted"):
        load_moe_checkpoint(checkpoints["mixtral"], dtype=torch.int8)


def test_non_moe_family_names_config_field(tmp_path):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError,
                       match=r"config.json: model_type 'llama' is not a supported MoE family"):
        load_moe_checkpoint(tmp_path)


def test_missing_config_names_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: missing") as err:
        load_moe_checkpoint(tmp_path)
    assert err.value.file == tmp_path / "config.json"


def test_weights_file_without_a_tensor_is_refused(tmp_path):
    """A shard that parses but lacks a weight the model needs must not load random weights."""
    from safetensors.torch import load_file, save_file
    path = build_tiny_checkpoint(tmp_path / "ck", family="mixtral", tokenizer=False)
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    dropped = next(k for k in tensors if k.endswith("gate.weight"))
    del tensors[dropped]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model.safetensors\): lacks 1 weights"):
        load_moe_checkpoint(path)


@pytest.mark.parametrize("key, value, dtype, match", [
    ("block_sparse_moe.gate.weight", float("nan"), torch.float32,
     r"model.safetensors: tensor \S+block_sparse_moe.gate.weight holds 1 .*\(1 NaN, 0 infinite\)"),
    ("experts.1.w2.weight", float("inf"), torch.float32,
     r"model.safetensors: tensor \S+experts.1.w2.weight holds 1 .*\(0 NaN, 1 infinite\)"),
    # finite in the file, past float16's 65504 once loaded in it
    ("self_attn.o_proj.weight", 1e5, torch.float16,
     r"\(model.safetensors\): weight \S+o_proj.weight holds 1 values past the range of torch.float16"),
])
def test_non_finite_weight_is_refused_naming_it(tmp_path, key, value, dtype, match):
    """A NaN router weight served NaN logits for every token (and int8 storage spreads one NaN
    over its channel): the load refuses, naming the tensor and the shard."""
    from safetensors.torch import load_file, save_file
    path = build_tiny_checkpoint(tmp_path / "ck", family="mixtral", tokenizer=False)
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    name = next(k for k in tensors if k.startswith("model.layers.0.") and k.endswith(key))
    tensors[name].view(-1)[3] = value
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=match) as err:
        load_moe_checkpoint(path, dtype=dtype)
    assert err.value.file == weights


def _rewrite_header(weights, edit):
    """Apply ``edit`` to a safetensors file's parsed header, keeping its length (so only what
    ``edit`` changed is wrong)."""
    import struct
    raw = weights.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    weights.write_bytes(raw[:8] + new.ljust(n) + raw[8 + n:])


def test_shard_whose_header_offsets_do_not_tile_its_data_names_the_file(tmp_path):
    """A header that parses but whose byte ranges are wrong: safetensors refuses it naming no
    file (SafetensorError: "invalid shape, data type, or offset for tensor")."""
    path = build_tiny_checkpoint(tmp_path / "ck", family="mixtral", tokenizer=False)
    weights = path / "model.safetensors"
    first = lambda h: sorted((v["data_offsets"], k) for k, v in h.items() if k != "__metadata__")[0][1]
    _rewrite_header(weights, lambda h: h[first(h)].update(data_offsets=[0, 4]))
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt safetensors header") as err:
        load_moe_checkpoint(path)
    assert err.value.file == weights


def test_shard_with_bytes_past_its_tensors_names_the_file(tmp_path):
    path = build_tiny_checkpoint(tmp_path / "ck", family="olmoe", tokenizer=False)
    weights = path / "model.safetensors"
    with weights.open("ab") as fh:
        fh.write(b"\0" * 100)
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt") as err:
        load_moe_checkpoint(path)
    assert err.value.file == weights


@pytest.mark.parametrize("field, value, match", [
    # transformers' own field validation (huggingface_hub StrictDataclassFieldValidationError)
    ("hidden_size", "sixty-four", r"config.json: transformers rejects it .*'hidden_size'"),
    # a value the model cannot be built with (ZeroDivisionError in the attention layer)
    ("num_attention_heads", 0, r"transformers could not build the model from config.json"),
])
def test_config_value_transformers_cannot_use_is_a_checkpoint_error(tmp_path, field, value, match):
    path = build_tiny_checkpoint(tmp_path / "ck", family="mixtral", tokenizer=False)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(CheckpointError, match=match):
        load_moe_checkpoint(path)


def test_weight_of_the_wrong_shape_is_named(tmp_path):
    """config.json and the weights disagree (vocab_size): the error names the weight and shard."""
    path = build_tiny_checkpoint(tmp_path / "ck", family="mixtral", tokenizer=False)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": 500}))
    with pytest.raises(CheckpointError,
                       match=r"\(model.safetensors\): has 2 weights of the wrong shape .*lm_head.weight"):
        load_moe_checkpoint(path)


def test_patched_model_saves_a_checkpoint_upstream_transformers_reads(checkpoints, tmp_path):
    """Same parameter names and shapes after patching: save_pretrained round-trips."""
    lm = load_moe_checkpoint(checkpoints["qwen2_moe"])
    lm.model.save_pretrained(tmp_path)
    ids = _tokens(seed=5)
    torch.testing.assert_close(_upstream_logits(tmp_path, ids), lm.forward(ids).logits,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k_range", [(1, 3), (2, 2)])
@pytest.mark.parametrize("scoped", [False, True])
def test_a_block_reads_the_host_once_per_forward(checkpoints, scoped, k_range):
    """The design's one host read per MoE layer (the per-expert counts): on CUDA every
    tolist()/float()/int()/bool() of a tensor waits for the device. Recording the block's
    stats read the gate entropy with float() right after the dispatch, a second sync per
    layer; it is now converted when read, after the forward. An expert group's capacity share
    (the experts its mask allows) is the same for every block: read once per forward, not per
    block. A fixed k (2, 2) under an expert group reads whether every pick is allowed in the
    same sync as the counts (a bool() of its own was a second sync per block)."""
    from sparsegate_workload.hf.gated_block import pin_gate
    import sys

    from torch.overrides import TorchFunctionMode

    reads = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__float__,
             torch.Tensor.__int__, torch.Tensor.__bool__}
    seen: list[str] = []

    class CountReads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            caller = sys._getframe(1).f_code.co_filename
            if func in reads and "sparsegate_workload" in caller:  # not transformers' own
                seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    gate = make_document({"confidenceThreshold": 0.6, "minExpertsPerToken": k_range[0],
                          "maxExpertsPerToken": k_range[1],
                          # fixed k: a cap that binds routes through assign (its own counts)
                          "capacityFactor": 2.0 if k_range[0] < k_range[1] else 8.0})
    lm = load_moe_checkpoint(checkpoints["mixtral"], gate=gate)
    ids = _tokens()
    allowed = None
    if scoped:
        allowed = torch.zeros(lm.num_experts, dtype=torch.bool)
        allowed[[0, 2, 5]] = True
    with torch.inference_mode(), pin_gate(lm.gate, allowed=allowed) as call, CountReads():
        lm.model(input_ids=ids, use_cache=False)
    assert len(call.layers) == len(lm.blocks) == 2
    assert len(seen) == len(lm.blocks) + scoped, seen
    if scoped:
        assert call.available_experts(lm.num_experts) == 3
        assert all(set(i for i, c in enumerate(st.counts) if c) <= {0, 2, 5} for st in call.layers)
    assert all(0.0 < st.entropy < 3.0 for st in call.layers)  # still a float when read
    assert isinstance(call.layers[0].entropy, float)
