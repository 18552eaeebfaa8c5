"""RoutingPolicy → OPA → flow allow-list (issue 5), as Kopf handlers.

Every RoutingPolicy and every pod feed one OPA data document and one allow-list, so each handler
runs the same `PolicySync.sync` (serialised by a lock) over Kopf's in-memory indexes of all
RoutingPolicies and pods, then writes only its own object's status:

1. build the indexed OPA data (`domain.policy`); push Rego + data when OPA's revision differs
   (a restarted OPA has none, so it gets everything again without anyone re-applying);
2. ask OPA, in one evaluation, about every (identity class, model, port) worth asking
   (`flow_decisions`; questions and answers in `domain.policy_compile`);
3. publish the allow-list ConfigMap (identities and identity rules, `domain.policy_compile`;
   sharded over several when it is large) when its version changed, with the decision basis (which policy specs it was decided from) as an
   annotation; unless it does not fit the agents' policy map or the ConfigMaps
   (`domain.policy_capacity`): then the published one is kept and every
   policy reports Ready=False/Stalled=True reason PolicyTooLarge with needed vs capacity;
4. read back which policy generations OPA holds (`status.loadedInOPA`).

A loop per RoutingPolicy (``handlers.periodic``, driven by watch events: no finalizer, so deleting
a policy never waits for the operator or OPA) repeats this every
`SPARSEGATE_POLICY_RESYNC_SECONDS`; when neither the policies, the pods nor OPA changed it costs
one GET to OPA (its revision) and no API request (the status is compared with the watched object).
Fail closed: when OPA is unreachable, or answers `flow_decisions` in a shape the Rego does not
define (a broken Rego; the error names the entry), the allow-list is only ever narrowed (deleted
policies, departed pods, and what a policy changed or created since OPA last decided might take
away: `narrow_undecided`, against the decision basis recorded on the ConfigMap, so a restarted
operator knows it too), the object gets Degraded=True, and create/update handlers retry with
backoff (kopf.TemporaryError); a deletion narrows and completes, and its sync is tried again every
resync interval until one succeeds (after the last policy no loop is left to resync).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import kopf

from sparsegate_contracts import flowpolicy, names, rego
from sparsegate_contracts.canonical import sha256_of

from sparsegate import envvars
from sparsegate.repeated_failures import repeats
from sparsegate.clients.flow_policy import FlowPolicyConfigMap
from sparsegate.clients.kube import Kube
from sparsegate import policy_metrics
from sparsegate.gc_pause import gc_paused
from sparsegate.clients.opa import DEFAULT_URL, OpaRejected, OpaUnavailable, RoutingOpa
from sparsegate.domain.policy import (
    DEFAULT_TRUST_DOMAIN,
    PolicySource,
    build_opa_data,
    decision_basis,
    undecided_policies,
)
from sparsegate.domain.policy_capacity import Capacity, check
from sparsegate.domain.policy_compile import (
    MalformedAnswer,
    PodInfo,
    decision_counts,
    flow_document,
    flow_question,
    identity_classes,
    ip_classes,
    ip_owners,
    listed_addresses,
    narrow_document,
    narrow_undecided,
    pod_info,
    policies_named,
)
from sparsegate.domain.policy_status import SyncOutcome, status_changed, status_patch
from sparsegate.handlers.periodic import ObjectLoops, Retries

GROUP, VERSION, PLURAL = names.GROUP, names.VERSION, names.ROUTINGPOLICIES
# The decision basis's record of the class each identity of the allow-list stands for.
IDENTITY_CLASSES = "identities"
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Settings:
    opa_url: str
    namespace: str  # where the allow-list ConfigMap lives (the operator's namespace)
    trust_domain: str
    resync_seconds: float
    rego_path: Path | None = None  # None: the Rego shipped in sparsegate_contracts.rego
    # Bearer token OPA requires (the chart's sidecar runs --authentication=token); None: send none.
    # Kept out of repr so that logging the settings never prints it.
    opa_token: str | None = dataclasses.field(default=None, repr=False)
    # Published as the allow-list's `allowedSources`: the agents always let this pod's admin and
    # metrics traffic reach policed model pods. From POD_IP (the chart sets it); None: none.
    own_ip: str | None = None
    # Its other addresses (dual-stack: the IPv6 one), from POD_IPS (the downward API's
    # status.podIPs, comma-separated), published with own_ip.
    own_ips: tuple[str, ...] = ()
    # Limits a compiled allow-list must fit before it is published (lowered for tests by env).
    capacity: Capacity = Capacity()
    # The allow-list's head ConfigMap (its shards are named after it): the chart passes the name
    # its agents read (agent.policyConfigMap).
    flow_policy_configmap: str = flowpolicy.CONFIGMAP_NAME

    @property
    def allowed_sources(self) -> list[str]:
        return sorted({ip for ip in (self.own_ip, *self.own_ips) if ip})

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            opa_url=os.environ.get("SPARSEGATE_OPA_URL", DEFAULT_URL),
            opa_token=os.environ.get("SPARSEGATE_OPA_TOKEN") or None,
            namespace=os.environ.get("SPARSEGATE_NAMESPACE", "sparsegate-system"),
            trust_domain=os.environ.get("SPARSEGATE_TRUST_DOMAIN", DEFAULT_TRUST_DOMAIN),
            resync_seconds=envvars.seconds("SPARSEGATE_POLICY_RESYNC_SECONDS", 10.0),
            rego_path=Path(p) if (p := os.environ.get(rego.OVERRIDE_ENV)) else None,
            own_ip=os.environ.get("POD_IP") or None,
            own_ips=listed_addresses(os.environ.get("POD_IPS", ""), where="POD_IPS"),
            flow_policy_configmap=os.environ.get("SPARSEGATE_FLOW_POLICY_CONFIGMAP") or flowpolicy.CONFIGMAP_NAME,
            capacity=Capacity.from_env(os.environ),
        )


class PolicySync:
    """The operator's single view of what OPA holds and what the data plane enforces."""

    def __init__(self, *, settings: Settings, opa: RoutingOpa, store: FlowPolicyConfigMap,
                 kube: Kube | None = None) -> None:
        self.settings = settings
        self.opa = opa
        self.store = store
        self.rego = rego.routing_policy(settings.rego_path)
        self.lock = asyncio.Lock()
        self.status_lock = asyncio.Lock()
        self.kube = kube  # status writes; None where only OPA and the allow-list are exercised
        self.published: dict[str, Any] | None = None  # last document written or found
        # What the published allow-list was decided from (`decision_basis`): the policy specs OPA
        # last decided, or that narrowing has since accounted for. None: unknown (nothing decided).
        self.basis: dict[str, Any] | None = None
        self.owners: dict[str, str] | None = None  # pod owning each IP when OPA last decided
        self.fingerprint: str | None = None  # data revision + pods of the last good sync
        self.counts: dict[str, int] = {}
        self.loaded: dict[str, dict[str, Any]] = {}
        self.revision: str | None = None
        self.too_large: str | None = None  # why the latest compiled allow-list was not published

    async def sync(self, *, policies: list[PolicySource], pods: list[PodInfo]) -> None:
        """Bring OPA and the allow-list up to date; raises OpaUnavailable/OpaRejected after failing closed."""
        async with self.lock:
            data, _ = build_opa_data(sources=policies, trust_domain=self.settings.trust_domain, rego=self.rego)
            basis = decision_basis(sources=policies, trust_domain=self.settings.trust_domain, rego=self.rego)
            fingerprint = sha256_of({"revision": data["revision"], "pods": [dataclasses.astuple(p) for p in pods]})
            try:
                pushed = False
                if await self.opa.revision() != data["revision"]:
                    await self.opa.push(rego=self.rego, data=data)
                    pushed = True
                if pushed or fingerprint != self.fingerprint:
                    # The whole allow-list in one evaluation (`flow_decisions`), not one per question.
                    # The cyclic GC waits during the two synchronous halves (gc_pause: a full
                    # collection over the operator's caches costs as much as the build).
                    with gc_paused():
                        question = flow_question(targets=data["targets"], pods=pods,
                                                 trust_domain=self.settings.trust_domain)
                    answers = await self.opa.flow_decisions(question.input)
                    with gc_paused():
                        try:
                            decisions = question.decisions(answers)
                        except MalformedAnswer as e:
                            # Only a broken Rego answers so: fail closed as when OPA is down.
                            raise OpaUnavailable(f"OPA at {self.opa.url}: malformed answer, not used: {e}") from e
                        document = flow_document(decisions=decisions, pods=pods,
                                                 policed_models=question.models,
                                                 allowed_sources=self.settings.allowed_sources)
                    needed, too_large = check(document, self.settings.capacity)
                    policy_metrics.observe(needed=needed, capacity=self.settings.capacity,
                                           too_large=too_large is not None)
                    if too_large is None:
                        # Recorded with it: the class each identity stands for (`identity_classes`),
                        # so narrowing, here or in the next process, can tell an IP that changed class.
                        await self._publish(document, {**basis, IDENTITY_CLASSES: identity_classes(document, pods)})
                        self.owners = ip_owners(pods)
                        self.counts = decision_counts(document, self.owners)
                        self.too_large = None
                    else:
                        # Publishing would be refused (API server) or not loaded (agents) while the
                        # old allow-list stays enforced: keep it, say so on every policy. Kept, it
                        # is narrowed as when OPA is down (a Deny that tipped the allow-list over
                        # the limit, an Allow narrowed, a departed pod's IP: none may keep access).
                        if self.too_large != too_large.message:
                            log.warning(too_large.message)
                        self.too_large = too_large.message
                        await self._narrow(pods=pods, policies=policies, basis=basis,
                                           why="allow-list too large to publish")
                        if self.published is not None:
                            self.counts = decision_counts(self.published, ip_owners(pods))
                    self.fingerprint = fingerprint
                # What OPA holds follows from the data it was given: read it back only when that
                # data changed (a push, or another revision than the last read), not every resync.
                if pushed or self.revision != data["revision"]:
                    self.loaded = await self.opa.loaded_policies()
                self.revision = data["revision"]
            except (OpaUnavailable, OpaRejected):
                self.fingerprint = None  # decide afresh once OPA answers
                await self._narrow(pods=pods, policies=policies, basis=basis)
                raise

    async def _load_published(self) -> None:
        if self.published is None:
            self.published, self.basis = await self.store.read_published()

    async def _publish(self, document: dict[str, Any], basis: dict[str, Any]) -> None:
        await self._load_published()
        if self.published is None or self.published.get("version") != document["version"] or self.basis != basis:
            await self.store.publish(document, basis=basis)
            self.published, self.basis = document, basis

    async def _narrow(self, *, pods: list[PodInfo], policies: list[PolicySource], basis: dict[str, Any],
                      why: str = "OPA not usable") -> None:
        """OPA cannot decide (or its allow-list cannot be published): remove what the last decisions
        no longer justify, add nothing.

        Entries of deleted policies and of departed or reused pod IPs go (`narrow_document`; an IP
        whose pod is now of another class than its identity was recorded for too, even after a
        restart: the basis records each identity's class), and so does what a policy changed since
        OPA last decided might take away (`narrow_undecided`; after a restart "last decided" is the
        basis recorded with the published allow-list, or nothing). The result is recorded as decided
        from today's specs: every allow entry left is one they allow.
        """
        await self._load_published()
        if self.published is None:
            return  # nothing published: the agent's default (deny) stands
        undecided = undecided_policies(current=basis, decided=self.basis)
        # The class of each identity: as recorded; a basis without that record (an older operator
        # wrote it) vouches for no IP; no basis at all leaves every policy undecided anyway.
        classes_then = None if self.basis is None else dict(self.basis.get(IDENTITY_CLASSES) or {})
        narrowed = narrow_document(
            document=self.published, owners_then=self.owners, owners_now=ip_owners(pods),
            live_policies={p.key for p in policies}, classes_then=classes_then, classes_now=ip_classes(pods),
        )
        # Narrowing keeps each identity's number and class: the record stays true of what is left.
        basis = {**basis, IDENTITY_CLASSES: classes_then or {}}
        narrowed = narrow_undecided(document=narrowed, sources=policies, undecided=undecided, pods=pods)
        # IP-level entries (identity rules counted per pair of IPs): only ever fewer.
        before = sum(decision_counts(self.published).values())
        dropped = before - sum(decision_counts(narrowed).values())
        narrower = narrowed.get("version") != self.published.get("version")
        if narrower or self.basis != basis:
            document = narrowed if narrower else self.published
            await self.store.publish(document, basis=basis)
            if dropped:
                log.warning(f"{why}: removed {dropped} of {before} allow-list entries (fail closed; "
                            f"changed or new policies OPA has not decided: {sorted(undecided) or 'none'})")
            self.published, self.basis = document, basis

    def outcome(self, *, key: str, generation: int, error: Exception | None = None) -> SyncOutcome:
        loaded = self.loaded.get(key) or {}
        return SyncOutcome(
            generation=generation,
            loaded_generation=loaded.get("generation") if error is None else None,
            decision_count=self.counts.get(key, 0) if error is None else None,
            revision=self.revision,
            error=str(error) if error else None,
            rejected=isinstance(error, OpaRejected),
            too_large=self.too_large,
        )


_sync: PolicySync | None = None


def _state() -> PolicySync:
    global _sync
    if _sync is None:
        settings = Settings.from_env()
        _sync = PolicySync(
            settings=settings, opa=RoutingOpa(url=settings.opa_url, token=settings.opa_token),
            store=FlowPolicyConfigMap(namespace=settings.namespace, name=settings.flow_policy_configmap,
                                      max_bytes=settings.capacity.max_bytes),
            kube=Kube.from_environment(),
        )
    return _sync


def _values(index: kopf.Index) -> Iterable[Any]:
    for store in index.values():
        yield from store


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _backoff(retry: int) -> float:
    return float(min(2 ** min(retry, 5), 30))


# --- Indexes: every RoutingPolicy and every pod with an IP ---------------------------------


@kopf.index(GROUP, VERSION, PLURAL)
async def sparsegate_routing_policies(namespace: str, name: str, meta: kopf.Meta, body: kopf.Body, **_: Any) -> dict:
    if meta.get("deletionTimestamp"):
        return {}  # being deleted: already out of what OPA should hold
    spec = copy.deepcopy(dict(body.get("spec") or {}))
    return {(namespace, name): PolicySource(namespace=namespace, name=name, generation=meta.get("generation", 1),
                                            spec=spec)}


@kopf.index("", "v1", "pods")
async def sparsegate_flow_pods(body: kopf.Body, **_: Any) -> dict:
    # Keyed by namespace: read only as a whole (``_values``), and Kopf keeps one store per key,
    # so one per namespace instead of one per pod.
    info = pod_info(dict(body))
    return {info.namespace: info} if info else {}


# --- Handlers --------------------------------------------------------------------------------


async def _sync_and_status(
    *, name: str, namespace: str, meta: kopf.Meta,
    sparsegate_routing_policies: kopf.Index, sparsegate_flow_pods: kopf.Index, write_status: bool = True,
    body: Mapping[str, Any] | None = None,
) -> Exception | None:
    """``body``: the policy as last watched, compared with first instead of reading it (None: read).
    ``write_status``: False for a deleted policy (the index no longer holds it; one of its name
    that does is a re-created policy, whose own events write its status)."""
    sync = _state()
    key = f"{namespace}/{name}"
    policies = sorted(_values(sparsegate_routing_policies), key=lambda p: p.key)
    pods = sorted(_values(sparsegate_flow_pods), key=lambda p: (p.namespace, p.name))
    error: Exception | None = None
    try:
        await sync.sync(policies=policies, pods=pods)
    except (OpaUnavailable, OpaRejected) as e:
        error = e
    if write_status:
        await _write_status(sync, key=key, namespace=namespace, name=name, generation=meta.get("generation", 1),
                            error=error, current=body)
    return error


async def _write_status(sync: PolicySync, *, key: str, namespace: str, name: str, generation: int,
                        error: Exception | None, current: Mapping[str, Any] | None = None) -> None:
    """Status from the latest shared sync state, computed and written under one lock.

    The create/update handlers and the resync timer of one policy run concurrently; through Kopf's
    patch each would write a status computed from its own, possibly older, snapshot in whatever order
    the patches land. Here the last write is always computed from the latest sync (read-modify-write
    of the current status, optimistic concurrency in ``Kube.update_status``). ``current``: the
    object as watched, for the first attempt (no write when its status is already right; a stale
    copy that needs one meets a 409 and the object is read again).
    """
    if sync.kube is None:
        raise RuntimeError("PolicySync needs a Kube client to write RoutingPolicy status")
    async with sync.status_lock:
        outcome = sync.outcome(key=key, generation=generation, error=error)

        def mutate(current: dict[str, Any]) -> dict[str, Any] | None:
            previous = dict(current.get("status") or {})
            new = status_patch(outcome=outcome, previous=previous, now=_now())
            return new if status_changed(previous=previous, patch=new) else None
        await asyncio.to_thread(sync.kube.update_status, "RoutingPolicy", namespace=namespace, name=name,
                                mutate=mutate, current=dict(current) if current else None)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def reconcile_routing_policy(retry: int, logger: kopf.Logger, **kwargs: Any) -> None:
    error = await _sync_and_status(**_pick(kwargs))
    if error is not None:
        logger.warning(f"OPA not usable, allow-list kept (fail closed): {error}")
        raise kopf.TemporaryError(f"OPA not usable: {error}", delay=_backoff(retry))


_loops = ObjectLoops(kind="RoutingPolicy", interval_s=Settings.from_env().resync_seconds, initial_delay_s=1.0)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def routing_policy_event(type: str | None, logger: kopf.Logger, **kwargs: Any) -> None:
    """Runs each policy's resync loop, and syncs once when a policy goes.

    No finalizer: a deleted policy leaves the index before this runs (Kopf indexes an event before
    its handlers; a deletionTimestamp makes the indexer drop it), so the sync below (and every
    later one) computes the allow-list without it. Nothing of the name is left out by hand: when
    the policy was re-created under the name, Kopf (which handles each uid apart) may run the old
    one's DELETED after the new one's first event, and the index then rightly holds the new one.
    While OPA is unreachable that sync still narrows the published allow-list (fail closed) and the
    deletion is not held up. OPA keeps the policy's
    data until the next successful sync, which only the operator reads. Agents drop a deleted
    policy's entries on their own too (``sparsegate_ebpf.policysource``), so access does not outlive
    the policy while the operator is down.
    """
    picked = _pick(kwargs)
    key = (picked["namespace"], picked["name"])

    async def resync(body: Mapping[str, Any]) -> None:
        await resync_routing_policy(logger=logger, body=body, **picked)

    if _loops.seen(key=key, event_type=type, body=kwargs["body"], tick=resync, logger=logger):
        return
    _resync_errors.pop(key, None)
    try:
        error = await _sync_and_status(**picked, write_status=False)
    except Exception as e:  # noqa: BLE001 (the allow-list not published: retried below)
        error = e
    if error is not None:
        logger.warning(f"RoutingPolicy deleted while OPA or the API server is not usable: its allow entries "
                       f"were removed from the allow-list if it could be written; synced again until one "
                       f"sync succeeds ({error})")
        # After the last policy no loop is left to sync again: the allow-list would keep policing its
        # targets with nothing allowed (narrowing adds nothing) until the operator restarted.
        _retries.start("sync", lambda: _deletion_synced(picked), delay_s=_loops.interval_s)


_retries = Retries("RoutingPolicy deletion sync")  # one key: each sync reads every policy


async def _deletion_synced(picked: dict[str, Any]) -> bool:
    """A deletion's sync again, from the indexes as they are now: whether it succeeded."""
    return await _sync_and_status(**picked, write_status=False) is None


async def resync_routing_policy(logger: kopf.Logger | logging.Logger, body: Mapping[str, Any] | None = None,
                                **picked: Any) -> None:
    """Notices OPA restarts (revision gone) and pod churn; Degraded while OPA is unreachable (a
    WARNING when that starts or its error changes; the same again, each resync of each policy, at DEBUG)."""
    error = await _sync_and_status(**picked, body=body)
    repeated = repeats(_resync_errors, (picked["namespace"], picked["name"]), None if error is None else str(error))
    if error is not None:
        (logger.debug if repeated else logger.warning)(f"OPA not usable, allow-list kept (fail closed): {error}")


# (namespace, name) → the error the policy's last resync logged (``resync_routing_policy``); dropped
# with the policy's loop.
_resync_errors: dict[tuple[str, str], str] = {}


@kopf.on.startup()
async def check_allow_list_at_startup(logger: kopf.Logger, **_: Any) -> None:
    """Zero trust from the first moment, and nothing kept for policies deleted while we were down.

    With no allow-list yet, publish an empty one (it polices nothing: no policy has been compiled;
    the first sync publishes what OPA decides). A half-published set (an operator stopped
    mid-publish) is left as it is: the agents keep the last whole document they read, and the first
    sync OPA answers republishes the set. An existing one is kept until OPA has
    been asked (it may be the last good one), minus the entries of policies that no longer exist
    (and, at the first sync if OPA is down, of policies changed since the recorded decision basis):
    policies go without a finalizer, so one may have been deleted while no operator ran, and if it
    was the last one no handler would ever run to drop its entries. Checking needs no OPA (only
    narrowing) and no index (one GET per policy named in the allow-list).
    """
    sync = _state()
    try:
        document, basis = await sync.store.read_published()
        if document is None and sync.store.half_published:
            logger.warning("the flow allow-list's shards do not match its head (a publish was cut short): "
                           "left as it is, the agents keep their last whole policy until OPA decides")
            return
        if document is None:
            await sync.store.publish(flow_document(decisions={}, pods=[], policed_models=(),
                                                   allowed_sources=sync.settings.allowed_sources))
            logger.info("published an empty flow allow-list (no destination policed yet)")
            return
        named = policies_named(document)
        live = {key for key in named if "/" not in key or await _still_exists(sync, key)}
        narrowed = narrow_document(document=document, owners_then=None, owners_now={}, live_policies=live)
        if narrowed.get("version") != document.get("version"):
            # Dropping a deleted policy's entries leaves the rest as decided: the basis stays.
            await sync.store.publish(narrowed, basis=basis)
            logger.info(f"dropped the allow entries of deleted RoutingPolicies {sorted(named - live)}")
            document = narrowed
        # What the first sync narrows against if OPA is down: without a recorded basis, every policy
        # counts as changed since OPA last decided (this process never saw OPA decide).
        sync.published, sync.basis = document, basis
        if basis is None:
            logger.info("the flow allow-list carries no decision basis: until OPA answers, every "
                        "RoutingPolicy counts as undecided (fail closed)")
    except Exception as e:  # noqa: BLE001 (the handlers retry publishing; startup must not fail)
        logger.warning(f"could not check the flow allow-list at startup: {e}")


async def _still_exists(sync: PolicySync, key: str) -> bool:
    """False only when the API server says the policy is gone; any doubt keeps its entries for now."""
    namespace, _, name = key.partition("/")
    try:
        body = await asyncio.to_thread(_kube(sync).get, "RoutingPolicy", namespace=namespace, name=name)
    except Exception:  # noqa: BLE001 (forbidden, unreachable: the handlers decide later)
        return True
    return body is not None and not (body.get("metadata") or {}).get("deletionTimestamp")


def _kube(sync: PolicySync) -> Kube:
    if sync.kube is None:
        raise RuntimeError("PolicySync needs a Kube client to read RoutingPolicies")
    return sync.kube


@kopf.on.cleanup()
async def close_opa_client(**_: Any) -> None:
    await _loops.stop()
    await _retries.stop()
    if _sync is not None:
        _sync.opa.close()


def _pick(kwargs: dict[str, Any]) -> dict[str, Any]:
    names = ("name", "namespace", "meta", "sparsegate_routing_policies", "sparsegate_flow_pods")
    return {k: kwargs[k] for k in names}
