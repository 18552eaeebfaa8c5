"""Request-level canary: the two-version gate set a model server holds, and which requests go
to the canary. One definition, imported by the operator (builds and verifies the set) and the
model server (parses it, routes requests with :func:`routes_to_canary`).

The admin channel's ``PUT /admin/gate`` body is a gate document (``gate.DOCUMENT_FIELDS``),
optionally with three more fields::

    {"version", "checksum", "params",            # the stable version, as before
     "canary": {"version", "checksum", "params"}, # the canary version (a gate document)
     "canaryWeight": 0.05,                        # share of requests routed to the canary, [0, 1]
     "stickyHeader": "x-session-id"}              # request header whose value keys the choice

A body without ``canary`` is the single-document PUT it always was (the canary, if any, is
dropped); a server that predates this module rejects the extra fields with 422 rather than
silently serving only the stable half.

Selection: a request's key (the sticky header's value when the request carries it, else its
``x-request-id``, else a random id) is hashed with BLAKE2b to a point in [0, 1); the request
goes to the canary when the point is below the weight. The hash does not depend on the
process or Python's hash seed, so every pod and every restart sends a key the same way, and
the choice is monotone in the weight: a key on the canary at 5 % stays on it at 20 %.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping
from typing import Any

from .gate import DOCUMENT_FIELDS, GateDocument, GateParamsError, finite_number, parse_document, shown_value

CANARY_FIELDS = ("canary", "canaryWeight", "stickyHeader")
DEFAULT_STICKY_HEADER = "x-session-id"
REQUEST_ID_HEADER = "x-request-id"
# RFC 9110 field-name token characters; lower case, as HTTP/2 sends them and aiohttp matches
# headers case-insensitively anyway. 64 characters is ample for a header name.
_HEADER_NAME = re.compile(r"^[a-z0-9!#$%&'*+.^_`|~-]{1,64}$")
_POINT_BITS = 53  # a float's mantissa: every point below is exact


def canary_point(key: str) -> float:
    """``key``'s place in [0, 1): the top 53 bits of BLAKE2b(key)'s 8-byte digest as a fraction
    of 2**53. All 64 bits over 2**64 rounded the top 1,024 digests to 1.0, which is not below
    weight 1, so such a key stayed on the stable version at 100 %."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> (64 - _POINT_BITS)) / float(1 << _POINT_BITS)


def routes_to_canary(key: str, weight: float) -> bool:
    """Whether the request keyed ``key`` is served by the canary at ``weight`` (monotone in it)."""
    return weight > 0 and canary_point(key) < weight


def valid_header_name(name: Any) -> bool:
    return isinstance(name, str) and bool(_HEADER_NAME.match(name))


def weight_of_percent(percent: int | float) -> float:
    """A rollout step's percent as the canary weight (5 → 0.05)."""
    return round(float(percent) / 100.0, 6)


def set_key(version: str, canary_version: str | None = None, weight: float | None = None,
            sticky_header: str | None = None) -> str:
    """One string naming what a pod serves: ``g-stable`` alone, or ``g-stable+g-canary@0.05``,
    followed by ``;<header>`` when the sticky header is not the default (``...@0.05;x-user``): a pod
    keying the choice by another header routes a session differently, so it does not hold the set.
    The operator compares it with what a pod reports (``/healthz``, the PUT's answer)."""
    if canary_version is None:
        return version
    key = f"{version}+{canary_version}@{float(weight or 0.0):.6g}"
    if sticky_header is not None and sticky_header != DEFAULT_STICKY_HEADER:
        key += f";{sticky_header}"
    return key


@dataclasses.dataclass(frozen=True)
class GateSet:
    """What one model server serves: a stable document, and optionally a canary with its weight."""

    stable: GateDocument
    canary: GateDocument | None = None
    weight: float = 0.0
    sticky_header: str = DEFAULT_STICKY_HEADER

    @property
    def key(self) -> str:
        return set_key(self.stable.version, self.canary.version if self.canary else None, self.weight,
                       self.sticky_header)

    def to_json(self) -> dict[str, Any]:
        return gate_set_document(self.stable.to_json(), self.canary.to_json() if self.canary else None,
                                 weight=self.weight, sticky_header=self.sticky_header)


def gate_set_document(stable: Mapping[str, Any], canary: Mapping[str, Any] | None, *, weight: float,
                      sticky_header: str = DEFAULT_STICKY_HEADER) -> dict[str, Any]:
    """The PUT body for ``stable`` (+ ``canary`` at ``weight``); without a canary, ``stable`` as is."""
    doc = {k: stable[k] for k in DOCUMENT_FIELDS}
    if canary is None:
        return doc
    return {**doc, "canary": {k: canary[k] for k in DOCUMENT_FIELDS}, "canaryWeight": float(weight),
            "stickyHeader": sticky_header}


def parse_gate_set(body: Any, *, num_experts: int | None = None) -> GateSet:
    """Validate a PUT body (single document or two-version set); errors name the field."""
    if not isinstance(body, Mapping):
        raise GateParamsError("gate document must be a JSON object")
    extra = sorted(set(body) - set(DOCUMENT_FIELDS) - set(CANARY_FIELDS))
    if extra:
        raise GateParamsError(f"unknown gate document fields: {', '.join(extra)}")
    stable = parse_document({k: body[k] for k in DOCUMENT_FIELDS if k in body}, num_experts=num_experts)
    if "canary" not in body:
        stray = [k for k in CANARY_FIELDS if k in body]
        if stray:
            raise GateParamsError(f"{', '.join(stray)} given without canary")
        return GateSet(stable=stable)
    try:
        canary = parse_document(body["canary"], num_experts=num_experts)
    except GateParamsError as e:
        raise GateParamsError(f"canary: {e}") from None
    weight = body.get("canaryWeight")
    if not finite_number(weight) or not 0.0 <= weight <= 1.0:
        raise GateParamsError(f"canaryWeight must be a number in [0, 1], got {shown_value(weight)}")
    header = body.get("stickyHeader", DEFAULT_STICKY_HEADER)
    if not valid_header_name(header):
        raise GateParamsError(f"stickyHeader must be a lower-case HTTP header name (token characters, "
                              f"1-64), got {header!r}")
    if canary.version == stable.version:
        raise GateParamsError(f"canary {canary.version} is the stable version itself")
    return GateSet(stable=stable, canary=canary, weight=float(weight), sticky_header=header)


def reported_key(body: Mapping[str, Any], *, version_field: str) -> str | None:
    """The :func:`set_key` of what a server reports (``/healthz``: ``gateVersion``; the PUT's
    answer: ``version``) with its ``canary`` block {version, checksum, weight, stickyHeader (absent:
    the default)}; None when the report is malformed."""
    version = body.get(version_field)
    if not isinstance(version, str):
        return None
    canary = body.get("canary")
    if canary is None:
        return version
    if not isinstance(canary, Mapping) or not isinstance(canary.get("version"), str) \
            or not isinstance(canary.get("weight"), int | float):
        return None
    header = canary.get("stickyHeader", DEFAULT_STICKY_HEADER)
    if not isinstance(header, str):
        return None
    return set_key(version, canary["version"], float(canary["weight"]), header)


def document_key(doc: Mapping[str, Any]) -> str:
    """The :func:`set_key` of a PUT body built by :func:`gate_set_document` (what the server
    must answer once it applied it)."""
    canary = doc.get("canary")
    if isinstance(canary, Mapping):
        return set_key(doc["version"], canary["version"], float(doc.get("canaryWeight") or 0.0),
                       doc.get("stickyHeader", DEFAULT_STICKY_HEADER))
    return doc["version"]
