"""A SparseModel whose `spec.model.source` names a Hugging Face MoE checkpoint baked into its image.

Given the dev stack (operator in-cluster from its image): a tiny random Mixtral-family checkpoint
with its tokenizer, built in code (nothing downloaded), copied into an image made FROM the stack's
model-server image with buildah; a SparseModel with that image and `source` = the checkpoint's
path. Then the operator renders `--model-path`, the pod becomes Ready, and the server answers the
OpenAI-compatible API with text and sparsegate's usage (experts per token, the gate version the
operator gave it).
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from localcluster.health import wait_for
from imagebuild.checkpoint import bake_checkpoint

CHECKPOINT_DIR = "/models/tiny-mixtral"


def checkpoint_image(base: str, ctx: Path) -> str:
    from sparsegate_workload.hf import build_tiny_checkpoint

    checkpoint = build_tiny_checkpoint(ctx / "tiny-mixtral", family="mixtral", experts=4, top_k=2)
    return bake_checkpoint(base, checkpoint, ctx=ctx / "image", target=CHECKPOINT_DIR,
                           tag="localhost/sparsegate-test-checkpoint:e2e")


def test_sparsemodel_serves_a_checkpoint_from_its_image(stack, stack_namespace: str, tmp_path: Path) -> None:
    image = checkpoint_image(stack.images["model-server"], tmp_path)
    name = "ckpt-moe"
    model = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "SparseModel", "metadata": {"name": name},
             "spec": {"replicas": 1, "image": image,
                      "model": {"dModel": 64, "experts": 4, "maxExpertsPerToken": 2, "source": CHECKPOINT_DIR}}}
    stack.kubectl("apply", "-n", stack_namespace, "-f", "-", input=json.dumps(model))

    def ready_pod() -> dict | None:
        for p in stack.pods(stack_namespace, f"sparsegate.dev/model={name}"):
            if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or []):
                return p
        return None

    pod = wait_for(ready_pod, what="the checkpoint's model server Ready", timeout_s=300, interval_s=1.0)
    args = next(c for c in pod["spec"]["containers"] if c["name"] == "server")["args"]
    assert args[args.index("--model-path") + 1] == CHECKPOINT_DIR and "--d-model" not in args
    base = f"http://{pod['status']['podIP']}:8080"
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as resp:
        assert [m["id"] for m in json.loads(resp.read())["data"]] == [name]
    req = urllib.request.Request(f"{base}/v1/completions", method="POST",
                                 data=json.dumps({"model": name, "prompt": "the gate routes", "max_tokens": 5,
                                                  "temperature": 0}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        answer = json.loads(resp.read())
    usage = answer["usage"]
    assert isinstance(answer["choices"][0]["text"], str) and 1 <= usage["completion_tokens"] <= 5
    status = json.loads(stack.kubectl("get", "sparsemodel", name, "-n", stack_namespace, "-o", "json").stdout)
    assert usage["sparsegate"]["gate_version"] == status["status"]["gateVersion"]
    # At most the model's bound (2); under 1 when the gate's capacity factor dropped assignments.
    assert 0.0 < usage["sparsegate"]["mean_experts_per_token"] <= 2.0
    stack.kubectl("delete", "sparsemodel", name, "-n", stack_namespace, "--wait=false")
