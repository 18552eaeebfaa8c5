"""The GateConfig rollout controller: observe → decide (pure) → persist → act, once per tick.

:meth:`RolloutLoop.tick` is called per GateConfig by the Kopf wiring (``handlers.gateconfig``:
a watch-driven loop, no finalizer). One tick:

1. read the GateConfig fresh (the watched body may predate our own last status write) — except
   for a resting GateConfig checking its pods, which starts from the object as last watched
   (:meth:`RolloutLoop.quiet_view` keeps it) unless that predates one of its own writes or its
   last write lost a race: at 2,000 GateConfigs those checks' GETs were a sixth of the operator's
   requests, and a resting check whose copy is stale can only push the same stable gate (its
   status write carries the copy's resourceVersion, so a stale one is a 409, not lost state);
2. observe: pods of the SparseModels whose ``spec.gateConfigRef`` names it (the wiring passes
   them from the Kopf index ``models_by_gate``; models, Deployments, ReplicaSets and pods are read
   from the watched views of ``handlers.fleetindex``, not the API server) — only pods whose owner
   chain leads to the model (pod → ReplicaSet → Deployment → SparseModel, ``domain.pod_ownership``)
   are the model's; a pod
   that only carries the model's labels gets no token, no push, no scrape and is no part of the
   rollout (Warning Event ``AdminTokenWithheld``) — their ``/healthz`` (heartbeat +
   version/checksum double check) and, while a canary is in flight, their ``/metrics``;
3. decide with ``domain.rollout.next_action`` (pure);
4. persist the new status (JSON patch replacing the whole status, optimistic concurrency)
   BEFORE acting; clear the one-shot annotations it consumed (the status names them until
   then, ``consumedRequests``, so a clear that fails is not acted on twice); then push gates
   (the models' admin Secrets are read just before), post Events, count metrics;
5. when it pushed, observe again at once so verified pods are recorded in the same tick.

Every API path comes from ``clients.kube.path_for``. Crash safety follows from (4) and from
pushes being level-based: a restarted operator reads status, looks at what the pods report and
only pushes what is still missing.

A resting GateConfig (nothing to roll out) checks its pods at its next tick after one of its
models' pods is seen Ready (``pod_changes``: the handler counts those watch events per GateConfig)
and otherwise every ``SPARSEGATE_ROLLOUT_RESTING_CHECK_S`` (default 300) as a safety net: a new
pod, or one back from a restart, is a Ready event, so the check that pushes it the stable gate
follows within a tick instead of a 30 s timer (at 2,000 GateConfigs that timer was ~70 GETs/s
and a /healthz per pod, finding nothing to do).
Between those checks its loop sleeps (:meth:`RolloutLoop.next_tick_in`) rather than ticking to
find nothing to do.

With ``spec.rollout.strategy: requests`` the same loop pushes every pod the stable + canary set
at the step's weight (``domain.request_canary``) and the builtin analysis compares the canary
version's requests with the stable version's, both served by the same pods.

Analysis goes through ``clients.analysis_providers`` (one ``AnalysisProvider`` interface): the
builtin check's provider every tick while a canary is in flight (a direct scrape that owns its
windows, or Prometheus), each declared check's provider when ``domain.analysis_run.due_checks``
says its next measurement is due.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import kopf
import prometheus_client

from sparsegate_contracts import gate as gatedoc
from sparsegate_contracts.canary import document_key
from sparsegate_contracts.canonical import canonical_json
from sparsegate_contracts import names

from sparsegate import envvars
from sparsegate.repeated_failures import repeats
from sparsegate.clients.admin_credentials import AdminCredentialStore, ModelCredentials
from sparsegate.clients.analysis_providers import (
    BuiltinProvider,
    BuiltinWindow,
    DirectScrape,
    MeasureRequest,
    PrometheusGroups,
    PrometheusQuery,
    WebRequest,
    measure_safely,
)
from sparsegate.clients.kube import Conflict, Kube, KubeError, path_for
from sparsegate.clients.metrics_source import PrometheusAPI
from sparsegate.controllers import admin_secret
from sparsegate.controllers.inventory import Inventory
from sparsegate.clients.podadmin import PodAdmin, PodTarget
from sparsegate.domain import admin_tls, analysis_run, fleet_view, render
from sparsegate.domain.analysis_run import Measured, Provider, RunPhase
from sparsegate.domain.conditions import listed
from sparsegate.domain.pod_ownership import controller_ref, ownership_problem
from sparsegate.domain.rollout import (
    RESTING_PHASES,
    ClearAnnotation,
    Decision,
    EmitEvent,
    Observations,
    Phase,
    PodObservation,
    PushGate,
    RecordOutcome,
    RecordStep,
    RolloutSpec,
    RolloutStatus,
    SpecError,
    Strategy,
    annotation_requests,
    declared_requests,
    pending_requests,
    request_values,
    rejection_holds,
    invalid_spec,
    next_action,
    parse_spec,
)

RESTING_CHECK_S = envvars.seconds("SPARSEGATE_ROLLOUT_RESTING_CHECK_S", 300.0)
# A full check reads the admin Secret of each model not sent anything for this long (a send reads
# it anyway), so a certificate ending within admin_tls.RENEW_BEFORE is renewed before it ends
# (:meth:`RolloutLoop.model_credentials`) even when neither the model nor the operator changes.
ADMIN_SECRET_CHECK_S = envvars.seconds("SPARSEGATE_ADMIN_SECRET_CHECK_S", 86400.0)
# How long a tick waits for the declared checks' measurements it started (or that are still in
# flight from an earlier tick): a web check's timeout has no upper bound, and a tick that awaited
# a hanging endpoint held the GateConfig's abort, pause, promote and status writes for that long. A
# measurement not answered by then is picked up by a later tick (``RolloutCache.measuring``). The
# builtin check's (a Prometheus group: 5 s a query) is waited for as long (``builtin_measuring``).
CHECK_WAIT_S = 2.0
# A pod that refused its push (a 4xx answer to the document itself: ``PushResult.refused``) is sent
# the same document again only after this long, doubled at each refusal up to the cap; another
# document (the status fixed, a new version) goes to it at once. It used to be pushed every tick
# (TICK_S) for as long as it refused, and nothing but a log line said so.
REFUSED_RETRY_S = 10.0
REFUSED_RETRY_MAX_S = 160.0
_LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"

ROLLOUTS = prometheus_client.Counter(
    "sparsegate_rollouts_total", "Gate rollouts that ended, by outcome.", ["outcome"])
STEP_SECONDS = prometheus_client.Histogram(
    "sparsegate_rollout_step_duration_seconds", "Time from a step's start to its promotion.",
    # Up to a day: analysisInterval has no upper bound (an hour per step is common) and a paused step
    # waits for its promote; a step beyond the last finite bucket read as that bound (30 min).
    ["percent"], buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200, 86400))
TICK_SECONDS = prometheus_client.Histogram(
    "sparsegate_rollout_tick_duration_seconds", "Wall time of one rollout reconcile tick.",
    # A tick waits on API requests (up to 30 s each) and pod pushes: slower ticks stay readable.
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
PUSHES = prometheus_client.Counter(
    "sparsegate_rollout_gate_pushes_total", "PUT /admin/gate calls by result.", ["result"])
MEASUREMENTS = prometheus_client.Counter(
    "sparsegate_rollout_analysis_measurements_total",
    "Declared analysis checks measured, by provider and answer (value, no_data, error).", ["provider", "answer"])
# Every outcome's and result's series exists at 0 from the start (and each step percent's from the
# tick that reads the spec): increase() counts a series from its first sample, so one born at 1 (an
# outcome's first rollout, the first failed push, a percent's first step) was never counted.
OUTCOMES = ("succeeded", "rolled_back", "aborted", "failed", "superseded", "reverted")
for _outcome in OUTCOMES:
    ROLLOUTS.labels(outcome=_outcome)
for _result in ("ok", "error"):
    PUSHES.labels(result=_result)

log = logging.getLogger(__name__)


@dataclass
class RolloutCache:
    """Per-GateConfig memory that is only an optimisation: losing it (restart) is safe."""

    last_full_check: float = 0.0
    # The GateConfig's pod-change count (``tick(pod_changes=)``) when its last full check began.
    checked_pod_changes: int = 0
    # The builtin provider of this GateConfig (a DirectScrape owns its window snapshots).
    builtin: BuiltinProvider | None = None
    # Admin credentials per model: the Secret is re-read before each push, credentials rebuilt only
    # when its resourceVersion changes (never cached beyond the Secret they came from).
    credentials: AdminCredentialStore = field(default_factory=AdminCredentialStore)
    # Model → when its admin Secret was last read (clock of the loop); ``RolloutLoop._check_admin_secrets``.
    secrets_read: dict[str, float] = field(default_factory=dict)
    withheld: set[tuple[str, str]] = field(default_factory=set)  # (pod uid, reason) reported, still refused
    # Pod → the error its last push failed with, logged once (``RolloutLoop.log_push_failures``): a pod
    # that keeps refusing is pushed again every tick, and a WARNING a tick per pod was log spam.
    push_failures: dict[str, str] = field(default_factory=dict)
    # resourceVersions our own status writes replaced (the last few): a watched copy still at one of
    # them predates our write, so the tick reads the object instead of starting from it.
    superseded: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=4))
    # The last tick's write lost a race (409): the next tick reads the object.
    read_fresh: bool = False
    # Declared checks' measurements in flight: check name → ((run key, check), task). Started by a
    # tick, recorded by the first tick that finds them answered (``RolloutLoop._declared``).
    measuring: dict[str, tuple[tuple[Any, ...], asyncio.Task[Measured]]] = field(default_factory=dict)
    # The builtin check's measurement in flight, as ``measuring`` (``RolloutLoop._metrics``): (what it
    # measures, task).
    builtin_measuring: tuple[tuple[Any, ...], asyncio.Task[Any]] | None = None
    # Pod → its refusal of the document it is to hold (``RolloutLoop._act``): not pushed that document
    # again before ``retry_at``; reported in the conditions while it lasts.
    refused: dict[str, Refusal] = field(default_factory=dict)

    def cancel_measurements(self) -> None:
        """Cancel and drop every declared check's measurement in flight (the GateConfig is gone, or
        its spec no longer parses): a request left running kept going to the check's own timeout,
        which the CRD does not bound."""
        for _, task in self.measuring.values():
            task.cancel()
        self.measuring.clear()
        self.cancel_builtin()

    def cancel_builtin(self) -> None:
        if self.builtin_measuring is not None:
            self.builtin_measuring[1].cancel()
            self.builtin_measuring = None


@dataclass(frozen=True)
class Refusal:
    key: str  # the refused document, exactly (its canonical JSON): a fixed one is another key
    reason: str  # the conditions' reason: StableChecksumMismatch, CanaryChecksumMismatch, GatePushRefused
    what: str  # what the pods refuse, why and what to do (the conditions' message names the pods first)
    retry_at: float
    delay: float


_REFUSAL_ORDER = ("StableChecksumMismatch", "CanaryChecksumMismatch", "GatePushRefused")


def _unhashed(doc: Mapping[str, Any]) -> list[str]:
    """The versions of ``doc``'s gate documents (stable, and a set's canary) whose params do not hash
    to their version and checksum. Hashes only a refused document, never a status as read."""
    out = []
    for part in (doc, doc.get("canary")):
        if not isinstance(part, Mapping) or not isinstance(part.get("params"), Mapping):
            continue
        try:
            ok = (gatedoc.version_of(part["params"]), gatedoc.checksum_of(part["params"])) == \
                (part.get("version"), part.get("checksum"))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            out.append(str(part.get("version")))
    return out


def refusal(*, namespace: str, name: str, doc: Mapping[str, Any], status: RolloutStatus, code: int | None,
            detail: str) -> tuple[str, str]:
    """(reason, what) for pods that refused ``doc`` with ``code`` and their message ``detail``."""
    answer = f"the pods answer {code}: {detail}"
    unhashed = (f"its params no longer hash to its version and checksum (edited by hand, or written back by a tool "
                f"restoring status; {answer})")
    until = f"it goes to these pods again only after a growing delay (up to {REFUSED_RETRY_MAX_S:g} s)"
    patch = f"kubectl patch gateconfig {name} -n {namespace} --subresource=status --type=json -p"
    for version in _unhashed(doc):
        if status.stable is not None and version == status.stable.version:
            return "StableChecksumMismatch", (
                f"refuse status.stable {version}: {unhashed}. Put back the params of {version} that status.history "
                f"holds, or remove status.stable ({patch} '[{{\"op\":\"remove\",\"path\":\"/status/stable\"}}]'): "
                f"the operator restores it from status.history. Until then {until}")
        if status.canary is not None and version == status.canary.version:
            return "CanaryChecksumMismatch", (
                f"refuse status.rollout.canary {version}: {unhashed}. Remove status.rollout.canary ({patch} "
                f"'[{{\"op\":\"remove\",\"path\":\"/status/rollout/canary\"}}]'): the rollout starts over "
                f"from stable. Until then {until}")
    return "GatePushRefused", (
        f"refuse gate {document_key(doc)} ({answer}): change spec.params (or the model) so that its pods "
        f"accept it; until then {until}")


FleetCache = RolloutCache  # what ``RolloutLoop.fleet`` keeps between calls (credentials, reported pods)


@dataclass(frozen=True)
class Fleet:
    # Reachable candidates (have an IP) whose owner chain is the model's; without credentials
    # (``RolloutLoop.credentials`` adds them just before something is sent).
    targets: dict[str, PodTarget]
    all_pods: tuple[str, ...]  # every live pod of the models, with or without IP
    withheld: dict[str, tuple[str, str]] = field(default_factory=dict)  # pod → (uid, why no token)
    model_of: dict[str, str] = field(default_factory=dict)  # target pod → its model
    server_names: dict[str, str] = field(default_factory=dict)  # model → its admin TLS server name


def admin_port(pod: Mapping[str, Any]) -> int | None:
    """The model server's TLS admin port as the pod declares it (None: a pod rendered before the
    admin channel had a port of its own)."""
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") != render.CONTAINER_NAME:
            continue
        for port in c.get("ports") or []:
            if port.get("name") == names.ADMIN_PORT_NAME and port.get("containerPort"):
                return int(port["containerPort"])
    return None


def _model_event(model: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    kopf.event(dict(model), type=type_, reason=reason, message=message[:1024])


class RolloutLoop:
    def __init__(self, *, kube: Kube, admin: PodAdmin | None = None,
                 prometheus: PrometheusAPI | None = None, prometheus_url: str | None = None,
                 clock: Any = time.time, monotonic: Any = None, check_wait_s: float = CHECK_WAIT_S) -> None:
        self.kube = kube
        self.admin = admin or PodAdmin()
        self.prometheus = prometheus
        self.clock = clock
        # The direct scrape's in-memory windows and rates (never written anywhere) are measured on a
        # clock that a wall-clock jump does not move. A test's clock stands for both unless it gives its own.
        self.monotonic = monotonic or (time.monotonic if clock is time.time else clock)
        self.check_wait_s = check_wait_s
        # Declared checks' providers (stateless; the builtin one is per GateConfig, in its RolloutCache).
        self.providers = {Provider.PROMETHEUS: PrometheusQuery(default_address=prometheus_url),
                          Provider.WEB: WebRequest()}

    # ------------------------------------------------------------ observation

    async def _fleet(self, *, namespace: str, models: Sequence[str], inventory: Inventory) -> Fleet:
        """Pods of the referencing models that are really theirs, read from the watched projections
        (``controllers.inventory``): no API request in the steady state. A model's Deployment or a
        pod's ReplicaSet the watches have not delivered yet (created a moment ago) is read from the
        API server instead, so a new pod is not refused for the watches' lag."""
        live_models = {m: v for m in models if (v := inventory.model(namespace, m)) is not None}
        if not live_models:
            return Fleet(targets={}, all_pods=())
        pods_of = {m: inventory.pods(namespace, m) for m in sorted(live_models)}
        items = [pod for pods in pods_of.values() for pod in pods]
        # Only a model with pods needs its Deployment (for their owner checks): a model created a
        # moment ago has neither, and asking for its Deployment would be a 404 every tick.
        deployment_of: dict[str, Mapping[str, Any] | None] = {}
        for m in (m for m, pods in pods_of.items() if pods):
            deployment_of[m] = inventory.deployment(namespace, m) or await self._read_view(
                "Deployment", namespace=namespace, name=m)
        replicasets: dict[str, Mapping[str, Any]] = {}
        for pod in items:
            ref = controller_ref(pod)
            uid = (ref or {}).get("uid")
            if not ref or ref.get("kind") != "ReplicaSet" or not uid or uid in replicasets:
                continue
            rs = inventory.replicaset(namespace, uid) or await self._read_view(
                "ReplicaSet", namespace=namespace, name=ref.get("name") or "")
            if rs is not None and rs["metadata"].get("uid") == uid:
                replicasets[uid] = rs
        targets: dict[str, PodTarget] = {}
        withheld: dict[str, tuple[str, str]] = {}
        model_of: dict[str, str] = {}
        live: list[str] = []
        for pod in items:
            meta, status = pod["metadata"], pod.get("status") or {}
            model_name = (meta.get("labels") or {}).get(names.MODEL_LABEL)
            if model_name not in live_models or meta.get("deletionTimestamp") \
                    or status.get("phase") in ("Succeeded", "Failed"):
                continue
            problem = ownership_problem(pod, replicasets=replicasets, deployment=deployment_of[model_name],
                                        model=live_models[model_name])
            if problem is not None:
                # Labelled as the model's but not its pod: no token, no push, no scrape, and not
                # part of the rollout (a labelled pod must not be able to stall or fake one).
                withheld[meta["name"]] = (meta.get("uid", ""), problem)
                continue
            live.append(meta["name"])
            if status.get("podIP"):
                model_of[meta["name"]] = model_name
                targets[meta["name"]] = PodTarget(
                    name=meta["name"], ip=status["podIP"], port=render.serving_port(live_models[model_name]),
                    admin_port=admin_port(pod))
        return Fleet(targets=targets, all_pods=tuple(sorted(live)), withheld=withheld, model_of=model_of,
                     server_names={m: render.admin_server_name(v) for m, v in live_models.items()})

    async def _read_view(self, kind: str, *, namespace: str, name: str) -> Mapping[str, Any] | None:
        body = await asyncio.to_thread(self.kube.get, kind, namespace=namespace, name=name) if name else None
        return fleet_view.owner_view(body) if body is not None else None

    async def fleet(self, *, namespace: str, models: Sequence[str], inventory: Inventory) -> Fleet:
        """The models' pods that may be sent their admin token (the same owner checks as a rollout's);
        ``handlers.accesssync`` pushes access rules to these."""
        return await self._fleet(namespace=namespace, models=models, inventory=inventory)

    async def credentials(self, *, namespace: str, fleet: Fleet, pods: Iterable[str],
                          cache: FleetCache) -> dict[str, PodTarget]:
        """``pods``' targets with their model's admin credentials, the models' Secrets read now (one
        GET per model, only when something is to be sent: a rotated or deleted Secret takes effect
        at the next push)."""
        wanted = [p for p in pods if p in fleet.targets]
        creds = await self.model_credentials(namespace=namespace, models=sorted({fleet.model_of[p] for p in wanted}),
                                             server_names=fleet.server_names, cache=cache)
        out = {}
        for p in wanted:
            c = creds[fleet.model_of[p]]
            out[p] = dataclasses.replace(fleet.targets[p], admin=c.current, previous_admin=c.previous, refusal=c.error)
        return out

    async def model_credentials(self, *, namespace: str, models: Sequence[str], server_names: Mapping[str, str],
                                cache: FleetCache) -> dict[str, ModelCredentials]:
        """The models' admin credentials from their Secrets as read now (one GET per model). A
        Secret that is gone, unusable or ending within ``admin_tls.RENEW_BEFORE`` is replaced first,
        as the model's reconcile would (``admin_secret.ensure_admin_secret``): reconciles follow
        changes of the model, so without this a certificate nobody changed ran out and every push
        to the model's pods was refused from then on."""
        secrets = await asyncio.gather(*(self._admin_secret(namespace, m, server_names[m], cache) for m in models))
        return {m: cache.credentials.update(secret, namespace=namespace, model=m, server_name=server_names[m])
                for m, secret in zip(models, secrets)}

    async def _admin_secret(self, namespace: str, model: str, server_name: str,
                            cache: FleetCache) -> Mapping[str, Any] | None:
        name = render.admin_secret_name(model)
        secret = await asyncio.to_thread(self.kube.get, "Secret", namespace=namespace, name=name)
        cache.secrets_read[model] = self.clock()
        problem = "not found" if secret is None else admin_tls.secret_problem(
            secret, server_name=server_name, now=datetime.datetime.now(datetime.timezone.utc))
        if problem is None:
            return secret
        if secret is not None:
            # What the pods present until their Secret volume shows the new files: the store keeps
            # it as the previous credentials for the rotation grace.
            cache.credentials.update(secret, namespace=namespace, model=model, server_name=server_name)
        try:
            await asyncio.to_thread(self._renew_admin_secret, namespace, model)
        except KubeError as e:  # e.g. a 409: the model's reconcile replaced it meanwhile
            log.warning("admin Secret %s/%s (%s) not replaced: %s", namespace, name, problem, e)
        return await asyncio.to_thread(self.kube.get, "Secret", namespace=namespace, name=name)

    def _renew_admin_secret(self, namespace: str, model: str) -> None:
        """The model's reconcile's Secret check, for a model that lives (a deleted one's Secret goes with it)."""
        body = self.kube.get("SparseModel", namespace=namespace, name=model)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        admin_secret.ensure_admin_secret(self.kube, body, events=_model_event, logger=log)

    async def _check_admin_secrets(self, *, namespace: str, fleet: Fleet, cache: RolloutCache) -> None:
        """Read (and renew if due) the admin Secret of each model last read ``ADMIN_SECRET_CHECK_S``
        ago or more. A model first seen counts as read now: the reconcile that created or resumed it
        has just checked its Secret. A model no longer the GateConfig's loses its credentials (TLS
        contexts, ~19 KiB a model, kept for as long as the GateConfig lives otherwise)."""
        now = self.clock()
        for m in [m for m in cache.secrets_read if m not in fleet.server_names]:
            del cache.secrets_read[m]
            cache.credentials.forget(namespace=namespace, model=m)
        due = sorted(m for m in fleet.server_names
                     if now - cache.secrets_read.setdefault(m, now) >= ADMIN_SECRET_CHECK_S)
        if not due:
            return
        try:
            await self.model_credentials(namespace=namespace, models=due, server_names=fleet.server_names,
                                         cache=cache)
        except KubeError as e:  # not this tick's business: the next check (or send) reads them again
            log.warning("admin Secrets of %s/%s not checked: %s", namespace, ", ".join(due), e)
            cache.secrets_read.update(dict.fromkeys(due, now))

    async def _observe_pods(self, fleet: Fleet) -> tuple[PodObservation, ...]:
        health = await self.admin.health(list(fleet.targets.values()))
        out = []
        for name in fleet.all_pods:
            h = health.get(name)
            out.append(PodObservation(name=name, reachable=bool(h and h.reachable), version=h.serving if h else None,
                                      addressed=name in fleet.targets))  # targets: the pods with an IP
        return tuple(out)

    def _request(self, *, namespace: str, fleet: Fleet, status: RolloutStatus, now: float,
                 mono: float | None = None) -> MeasureRequest:
        # Each group counts only the requests its own version served. Under `requests` both groups
        # are every pod; under `instances` the canary pods' requests of the canary version and the
        # others' of the stable one, so a pod still finishing requests of a version just rolled
        # back (seconds of injected latency, in CI) does not fail the next rollout's first window.
        by_version = status.canary is not None and status.stable is not None
        if by_version and status.strategy == Strategy.REQUESTS:
            canary = stable = sorted(fleet.targets)
        else:
            canary = [p for p in status.canary_pods if p in fleet.targets]
            stable = [p for p in fleet.targets if p not in set(status.canary_pods)]
        return MeasureRequest(
            namespace=namespace, now=now, monotonic=mono, targets=fleet.targets, canary=canary, stable=stable,
            analysing=status.phase == Phase.ANALYSING,
            window_key=(status.canary.version if status.canary else None, status.step, status.analysis_started_at),
            analysis_started_at=status.analysis_started_at,
            canary_version=status.canary.version if by_version and status.canary else None,
            stable_version=status.stable.version if by_version and status.stable else None)

    async def _metrics(self, *, spec: RolloutSpec, request: MeasureRequest, status: RolloutStatus,
                       cache: RolloutCache) -> dict[str, Any]:
        """The builtin check's window groups and this tick's calibration samples (no builtin check: none)."""
        if cache.builtin is None:
            cache.builtin = PrometheusGroups(self.prometheus) if self.prometheus is not None \
                else DirectScrape(self.admin)
        if spec.builtin is None or status.phase not in (Phase.PROGRESSING, Phase.ANALYSING) or status.canary is None:
            cache.cancel_builtin()
            cache.builtin.reset()
            return {}
        # Waited for at most check_wait_s, as declared checks are: a slow or hanging Prometheus (5 s a
        # query) held the tick, and with it an abort, a pause or a promote. An answer not in by then
        # is picked up by a later tick, unless the window or its pods changed meanwhile.
        key = (request.window_key, request.analysing, tuple(request.canary), tuple(request.stable))
        if cache.builtin_measuring is not None and cache.builtin_measuring[0] != key:
            cache.cancel_builtin()
        if cache.builtin_measuring is None:
            cache.builtin_measuring = (key, asyncio.ensure_future(cache.builtin.measure(spec.builtin, request)))
        task = cache.builtin_measuring[1]
        await asyncio.wait([task], timeout=self.check_wait_s)
        if not task.done():
            return {"builtin_error": f"{type(cache.builtin).__name__} has not answered within {self.check_wait_s:g}s; "
                                     f"a later tick takes its answer"}
        cache.builtin_measuring = None
        try:
            answer = task.result()
        except Exception as e:  # noqa: BLE001 - Prometheus down or refusing: no data this tick, said in status
            return {"builtin_error": f"{type(e).__name__}: {e}"[:300]}
        return answer.observations() if isinstance(answer, BuiltinWindow) else {}

    @staticmethod
    def _drop_measuring(cache: RolloutCache, keep: Mapping[str, tuple[Any, ...]]) -> None:
        """Cancel the measurements in flight that are no longer wanted (the run ended, the check
        was edited or removed): ``keep`` maps the wanted checks to their (run key, check)."""
        for n, (key, task) in list(cache.measuring.items()):
            if keep.get(n) != key:
                task.cancel()
                del cache.measuring[n]

    async def _declared(self, *, spec: RolloutSpec, request: MeasureRequest, status: RolloutStatus, name: str,
                        models: Sequence[str], now: float, cache: RolloutCache,
                        wait_s: float | None = None) -> dict[str, Measured]:
        """Answers of the declared checks whose measurement is due this tick. Each due check's
        measurement is started once and waited for at most ``wait_s`` (``check_wait_s``); one still
        in flight then is kept in ``cache.measuring`` and recorded by the tick that finds it answered
        (taken at the time it was started), so a hanging endpoint never holds the tick."""
        run = status.analysis_runs[-1] if status.analysis_runs else None
        if status.phase != Phase.ANALYSING or run is None or run.phase != RunPhase.RUNNING \
                or status.canary is None or status.stable is None or status.step is None:
            self._drop_measuring(cache, {})
            return {}
        due = analysis_run.due_checks(spec.checks, run, now=now, default_interval_s=spec.analysis_interval_s)
        run_key = (run.step, run.canary_version, run.started_at)
        self._drop_measuring(cache, {c.name: (run_key, c) for c in due})
        if not due:
            return {}

        def args(check: analysis_run.CheckSpec) -> dict[str, str]:
            assert status.canary is not None and status.stable is not None and status.step is not None
            return analysis_run.measure_args(
                namespace=request.namespace, gate_config=name, models=models, canary_pods=status.canary_pods,
                # The builtin's stable group: every pod under `requests` (each serves both versions;
                # this was "_", no pod), the others under `instances`.
                stable_pods=request.stable,
                canary_version=status.canary.version, stable_version=status.stable.version, step=status.step + 1,
                percent=spec.steps[min(status.step, len(spec.steps) - 1)],
                window_s=check.interval_s or spec.analysis_interval_s)

        for c in due:
            if c.name not in cache.measuring:
                task = asyncio.ensure_future(
                    measure_safely(self.providers[c.provider], c, dataclasses.replace(request, args=args(c))))
                cache.measuring[c.name] = ((run_key, c), task)
        tasks = [cache.measuring[c.name][1] for c in due]
        await asyncio.wait(tasks, timeout=self.check_wait_s if wait_s is None else wait_s)
        out: dict[str, Measured] = {}
        for c in due:
            task = cache.measuring[c.name][1]
            if not task.done():
                continue  # still measuring: a later tick records it
            del cache.measuring[c.name]
            a = out[c.name] = task.result()
            answer = "error" if a.error is not None else "no_data" if a.value is None else "value"
            MEASUREMENTS.labels(provider=c.provider.value, answer=answer).inc()
        return out

    # ------------------------------------------------------------ the tick

    async def tick(self, *, namespace: str, name: str, models: Sequence[str], cache: RolloutCache,
                   inventory: Inventory, seen: Mapping[str, Any] | None = None, pod_changes: int = 0,
                   logger: logging.Logger = log) -> Decision | None:
        """One reconcile. ``seen``: the object as the watch last delivered it, for a cheap skip.
        ``pod_changes``: how many watch events of its models' pods the caller has counted (a
        resting GateConfig checks again when the count moved since its last full check)."""
        if seen is not None and self._quiet(seen, cache=cache, now=self.clock(), pod_changes=pod_changes):
            return None  # resting and checked recently: not even a GET (1,000s of ticks at scale)
        started = time.perf_counter()
        try:
            return await self._tick(namespace=namespace, name=name, models=models, cache=cache, inventory=inventory,
                                    pod_changes=pod_changes, logger=logger, seen=seen)
        except Exception as e:
            # The check did not finish (a 409, the API server failing or unreachable): the next tick
            # checks in full again, or a resting GateConfig's pods it was to fix waited for the
            # safety-net check (RESTING_CHECK_S), its pod-change count being marked as checked.
            cache.last_full_check = -math.inf
            if isinstance(e, Conflict):
                cache.read_fresh = True
            raise
        finally:
            TICK_SECONDS.observe(time.perf_counter() - started)

    def next_tick_in(self, seen: Mapping[str, Any], *, cache: RolloutCache, interval_s: float) -> float | None:
        """How long a GateConfig's loop may sleep after a tick (None: ``interval_s``). A resting one
        (``seen``: its :meth:`quiet_view`) has nothing to do before its safety-net check,
        ``RESTING_CHECK_S`` after its last full check; a pod change or an event of the object
        brings its next tick within ``interval_s`` again (``handlers.periodic``)."""
        if seen.get("resting") is not True or cache.read_fresh:
            return None
        since = self.clock() - cache.last_full_check
        if since < 0:  # the wall clock went back past the last check: not a sleep of the jump's length
            return None
        return max(interval_s, RESTING_CHECK_S - since)

    @staticmethod
    def quiet_view(body: Mapping[str, Any]) -> dict[str, Any]:
        """What the per-GateConfig loop keeps between ticks instead of the parsed object: the
        metadata ``handlers.periodic`` reads and whether the object as delivered is :meth:`resting`,
        decided once per watch event rather than once per tick (parsing the spec and hashing its
        version took ~60 µs: at 2,000 GateConfigs and a 1 s tick, a tenth of a core); when resting,
        also its :meth:`snapshot`, which a pod check starts from instead of a GET."""
        meta = body.get("metadata") or {}
        resting = RolloutLoop.resting(body)
        # uid too: ``handlers.periodic`` tells a re-created object of the name from the deleted one by it.
        view: dict[str, Any] = {"metadata": {k: meta[k] for k in ("name", "namespace", "uid", "deletionTimestamp")
                                             if k in meta},
                                "resting": resting}
        if resting:
            view["snapshot"] = RolloutLoop.snapshot(body)
        return view

    @staticmethod
    def snapshot(body: Mapping[str, Any]) -> bytes:
        """The object as compact JSON, without what no tick reads (managedFields, kubectl's
        last-applied copy): what a resting GateConfig's pod check starts from instead of a GET.
        Bytes rather than the parsed object: ~a third of its memory, parsed only when used."""
        meta = dict(body.get("metadata") or {})
        meta.pop("managedFields", None)
        annotations = meta.get("annotations")
        if annotations and _LAST_APPLIED in annotations:
            meta["annotations"] = {k: v for k, v in annotations.items() if k != _LAST_APPLIED}
        return json.dumps({**body, "metadata": meta}, separators=(",", ":"), default=dict).encode()

    @staticmethod
    def _watched_copy(seen: Mapping[str, Any] | None, cache: RolloutCache) -> dict[str, Any] | None:
        """The resting object as last watched, if the tick may start from it."""
        raw = (seen or {}).get("snapshot")
        if not raw or cache.read_fresh:
            return None
        body = json.loads(raw)
        if (body.get("metadata") or {}).get("resourceVersion") in cache.superseded:
            return None  # our own write since has not come back through the watch yet
        return body

    @staticmethod
    def _quiet(body: Mapping[str, Any], *, cache: RolloutCache, now: float, pod_changes: int = 0) -> bool:
        """Nothing to do: checked recently, no pod changed since, and :meth:`resting`. ``body``: the
        object, or its :meth:`quiet_view`."""
        # A check "in the future" (the wall clock went back past it) is due too, not the jump waited out.
        if not 0 <= now - cache.last_full_check < RESTING_CHECK_S or pod_changes != cache.checked_pod_changes:
            return False
        resting = body.get("resting")
        return resting if isinstance(resting, bool) else RolloutLoop.resting(body)

    @staticmethod
    def resting(body: Mapping[str, Any]) -> bool:
        """Resting, spec already stable (or rejected), no one-shot annotation, status observed the spec."""
        meta = body.get("metadata") or {}
        status = RolloutStatus.from_status(body.get("status"))
        if any(pending_requests(meta.get("annotations"), status).values()):
            return False  # (a request left in place, its value handled, is none: GitOps keeps it)
        present = request_values(meta.get("annotations"))
        if any(present.get(a) != v for a, v in status.handled_requests):
            return False  # gone (or changed): drop its record, or the same value back would not act
        if (body.get("status") or {}).get("observedGeneration") != meta.get("generation"):
            return False  # Flux/Argo wait on observedGeneration: record a spec edit (e.g. pause) at once
        if status.phase not in RESTING_PHASES or status.stable is None:
            return False
        try:
            target = parse_spec(body.get("spec") or {}).target.version
        except SpecError:
            return False
        return target == status.stable.version or rejection_holds(status, target)

    async def _tick(self, *, namespace: str, name: str, models: Sequence[str], cache: RolloutCache,
                    inventory: Inventory, pod_changes: int, logger: logging.Logger,
                    seen: Mapping[str, Any] | None = None) -> Decision | None:
        body = self._watched_copy(seen, cache)
        if body is None:
            body = await asyncio.to_thread(self.kube.get, "GateConfig", namespace=namespace, name=name)
            cache.read_fresh = False
        if body is None or body["metadata"].get("deletionTimestamp"):
            cache.cancel_measurements()
            return None
        now, mono = self.clock(), self.monotonic()
        status = RolloutStatus.from_status(body.get("status"))
        requests = annotation_requests(body["metadata"].get("annotations"))
        values = request_values(body["metadata"].get("annotations"))
        declared = declared_requests(body["metadata"])
        try:
            spec = parse_spec(body.get("spec") or {})
        except SpecError as e:
            cache.cancel_measurements()
            decision = invalid_spec(status=status, error=str(e), now=now)
            await self._persist(body, decision, steps=(100,), cache=cache)
            await self._act(body, decision, fleet=None, cache=cache, logger=logger)
            return decision

        for percent in spec.steps:
            STEP_SECONDS.labels(percent=str(percent))  # at 0 before its first step ends (see OUTCOMES)
        if self._quiet(body, cache=cache, now=now, pod_changes=pod_changes):
            return None
        cache.last_full_check, cache.checked_pod_changes = now, pod_changes

        fleet = await self._fleet(namespace=namespace, models=models, inventory=inventory)
        self._report_withheld(body, fleet, cache=cache, logger=logger)
        await self._check_admin_secrets(namespace=namespace, fleet=fleet, cache=cache)
        decision: Decision | None = None
        for attempt in range(3):
            pods = await self._observe_pods(fleet)
            request = self._request(namespace=namespace, fleet=fleet, status=status, now=now, mono=mono)
            metrics = await self._metrics(spec=spec, request=request, status=status, cache=cache)
            if attempt:
                # One calibration sample per tick: a second look's rates span only the moment since
                # the first (a direct scrape's fleet qps over a sub-second gap is noise).
                metrics.pop("fleet_qps", None)
                metrics.pop("stable_error_rate", None)
            # (A later look only collects what answered meanwhile: the tick waited once.)
            measured = await self._declared(spec=spec, request=request, status=status, name=name, models=models,
                                            now=now, cache=cache, wait_s=0.0 if attempt else None)
            refused = self._push_refused(namespace=namespace, name=name, cache=cache)
            obs = Observations(pods=pods, **requests, **metrics, measurements=measured,
                               models=len(fleet.server_names), request_values=values, declared=declared,
                               push_refused=refused)
            decision = next_action(spec=spec, status=status, obs=obs, now=now)
            body = await self._persist(body, decision, steps=spec.steps, cache=cache)
            body = await self._clear_requests(body, decision, steps=spec.steps, cache=cache)
            pushed = await self._act(body, decision, fleet=fleet, cache=cache, logger=logger)
            if not pushed and self._push_refused(namespace=namespace, name=name, cache=cache) == refused:
                break  # nothing new landed on a pod, no refusal began or ended: the next tick looks again
            # Pushed: look again now so verified pods (and the next phase) are recorded this tick.
            status, now, mono = decision.status, self.clock(), self.monotonic()
            requests = dict.fromkeys(requests, False)
        return decision

    @staticmethod
    def _report_withheld(body: Mapping[str, Any], fleet: Fleet, *, cache: RolloutCache, logger: logging.Logger) -> None:
        """One Warning Event (and log line) per pod and reason that was refused the admin token, while it
        is refused: the record of a pod gone (or no longer refused) goes, so the cache holds the pods
        refused now, not every labelled pod ever refused."""
        cache.withheld &= set(fleet.withheld.values())
        for pod, (uid, why) in sorted(fleet.withheld.items()):
            if (uid, why) in cache.withheld:
                continue
            cache.withheld.add((uid, why))
            message = f"pod {pod} carries a model's labels but is not its pod ({why}): no admin token sent"
            logger.warning("%s", message)
            kopf.event(dict(body), type="Warning", reason="AdminTokenWithheld", message=message[:1024])

    async def _persist(self, body: Mapping[str, Any], decision: Decision, *, steps: Sequence[int],
                       cache: RolloutCache) -> dict[str, Any]:
        """Replace status (keeping fields other writers own); skipped when nothing changed. A write
        records the resourceVersion it replaced in ``cache.superseded``."""
        current = dict(body.get("status") or {})
        new = {**current, **decision.status.to_status(steps=steps),
               "observedGeneration": body["metadata"].get("generation")}
        if new == current:
            return dict(body)
        path = path_for("GateConfig", namespace=body["metadata"]["namespace"], name=body["metadata"]["name"],
                        subresource="status")
        # A JSON patch replaces status wholesale (a merge patch would merge the params maps of
        # two gate versions). Carrying metadata.resourceVersion makes a concurrent writer's
        # change a 409 Conflict: nothing is acted on, the next tick starts from a fresh read.
        ops = [{"op": "replace", "path": "/metadata/resourceVersion", "value": body["metadata"]["resourceVersion"]},
               {"op": "add", "path": "/status", "value": new}]
        written = await asyncio.to_thread(self.kube.request, "PATCH", path, body=ops,
                                          content_type="application/json-patch+json")
        cache.superseded.append(body["metadata"]["resourceVersion"])
        return written

    async def _clear_requests(self, body: Mapping[str, Any], decision: Decision, *, steps: Sequence[int],
                              cache: RolloutCache) -> dict[str, Any]:
        """Clear the one-shot annotations the decision consumed (its status, which holds their effect
        and names them in ``consumedRequests``, is written by now), then write that status without
        that record: from then on such an annotation is a new request. Returns the object as last
        written, so a later write of this tick carries its resourceVersion (not a 409)."""
        names = [a.name for a in decision.actions if isinstance(a, ClearAnnotation)]
        if not names:
            return dict(body)
        path = path_for("GateConfig", namespace=body["metadata"]["namespace"], name=body["metadata"]["name"])
        cleared = await asyncio.to_thread(
            self.kube.request, "PATCH", path, body={"metadata": {"annotations": dict.fromkeys(names)}},
            content_type="application/merge-patch+json")
        body = cleared if (cleared.get("metadata") or {}).get("resourceVersion") else dict(body)
        if not decision.status.consumed_requests:
            return body
        done = dataclasses.replace(decision.status, consumed_requests=())
        try:
            return await self._persist(body, dataclasses.replace(decision, status=done), steps=steps, cache=cache)
        except Conflict:
            # Written meanwhile (a spec edit): the tick still acts on its persisted decision, and the
            # next one drops the record, the annotations being gone.
            return body

    async def _act(self, body: Mapping[str, Any], decision: Decision, *, fleet: Fleet | None, cache: RolloutCache,
                   logger: logging.Logger) -> int:
        """Perform the decision's side effects (its annotation clears are :meth:`_clear_requests`'); returns
        how many gate pushes succeeded."""
        gates: list[tuple[str, Mapping[str, Any]]] = []
        for action in decision.actions:
            if isinstance(action, PushGate) and fleet is not None and action.pod in fleet.targets:
                gates.append((action.pod, action.gate.document()))
            elif isinstance(action, EmitEvent):
                kopf.event(dict(body), type=action.type, reason=action.reason, message=action.message[:1024])
                (logger.warning if action.type == "Warning" else logger.info)("%s: %s", action.reason, action.message)
            elif isinstance(action, RecordOutcome):
                ROLLOUTS.labels(outcome=action.outcome).inc()
            elif isinstance(action, RecordStep):
                STEP_SECONDS.labels(percent=str(action.percent)).observe(action.seconds)
        gates = self._hold_refused(gates, cache=cache)
        if not gates or fleet is None:
            return 0
        targets = await self.credentials(namespace=body["metadata"]["namespace"], fleet=fleet,
                                         pods=[p for p, _ in gates], cache=cache)
        results = await self.admin.push([(targets[p], doc) for p, doc in gates])
        for r in results.values():
            PUSHES.labels(result="ok" if r.ok else "error").inc()
        self.log_push_failures([(r.name, None if r.ok else str(r.error)) for r in results.values()],
                               pods=fleet.targets, cache=cache, logger=logger, what="push to %s")
        self._record_refusals(body, decision, gates, results, cache=cache)
        if not all(r.ok or r.refused for r in results.values()):
            # A pod left on the wrong gate (unreachable for a moment): the next tick checks in full
            # again, not a resting GateConfig's safety net (RESTING_CHECK_S) later.
            cache.last_full_check = -math.inf
        return sum(1 for r in results.values() if r.ok)

    def _hold_refused(self, gates: list[tuple[str, Mapping[str, Any]]], *,
                      cache: RolloutCache) -> list[tuple[str, Mapping[str, Any]]]:
        """``gates`` less the pods that refused that same document and wait out their delay. A pod's
        refusal goes once it is to hold another document (or none: it reports the one it should)."""
        if not cache.refused:
            return gates
        wanted = {p: canonical_json(doc) for p, doc in gates if p in cache.refused}
        for pod in [p for p, r in cache.refused.items() if wanted.get(p) != r.key]:
            del cache.refused[pod]
        now = self.clock()
        held = {p for p in wanted if p in cache.refused and now < cache.refused[p].retry_at}
        self._next_check_at_retry(cache, now=now)
        return [(p, doc) for p, doc in gates if p not in held]

    def _record_refusals(self, body: Mapping[str, Any], decision: Decision, gates: list[tuple[str, Mapping[str, Any]]],
                         results: Mapping[str, Any], *, cache: RolloutCache) -> None:
        """Remember the pods that refused their document (the conditions say so from the next look),
        each waiting a doubled delay before the same document goes to it again; a Warning Event when
        a refusal begins."""
        meta, now, started = body["metadata"], self.clock(), []
        for pod, doc in gates:
            r = results.get(pod)
            if r is not None and r.ok:
                cache.refused.pop(pod, None)
            if r is None or not r.refused:
                continue
            previous = cache.refused.get(pod)
            delay = min(REFUSED_RETRY_MAX_S, 2 * previous.delay) if previous is not None else REFUSED_RETRY_S
            reason, what = refusal(namespace=meta["namespace"], name=meta["name"], doc=doc, status=decision.status,
                                   code=r.status, detail=r.detail or str(r.error))
            cache.refused[pod] = Refusal(key=canonical_json(doc), reason=reason, what=what, retry_at=now + delay,
                                         delay=delay)
            if previous is None:
                started.append(pod)
        if started:
            message = self._push_refused(namespace=meta["namespace"], name=meta["name"], cache=cache,
                                         pods=started)
            if message is not None:
                kopf.event(dict(body), type="Warning", reason=message[0], message=message[1][:1024])
        self._next_check_at_retry(cache, now=now)

    @staticmethod
    def _next_check_at_retry(cache: RolloutCache, *, now: float) -> None:
        """A resting GateConfig whose pods refuse checks them again when the first delay still to come
        ends (not at every tick, nor RESTING_CHECK_S later)."""
        waits = [r.retry_at for r in cache.refused.values() if r.retry_at > now]
        if waits:
            cache.last_full_check = min(cache.last_full_check, min(waits) - RESTING_CHECK_S)

    @staticmethod
    def _push_refused(*, namespace: str, name: str, cache: RolloutCache,
                      pods: Iterable[str] | None = None) -> tuple[str, str] | None:
        """(reason, message) of the pods' refusals (``pods``: only theirs) for the conditions: the most
        telling one (a checksum mismatch first), naming the GateConfig and its pods; None: none."""
        chosen = set(cache.refused) if pods is None else set(pods)
        groups: dict[tuple[str, str], list[str]] = {}
        for pod, r in cache.refused.items():
            if pod in chosen:
                groups.setdefault((r.reason, r.what), []).append(pod)
        if not groups:
            return None
        (reason, what), refusing = min(groups.items(), key=lambda g: (_REFUSAL_ORDER.index(g[0][0]), g[0][1]))
        refusing.sort()
        shown = listed(refusing)
        others = len(groups) - 1
        return reason, (f"GateConfig {namespace}/{name}: {len(refusing)} pod(s) ({shown}) {what}"
                        + (f"; other pods refuse another document ({others} more refusal(s))" if others else ""))[:2048]

    @staticmethod
    def log_push_failures(results: Iterable[tuple[str, str | None]], *, pods: Iterable[str], cache: RolloutCache,
                          logger: logging.Logger | logging.LoggerAdapter, what: str) -> None:
        """A WARNING when a pod's push fails, again only once it fails otherwise or after one landed;
        the same failure at the next ticks (a pod that keeps refusing is pushed again every tick) at
        DEBUG. ``results``: (pod, error; None: it landed); ``pods``: the live ones (others are
        forgotten); ``what``: the message's start, with the pod's ``%s``."""
        live = set(pods)
        for pod in [p for p in cache.push_failures if p not in live]:
            del cache.push_failures[pod]
        for pod, error in results:
            repeated = repeats(cache.push_failures, pod, error)
            if error is not None:
                (logger.debug if repeated else logger.warning)(f"{what} failed%s: %s", pod,
                                                                 " again" if repeated else "", error)
