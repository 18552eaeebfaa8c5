"""Container pod runner: the kubelet part kwok leaves out, with real containers.

For every Running pod of its cluster (kwok assigned the node and a loopback pod IP) the runner:
plans the pod (:mod:`localcluster.podplan`), writes its volumes as files (ConfigMaps, Secrets,
emptyDirs, the projected ServiceAccount token from a bound TokenRequest, refreshed before it
expires; rewritten on every pass when their source changed, so running containers see updates),
runs each container with podman on the host network from its image, probes it
(readiness, liveness, startup), restarts it with back-off when it exits or fails liveness, and
writes the pod's ``containerStatuses`` and ``Ready``/``ContainersReady`` conditions. A missing image
waits with ``ErrImageNeverPull`` (pull policy Never) or ``ErrImagePull`` (no registry is reachable,
nothing is pulled). Fields it cannot honour are named in a Warning event on the pod.

kwok's ``pod-start`` stage (see ``cluster.py``) leaves such pods Running but not Ready: readiness is
the runner's to report, as it is the kubelet's. Deletion is the runner's to finish too (cluster.py
leaves kwok's ``pod-delete`` stage out in this mode): a deleted pod's containers get SIGTERM and
the pod's grace period (capped), and only once none of them is left does the runner delete the
pod object (grace 0, on its uid), as a kubelet does, so a stopping container's ServiceAccount token
stays valid while it stops.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime as dt
import logging
import os
import shutil
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from localcluster import podman
from localcluster.podplan import (
    SA_MOUNT,
    ContainerPlan,
    NotReadyToRun,
    Observed,
    PodPlan,
    Probe,
    VolumeFiles,
    decode_secret,
    plan_pod,
    pod_status,
)

LOG = logging.getLogger("localcluster.containerrunner")
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 20.0
RESET_AFTER_S = 60.0  # a container that ran this long before exiting restarts without back-off
STOP_GRACE_CAP_S = 10


def now_rfc3339(t: float | None = None) -> str:
    return dt.datetime.fromtimestamp(time.time() if t is None else t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def backoff_s(restarts: int) -> float:
    """Crash-loop delay after the ``restarts``-th restart (the kubelet's doubling, capped short)."""
    return min(BACKOFF_BASE_S * 2 ** max(restarts - 1, 0), BACKOFF_CAP_S)


def container_name(plan: PodPlan, container: str) -> str:
    return podman.container_name(namespace=plan.namespace, pod=plan.name, uid=plan.uid, container=container)


@dataclasses.dataclass
class _ProbeState:
    successes: int = 0
    failures: int = 0
    last_run: float = 0.0
    ok: bool = False


@dataclasses.dataclass
class _Track:
    """The runner's memory of one container across passes."""

    restarts: int = 0
    backoff_until: float = 0.0
    seen_exit: int = 0  # ExitedAt of the last exit already counted
    last_terminated: dict[str, Any] | None = None
    waiting: tuple[str, str] = ("ContainerCreating", "")
    started: bool = False  # startup probe passed (or none)
    readiness: _ProbeState = dataclasses.field(default_factory=_ProbeState)
    liveness: _ProbeState = dataclasses.field(default_factory=_ProbeState)
    startup: _ProbeState = dataclasses.field(default_factory=_ProbeState)
    busy: bool = False
    # When its last podman action ended (monotonic): a listing taken before that is stale for it
    # (a create that ends between the listing and the pass must not be started a second time).
    acted_at: float = 0.0


def probe_once(probe: Probe) -> bool:
    """One probe attempt: HTTP 200-399, or a TCP connect, within the probe's timeout."""
    try:
        if probe.kind == "tcp":
            with socket.create_connection((probe.host, probe.port), timeout=probe.timeout_s):
                return True
        ctx = ssl._create_unverified_context() if probe.scheme == "https" else None  # kubelet skips verification too
        url = f"{probe.scheme}://{probe.host}:{probe.port}{probe.path}"
        with urllib.request.urlopen(url, timeout=probe.timeout_s, context=ctx) as resp:
            return 200 <= resp.status < 400
    except urllib.error.HTTPError as exc:
        return 200 <= exc.code < 400
    except (OSError, ValueError):
        return False


def _step_probe(probe: Probe, state: _ProbeState, *, started_at: float, now: float) -> bool | None:
    """Runs ``probe`` if due; returns the new verdict when it changed, else None."""
    if now < started_at + probe.initial_delay_s or now < state.last_run + probe.period_s:
        return None
    state.last_run = now
    if probe_once(probe):
        state.successes, state.failures = state.successes + 1, 0
        if not state.ok and state.successes >= probe.success_threshold:
            state.ok = True
            return True
    else:
        state.failures, state.successes = state.failures + 1, 0
        if state.failures >= probe.failure_threshold and (state.ok or state.failures == probe.failure_threshold):
            state.ok = False
            return False
    return None


class TokenCache:
    """Bound ServiceAccount tokens (TokenRequest), reused until 80 % of their lifetime."""

    def __init__(self, core_api: Any) -> None:
        self.api = core_api
        self._cache: dict[tuple[str, str, tuple[str, ...], str], tuple[str, float]] = {}

    def __call__(self, namespace: str, sa: str, audiences: tuple[str, ...], seconds: int, pod: str, uid: str) -> str:
        key = (namespace, sa, audiences, uid)
        hit = self._cache.get(key)
        if hit and time.time() < hit[1]:
            return hit[0]
        from kubernetes.client.exceptions import ApiException

        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
            "audiences": list(audiences) or None, "expirationSeconds": seconds,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid}}}
        try:
            resp = self.api.create_namespaced_service_account_token(sa, namespace, body)
        except ApiException as exc:
            if exc.status == 404:
                raise NotReadyToRun(f"ServiceAccount {namespace}/{sa} not found") from exc
            raise
        token = resp.status.token
        self._cache[key] = (token, time.time() + 0.8 * seconds)
        return token

    def forget(self, uid: str) -> None:
        for key in [k for k in self._cache if k[3] == uid]:
            del self._cache[key]


class ContainerPodRunner:
    """Reconciles podman containers against every Running pod of one cluster."""

    def __init__(self, *, core_api: Any, work_dir: Path, api_host: str, api_port: int, ca_file: Path | None = None,
                 runner_id: str | None = None, resync_s: float = 1.0) -> None:
        self.api = core_api
        self.work_dir = work_dir
        self.service_env = {"KUBERNETES_SERVICE_HOST": api_host, "KUBERNETES_SERVICE_PORT": str(api_port),
                            "KUBERNETES_SERVICE_PORT_HTTPS": str(api_port),
                            "KUBERNETES_PORT": f"tcp://{api_host}:{api_port}"}
        self.runner_id = runner_id or podman.runner_id(work_dir)
        self.resync_s = resync_s
        self.tokens = TokenCache(core_api)
        self.tracks: dict[str, _Track] = {}  # container name -> memory
        self.plans: dict[str, PodPlan] = {}  # pod uid -> last plan
        self.written: dict[str, dict[str, Any]] = {}  # pod uid -> last status written
        self.events_sent: set[tuple[str, str, str]] = set()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="podman")
        self._lock = threading.Lock()
        self._volumes_lock = threading.Lock()  # the pass and container creation both write volumes
        self._stop = threading.Event()
        self._changed = threading.Event()
        self._images: set[str] = set()
        self._removing: set[str] = set()  # containers being stopped and removed (one removal each)
        self._finished: set[str] = set()  # uids of deleted pods whose object this runner has deleted

    # -- API lookups ------------------------------------------------------------------------

    def _read(self, kind: str, namespace: str, name: str) -> Mapping[str, str] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            if kind == "secret":
                return decode_secret(self.api.read_namespaced_secret(name, namespace).data)
            return dict(self.api.read_namespaced_config_map(name, namespace).data or {})
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _event(self, pod: Mapping[str, Any], *, reason: str, message: str, kind: str = "Warning") -> None:
        meta = pod["metadata"]
        key = (meta["uid"], reason, message)
        if key in self.events_sent:
            return
        self.events_sent.add(key)
        now = now_rfc3339()
        body = {"metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                "involvedObject": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"],
                                   "namespace": meta["namespace"], "uid": meta["uid"]},
                "reason": reason, "message": message, "type": kind, "count": 1,
                "firstTimestamp": now, "lastTimestamp": now, "source": {"component": "sparsegate-podrunner"}}
        try:
            self.api.create_namespaced_event(meta["namespace"], body)
        except Exception as exc:  # an event is best effort, as the kubelet's are
            LOG.warning("event %s for %s/%s not recorded: %s", reason, meta["namespace"], meta["name"], exc)
        LOG.info("event %s %s/%s: %s", reason, meta["namespace"], meta["name"], message)

    # -- volumes ----------------------------------------------------------------------------

    def _pod_dir(self, plan: PodPlan) -> Path:
        return self.work_dir / f"{plan.namespace}_{plan.name}_{plan.uid[:8]}"

    def _write_volume(self, root: Path, vol: VolumeFiles) -> Path:
        with self._volumes_lock:
            return self._write_volume_locked(root, vol)

    def _write_volume_locked(self, root: Path, vol: VolumeFiles) -> Path:
        if vol.kind == "hostPath":
            return Path(vol.host_path or "/")
        path = root / "volumes" / vol.name
        path.mkdir(parents=True, exist_ok=True)
        if vol.writable:
            path.chmod(0o777)  # an emptyDir is writable by whichever user the container runs as
            return path
        path.chmod(0o755)
        wanted = {rel for rel, _, _ in vol.files}
        for rel, content, mode in vol.files:
            target = path / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists() and target.read_bytes() == content and (target.stat().st_mode & 0o777) == mode:
                continue
            # Atomic replace, as a kubelet swaps a volume's files: readers see old or new, never half.
            tmp = target.with_name(f".{target.name}.tmp")
            tmp.write_bytes(content)
            tmp.chmod(mode)
            os.replace(tmp, target)
        for stale in [p for p in path.rglob("*") if p.is_file() and str(p.relative_to(path)) not in wanted]:
            stale.unlink()
        return path

    def _mounts(self, plan: PodPlan, container: ContainerPlan) -> list[tuple[str, str, bool]]:
        root = self._pod_dir(plan)
        sources = {v.name: self._write_volume(root, v) for v in plan.volumes}
        mounts = []
        for m in container.mounts:
            source = sources[m.volume] / m.sub_path if m.sub_path else sources[m.volume]
            mounts.append((str(source), m.target, m.read_only))
        return mounts

    # -- one pass ---------------------------------------------------------------------------

    def reconcile(self) -> None:
        pods = self.api.list_pod_for_all_namespaces()
        client = self.api.api_client
        desired: dict[str, tuple[PodPlan, dict[str, Any]]] = {}
        # One GET per object per pass: every pod mounts kube-root-ca.crt, replicas share their ConfigMaps.
        read: dict[tuple[str, str, str], Mapping[str, str] | None] = {}

        def lookup(kind: str) -> Any:
            def get(ns: str, name: str) -> Mapping[str, str] | None:
                if (kind, ns, name) not in read:
                    read[(kind, ns, name)] = self._read(kind, ns, name)
                return read[(kind, ns, name)]
            return get

        deleting: dict[str, dict[str, Any]] = {}  # uid -> metadata of a pod being deleted
        for obj in pods.items:
            pod = client.sanitize_for_serialization(obj)
            meta = pod["metadata"]
            if meta.get("deletionTimestamp"):
                deleting[meta["uid"]] = meta
                continue
            try:
                plan = plan_pod(pod, secrets=lookup("secret"), configmaps=lookup("configmap"),
                                tokens=self.tokens, service_env=self.service_env)
            except NotReadyToRun as exc:
                LOG.info("pod %s/%s waits: %s", meta.get("namespace"), meta.get("name"), exc)
                self._event(pod, reason="FailedMount", message=str(exc))
                continue
            if plan is None:
                continue
            if plan.unsupported:
                self._event(pod, reason="UnsupportedField",
                            message="the dev pod runner does not implement: " + ", ".join(plan.unsupported))
            desired[plan.uid] = (plan, pod)
            self.plans[plan.uid] = plan
        listed_at = time.monotonic()
        existing = podman.list_containers(self.runner_id)
        wanted_names = {container_name(p, c.name) for p, _ in desired.values() for c in p.containers}
        for name, state in existing.items():
            if name not in wanted_names:
                grace = int(state.labels.get(podman.LABEL_GRACE, STOP_GRACE_CAP_S))
                pod_meta = deleting.get(state.labels.get(podman.LABEL_POD_UID, ""))
                if pod_meta is not None and pod_meta.get("deletionGracePeriodSeconds") is not None:
                    grace = min(grace, int(pod_meta["deletionGracePeriodSeconds"]))  # kubectl delete --grace-period
                self._remove(name, grace_s=grace)
        self._finish_deletions(deleting, existing, listed_at=listed_at)
        # A deleted pod's plan (its container names, its volumes) is kept until its object is gone:
        # a stopping container still reads its volumes, as under a kubelet.
        for uid in [u for u in self.plans if u not in desired and (u not in deleting or u in self._finished)]:
            self._forget_pod(uid)
        # As a kubelet syncs ConfigMap/Secret volumes of running pods: rewrite files whose source
        # changed (unchanged files are left alone), so a running container sees a changed Secret
        # without a restart. Each file is replaced atomically, but not all of a volume's files at
        # once (a kubelet swaps a ..data symlink): a reader may briefly see some new, some old.
        for plan, _ in desired.values():
            root = self._pod_dir(plan)
            if root.is_dir():
                for vol in plan.volumes:
                    self._write_volume(root, vol)
        now = time.time()
        for plan, pod in desired.values():
            observed = {c.name: self._drive(plan, pod, c, existing.get(container_name(plan, c.name)), now,
                                            listed_at=listed_at)
                        for c in plan.containers}
            self._write_status(plan, pod, observed)

    def _drive(self, plan: PodPlan, pod: Mapping[str, Any], c: ContainerPlan,
               state: podman.ContainerState | None, now: float, *, listed_at: float = 0.0) -> Observed:
        """Moves one container toward running and returns what the status should say about it.
        ``state`` is what a listing begun at ``listed_at`` (monotonic) saw."""
        name = container_name(plan, c.name)
        track = self.tracks.setdefault(name, _Track())
        base = dict(restart_count=track.restarts, last_terminated=track.last_terminated)
        if track.busy or track.acted_at > listed_at:  # acting, or acted since the listing: wait a pass
            return Observed("waiting", *track.waiting, **base)
        if state is None:
            if not self._image_present(c.image):
                reason, msg = (("ErrImageNeverPull", f'Container image "{c.image}" is not present with pull policy of Never')
                               if c.pull_policy == "Never" else
                               ("ErrImagePull", f'Container image "{c.image}" is not present locally and the dev '
                                                f'pod runner pulls nothing (no registry is reachable)'))
                track.waiting = (reason, msg)
                self._event(pod, reason=reason, message=msg)
                return Observed("waiting", reason, msg, **base)
            if now < track.backoff_until:
                return Observed("waiting", *track.waiting, **base)
            track.waiting = ("ContainerCreating", "")
            self._submit(track, self._create, plan, c, name)
            return Observed("waiting", "ContainerCreating", **base)
        obs_base = dict(base, container_id=state.id[:12])
        # A paused (frozen) container has not exited: it is a hung process, for probes to judge.
        if state.state in ("running", "paused"):
            track.waiting = ("ContainerCreating", "")
            return self._probe(plan, pod, c, name, state, track, now, obs_base)
        # Exited (or created but never started): count the exit once, then restart after back-off.
        if state.exited_at and state.exited_at != track.seen_exit:
            track.seen_exit = state.exited_at
            ran_s = state.exited_at - state.started_at if state.started_at else 0
            track.restarts += 1
            track.last_terminated = {"exitCode": state.exit_code, "reason": "Completed" if state.exit_code == 0 else "Error",
                                     "startedAt": now_rfc3339(state.started_at) if state.started_at else None,
                                     "finishedAt": now_rfc3339(state.exited_at), "containerID": f"podman://{state.id[:12]}"}
            delay = 0.0 if ran_s >= RESET_AFTER_S else backoff_s(track.restarts)
            track.backoff_until = now + delay
            track.waiting = ("CrashLoopBackOff", f"back-off {delay:.0f}s restarting failed container={c.name} "
                                                 f"pod={plan.name}_{plan.namespace}({plan.uid})")
            track.readiness, track.liveness, track.startup = _ProbeState(), _ProbeState(), _ProbeState()
            track.started = False
            self._event(pod, reason="BackOff", message=f"container {c.name} exited with {state.exit_code}; "
                                                       f"restart {track.restarts} after {delay:.0f}s")
            LOG.warning("%s exited with %s; restart %d in %.0fs: %s", name, state.exit_code, track.restarts, delay,
                        podman.logs_tail(name, 5).replace("\n", " | "))
        obs = Observed("waiting", *track.waiting, **{**obs_base, "last_terminated": track.last_terminated,
                                                     "restart_count": track.restarts})
        if now >= track.backoff_until:
            self._submit(track, self._restart, name)
        return obs

    def _probe(self, plan: PodPlan, pod: Mapping[str, Any], c: ContainerPlan, name: str,
               state: podman.ContainerState, track: _Track, now: float, base: dict[str, Any]) -> Observed:
        started_at = float(state.started_at or now)
        if not track.started:
            if c.startup is None:
                track.started = True
            elif _step_probe(c.startup, track.startup, started_at=started_at, now=now) is False:
                self._event(pod, reason="Unhealthy", message=f"Startup probe failed for {c.name}; killing it")
                self._submit(track, self._kill, name)
            elif track.startup.ok:
                track.started = True
        if track.started and c.liveness is not None:
            if _step_probe(c.liveness, track.liveness, started_at=started_at, now=now) is False:
                self._event(pod, reason="Unhealthy", message=f"Liveness probe failed for {c.name}; restarting it")
                self._submit(track, self._kill, name)
        if track.started:
            if c.readiness is None:
                track.readiness.ok = True
            else:
                _step_probe(c.readiness, track.readiness, started_at=started_at, now=now)
        return Observed("running", started_at=now_rfc3339(started_at), ready=track.started and track.readiness.ok,
                        started=track.started, **base)

    def _image_present(self, image: str) -> bool:
        if image in self._images:
            return True
        if podman.image_exists(image):
            self._images.add(image)
            return True
        return False

    # -- podman actions (on the pool; one at a time per container) ---------------------------

    def _submit(self, track: _Track, fn: Any, *args: Any) -> None:
        track.busy = True

        def run() -> None:
            try:
                fn(*args)
            except Exception as exc:
                LOG.warning("%s%s failed: %s", fn.__name__, args[-1:], exc)
                track.waiting = ("CreateContainerError", str(exc)[-500:])
                track.backoff_until = time.time() + backoff_s(max(track.restarts, 1))
            finally:
                track.acted_at = time.monotonic()
                track.busy = False
                self._changed.set()

        self.pool.submit(run)

    def _create(self, plan: PodPlan, c: ContainerPlan, name: str) -> None:
        labels = {podman.LABEL_RUNNER: self.runner_id, podman.LABEL_POD_UID: plan.uid,
                  podman.LABEL_CONTAINER: c.name,
                  # The pod's terminationGracePeriodSeconds (capped): how long a stop may wait.
                  podman.LABEL_GRACE: str(min(plan.grace_s, STOP_GRACE_CAP_S))}
        argv = podman.run_argv(c, name=name, labels=labels, mounts=self._mounts(plan, c), hostname=plan.name)
        podman.podman("rm", "-f", "--ignore", name)
        podman.podman(*argv)
        LOG.info("started %s (%s) for %s on %s", name, c.image, plan.key, plan.pod_ip)

    def _restart(self, name: str) -> None:
        podman.podman("start", name)
        LOG.info("restarted %s", name)

    def _kill(self, name: str) -> None:
        podman.podman("kill", name, check=False)

    def _remove(self, name: str, *, grace_s: int) -> None:
        track = self.tracks.pop(name, None)
        if track is not None and track.busy:
            return
        with self._lock:
            # The next pass still lists a container that is stopping: one removal is enough (a
            # second `podman rm -f` of a stopping container must not cut its grace short).
            if name in self._removing:
                return
            self._removing.add(name)
        self.pool.submit(self._remove_now, name, grace_s)

    def _remove_now(self, name: str, grace_s: int) -> None:
        # Stop first (SIGTERM, SIGKILL after the grace), so the log says how the container ended:
        # exit code 137 means the grace ran out (or something else killed it).
        try:
            t0 = time.monotonic()
            podman.podman("stop", "-t", str(grace_s), "--ignore", name, check=False)
            inspect = podman.podman("inspect", "--format", "{{.State.ExitCode}}", name, check=False)
            podman.podman("rm", "-f", "-t", str(grace_s), "--ignore", name, check=False)
            LOG.info("removed %s: stopped in %.1fs (grace %ds), exit code %s", name, time.monotonic() - t0, grace_s,
                     inspect.stdout.strip() or "unknown")
        finally:
            with self._lock:
                self._removing.discard(name)
            self._changed.set()  # its pod's deletion may now be finished

    def _finish_deletions(self, deleting: Mapping[str, Mapping[str, Any]],
                          existing: Mapping[str, podman.ContainerState], *, listed_at: float) -> None:
        """Deletes the object of each pod being deleted none of whose containers is left (listed,
        being removed, or acted on since the listing began), as a kubelet ends a pod's deletion."""
        with self._lock:
            removing = set(self._removing)
        live = {s.labels.get(podman.LABEL_POD_UID) for s in existing.values()}
        for uid, meta in deleting.items():
            if uid in self._finished or uid in live:
                continue
            plan = self.plans.get(uid)
            names = {container_name(plan, c.name) for c in plan.containers} if plan else set()
            if names & removing or any(t.busy or t.acted_at > listed_at
                                       for t in (self.tracks.get(n) for n in names) if t is not None):
                continue
            self._delete_pod(meta)
        self._finished &= set(deleting)  # a uid whose object is gone need not be remembered

    def _delete_pod(self, meta: Mapping[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}
        try:
            self.api.delete_namespaced_pod(meta["name"], meta["namespace"], body=body, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone already, or a new pod of that name (uid precondition)
                raise
        self._finished.add(meta["uid"])
        LOG.info("deleted pod %s/%s (%s): its containers have stopped", meta["namespace"], meta["name"],
                 meta["uid"][:8])

    def _forget_pod(self, uid: str) -> None:
        plan = self.plans.pop(uid)
        self.written.pop(uid, None)
        self.tokens.forget(uid)
        shutil.rmtree(self._pod_dir(plan), ignore_errors=True)

    # -- status -----------------------------------------------------------------------------

    def _write_status(self, plan: PodPlan, pod: Mapping[str, Any], observed: Mapping[str, Observed]) -> None:
        status = pod_status(plan, observed, previous=pod.get("status"), now=now_rfc3339())
        comparable = {"containerStatuses": status["containerStatuses"],
                      "conditions": [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status["conditions"]]}
        if self.written.get(plan.uid) == comparable:
            return
        from kubernetes.client.exceptions import ApiException

        try:
            self.api.patch_namespaced_pod_status(plan.name, plan.namespace, {"status": status})
            self.written[plan.uid] = comparable
        except ApiException as exc:
            if exc.status != 404:
                raise

    # -- lifecycle --------------------------------------------------------------------------

    def remove_all(self) -> None:
        removed = podman.remove_runner_containers(self.runner_id, grace_s=STOP_GRACE_CAP_S)
        if removed:
            LOG.info("removed %d containers", removed)

    def _watch(self) -> None:
        from kubernetes import watch

        while not self._stop.is_set():
            try:
                for _ in watch.Watch().stream(self.api.list_pod_for_all_namespaces, timeout_seconds=30):
                    self._changed.set()
                    if self._stop.is_set():
                        return
            except Exception as exc:  # the API may restart; retry after a pause
                LOG.warning("pod watch failed: %s", exc)
                self._stop.wait(1.0)

    def run(self) -> None:
        """Reconciles until :meth:`shutdown`; removes every container it made on the way out."""
        self.remove_all()  # leftovers of an earlier runner of this cluster
        threading.Thread(target=self._watch, name="podrunner-watch", daemon=True).start()
        synced = False
        try:
            while not self._stop.is_set():
                self._changed.clear()
                try:
                    self.reconcile()
                    if not synced:
                        synced = True
                        LOG.info("synced: %d pods", len(self.plans))
                except Exception as exc:
                    LOG.warning("reconcile failed: %s", exc)
                self._changed.wait(self.resync_s)
        finally:
            self.pool.shutdown(wait=True)
            self.remove_all()

    def shutdown(self) -> None:
        self._stop.set()
        self._changed.set()


__all__ = ["ContainerPodRunner", "SA_MOUNT", "backoff_s", "probe_once"]
