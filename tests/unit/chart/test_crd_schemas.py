"""CRD sanity without a cluster: structure, descriptions, validation rules, one source.

The real kube-apiserver checks of the same rules are in tests/e2e/operator/test_crd_validation.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
CRD_DIR = ROOT / "charts" / "sparsegate" / "crds"
MINE = ["sparsemodels.yaml", "gateconfigs.yaml", "telemetryprobes.yaml"]


def load(name: str) -> dict:
    return yaml.safe_load((CRD_DIR / name).read_text())


def walk(schema: dict, path: str = ""):
    """Yield (path, schema) for every property and array item below ``schema``."""
    for key, sub in (schema.get("properties") or {}).items():
        yield f"{path}.{key}", sub
        yield from walk(sub, f"{path}.{key}")
    if "items" in schema:
        yield f"{path}[]", schema["items"]
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield f"{path}{{}}", schema["additionalProperties"]


@pytest.mark.parametrize("name", MINE)
def test_crd_shape(name):
    crd = load(name)
    spec = crd["spec"]
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1" and crd["kind"] == "CustomResourceDefinition"
    assert spec["group"] == "sparsegate.dev" and crd["metadata"]["name"] == f"{spec['names']['plural']}.sparsegate.dev"
    assert spec["names"]["categories"] == ["sparsegate"] and spec["names"]["shortNames"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["additionalPrinterColumns"]


@pytest.mark.parametrize("name", MINE)
def test_every_field_has_a_description(name):
    (version,) = load(name)["spec"]["versions"]
    root = version["schema"]["openAPIV3Schema"]
    # metadata is the one exception: the API server forbids anything but its type.
    missing = [path for path, sub in walk(root) if not sub.get("description") and path != ".metadata"]
    assert root.get("description") and missing == []


def test_default_values_satisfy_their_own_bounds():
    for name in MINE:
        (version,) = load(name)["spec"]["versions"]
        for path, sub in walk(version["schema"]["openAPIV3Schema"]):
            d = sub.get("default")
            if isinstance(d, (int, float)) and not isinstance(d, bool):
                assert sub.get("minimum", d) <= d <= sub.get("maximum", d), path
            if "enum" in sub and "default" in sub:
                assert d in sub["enum"], path


def rules(schema: dict) -> list[str]:
    return [r["rule"] for r in schema.get("x-kubernetes-validations", [])]


def test_gateconfig_rules_present():
    (version,) = load("gateconfigs.yaml")["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    steps = spec["rollout"]["properties"]["steps"]
    assert any("isSorted" in r and "indexOf" in r for r in rules(steps))  # strictly increasing
    assert any("== 100" in r for r in rules(steps))  # ends at 100
    assert steps["items"]["minimum"] == 1 and steps["items"]["maximum"] == 100
    params = spec["params"]
    assert any("self.minExpertsPerToken <=" in r and "has(self.maxExpertsPerToken) ? self.maxExpertsPerToken : 4" in r
               for r in rules(params))
    for key in ("toolGateThreshold", "confidenceThreshold"):
        p = params["properties"][key]
        assert p["exclusiveMinimum"] and p["exclusiveMaximum"] and (p["minimum"], p["maximum"]) == (0, 1)
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["rollout"]["x-kubernetes-preserve-unknown-fields"] is True
    assert set(status["stable"]["properties"]) == {"version", "checksum", "params"}


def test_sparsemodel_rules_name_their_field():
    (version,) = load("sparsemodels.yaml")["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["replicas"]["minimum"] == 0 and spec["servingPort"]["default"] == 8080
    for r in spec["model"]["x-kubernetes-validations"]:
        assert r["fieldPath"].lstrip(".") in r["message"] and r["message"].startswith("spec.model.")


def test_crds_have_one_source():
    """No other tracked file carries a copy of a sparsegate CRD (they are read from crds/)."""
    out = subprocess.run(["git", "grep", "-l", "-E", "^kind: +CustomResourceDefinition"], cwd=ROOT,
                         capture_output=True, text=True, check=False).stdout.split()
    assert [p for p in out if not p.startswith("charts/sparsegate/crds/")] == []


ALL = [*MINE, "routingpolicies.yaml"]


@pytest.mark.parametrize("name", ALL)
def test_every_user_field_is_bounded(name):
    """What users write is bounded: arrays by maxItems, maps by maxProperties, strings by maxLength
    or an enum (CEL cost estimates need the bounds; tests/e2e/operator/test_crd_fuzz.py sends one
    past each to the API server)."""
    (version,) = load(name)["spec"]["versions"]
    unbounded = []
    for path, sub in walk(version["schema"]["openAPIV3Schema"]):
        if not path.startswith(".spec"):
            continue
        kind = sub.get("type")
        if kind == "array" and "maxItems" not in sub:
            unbounded.append(path)
        elif kind == "object" and isinstance(sub.get("additionalProperties"), dict) and "maxProperties" not in sub:
            unbounded.append(path)
        elif kind == "string" and "maxLength" not in sub and "enum" not in sub:
            unbounded.append(path)
    assert unbounded == []


def test_name_references_are_object_names():
    """A SparseModel's gateConfigRef names a GateConfig (DNS-1123 subdomain, at most 253); a
    RoutingPolicy target names a SparseModel (DNS-1035 label, at most 63, as its CRD's rule says)."""
    import re

    (model,) = load("sparsemodels.yaml")["spec"]["versions"]
    ref = model["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["gateConfigRef"]["properties"]["name"]
    assert ref["maxLength"] == 253
    assert re.match(ref["pattern"], "gate.v1-a") and not re.match(ref["pattern"], "..")
    (policy,) = load("routingpolicies.yaml")["spec"]["versions"]
    target = policy["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["targets"]["items"]
    name = target["properties"]["sparseModel"]
    assert name["maxLength"] == 63
    assert re.match(name["pattern"], "*") and re.match(name["pattern"], "moe-small")
    assert not re.match(name["pattern"], "moe.small") and not re.match(name["pattern"], "1st")
