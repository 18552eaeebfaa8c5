"""GPU placement in the rendered model server: a checkpoint with spec.resources.gpus > 0 gets
``--device cuda`` beside its nvidia.com/gpu limit; without GPUs, or for the built-in model
(CPU only), no --device flag (the server's default, auto)."""

from pathlib import Path

import pytest
import yaml

from sparsegate.domain import render
from sparsegate_workload import gateparams
from sparsegate_workload.server import build_parser

ROOT = Path(__file__).resolve().parents[3]
DOC = gateparams.make_document(gateparams.DEFAULT_PARAMS)


def _model(*, gpus: int, source: str | None):
    body = yaml.safe_load((ROOT / "examples" / "sparsemodel.yaml").read_text())
    body["metadata"].update(namespace="ml", uid="0b7c1f6e-1111-2222-3333-444455556666")
    body["spec"]["resources"] = {"gpus": gpus}
    if source is not None:
        body["spec"]["model"]["source"] = source
    return body


def _container(m):
    return render.render_deployment(m, DOC)["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("gpus", [1, 4])
def test_a_checkpoint_on_gpus_runs_on_cuda_with_the_gpu_limit(gpus):
    c = _container(_model(gpus=gpus, source="/models/mixtral"))
    args = c["args"]
    assert args[args.index("--device") + 1] == "cuda"
    assert c["resources"] == {"limits": {"nvidia.com/gpu": str(gpus)},
                              "requests": {"nvidia.com/gpu": str(gpus)}}
    # The rendered flags are the server's own: its parser accepts them as rendered.
    parsed = build_parser().parse_args([a for a in args if not a.startswith("--host=")])
    assert parsed.device == "cuda" and parsed.model_path == "/models/mixtral"


def test_a_checkpoint_without_gpus_renders_no_device():
    c = _container(_model(gpus=0, source="/models/mixtral"))
    assert "--device" not in c["args"] and "resources" not in c


def test_the_builtin_model_never_renders_cuda():
    # The built-in model runs on the CPU only; the server refuses --device cuda for it.
    c = _container(_model(gpus=2, source="builtin:tiny"))
    assert "--device" not in c["args"]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "2"}
