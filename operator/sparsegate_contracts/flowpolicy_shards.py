"""A flow-policy document spread over several ConfigMaps (the 1 MiB object limit no longer binds).

Layouts, chosen by ``split`` from the document's ``policy.json`` size (``flowpolicy.document_text``):

* **single** (the document fits ``max_bytes``): the head ConfigMap (``flowpolicy.CONFIGMAP_NAME``)
  holds the whole document under ``policy.json``, byte for byte as before sharding, so agents
  that predate sharding read it unchanged.
* **sharded**: the head's ``policy.json`` is a *head document*
  ``{"version": V, "defaultAction": A, "shards": [{"name": "<head>-0", "digest": "sha256:..."}, ...]}``
  and each shard ConfigMap ``<head>-<k>`` holds under ``shard.json`` (canonical JSON)
  ``{"version": V, "shard": k, <list fields>: [...]}``: consecutive slices of the document's list
  fields (``entries``, ``identities``, ``rules``, ``policedDestinations``, ``allowedSources``; an
  identity with many IPs is cut into chunks that may span shards). ``digest`` =
  ``sha256:`` + hex SHA-256 of the shard's ``shard.json`` text. An agent that predates sharding
  refuses a head document (unknown field ``shards``) and keeps its policy.

``join`` rebuilds the document only from a consistent set: every named shard present, its digest
and ``version`` those of the head, and the rebuilt document's content address equal to ``V``;
otherwise ``ShardsNotReady`` and the reader keeps the policy it has (never a half-updated set).
The writer publishes shards first and the head last (``publish_steps``), then empties the shards
the new head no longer names (not deleted: the operator's RBAC has no delete verb). Shard names
are ``<head>-0`` .. ``<head>-(MAX_SHARDS-1)``: a fixed set, so the agent's RBAC can name them
(resourceNames) instead of reading every ConfigMap.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sparsegate_contracts.canonical import canonical_json
from sparsegate_contracts.flowpolicy import (
    ALLOWED_SOURCES, CONFIGMAP_NAME, DOCUMENT_KEY, DOCUMENT_MAX_BYTES, IDENTITIES, POLICED_DESTINATIONS, RULES,
    FlowPolicyError, document_text, version_of)

SHARDS = "shards"
SHARD_KEY = "shard.json"
MAX_SHARDS = 16
"""Shard ConfigMaps per document (the chart grants exactly these names): 16 x ``SHARD_MAX_BYTES``
is ~15 MiB, several times what a document within the map's 65,536 records takes."""
SHARD_MAX_BYTES = DOCUMENT_MAX_BYTES
"""Largest ``policy.json`` (single layout) or ``shard.json`` (sharded) written: 1 MiB less headroom."""
MIN_SHARD_BYTES = 4096
"""Smallest budget ``split`` accepts: room for a head naming ``MAX_SHARDS`` shards (~2.3 KB)."""
LIST_FIELDS = ("entries", IDENTITIES, RULES, POLICED_DESTINATIONS, ALLOWED_SOURCES)


class ShardsNotReady(FlowPolicyError):
    """The head and its shards do not form one consistent document (yet): keep the live policy."""


@dataclass(frozen=True)
class Layout:
    head: str
    """``policy.json`` of the head ConfigMap: the document (single) or the head document (sharded)."""
    shards: tuple[tuple[str, str], ...] = ()
    """(ConfigMap name, ``shard.json`` text), in order; empty for the single layout."""


def shard_name(head_name: str, k: int) -> str:
    return f"{head_name}-{k}"


def shard_names(head_name: str = CONFIGMAP_NAME) -> list[str]:
    """Every name a shard of ``head_name`` can have (what RBAC grants)."""
    return [shard_name(head_name, k) for k in range(MAX_SHARDS)]


def digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def is_head(document: Mapping[str, Any]) -> bool:
    return SHARDS in document


def split(document: Mapping[str, Any], *, head_name: str = CONFIGMAP_NAME, max_bytes: int = SHARD_MAX_BYTES,
          max_shards: int = MAX_SHARDS) -> Layout:
    """The ConfigMaps that carry ``document``; FlowPolicyError when it needs more than ``max_shards``."""
    text = document_text(document)
    if len(text.encode()) <= max_bytes:
        return Layout(head=text)
    if max_bytes < MIN_SHARD_BYTES:
        raise FlowPolicyError(f"shard byte budget {max_bytes} is below the minimum {MIN_SHARD_BYTES}")
    version = str(document["version"])
    fields = [f for f in LIST_FIELDS if f in document]
    bodies = _pack(document, fields, version=version, budget=max_bytes)
    if len(bodies) > max_shards:
        raise FlowPolicyError(f"the flow policy needs {len(bodies)} shards of {max_bytes} bytes, "
                              f"at most {max_shards} are published")
    shards = tuple((shard_name(head_name, k), canonical_json(body)) for k, body in enumerate(bodies))
    head = {"version": version, "defaultAction": document.get("defaultAction", "deny"),
            SHARDS: [{"name": name, "digest": digest(t)} for name, t in shards]}
    head_text = document_text(head)
    if len(head_text) > max_bytes and len(shards) <= MAX_SHARDS:  # past MAX_SHARDS: only counted, never written
        raise FlowPolicyError(f"the head naming {len(shards)} shards takes {len(head_text)} bytes, "
                              f"over the budget {max_bytes}")
    return Layout(head=head_text, shards=shards)


def _pack(document: Mapping[str, Any], fields: list[str], *, version: str, budget: int) -> list[dict[str, Any]]:
    """Greedy: items in document order into shards whose canonical text stays within ``budget``
    (sizes add up exactly: canonical JSON of a list is its items' texts joined by commas)."""
    bodies: list[dict[str, Any]] = []
    sizes: list[int] = []

    def new() -> None:
        body = {"version": version, "shard": len(bodies), **{f: [] for f in fields}}
        bodies.append(body)
        sizes.append(len(canonical_json(body)))

    def add(field: str, item: Any, n: int) -> None:
        """Append an item of ``n`` bytes, to a new shard when the current one has no room."""
        if sizes[-1] + n + (1 if bodies[-1][field] else 0) > budget:
            new()
            if sizes[-1] + n > budget:
                raise FlowPolicyError(f"{field}: one item of {n} bytes exceeds the shard budget {budget}")
        sizes[-1] += n + (1 if bodies[-1][field] else 0)
        bodies[-1][field].append(item)

    new()
    for field in fields:
        for item in document.get(field) or ():
            if field != IDENTITIES:
                add(field, item, len(canonical_json(item)))
                continue
            # An identity's IPs fill the current shard, then continue as a chunk of the same identity.
            ident, ips = item["identity"], list(item.get("ips") or ())
            empty = len(canonical_json({"identity": ident, "ips": []}))
            chunk: dict[str, Any] | None = None
            for ip in ips or [None]:
                n = 0 if ip is None else len(canonical_json(ip))
                if chunk is not None and sizes[-1] + n + 1 <= budget:
                    chunk["ips"].append(ip)
                    sizes[-1] += n + 1
                    continue
                chunk = {"identity": ident, "ips": [] if ip is None else [ip]}
                add(field, chunk, empty + n)
    return bodies


def join(head: Mapping[str, Any], shard_texts: Mapping[str, str | None], *,
         head_name: str = CONFIGMAP_NAME) -> dict[str, Any]:
    """The document a head names, rebuilt from ``shard_texts`` (name -> ``shard.json``, None/absent:
    missing); ShardsNotReady unless the set is consistent, FlowPolicyError when the head is malformed."""
    refs = head.get(SHARDS)
    version = head.get("version")
    if not isinstance(refs, list) or not refs or len(refs) > MAX_SHARDS:
        raise FlowPolicyError(f"shards: must be a list of 1..{MAX_SHARDS} shard references")
    if not isinstance(version, str):
        raise FlowPolicyError("version must be a string")
    unknown = set(head) - {"version", "defaultAction", SHARDS}
    if unknown:
        raise FlowPolicyError(f"unknown top-level fields in a sharded head: {sorted(unknown)}")
    lists: dict[str, list[Any]] = {}
    for k, ref in enumerate(refs):
        if not isinstance(ref, Mapping) or ref.get("name") != shard_name(head_name, k):
            raise FlowPolicyError(f"shards[{k}].name: must be {shard_name(head_name, k)!r}")
        name = ref["name"]
        text = shard_texts.get(name)
        if text is None:
            raise ShardsNotReady(f"shard {name} of version {version} is missing")
        if digest(text) != ref.get("digest"):
            raise ShardsNotReady(f"shard {name}: digest {digest(text)} is not the head's {ref.get('digest')}")
        try:
            body = json.loads(text)
        except ValueError as exc:
            raise FlowPolicyError(f"shard {name}: not valid JSON: {exc}") from exc
        if not isinstance(body, Mapping) or body.get("version") != version or body.get("shard") != k:
            raise FlowPolicyError(f"shard {name}: version/shard do not match the head's {version}/{k}")
        for field in LIST_FIELDS:
            if field in body:
                if not isinstance(body[field], list):
                    raise FlowPolicyError(f"shard {name}: {field} must be a list")
                _extend(lists.setdefault(field, []), field, body[field])
    document = {"defaultAction": head.get("defaultAction", "deny"), **lists}
    if version_of(document) != version:
        raise ShardsNotReady(f"the shards rebuild a document of version {version_of(document)}, "
                             f"not the head's {version}")
    return {"version": version, **document}


def _extend(into: list[Any], field: str, items: list[Any]) -> None:
    """Append ``items``; an identity chunk continuing the previous identity is merged into it."""
    for item in items:
        if (field == IDENTITIES and into and isinstance(item, Mapping) and isinstance(into[-1], Mapping)
                and item.get("identity") == into[-1].get("identity")):
            into[-1] = {**into[-1], "ips": list(into[-1].get("ips") or ()) + list(item.get("ips") or ())}
        else:
            into.append(item)


@dataclass(frozen=True)
class Step:
    """One write of ``publish_steps``: put ``text`` under ``key`` of ConfigMap ``name``, or clear
    its data (an existing ConfigMap only)."""

    action: str  # "put" | "clear"
    name: str
    key: str = ""
    text: str = ""


def publish_steps(layout: Layout, *, head_name: str = CONFIGMAP_NAME,
                  previous_shards: Iterable[str] = ()) -> list[Step]:
    """Writes in a safe order: shards, then the head (the commit point), then emptying the shards the
    previous head named that the new one does not. A reader that sees the new head finds its
    shards; one that still sees the old head finds shards that no longer match and keeps its policy."""
    names = [name for name, _ in layout.shards]
    steps = [Step("put", name, SHARD_KEY, text) for name, text in layout.shards]
    steps.append(Step("put", head_name, DOCUMENT_KEY, layout.head))
    steps += [Step("clear", name) for name in previous_shards if name not in names]
    return steps


def shards_named(head_text: str | None) -> list[str]:
    """The shard names a published ``policy.json`` names (none for the single layout or unreadable text)."""
    if not head_text:
        return []
    try:
        head = json.loads(head_text)
    except ValueError:
        return []
    refs = head.get(SHARDS) if isinstance(head, Mapping) else None
    return [r["name"] for r in refs if isinstance(r, Mapping) and isinstance(r.get("name"), str)] \
        if isinstance(refs, list) else []
