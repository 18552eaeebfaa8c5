"""``precisionPolicy: auto`` on a served checkpoint (tiny Mixtral, built here): the offline step
(`python -m sparsegate_workload.calibrate`) measures each MoE layer's router and expert gradient
variance and writes them beside the weights; the server loading the checkpoint under auto then
stores each layer as the rule picks (checked on the stored tensors), reports it with its source
on /v1/model, refuses a file that does not match the checkpoint (naming the file), and without a
file keeps fp32 as before."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import aiohttp  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from aiohttp.test_utils import TestClient, TestServer  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from sparsegate_workload.calibrate import main as calibrate_main  # noqa: E402
from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document  # noqa: E402
from sparsegate_workload.hf import CheckpointError, build_tiny_checkpoint, load_moe_checkpoint  # noqa: E402
from sparsegate_workload.hf.precision_file import PRECISION_FILE  # noqa: E402
from sparsegate_workload.quality import PROBE_FILE  # noqa: E402
from sparsegate_workload.server import STATE, create_app, wait_ready  # noqa: E402

AUTO = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 2, "maxExpertsPerToken": 2,
                      "confidenceThreshold": 1.0, "precisionPolicy": "auto"})
assert DEFAULT_PARAMS["precisionPolicy"] == "auto"  # the CRD default this is about
PROBE_LINES = ["The router scores every expert and keeps the most probable ones.",
               "Layers whose gradients barely move are stored in eight-bit integers.",
               "A canary gate serves a few requests before the whole fleet switches."]
DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("ck") / "tiny-mixtral", family="mixtral",
                                 seed=1)
    (path / PROBE_FILE).write_text("".join(line + "\n" for line in PROBE_LINES), encoding="utf-8")
    return path


@pytest.fixture
def checkpoint(pristine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / pristine.name))


def _calibrate(path: Path, *extra: str) -> dict:
    assert calibrate_main([str(path), *extra]) == 0
    return json.loads((path / PRECISION_FILE).read_text())


def _stored(lm) -> list[tuple[str, str]]:
    """Per block: (router, experts) precision read off the stored tensors' dtypes, with the
    bytes they really hold checked against what weight_bytes() says."""
    out = []
    for blk, reported in zip(lm.blocks, lm.weight_bytes(), strict=True):
        names = []
        for weights, reported_bytes in (((blk.gate.storage,), reported.gate_bytes),
                                        (blk.expert_storage, reported.expert_bytes)):
            dtypes = {w.data.dtype for w in weights}
            assert len(dtypes) == 1
            name = {v: k for k, v in DTYPE.items()}[dtypes.pop()]
            assert all((w.scale is not None) == (name == "int8") for w in weights)
            held = sum(w.data.untyped_storage().nbytes()
                       + (w.scale.untyped_storage().nbytes() if w.scale is not None else 0)
                       for w in weights)
            assert held == reported_bytes
            names.append(name)
        out.append(tuple(names))
    return out


async def _serve(path: Path):
    app = create_app(gate_doc=AUTO, model_path=str(path))
    client = TestClient(TestServer(app, host="127.0.0.1"), connector=aiohttp.TCPConnector(limit=0))
    await client.start_server()
    await wait_ready(app)
    return client


def test_calibrate_writes_the_measured_variances_beside_the_weights(checkpoint: Path) -> None:
    record = _calibrate(checkpoint)
    probe = checkpoint / PROBE_FILE
    assert record["calibration"]["data"].startswith(f"{probe} through its tokenizer")
    assert record["moeLayers"] == 2 and record["experts"] == 8
    # The same measurement as calibrating in process on the same text (the variances are what
    # calibrate_gate_precision measures, not made up by the writer).
    lm = load_moe_checkpoint(checkpoint, precision_file=False)
    lm.calibrate_gate_precision(text=probe.read_text(), text_source=str(probe))
    assert record["routerVariance"] == pytest.approx(lm.gate_sensitivity, rel=1e-5)
    assert record["expertVariance"] == pytest.approx(lm.expert_sensitivity, rel=1e-5)
    assert all(0 < v < 1e-3 for v in record["routerVariance"] + record["expertVariance"])
    # --text-file takes another text; loading under auto stores what the rule picks for it:
    # this random checkpoint's gradients barely move, so int8 everywhere (< 0.3x fp32 bytes).
    other = checkpoint.parent / "calibration.txt"
    other.write_text("Numbers and names: 42 requests in 3.5 seconds, version g-1a2b.\n" * 4)
    assert _calibrate(checkpoint, "--text-file", str(other))["calibration"]["data"].startswith(
        f"{other} through its tokenizer")
    lm = load_moe_checkpoint(checkpoint, gate=AUTO, dropless=True)
    assert (lm.sensitivity_source, lm.precision_file) == ("file", checkpoint / PRECISION_FILE)
    assert _stored(lm) == [("int8", "int8")] * 2
    sizes = lm.weight_bytes()
    assert sum(b.gate_bytes + b.expert_bytes for b in sizes) <= 0.3 * sum(
        b.gate_fp32_bytes + b.expert_fp32_bytes for b in sizes)


async def test_server_under_auto_stores_each_layer_as_the_file_measured(checkpoint: Path) -> None:
    record = _calibrate(checkpoint)
    # Values both sides of the 1e-3 threshold (the tiny model's own are all below), written
    # into the file calibrate made, so each layer and weight group gets its own answer.
    record["routerVariance"], record["expertVariance"] = [2e-3, 5e-4], [5e-4, 3e-3]
    (checkpoint / PRECISION_FILE).write_text(json.dumps(record))
    client = await _serve(checkpoint)
    try:
        lm = client.server.app[STATE].hf.lm
        assert _stored(lm) == [("bf16", "int8"), ("int8", "bf16")]
        # the fp32 router/expert parameters are gone: nothing is held twice
        assert not [n for n, _ in lm.model.named_parameters()
                    if n.endswith(("gate.weight", "gate_up_proj", "down_proj"))]
        info = await (await client.get("/v1/model")).json()
        precision = info["precision"]
        assert (precision["policy"], precision["source"]) == ("auto", "file")
        assert precision["file"] == str(checkpoint / PRECISION_FILE)
        assert precision["calibrationData"] == record["calibration"]["data"]
        assert [(x["gatePrecision"], x["expertPrecision"]) for x in precision["layers"]] == [
            ("bf16", "int8"), ("int8", "bf16")]
        assert [x["routerVariance"] for x in precision["layers"]] == [2e-3, 5e-4]
        assert [b.to_json() for b in lm.weight_bytes()] == [
            {k: v for k, v in x.items() if not k.endswith("Variance")} for x in precision["layers"]]
        assert precision["bytes"] < 0.5 * precision["fp32Bytes"]
        resp = await client.post("/v1/infer", json={"tokens": [[5, 17, 99, 3]]})
        assert resp.status == 200
        assert (await resp.json())["precisions"] == ["bf16", "int8"]
    finally:
        await client.close()


@pytest.mark.parametrize("change", ["config", "weights", "layers"])
def test_a_precision_file_that_does_not_match_is_refused_naming_it(checkpoint: Path,
                                                                   change: str) -> None:
    record = _calibrate(checkpoint)
    path = checkpoint / PRECISION_FILE
    if change == "config":  # another model written over it: config.json differs
        build_tiny_checkpoint(checkpoint, family="mixtral", seed=1, layers=3)
        why = "config.json changed since it was measured"
    elif change == "weights":  # same config.json, the shard re-saved in bf16
        shard = checkpoint / "model.safetensors"
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(shard).items()}, shard,
                  metadata={"format": "pt"})
        why = "weight file model.safetensors changed since it was measured"
    else:  # a file claiming another layer count for these very files
        record["moeLayers"], record["routerVariance"], record["expertVariance"] = 3, [0.0] * 3, [0.0] * 3
        path.write_text(json.dumps(record))
        why = "it measured 3 MoE layers of 8 experts, the model has 2 of 8"
    with pytest.raises(CheckpointError) as info:
        load_moe_checkpoint(checkpoint, gate=AUTO)
    assert info.value.file == path
    assert str(info.value).startswith(f"{path}: does not match this checkpoint ({why}")
    assert "python -m sparsegate_workload.calibrate" in str(info.value)
    # Calibrating again replaces it; then it loads.
    _calibrate(checkpoint)
    assert load_moe_checkpoint(checkpoint, gate=AUTO).sensitivity_source == "file"


async def test_the_server_refuses_a_stale_precision_file_on_healthz(checkpoint: Path) -> None:
    _calibrate(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["sparsegate_note"] = "edited after calibration"  # a field transformers keeps
    (checkpoint / "config.json").write_text(json.dumps(config))
    client = await _serve(checkpoint)
    try:
        health = await client.get("/healthz")
        assert health.status == 500
        error = (await health.json())["error"]
        assert f"{checkpoint / PRECISION_FILE}: does not match this checkpoint" in error
        assert (await client.get("/readyz")).status == 503
    finally:
        await client.close()


async def test_without_a_precision_file_auto_keeps_fp32_and_says_unmeasured(checkpoint: Path) -> None:
    client = await _serve(checkpoint)
    try:
        lm = client.server.app[STATE].hf.lm
        assert _stored(lm) == [("fp32", "fp32")] * 2
        precision = (await (await client.get("/v1/model")).json())["precision"]
        assert (precision["policy"], precision["source"], precision["file"]) == (
            "auto", "unmeasured", None)
        assert precision["bytes"] == precision["fp32Bytes"]
        assert all(x["routerVariance"] is None and x["gatePrecision"] == "fp32"
                   for x in precision["layers"])
    finally:
        await client.close()


@pytest.mark.parametrize("loss_scale", [1e21, 1e40])
def test_calibrate_with_huge_or_infinite_gradients_writes_the_file(
        checkpoint: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        loss_scale: float) -> None:
    """Gradients ~1e19 (a loss scaled by 1e21) overflowed the fp32 variance accumulator to inf,
    and writing the file failed ("Out of range float values are not JSON compliant", exit 1).
    Now the variance is accumulated in float64: finite, so the layer is bf16 under auto. Inf
    gradients (1e40 overflows the fp32 loss) give a failed measurement: null in the file and the
    summary (strict JSON), named on stderr, and auto keeps those layers fp32."""
    import types

    import torch.nn.functional as F

    import sparsegate_workload.hf.loader as loader

    scaled = types.SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("__")})
    scaled.cross_entropy = lambda *a, **kw: F.cross_entropy(*a, **kw) * loss_scale
    monkeypatch.setattr(loader, "F", scaled)
    record = _calibrate(checkpoint)
    out, err = capsys.readouterr()
    summary = json.loads(out, parse_constant=lambda c: pytest.fail(f"summary is not JSON: {c}"))
    variances = record["routerVariance"] + record["expertVariance"]
    if loss_scale == 1e21:
        assert all(1e30 < v < 1e40 for v in variances), variances
        assert [(x["autoRouter"], x["autoExperts"]) for x in summary["layers"]] == [
            ("bf16", "bf16")] * 2
        assert "not finite" not in err
    else:
        assert variances == [None] * 4
        assert [(x["routerVariance"], x["autoRouter"]) for x in summary["layers"]] == [
            (None, "fp32")] * 2
        assert "layer 0: router and expert gradient variance is not finite" in err
        lm = load_moe_checkpoint(checkpoint, gate=AUTO, dropless=True)
        assert lm.gate.precisions == lm.gate.expert_precisions == ("fp32", "fp32")


def test_calibrate_exits_1_naming_a_checkpoint_that_does_not_load(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert calibrate_main([str(tmp_path / "missing")]) == 1
    assert "not a checkpoint directory" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("device, reason", [
    ("bogus", "--device must be cpu, cuda or cuda:N, got 'bogus'"),
    ("meta", "--device must be cpu, cuda or cuda:N, got 'meta'"),
    ("cuda:99", "cuda"),  # no GPU, or not that many: refused either way
])
def test_calibrate_refuses_an_unusable_device_as_a_bad_flag(
        checkpoint: Path, capsys: pytest.CaptureFixture[str], device: str, reason: str) -> None:
    """A --device this host cannot use exits 2 with the reason (as the server's --device does),
    before loading anything; it used to raise torch's RuntimeError traceback mid-load."""
    with pytest.raises(SystemExit) as exc:
        calibrate_main([str(checkpoint), "--device", device])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert reason in err and "Traceback" not in err
    assert not (checkpoint / PRECISION_FILE).exists()


def test_calibrate_refuses_bfloat16_on_a_gpu_without_it_as_a_bad_flag(
        checkpoint: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """--dtype bfloat16 on a GPU where torch cannot run bf16 exits 2 naming the flag and the
    GPU, before loading (torch.cuda faked: no GPU is touched)."""
    for name, fake in (("is_available", lambda: True), ("device_count", lambda: 1),
                       ("current_device", lambda: 0),
                       ("get_device_capability", lambda device=None: (6, 0)),
                       ("get_device_name", lambda device=None: "Tesla P100"),
                       ("is_bf16_supported", lambda including_emulation=True: False)):
        monkeypatch.setattr(torch.cuda, name, fake)
    import sparsegate_workload.calibrate as calibrate_module

    monkeypatch.setattr(calibrate_module, "calibrate",
                        lambda *a, **kw: pytest.fail("calibrate() ran"))
    with pytest.raises(SystemExit) as exc:
        calibrate_main([str(checkpoint), "--device", "cuda", "--dtype", "bfloat16"])
    assert exc.value.code == 2
    assert ("--dtype bfloat16: Tesla P100 (compute capability 6.0) does not support bfloat16"
            in capsys.readouterr().err)


def test_sparsegate_train_over_a_calibrated_checkpoint_removes_its_precision_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sparsegate_workload.hf.checkpoint_files import check_weight_files
    from sparsegate_workload.hf.precision_file import read_precision_file
    from sparsegate_workload.training.cli import main as train_main

    out = tmp_path / "trained"
    tiny = ["--output", str(out), "--steps", "2", "--hidden-size", "32", "--layers", "1",
            "--heads", "2", "--experts", "4", "--expert-ffn", "32", "--max-positions", "64",
            "--seq-len", "32", "--batch-size", "4", "--corpus-lines", "100",
            "--heldout-lines", "20", "--quiet"]
    assert train_main(tiny) == 0
    measured = _calibrate(out)
    assert train_main([*tiny, "--seed", "5"]) == 0  # other weights, same names/shapes/sizes
    assert not (out / PRECISION_FILE).exists()
    # Why it must go: the old file still matches what the check reads (values are not hashed).
    (out / PRECISION_FILE).write_text(json.dumps(measured))
    assert read_precision_file(out, check_weight_files(out)) is not None
    capsys.readouterr()
