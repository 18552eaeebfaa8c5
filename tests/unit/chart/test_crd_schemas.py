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


@pytest.mark.parametrize("name", ["sparsemodels.yaml", "gateconfigs.yaml", "telemetryprobes.yaml",
                                  "routingpolicies.yaml"])
def test_default_values_satisfy_their_own_bounds(name):
    (version,) = load(name)["spec"]["versions"]
    checked = 0
    for path, sub in walk(version["schema"]["openAPIV3Schema"]):
        if "default" not in sub:
            continue
        checked += 1
        d = sub["default"]
        if isinstance(d, (int, float)) and not isinstance(d, bool):
            assert sub.get("minimum", d) <= d <= sub.get("maximum", d), path
        if "enum" in sub:
            assert d in sub["enum"], path
    assert checked, f"{name} has no defaults: nothing was checked"


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
    for r in spec["resources"]["x-kubernetes-validations"]:  # a request above its limit
        assert r["message"].startswith("spec.resources" + r["fieldPath"] + " must not exceed spec.resources.limits.")


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


def _routing_items() -> tuple[dict, dict]:
    (policy,) = load("routingpolicies.yaml")["spec"]["versions"]
    spec = policy["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    return spec["targets"]["items"]["properties"]["routes"]["items"], spec["sources"]["items"]["properties"]["spiffeID"]


def _accepts(schema: dict, value: str) -> bool:
    """The pattern and the dot-segment CEL rule, as the API server applies them (RE2 and Python's re
    agree on these expressions)."""
    import re

    rules = [r["rule"] for r in schema.get("x-kubernetes-validations", ())]
    assert rules == ["!self.matches('/[.][.]?(/|$)')"]
    return bool(re.search(schema["pattern"], value)) and not re.search("/[.][.]?(/|$)", value)


def test_routes_accept_every_served_path_and_refuse_paths_no_request_has():
    """A route is compared exactly with the model server's request path: every route it serves is
    accepted, and non-canonical paths (which could never match, so a Deny would do nothing) are not."""
    import re

    route, _ = _routing_items()
    workload = ROOT / "workloads" / "sparsegate_workload"
    source = (workload / "server.py").read_text() + (workload / "openai_api.py").read_text()
    consts = dict(re.findall(r'^(OPENAI_\w+) = "([^"]+)"', (workload / "server_state.py").read_text(), re.M))
    served = re.findall(r'router\.add_(?:get|post|put)\("([^"]+)"', source)
    served += [consts[c] for c in re.findall(r"router\.add_(?:get|post|put)\((OPENAI_\w+)", source)]
    assert {"/v1/infer", "/v1/chat/completions", "/v1/completions", "/v1/models", "/admin/access"} <= set(served)
    for path in served:
        assert _accepts(route, path), path
    for bad in ("/v1/infer/", "/v1//infer", "/v1/%69nfer", "/v1/infer;x", "/v1/infer?x=1", "/V1/infer", "/v1/*",
                "/", "v1/infer", "/v1/./infer", "/v1/../admin/access", "/v1/infer/.."):
        assert not _accepts(route, bad), bad


def test_spiffe_ids_follow_the_spiffe_id_spec():
    _, spiffe = _routing_items()
    for good in ("spiffe://cluster.local/ns/web/sa/frontend", "spiffe://my_td.example-1/ns/Web/sa/a_b.c-d",
                 "spiffe://td/.../a..b"):
        assert _accepts(spiffe, good), good
    for bad in ("spiffe://Cluster.local/ns/web", "spiffe://cluster.local/ns/web/", "spiffe://cluster.local/ns//web",
                "spiffe://cluster.local/ns/we%62", "spiffe://cluster.local:8443/ns/web", "spiffe://u@td/ns/web",
                "spiffe://cluster.local", "spiffe://cluster.local/ns/web/../sa/x", "spiffe://td/ns/a~b"):
        assert not _accepts(spiffe, bad), bad


def test_no_default_inside_list_items():
    """A schema default inside a list item puts the field into every stored item that leaves it out,
    so a Git copy without it never equals the live list: Argo CD's default (non server-side) diff
    replaces lists whole and reports such an object OutOfSync for good (self-heal re-applies it
    every cycle), and a second server-side applier of the unchanged file (Argo CD or Flux after
    `kubectl apply`) is refused with a conflict on an atomic list. The operator and the model
    server apply such defaults themselves (RoutingPolicy ports[].protocol TCP, SparseModel
    tools[].timeoutMs 1000)."""
    found = []

    def walk(schema: dict, path: str, in_item: bool) -> None:
        if not isinstance(schema, dict):
            return
        if in_item and "default" in schema:
            found.append(path)
        for key, sub in (schema.get("properties") or {}).items():
            walk(sub, f"{path}.{key}", in_item)
        if isinstance(schema.get("items"), dict):
            walk(schema["items"], f"{path}[]", True)
        if isinstance(schema.get("additionalProperties"), dict):
            walk(schema["additionalProperties"], f"{path}.*", in_item)

    for crd_path in sorted(CRD_DIR.glob("*.yaml")):
        crd = load(crd_path.name)
        for version in crd["spec"]["versions"]:
            walk(version["schema"]["openAPIV3Schema"], f"{crd['spec']['names']['kind']}", False)
    assert not found, found


def _web_header_schemas() -> tuple[dict, dict]:
    (version,) = load("gateconfigs.yaml")["spec"]["versions"]
    check = (version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["rollout"]["properties"]
             ["analysis"]["properties"]["checks"]["items"])
    header = check["properties"]["provider"]["properties"]["web"]["properties"]["headers"]["items"]["properties"]
    return header["name"], header["value"]


def test_web_check_headers_accept_exactly_what_the_http_client_sends():
    """A header the HTTP client (aiohttp) refuses fails every measurement of the check (the request
    is never sent): the CRD refuses those values, and only those (text past Latin-1 goes out as UTF-8)."""
    import re

    from aiohttp.http_writer import _py_serialize_headers
    from multidict import CIMultiDict

    def sent(name: str, value: str) -> bool:
        try:
            _py_serialize_headers("GET / HTTP/1.1", CIMultiDict({name: value}))
        except ValueError:
            return False
        return True

    name, value = _web_header_schemas()
    for c in map(chr, [*range(0x300), 0x2028, 0x4E2D, 0xFEFF, 0x1F600]):
        text = f"a{c}b"
        assert bool(re.fullmatch(value["pattern"], text)) == sent("X-Key", text), repr(c)
    assert re.fullmatch(value["pattern"], "") and re.fullmatch(value["pattern"], "Bearer abc\tdef")
    for bad in ("X Key", "X:Key", "X-Key\r\n", "", "X(Key)", "Kéy"):
        assert not re.fullmatch(name["pattern"], bad), bad


def test_telemetry_probe_interfaces_are_names_linux_takes():
    """The kernel (dev_valid_name) refuses '.', '..' and any ':' (an alias label like eth0:1 is no
    device; if_nametoindex would answer eth0's index for it): the CRD refuses what the agent would."""
    import re

    from sparsegate_contracts.probes import is_ifname

    (version,) = load("telemetryprobes.yaml")["spec"]["versions"]
    item = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["interfaces"]["items"]
    assert rules(item) == ["self != '.' && self != '..'"]

    def accepts(name: str) -> bool:
        return bool(re.fullmatch(item["pattern"], name)) and len(name) <= item["maxLength"] and name not in (".", "..")

    for name in ("eth0", "lo", "veth1@if5", "bond0.100", "br-0_a", ".x", "a..b", "...", "e" * 15):
        assert accepts(name) and is_ifname(name), name
    for name in (".", "..", "eth0:1", ":", "", "e" * 16, "eth/0", "eth 0", "eth0\n", "\x00"):
        assert not accepts(name) and not is_ifname(name), repr(name)
