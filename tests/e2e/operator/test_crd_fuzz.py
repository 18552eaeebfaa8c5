"""Fuzzing the four custom resource kinds: what the schema accepts, the operator accepts.

Given the chart installed by helm on the dev stack (its crds/ are the only CRD source) and the
seeded cases of crd_fuzz_cases.py:

- when each invalid case is sent to the real kube-apiserver as a server-side dry-run create
  (``dryRun=All``: OpenAPI validation, defaulting and CEL, nothing stored), then every one is
  refused (422 Invalid; 400 "strict decoding error" for unknown fields, sent with
  ``fieldValidation=Strict`` since the API server otherwise prunes them silently) with a message
  that names the field it breaks. Any case the API server accepts is a missing bound in a CRD.
  This half covers SparseModel, GateConfig, RoutingPolicy and TelemetryProbe.
- when the valid boundary objects are created for real (SparseModel, GateConfig, RoutingPolicy:
  the kinds the operator reconciles; TelemetryProbe has a schema but no controller yet, so only
  the API server's half applies to it and its edges are dry-run only), then the in-cluster
  operator writes a status condition on each, its containers never restart and its log shows
  no Traceback.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from devstack import Stack
from kubernetes import client as kube_client
from kubernetes import config as kube_config
from kubernetes.client.exceptions import ApiException
from localcluster.health import wait_for
from sparsegate_contracts import names

import crd_fuzz_cases as fuzz
from operator_e2e_support import EXAMPLES, REPO, leader, operator_restarts

SCHEMAS = fuzz.load_schemas(REPO / "charts" / "sparsegate" / "crds")
EXAMPLE_OBJECTS = fuzz.load_examples(EXAMPLES)
CASES = fuzz.invalid_cases(SCHEMAS, EXAMPLE_OBJECTS)
EDGES = fuzz.valid_edges(SCHEMAS, EXAMPLE_OBJECTS)
OPERATOR_KINDS = ("GateConfig", "SparseModel", "RoutingPolicy")  # created in this order
# Condition types each kind's status reports (domain/conditions.py, domain/rollout.py, domain/policy_status.py).
CONDITION_TYPES = {"Ready", "Degraded", "Progressing", "Reconciling", "Stalled"}


@pytest.fixture(scope="module")
def api(stack: Stack) -> Iterator[kube_client.CustomObjectsApi]:
    api_client = kube_config.new_client_from_config(config_file=str(stack.cluster.kubeconfig))
    yield kube_client.CustomObjectsApi(api_client)
    api_client.close()


def create(api: kube_client.CustomObjectsApi, namespace: str, obj: dict[str, Any], *, dry_run: bool,
           strict: bool = True) -> tuple[int, str]:
    """(HTTP status, message) of a create; 201 when the API server accepted it."""
    try:
        api.create_namespaced_custom_object(names.GROUP, names.VERSION, namespace, names.PLURALS[obj["kind"]], obj,
                                            dry_run="All" if dry_run else None,
                                            field_validation="Strict" if strict else None)
        return 201, ""
    except ApiException as exc:
        try:
            return exc.status, json.loads(exc.body).get("message", "")
        except (TypeError, ValueError):
            return exc.status, str(exc.body)


def names_field(message: str, path: str) -> bool:
    """Whether the API server's message names ``path``: the path itself, or (for a CEL rule held
    by an object, which the API server reports at the object) an enclosing path of at least two
    segments plus the field's own name as a word (``spec.ports[0]: ... ports[].port must ...``)."""
    if path in message:
        return True
    tokens = fuzz.parse_path(path)
    leaf = tokens[-1]
    for cut in range(len(tokens) - 1, 1, -1):
        parent = fuzz.path_text(tokens[:cut])
        if parent in message and isinstance(leaf, str) and re.search(rf"(?<![A-Za-z0-9]){re.escape(leaf)}(?![A-Za-z0-9])",
                                                                     message.replace(parent, "")):
            return True
    return False


def expected_status(case: fuzz.Case, status: int, message: str) -> bool:
    if case.strict:  # decoding refuses unknown fields before validation runs
        return status == 400 and "strict decoding error: unknown field" in message
    return status == 422


def test_invalid_objects_are_refused_naming_the_field(stack: Stack, stack_namespace: str,
                                                       api: kube_client.CustomObjectsApi) -> None:
    # The bases the cases mutate are valid: a refusal below is the mutation's doing.
    for kind, base in fuzz.full_bases(EXAMPLE_OBJECTS).items():
        assert create(api, stack_namespace, base, dry_run=True) == (201, ""), kind
    by_kind, by_category = fuzz.counts(CASES)
    assert len(CASES) >= 200 and all(by_kind.values()) and all(by_category.values())
    failures = []
    t0 = time.monotonic()
    for case in CASES:
        status, message = create(api, stack_namespace, case.obj, dry_run=True, strict=case.strict)
        if not (expected_status(case, status, message) and names_field(message, case.path)):
            failures.append(f"{case.id}: HTTP {status}: {message[:400]}")
    elapsed = time.monotonic() - t0
    sys.stderr.write(f"\n[fuzz] {len(CASES)} invalid objects in {elapsed:.1f}s, per kind {by_kind}, "
                     f"per category {by_category}; not refused as expected: {len(failures)}\n")
    assert failures == [], "\n".join(failures)


def conditions_of(api: kube_client.CustomObjectsApi, namespace: str, obj: dict[str, Any]) -> list[dict[str, Any]]:
    body = api.get_namespaced_custom_object(names.GROUP, names.VERSION, namespace, names.PLURALS[obj["kind"]],
                                            obj["metadata"]["name"])
    status = body.get("status") or {}
    # Written for this generation (where the kind records it), not left over.
    if status.get("observedGeneration", body["metadata"]["generation"]) < body["metadata"]["generation"]:
        return []
    return [c for c in status.get("conditions") or () if c.get("type") in CONDITION_TYPES]


def operator_log(stack: Stack) -> dict[str, list[str]]:
    """Every operator pod's ``operator`` container log, as lines."""
    return {p["metadata"]["name"]: stack.logs(p, "operator", lines=1_000_000).splitlines()
            for p in stack.operator_pods()}


def test_valid_edges_get_a_condition_and_the_operator_never_crashes(stack: Stack, stack_namespace: str,
                                                                     api: kube_client.CustomObjectsApi) -> None:
    leader(stack)
    restarts = operator_restarts(stack)
    log_before = {pod: len(lines) for pod, lines in operator_log(stack).items()}
    # Every kind's edges, TelemetryProbe's included, are accepted by the API server.
    refused = [(e.kind, e.note, create(api, stack_namespace, e.obj, dry_run=True)) for e in EDGES]
    assert [r for r in refused if r[2][0] != 201] == []

    created = [e for kind in OPERATOR_KINDS for e in EDGES if e.kind == kind]
    t0 = time.monotonic()
    seen: dict[str, list[dict[str, Any]]] = {}
    try:
        for edge in created:
            assert create(api, stack_namespace, edge.obj, dry_run=False) == (201, ""), edge.note

        def all_reported() -> bool:
            for edge in created:
                key = f"{edge.kind}/{edge.obj['metadata']['name']}"
                if key not in seen:
                    found = conditions_of(api, stack_namespace, edge.obj)
                    if found:
                        seen[key] = found
                        sys.stderr.write(f"[fuzz] {key[:60]} ({edge.note}) after {time.monotonic() - t0:.1f}s: "
                                         + ", ".join(f"{c['type']}={c['status']}/{c.get('reason')}" for c in found)
                                         + "\n")
            return len(seen) == len(created)

        wait_for(all_reported, what="a status condition on every valid edge object", timeout_s=180, interval_s=1.0)

        # What the operator settles on for some of them is known in advance.
        expected = {
            "SparseModel/sm-missing-gate": {"Degraded": ("True", "GateConfigNotFound")},
            # replicas 0, gate resolved (the built-in one; the 253-char GateConfig's)
            f"SparseModel/m{'0' * 61}x": {"Degraded": ("False", "AsExpected"), "Ready": ("True", "ScaledToZero")},
            "SparseModel/sm-largest": {"Degraded": ("False", "AsExpected"), "Ready": ("True", "ScaledToZero")},
            # unset maxExpertsPerToken: 2 of its 2 experts, for the model and its GateConfig's gate
            "SparseModel/sm-two-experts": {"Degraded": ("False", "AsExpected"), "Ready": ("True", "ScaledToZero")},
            # OPA took them, the fullest one included
            "RoutingPolicy/rp-fullest": {"Ready": ("True", "LoadedInOPA")},
            "RoutingPolicy/rp-emptiest": {"Ready": ("True", "LoadedInOPA")},
        }
        by_key = {f"{e.kind}/{e.obj['metadata']['name']}": e.obj for e in created}
        current: dict[str, dict[str, tuple[str, str]]] = {}

        def settled() -> bool:
            for key, want in expected.items():
                conds = conditions_of(api, stack_namespace, by_key[key])
                current[key] = {c["type"]: (c["status"], c.get("reason")) for c in conds}
            return all(current[key].get(t) == v for key, want in expected.items() for t, v in want.items())

        try:
            wait_for(settled, what="the expected conditions", timeout_s=120, interval_s=1.0)
        except AssertionError:
            raise AssertionError(f"conditions now: {json.dumps(current, indent=1)}") from None
        sys.stderr.write(f"[fuzz] expected conditions after {time.monotonic() - t0:.1f}s\n")
        # The same operator processes, and nothing they logged since the edges arrived is a crash
        # or a handler exception. Checked before the deletions below: what follows them is the
        # deletion path, not the edge cases.
        assert operator_restarts(stack) == restarts
        for pod, lines in operator_log(stack).items():
            new = lines[log_before.get(pod, 0):]
            crashes = [line for line in new if "Traceback" in line or "failed with an exception" in line]
            assert crashes == [], f"{pod}:\n" + "\n".join(new[-80:])
    finally:
        # The models go now (their Deployments with them); the namespace is deleted after the test.
        for edge in created:
            if edge.kind == "SparseModel":
                api.delete_namespaced_custom_object(names.GROUP, names.VERSION, stack_namespace, "sparsemodels",
                                                    edge.obj["metadata"]["name"])
