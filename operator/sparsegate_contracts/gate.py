"""The gate document: parameters, validation, checksum and content-addressed version.

One definition for the operator (GateConfig status, SparseModel ConfigMaps, rollout pushes) and
the model server (``--gate-config``, ``PUT /admin/gate``), which validate and hash alike.
A gate document is ``{"version": str, "checksum": "sha256:<hex>", "params": {...}}``.
Canonical JSON of params = ``json.dumps(params, sort_keys=True, separators=(",", ":"),
ensure_ascii=True)`` (``canonical.canonical_json``) over the params object exactly as written in
the document (defaults are not filled in before hashing). checksum = ``sha256:`` + full hex digest
of that text, version = ``g-`` + its first 12 hex digits (dev/CONTRACTS.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping

from sparsegate_contracts.canonical import SHA256_PREFIX, canonical_json, sha256_of

VERSION_PREFIX = "g-"
VERSION_HEX_DIGITS = 12
DOCUMENT_FIELDS = ("version", "checksum", "params")

PRECISION_POLICIES = ("auto", "fp32", "bf16", "int8")

DEFAULT_PARAMS: dict[str, Any] = {
    "toolGateThreshold": 0.85,
    "entropyBeta": 0.1,
    "confidenceThreshold": 0.6,
    "capacityFactor": 1.25,
    "minExpertsPerToken": 1,
    "maxExpertsPerToken": 4,
    "precisionPolicy": "auto",
}

# Optional params with no default: absent means "off" and is not written into documents, so a
# document without them hashes (and versions) exactly as before they existed.
OPTIONAL_PARAMS = ("targetExpertsPerToken", "hardwareCostLambda")

# Generous upper bounds: a typo (addedLatencyMs: 600000) must not wedge every request.
MAX_ADDED_LATENCY_MS = 10_000
MAX_EXPERTS_LIMIT = 64
# Costs are normalised to [0, 1] (expert_cost.py), so a lambda past a few tens already routes by
# cost alone; the cap only catches typos.
MAX_HARDWARE_COST_LAMBDA = 100.0


def default_max_experts(num_experts: int | None) -> int:
    """maxExpertsPerToken where a gate's params or a SparseModel's spec.model leave it unset: 4, or
    every expert of a model that has fewer (so a 2-expert model takes the defaults as they are)."""
    default = int(DEFAULT_PARAMS["maxExpertsPerToken"])
    return default if num_experts is None else max(1, min(default, num_experts))


class GateParamsError(ValueError):
    """A gate document or its params are invalid; the message is safe to show to clients."""


@dataclasses.dataclass(frozen=True)
class FaultInjection:
    """Chaos-testing knob: NOT a model parameter. Lets tests/demos make a bad version visible."""

    error_rate: float = 0.0
    added_latency_ms: float = 0.0


@dataclasses.dataclass(frozen=True)
class GateParams:
    tool_gate_threshold: float = 0.85
    entropy_beta: float = 0.1
    confidence_threshold: float = 0.6
    capacity_factor: float = 1.25
    min_experts_per_token: int = 1
    max_experts_per_token: int = 4
    precision_policy: str = "auto"
    fault_injection: FaultInjection = FaultInjection()
    # Mean selected experts per token a PI controller holds by moving the threshold
    # (threshold_control.py in the model server); None: confidence_threshold stays fixed.
    target_experts_per_token: float | None = None
    # Weight of the per-expert hardware cost subtracted from the router logits before the
    # top-p selection (expert_cost.py in the model server); 0: no bias.
    hardware_cost_lambda: float = 0.0


@dataclasses.dataclass(frozen=True)
class GateDocument:
    """A validated, immutable gate version; swapped by reference in the server."""

    version: str
    checksum: str
    raw_params: Mapping[str, Any]
    params: GateParams

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "checksum": self.checksum, "params": dict(self.raw_params)}

    def file_text(self) -> str:
        """The ``gate.json`` the server reads (canonical, so equal documents are byte-identical)."""
        return canonical_json(self.to_json())


def checksum_of(params: Mapping[str, Any]) -> str:
    return sha256_of(params)


def version_of(params: Mapping[str, Any]) -> str:
    return VERSION_PREFIX + checksum_of(params)[len(SHA256_PREFIX):][:VERSION_HEX_DIGITS]


def version_matches_checksum(version: Any, checksum: Any) -> bool:
    """``g-<hex>`` must be a prefix of ``sha256:<hex>`` (the version is the checksum's address).

    What a reader that has only the two strings (e.g. a pod's ``/healthz``) can check."""
    return (
        isinstance(version, str)
        and isinstance(checksum, str)
        and version.startswith(VERSION_PREFIX)
        and checksum.startswith(SHA256_PREFIX)
        and checksum[len(SHA256_PREFIX):].startswith(version[len(VERSION_PREFIX):])
        and len(version) > len(VERSION_PREFIX)
    )


def finite_number(value: Any) -> bool:
    """A JSON number that fits a float (bool is an int subclass and never one; an integer past
    float range, e.g. 10**400, is not finite either: math.isfinite would raise OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def shown_value(value: Any) -> str:
    """``repr(value)`` for an error message, cut short when long (a 400-digit integer)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _number(raw: Mapping[str, Any], key: str, *, lo: float, hi: float,
            lo_open: bool = False) -> float:
    value = raw[key]
    if not finite_number(value):
        raise GateParamsError(f"{key} must be a finite number, got {shown_value(value)}")
    if value < lo or value > hi or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise GateParamsError(f"{key} must be in {bracket}{lo}, {hi}], got {value!r}")
    return float(value)


def _integer(raw: Mapping[str, Any], key: str, *, lo: int, hi: int) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise GateParamsError(f"{key} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise GateParamsError(f"{key} must be in [{lo}, {hi}], got {value!r}")
    return value


def validate_params(raw: Any, *, num_experts: int | None = None) -> GateParams:
    """Check types and ranges; missing keys take DEFAULT_PARAMS (an unset maxExpertsPerToken:
    ``default_max_experts(num_experts)``). Raises GateParamsError."""
    if not isinstance(raw, Mapping):
        raise GateParamsError("params must be a JSON object")
    unknown = sorted(set(raw) - set(DEFAULT_PARAMS) - set(OPTIONAL_PARAMS) - {"faultInjection"})
    if unknown:
        raise GateParamsError(f"unknown gate params: {', '.join(unknown)}")
    merged = {**DEFAULT_PARAMS, "maxExpertsPerToken": default_max_experts(num_experts),
              **{k: v for k, v in raw.items() if k != "faultInjection"}}
    max_limit = num_experts if num_experts is not None else MAX_EXPERTS_LIMIT
    lo_k = _integer(merged, "minExpertsPerToken", lo=1, hi=max_limit)
    hi_k = _integer(merged, "maxExpertsPerToken", lo=1, hi=max_limit)
    if lo_k > hi_k:
        raise GateParamsError(
            f"minExpertsPerToken ({lo_k}) must not exceed maxExpertsPerToken ({hi_k})")
    target = None
    if "targetExpertsPerToken" in merged:
        target = _number(merged, "targetExpertsPerToken", lo=lo_k, hi=hi_k)
    cost_lambda = 0.0
    if "hardwareCostLambda" in merged:
        cost_lambda = _number(merged, "hardwareCostLambda", lo=0.0, hi=MAX_HARDWARE_COST_LAMBDA)
    policy = merged["precisionPolicy"]
    if policy not in PRECISION_POLICIES:
        raise GateParamsError(
            f"precisionPolicy must be one of {', '.join(PRECISION_POLICIES)}, got {policy!r}")
    fault = FaultInjection()
    if "faultInjection" in raw:
        fi = raw["faultInjection"]
        if not isinstance(fi, Mapping):
            raise GateParamsError("faultInjection must be a JSON object")
        extra = sorted(set(fi) - {"errorRate", "addedLatencyMs"})
        if extra:
            raise GateParamsError(f"unknown faultInjection fields: {', '.join(extra)}")
        fi = {"errorRate": 0.0, "addedLatencyMs": 0, **fi}
        fault = FaultInjection(
            error_rate=_number(fi, "errorRate", lo=0.0, hi=1.0),
            added_latency_ms=_number(fi, "addedLatencyMs", lo=0.0, hi=MAX_ADDED_LATENCY_MS))
    return GateParams(
        tool_gate_threshold=_number(merged, "toolGateThreshold", lo=0.0, hi=1.0),
        entropy_beta=_number(merged, "entropyBeta", lo=0.0, hi=10.0),
        confidence_threshold=_number(merged, "confidenceThreshold", lo=0.0, hi=1.0, lo_open=True),
        capacity_factor=_number(merged, "capacityFactor", lo=0.0, hi=64.0, lo_open=True),
        min_experts_per_token=lo_k,
        max_experts_per_token=hi_k,
        precision_policy=policy,
        fault_injection=fault,
        target_experts_per_token=target,
        hardware_cost_lambda=cost_lambda,
    )


def make_document(params: Mapping[str, Any], *, num_experts: int | None = None) -> GateDocument:
    """Build the content-addressed document for params (used for defaults and by tests)."""
    validated = validate_params(params, num_experts=num_experts)
    raw = json.loads(canonical_json(params))
    return GateDocument(version=version_of(raw), checksum=checksum_of(raw), raw_params=raw,
                        params=validated)


def parse_document(doc: Any, *, num_experts: int | None = None) -> GateDocument:
    """Validate a gate document: shape, params, checksum and content-addressed version."""
    if not isinstance(doc, Mapping):
        raise GateParamsError("gate document must be a JSON object")
    missing = [k for k in DOCUMENT_FIELDS if k not in doc]
    if missing:
        raise GateParamsError(f"gate document is missing: {', '.join(missing)}")
    extra = sorted(set(doc) - set(DOCUMENT_FIELDS))
    if extra:
        raise GateParamsError(f"unknown gate document fields: {', '.join(extra)}")
    version, checksum = doc["version"], doc["checksum"]
    if not isinstance(version, str) or not isinstance(checksum, str):
        raise GateParamsError("version and checksum must be strings")
    built = make_document(doc["params"], num_experts=num_experts)
    if checksum != built.checksum:
        raise GateParamsError(
            f"checksum mismatch: document says {checksum}, params hash to {built.checksum}")
    if version != built.version:
        raise GateParamsError(
            f"version {version!r} is not the content address of params (expected {built.version})")
    return built


DEFAULT_DOCUMENT = make_document(DEFAULT_PARAMS)
