"""The demo: a local control plane with sparsegate installed, a model served, and a gate rollout.

``python dev/demo.py up`` (what ``./dev/demo.sh`` runs after set-up):

1. brings up the dev stack (``devstack.Stack``): the project's images, a local control plane whose
   pods run their containers with podman (the pod runner in container mode), and the chart
   installed with helm pointing at those images — so the operator runs in-cluster from its image
   with the chart's ServiceAccount, next to its OPA sidecar; a running stack is reused;
2. applies ``examples/`` (incl. a RoutingPolicy, decided by the chart's OPA), scales the GPU model to 6 pods
   (every one holds both versions during a step: strategy requests, the default), waits until
   its model-server containers are Ready;
3. starts a bounded loopback load generator against the model pods, changes the GateConfig's
   parameters and prints the rollout (``kubectl get gateconfig -o wide``) as it goes
   5% → 20% → 100% until it ends; then a fault-injected version that is rolled back;
4. a trained model: the demo checkpoint (``dev/trained_model.py``, trained once per machine) baked
   into an image FROM the model-server image (``imagebuild.trained``), served by a second
   SparseModel with its own GateConfig (objects made here, not in ``examples/``); under load, a
   benign ``confidenceThreshold`` change is promoted and a harmful one (``confidenceThreshold``
   0.05 with ``maxExpertsPerToken`` 1) is rolled back by the ``qualityDrop`` check.

``python dev/demo.py down`` stops everything the demo started (pid files under the state dir; the
pod runner removes the containers). Processes outlive this script on purpose, so the cluster can
be explored afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from devstack import RELEASE_NS, Stack
from localcluster import processes
from localcluster.cluster import default_state_dir
from localcluster.health import wait_for

from sparsegate_contracts import flowpolicy
from sparsegate_contracts.names import PROMOTE_ANNOTATION

REPO = Path(__file__).resolve().parent.parent
MODEL, GATE, NS = "moe-small", "default-gate", "default"
DEMO_REPLICAS = 6  # each step: 5 / 20 / 100 % of requests on the new version, on all 6 pods
# A 2 s rollout tick (the chart's operator.extraEnv) so the demo ends in minutes.
DEMO_OPERATOR_ENV = {"SPARSEGATE_ROLLOUT_TICK_S": "2"}
TRAINED_MODEL, TRAINED_GATE, TRAINED_REPLICAS = "moe-trained", "trained-gate", 4  # 25 % of requests on every pod


def log(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)



class Demo:
    def __init__(self, state_dir: Path) -> None:
        # The chart serves only the release namespace by default; the examples go to NS.
        self.stack = Stack(state_dir=state_dir, die_with_parent=False, operator_env=DEMO_OPERATOR_ENV,
                           extra_values=["--set", f"operator.watchNamespaces={{{NS}}}"])
        self.cluster = self.stack.cluster
        self.work = state_dir / "demo"
        self.work.mkdir(parents=True, exist_ok=True)
        self._printed: dict[tuple[str, ...], str] = {}
        self.trained_image = ""  # set by control_plane()

    def pid_file(self, name: str) -> Path:
        return self.work / f"{name}.pid"

    def start_detached(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        if processes.pid_file_alive(self.pid_file(name)):
            log(f"{name} already running")
            return
        processes.start(name=name, argv=argv, log_path=self.work / f"{name}.log", pid_file=self.pid_file(name),
                        env={**os.environ, **(env or {})})
        log(f"{name} started (log: {self.work / f'{name}.log'})")

    def kubectl(self, *args: str, **kw) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, **kw)

    # -- steps ----------------------------------------------------------------------------

    def control_plane(self) -> None:
        images = self.stack.build_images()
        log("images: " + ", ".join(images.values()))
        from imagebuild.trained import ensure_trained_image

        self.trained_image = ensure_trained_image(images["model-server"])
        log(f"trained-model image: {self.trained_image} (demo checkpoint FROM {images['model-server']})")
        running = self.cluster.running_components()
        if len(running) >= 6:
            log(f"control plane already running ({', '.join(running)})")
            return
        # Start from a clean state: kwok keeps its pod-IP pool in memory, so a restart over old pods
        # could hand out an address that a surviving pod still holds.
        self.down()
        shutil.rmtree(self.cluster.state_dir, ignore_errors=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.stack.start_cluster()
        log(f"control plane up in {self.cluster.timings.get('total', 0):.1f}s; pods run as podman containers")

    def install_chart(self) -> None:
        self.stack.install()
        pod = self.stack.wait_operator_ready()
        log(f"chart installed (release sparsegate in {RELEASE_NS}); operator pod {pod['metadata']['name']} "
            f"Ready: operator + OPA sidecar containers from their images")

    def apply_examples(self) -> None:
        # --force-conflicts: a re-run resets what the previous run patched back to examples/.
        self.kubectl("apply", "--server-side", "--force-conflicts", "-n", NS, "-f", str(REPO / "examples"))
        # A few more instances than the example: the rollout's share of requests holds on all of them.
        self.kubectl("scale", f"sparsemodel/{MODEL}", "-n", NS, f"--replicas={DEMO_REPLICAS}")
        # Shorter analysis windows than production so the demo ends in minutes.
        self.kubectl("patch", f"gateconfig/{GATE}", "-n", NS, "--type=merge",
                     "-p", json.dumps({"spec": {"rollout": {"analysisInterval": "15s"}}}))
        self.settle_reset(GATE)
        log(f"applied examples/; {MODEL} scaled to {DEMO_REPLICAS}")

    def settle_reset(self, gate: str) -> None:
        """On a re-run over a running cluster the apply puts the spec back to its starting params while
        the stable version is the last run's: that starts a rollout nothing loads yet (it would sit
        inconclusive), and the demo's own change, read from the spec, would then only revert to the
        last run's stable. Promote the reset at once (the promote annotation skips analysis), so
        every run's changes start from the same stable version. A first run has nothing in flight."""
        def observed() -> dict | None:
            gc = json.loads(self.kubectl("get", f"gateconfig/{gate}", "-n", NS, "-o", "json").stdout)
            status = gc.get("status") or {}
            return gc if status.get("observedGeneration", 0) >= gc["metadata"]["generation"] else None
        gc = wait_for(observed, what=f"GateConfig {gate} observed", timeout_s=120, interval_s=1)
        rollout = (gc.get("status") or {}).get("rollout") or {}
        if rollout.get("phase") not in ("Progressing", "Analysing", "Paused") or not rollout.get("canary"):
            return
        log(f"GateConfig {gate}: promoting the reset to its applied params (stable was the last run's)")
        self.kubectl("annotate", f"gateconfig/{gate}", "-n", NS, f"{PROMOTE_ANNOTATION}=all", "--overwrite")
        wait_for(lambda: self.rollout(gate).get("phase") == "Succeeded", what=f"GateConfig {gate} reset promoted",
                 timeout_s=300, interval_s=2)

    def print_table(self, *args: str, only_changes: bool = False) -> None:
        out = self.kubectl("get", *args, "-n", NS, check=False).stdout.rstrip()
        if not only_changes or self._printed.get(args) != out:
            print(out, flush=True)
        self._printed[args] = out

    def model_ready(self, model: str = MODEL, gate: str = GATE, replicas: int = DEMO_REPLICAS) -> None:
        def ready() -> bool:
            sm = json.loads(self.kubectl("get", f"sparsemodel/{model}", "-n", NS, "-o", "json").stdout)
            conds = {c["type"]: c["status"] for c in sm.get("status", {}).get("conditions", [])}
            self.print_table("sparsemodels", only_changes=True)
            return conds.get("Ready") == "True" and sm["status"].get("readyReplicas") == replicas
        wait_for(ready, what=f"SparseModel {model} Ready", timeout_s=300, interval_s=3)

        def stable_everywhere() -> str | None:
            stable = json.loads(self.kubectl("get", f"gateconfig/{gate}", "-n", NS, "-o", "json").stdout
                                ).get("status", {}).get("stable", {}).get("version")
            versions = [self.served_version(target) for target in self.serving_pods(model)]
            return stable if len(versions) == replicas and set(versions) == {stable} else None
        stable = wait_for(stable_everywhere, what="every model server to answer with the GateConfig's stable version",
                          timeout_s=300, interval_s=3)
        log(f"{model} Ready: {replicas} model servers answer /healthz with gate {stable}")

    @staticmethod
    def served_version(target: str) -> str | None:
        try:
            with urllib.request.urlopen(f"http://{target}/healthz", timeout=2) as resp:
                return json.loads(resp.read()).get("gateVersion")
        except OSError:
            return None

    def serving_pods(self, model: str = MODEL) -> list[str]:
        pods = json.loads(self.kubectl("get", "pods", "-n", NS, "-l", f"sparsegate.dev/model={model}",
                                       "-o", "json").stdout)["items"]
        return [f"{p['status']['podIP']}:8080" for p in pods if p.get("status", {}).get("podIP")]

    def rollout(self, gate: str = GATE) -> dict:
        gc = json.loads(self.kubectl("get", f"gateconfig/{gate}", "-n", NS, "-o", "json").stdout)
        return gc.get("status", {}).get("rollout", {})

    def load(self, name: str = "loadgen", model: str = MODEL, qps: int = 30) -> None:
        argv = [sys.executable, str(REPO / "dev" / "loadgen.py"), "--qps", str(qps), "--duration", "900"]
        for target in self.serving_pods(model):
            argv += ["--target", target]
        # Restarted every run: the pods (and so the targets) may have changed since the last one.
        processes.stop_from_pid_file(self.pid_file(name), grace_s=5)
        self.start_detached(name, argv)

    def change_gate(self, params: dict, why: str, gate: str = GATE) -> dict:
        """Patches the GateConfig's params and prints the rollout until it ends; returns status.rollout."""
        patched = json.loads(self.kubectl("patch", f"gateconfig/{gate}", "-n", NS, "--type=merge", "-o", "json",
                                          "-p", json.dumps({"spec": {"params": params}})).stdout)
        generation = patched["metadata"]["generation"]
        log(f"GateConfig {gate}: params {json.dumps(params)} ({why}); watching the rollout")
        last = ""
        end = {"Succeeded", "RolledBack", "Aborted", "Failed"}

        def finished() -> bool:
            nonlocal last
            out = self.kubectl("get", f"gateconfig/{gate}", "-n", NS, "-o", "wide", "--no-headers",
                               check=False).stdout.strip()
            if out != last:
                log(out)
                last = out
            gc = json.loads(self.kubectl("get", f"gateconfig/{gate}", "-n", NS, "-o", "json").stdout)
            status = gc.get("status", {})
            return status.get("observedGeneration", 0) >= generation and status.get("rollout", {}).get("phase") in end
        wait_for(finished, what="the rollout to finish", timeout_s=600, interval_s=2)
        rollout = self.rollout(gate)
        log(f"rollout ended: {rollout.get('phase')} — {rollout.get('message', '')}")
        failed = [c for c in (rollout.get("analysis") or {}).get("checks") or [] if c.get("passed") is False]
        if failed:
            log("failed checks: " + ", ".join(f"{c['name']} {c['value']} > {c['threshold']}" for c in failed))
        return rollout

    def trained_objects(self) -> list[dict]:
        """A GateConfig + SparseModel serving the trained checkpoint (the image built in control_plane)."""
        from imagebuild.trained import CHECKPOINT_DIR

        gate = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "GateConfig", "metadata": {"name": TRAINED_GATE},
                "spec": {"params": {"toolGateThreshold": 0.85, "entropyBeta": 0.1, "confidenceThreshold": 0.6,
                                    "capacityFactor": 1.25, "minExpertsPerToken": 1, "maxExpertsPerToken": 4,
                                    "precisionPolicy": "auto"},
                         # This gate's rollouts are judged on quality (maxQualityDrop: the CRD default,
                         # 0.02). As in tests/e2e/rollout/test_quality_rollout.py, a loose SLA (CPU model
                         # servers on a shared machine: p99 ~1 s seen) and a loose drift bound (the benign
                         # change, threshold 0.6 → 0.8, is meant to activate more experts: drift 0.74
                         # measured there) keep the latency and drift checks from deciding.
                         "rollout": {"steps": [25, 50, 100], "analysisInterval": "4s",
                                     "slaP99LatencyMs": 10000, "maxDrift": 2.0, "autoRollback": True}}}
        model = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "SparseModel", "metadata": {"name": TRAINED_MODEL},
                 "spec": {"replicas": TRAINED_REPLICAS, "image": self.trained_image,
                          "gateConfigRef": {"name": TRAINED_GATE},
                          "model": {"dModel": 64, "experts": 8, "maxExpertsPerToken": 4, "source": CHECKPOINT_DIR}}}
        return [gate, model]

    def trained_rollouts(self) -> None:
        """Real gate changes on the trained model: a benign one promoted, a harmful one rolled back on quality."""
        # The first model's load is done with; the trained model's servers get the CPU.
        if processes.stop_from_pid_file(self.pid_file("loadgen"), grace_s=5):
            log(f"stopped loadgen ({MODEL})")
        # --force-conflicts: a re-run resets what the previous run patched back to these objects.
        self.kubectl("apply", "--server-side", "--force-conflicts", "-n", NS, "-f", "-",
                     input=json.dumps({"apiVersion": "v1", "kind": "List", "items": self.trained_objects()}))
        log(f"applied GateConfig {TRAINED_GATE} + SparseModel {TRAINED_MODEL} ({TRAINED_REPLICAS} replicas, "
            f"image {self.trained_image})")
        self.settle_reset(TRAINED_GATE)
        self.model_ready(TRAINED_MODEL, TRAINED_GATE, TRAINED_REPLICAS)
        self.load("loadgen-trained", TRAINED_MODEL, qps=40)
        good = self.change_gate({"confidenceThreshold": 0.8}, "benign: top-p threshold 0.6 → 0.8 on the trained "
                                "model", gate=TRAINED_GATE)
        bad = self.change_gate({"confidenceThreshold": 0.05, "maxExpertsPerToken": 1},
                               "harmful: top-1 routing on the trained model, no fault injection", gate=TRAINED_GATE)
        # The demo claims both outcomes: say so loudly if this run did not show them.
        failed = [c["name"] for c in (bad.get("analysis") or {}).get("checks") or [] if c.get("passed") is False]
        if good.get("phase") != "Succeeded" or bad.get("phase") != "RolledBack" or failed != ["qualityDrop"]:
            raise AssertionError(f"trained model: expected the benign change Succeeded and the harmful one "
                                 f"RolledBack on qualityDrop alone; got {good.get('phase')} and {bad.get('phase')} "
                                 f"(failed checks {failed})")

    def show(self) -> None:
        print(flush=True)
        self.print_table("gateconfigs", "-o", "wide")
        self.print_table("sparsemodels")
        print(self.kubectl("get", "events", "-n", NS, "--field-selector", f"involvedObject.name={GATE}",
                           "--sort-by=.lastTimestamp", check=False).stdout.rstrip(), flush=True)
        self.print_table("routingpolicies", "-o", "wide")
        flow = self.kubectl("get", "configmap", "sparsegate-flow-policy", "-n", RELEASE_NS, "-o", "json",
                            check=False)
        if flow.returncode == 0:
            document = json.loads(json.loads(flow.stdout)["data"]["policy.json"])
            log(f"flow allow-list for the XDP agent (ConfigMap {RELEASE_NS}/sparsegate-flow-policy): "
                f"default {document['defaultAction']}, {len(document.get('rules') or [])} identity rules over "
                f"{len(document.get('identities') or [])} identities, "
                f"{sum(e['action'] == 'allow' for e in flowpolicy.ip_entries(document))} allowed (source, pod, port)")

    def up(self) -> None:
        self.control_plane()
        os.environ["KUBECONFIG"] = str(self.cluster.kubeconfig)
        self.install_chart()
        self.apply_examples()
        self.model_ready()
        self.load()
        current = json.loads(self.kubectl("get", f"gateconfig/{GATE}", "-n", NS, "-o", "json").stdout)["spec"]["params"]
        # A good change: the tool gate fires a little later; routing is untouched, so it is promoted.
        tool = 0.9 if abs(current["toolGateThreshold"] - 0.9) > 1e-9 else 0.85
        self.change_gate({"toolGateThreshold": tool, "faultInjection": None}, "good: tool gate threshold")
        # A bad change: the chaos knob makes canary pods fail 30 % of requests; analysis catches it
        # at the first step and rolls back, the stable version untouched.
        self.change_gate({"capacityFactor": 1.5, "faultInjection": {"errorRate": 0.3}},
                         "bad: fault injection, 30 % errors")
        self.trained_rollouts()
        self.show()
        log(f"done. KUBECONFIG={self.cluster.kubeconfig}; try `kubectl get sparsegate -A`; "
            "stop everything with ./dev/demo.sh down")

    def down(self) -> None:
        for name in ("loadgen", "loadgen-trained"):
            if processes.stop_from_pid_file(self.pid_file(name), grace_s=10):
                log(f"stopped {name}")
        stopped = self.cluster.stop()
        log("stopped: " + (", ".join(stopped) if stopped else "no cluster component was running"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["up", "down"], nargs="?", default="up")
    parser.add_argument("--state-dir", type=Path, default=default_state_dir())
    args = parser.parse_args(argv)
    demo = Demo(args.state_dir)
    try:
        demo.up() if args.command == "up" else demo.down()
    except AssertionError as exc:  # a wait_for timed out: say what, and what the stack looks like
        print(f"[demo] {exc}\n{demo.stack.diagnose()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
