"""The request-level canary plan (``spec.rollout.strategy: requests``), pure.

Under the ``instances`` strategy a step moves ceil(percent · pods) pods to the canary version,
so with 2 replicas every step is at least 50 %. Under ``requests`` every pod holds both the
stable and the canary gate document (``sparsegate_contracts.canary``) and routes ``percent`` %
of requests to the canary, by a hash of the sticky header's value (else the request id): 5 %
is 5 % of requests at any replica count, and the same pods serve both sides of the comparison.

What a pod should hold during a step is a :class:`GateSetTarget`; its ``version`` is the set key
(``g-stable+g-canary@0.05``) a pod reports on ``/healthz``, so the state machine
(``domain.rollout``) compares and pushes it exactly as it does a single version. Promotion
pushes the canary alone (it becomes stable, weight 0); rollback and abort push the stable alone
(the canary dropped).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sparsegate_contracts import canary as contract
from sparsegate_contracts import gate as gate_contract


class Strategy(str, enum.Enum):
    INSTANCES = "instances"
    # A step's percent is a share of the model's pods, each running one version.
    REQUESTS = "requests"
    # A step's percent is a share of requests; every pod holds both versions.


# What a spec without spec.rollout.strategy gets: the share of requests is exact at any replica count.
DEFAULT_STRATEGY = Strategy.REQUESTS


class GateDoc(Protocol):
    """What the plan needs of a gate version (``domain.rollout.GateVersion``)."""

    version: str

    def document(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class GateSetTarget:
    """Stable + canary at a weight: what every pod holds during a request-level step."""

    stable: GateDoc
    canary: GateDoc
    weight: float
    sticky_header: str = contract.DEFAULT_STICKY_HEADER

    @property
    def version(self) -> str:
        """The set key the pod reports once it holds this set (compared, never parsed)."""
        return contract.set_key(self.stable.version, self.canary.version, self.weight, self.sticky_header)

    def document(self) -> dict[str, Any]:
        """The ``PUT /admin/gate`` body."""
        return contract.gate_set_document(self.stable.document(), self.canary.document(), weight=self.weight,
                                          sticky_header=self.sticky_header)


def parse_strategy(raw: Any) -> Strategy:
    """``spec.rollout.strategy``; raises ValueError naming the field."""
    if raw is None:
        return DEFAULT_STRATEGY
    try:
        return Strategy(raw)
    except ValueError:
        raise ValueError(f"spec.rollout.strategy must be one of {[s.value for s in Strategy]}, "
                         f"got {raw!r}") from None


def strategy_for(requested: Strategy, *, stable: GateDoc | None, canary: GateDoc) -> tuple[Strategy, str]:
    """The strategy a rollout runs under, and why when it is not the requested one.

    A checkpoint pod holds one weight storage, so it cannot serve two versions whose
    ``precisionPolicy`` differ side by side (it answers such a set with 422). A rollout that
    changes ``precisionPolicy`` therefore runs pod by pod (``instances``) whatever the spec asks;
    every other change keeps the requested strategy."""
    if requested != Strategy.REQUESTS or stable is None:
        return requested, ""
    before = stable.document()["params"].get("precisionPolicy", gate_contract.DEFAULT_PARAMS["precisionPolicy"])
    after = canary.document()["params"].get("precisionPolicy", gate_contract.DEFAULT_PARAMS["precisionPolicy"])
    if before == after:
        return requested, ""
    return Strategy.INSTANCES, (f"strategy instances for this rollout: precisionPolicy {before} -> {after} "
                                "changes weight storage, which a pod holds once")


def parse_sticky_header(raw: Any) -> str:
    """``spec.rollout.stickyHeader``; raises ValueError naming the field."""
    if raw is None:
        return contract.DEFAULT_STICKY_HEADER
    if not contract.valid_header_name(raw):
        raise ValueError(f"spec.rollout.stickyHeader must be a lower-case HTTP header name (1-64 token "
                         f"characters), got {raw!r}")
    return raw


def weight_of(percent: int | None) -> float:
    return contract.weight_of_percent(percent or 0)


def step_target(*, stable: GateDoc, canary: GateDoc, percent: int | None, sticky_header: str) -> GateSetTarget:
    return GateSetTarget(stable=stable, canary=canary, weight=weight_of(percent), sticky_header=sticky_header)


def step_pods(pod_names: Sequence[str]) -> tuple[str, ...]:
    """The pods a request-level step covers: all of them (sorted, as the instance plan's are)."""
    return tuple(sorted(pod_names))


def step_text(*, percent: int, pods: int) -> str:
    return f"{percent}% of requests on all {pods} instances"

