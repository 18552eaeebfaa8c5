"""sparsegate_contracts: stdlib only, hashes pinned, both sides of each document agree, names match the CRDs."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
import yaml

import sparsegate_contracts
from sparsegate_contracts import canonical, flowpolicy, gate, names, rego
from sparsegate_contracts.version import installed_version

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = Path(sparsegate_contracts.__file__).parent

# Computed by the implementations these replaced (workloads gateparams, operator domain.policy,
# policy_compile and the agent's parser) at the commit before sparsegate_contracts existed.
PINNED_DEFAULT = ("g-3138a05aa441", "sha256:3138a05aa441ac94779607a2b23b6ebf467a5e20acc1df7f0590bb16c494c77e")
PINNED_CUSTOM = ("g-9c2123f38ba0", "sha256:9c2123f38ba06ffc804bd52c4e99943e6ef0aaf0226537fe0bac4a23ece3dc67")
CUSTOM_PARAMS = {"toolGateThreshold": 0.7, "faultInjection": {"errorRate": 0.25}, "precisionPolicy": "int8"}
PINNED_OPA_REVISION = "sha256:856aea44211f10db87460d1b26730816f0e6a470fec0441a647c03cecd6876f0"
# The identity form (identities + rules) since the operator stopped publishing IP-level entries.
PINNED_FLOW = "sha256:80470476bc896c38554dec9d2c20ea8d6c5a59671d77da2befb504e8e9b9bd7d"
PINNED_FLOW_EMPTY = "sha256:61481ef7da9a34b7a0d01512bf0626c57a494983e4b6f49e9a105e3d6dfe7128"
PINNED_AGENT_NO_VERSION = "sha256:26c1b21163b30b75c62c3419afa108b42f74fe9cf0af03d6a56d7fa16342e758"
ENTRY = {"srcIP": "10.0.0.1", "dstIP": "10.0.0.2", "dstPort": 8080, "protocol": "tcp", "action": "allow",
         "rule": "ns/p#0"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_imports_only_the_standard_library() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) >= 7
    allowed = set(sys.stdlib_module_names) | {"__future__", "sparsegate_contracts"}
    for path in files:
        assert _imports(path) <= allowed, f"{path.relative_to(ROOT)}: {_imports(path) - allowed}"


def test_gate_hashes_are_unchanged() -> None:
    assert (gate.DEFAULT_DOCUMENT.version, gate.DEFAULT_DOCUMENT.checksum) == PINNED_DEFAULT
    doc = gate.make_document(CUSTOM_PARAMS)
    assert (doc.version, doc.checksum) == PINNED_CUSTOM
    assert doc.file_text() == canonical.canonical_json(doc.to_json())
    assert json.loads(doc.file_text()) == {"version": PINNED_CUSTOM[0], "checksum": PINNED_CUSTOM[1],
                                           "params": CUSTOM_PARAMS}
    assert gate.checksum_of(CUSTOM_PARAMS) == canonical.sha256_of(CUSTOM_PARAMS)


def test_version_matches_checksum() -> None:
    version, checksum = PINNED_CUSTOM
    assert gate.version_matches_checksum(version, checksum)
    assert not gate.version_matches_checksum(version, PINNED_DEFAULT[1])
    assert not gate.version_matches_checksum("g-", checksum)
    assert not gate.version_matches_checksum(None, checksum)
    assert not gate.version_matches_checksum(version.replace("g-", "v-"), checksum)


def test_model_server_and_operator_use_the_same_gate_module() -> None:
    from sparsegate_workload import gateparams  # the model server's former module name: an alias
    from sparsegate.domain import gate as operator_gate

    assert gateparams is gate and operator_gate.gatedoc is gate
    assert operator_gate.resolve(None, referenced=False, num_experts=8).document.version == PINNED_DEFAULT[0]


def test_opa_data_revision_is_unchanged() -> None:
    from sparsegate.domain.policy import PolicySource, build_opa_data

    src = PolicySource(namespace="models", name="allow-web", generation=3, spec={
        "action": "Allow", "priority": 10, "sources": [{"namespace": "web", "serviceAccount": "frontend"}],
        "targets": [{"sparseModel": "mixtral"}], "ports": [{"port": 8080}]})
    data, _ = build_opa_data(sources=[src], trust_domain="cluster.local", rego="package sparsegate.routing\n")
    assert data["revision"] == PINNED_OPA_REVISION


def test_flow_policy_producer_and_agent_agree() -> None:
    from sparsegate.domain.policy_compile import PodInfo, QueryKey, flow_document
    from sparsegate_ebpf.policy import PolicyError, parse_policy

    pods = [PodInfo(namespace="models", name="m-0", ip="10.0.0.2", service_account="default",
                    labels=((names.MODEL_LABEL, "mixtral"),)),
            PodInfo(namespace="web", name="fe-0", ip="10.0.1.1", service_account="frontend", labels=())]
    query = QueryKey(namespace="web", service_account="frontend", labels=(), target_namespace="models",
                     model="mixtral", port=8080, protocol="tcp")
    doc = flow_document(decisions={query: {"allow": True, "rule": "models/allow-web#s0t0"}}, pods=pods)
    assert doc["version"] == PINNED_FLOW
    assert flow_document(decisions={}, pods=[])["version"] == PINNED_FLOW_EMPTY
    # What the operator writes into the ConfigMap is what the agent accepts, with the same version,
    # and the version is the content address of the rest of the document, computed by either side.
    parsed = parse_policy(flowpolicy.document_text(doc))
    assert parsed.version == doc["version"]
    assert [r.to_json() for r in parsed.rules] == doc["rules"] and len(parsed.identities) == 2
    body = {k: v for k, v in doc.items() if k != "version"}
    assert parse_policy(body).version == doc["version"] == flowpolicy.version_of(body)
    assert parse_policy({"entries": [ENTRY]}).version == PINNED_AGENT_NO_VERSION
    assert PolicyError is flowpolicy.FlowPolicyError


def test_flow_policy_capacity_is_the_consumers() -> None:
    doc = flowpolicy.build_document(entries=[ENTRY] * 3)
    assert len(flowpolicy.parse_document(doc).entries) == 3
    with pytest.raises(flowpolicy.FlowPolicyError, match="exceed the map capacity 2"):
        flowpolicy.parse_document(doc, max_entries=2)


def test_agent_protocols_and_actions_are_the_documents() -> None:
    from sparsegate_ebpf.maps import PROTO_NUMBERS
    from sparsegate_ebpf.policy import ACTIONS

    assert set(PROTO_NUMBERS) == set(flowpolicy.PROTOCOLS)
    assert set(ACTIONS) == set(flowpolicy.ACTIONS)


@pytest.mark.parametrize("crd", sorted((ROOT / "charts" / "sparsegate" / "crds").glob("*.yaml")), ids=lambda p: p.name)
def test_api_names_match_the_crds(crd: Path) -> None:
    spec = yaml.safe_load(crd.read_text())["spec"]
    assert spec["group"] == names.GROUP
    assert names.VERSION in [v["name"] for v in spec["versions"]]
    assert names.PLURALS[spec["names"]["kind"]] == spec["names"]["plural"]


def test_operator_writes_and_watches_the_shared_names() -> None:
    from sparsegate.clients.kube import path_for
    from sparsegate.domain import render

    assert path_for("RoutingPolicy", namespace="ns", name="p") == "/apis/sparsegate.dev/v1alpha1/namespaces/ns/routingpolicies/p"
    model = {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}, "spec": {"image": "i", "model": {}}}
    deployment = render.render_deployment(model, gate.DEFAULT_DOCUMENT)
    assert deployment["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "sparsegate-model", "sparsegate.dev/model": "m"}
    assert deployment["metadata"]["annotations"] == {
        "sparsegate.dev/gate-version": PINNED_DEFAULT[0], "sparsegate.dev/gate-checksum": PINNED_DEFAULT[1]}
    assert deployment["metadata"]["ownerReferences"][0]["apiVersion"] == "sparsegate.dev/v1alpha1"


def test_rego_ships_the_one_source() -> None:
    source = ROOT / "policies" / "routing" / "src.rego"
    shipped = PACKAGE / "rego" / rego.ROUTING_RESOURCE
    # In the source tree the packaged file is a relative symlink to policies/routing/src.rego.
    assert shipped.is_symlink() and shipped.resolve() == source.resolve()
    assert rego.routing_policy() == source.read_text()
    assert f"package {rego.PACKAGE}" in rego.routing_policy()


def test_routing_sync_reads_the_packaged_rego_unless_overridden(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    from sparsegate.handlers.routingpolicy import PolicySync, Settings

    monkeypatch.delenv(rego.OVERRIDE_ENV, raising=False)
    settings = Settings.from_env()
    assert settings.rego_path is None
    assert PolicySync(settings=settings, opa=None, store=None).rego == rego.routing_policy()
    override = tmp_path / "other.rego"
    override.write_text("package sparsegate.routing\n")
    monkeypatch.setenv(rego.OVERRIDE_ENV, str(override))
    settings = Settings.from_env()
    assert settings.rego_path == override
    assert PolicySync(settings=settings, opa=None, store=None).rego == "package sparsegate.routing\n"


def test_installed_version_is_the_distributions() -> None:
    from importlib import metadata

    assert installed_version() == metadata.version("sparsegate")
    assert installed_version("no-such-distribution-sparsegate") == "0+unknown"
