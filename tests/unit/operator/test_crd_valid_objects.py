"""What the schema accepts, the operator accepts: a seeded property check without a cluster.

Valid objects are generated from each CRD's OpenAPI schema beside the full example object of
``tests/e2e/operator/crd_fuzz_cases.py`` (``full_bases``): every numeric field at its minimum and
maximum (int32/int64/float bounds where the schema sets none), every enum value, strings at
``maxLength``/``minLength`` still matching their pattern, arrays at ``maxItems`` and cut to
``minItems``, maps at ``maxProperties``, each optional field absent, strings that may
carry ``$(VAR)``/``$$`` (the kubelet expands those in args), plus seeded random combinations
of these. The SparseModel CEL rules are honoured by a Python transcription (:func:`sparsemodel_cel_ok`);
for the other kinds, an object the schema's CEL rules would refuse may only end in the domain's
documented "invalid spec" errors (``SpecError``, ``GateParamsError``), which the handlers turn into
conditions — so any other exception is a bug, whatever the object.

Each object goes through the pure domain entry points of its kind:

- SparseModel: gate resolution (built-in default and a referenced GateConfig), ``render_applied``
  and ``render_secret``; the rendered objects must be ones Kubernetes accepts (label values ≤ 63,
  Service name a DNS-1035 label, env var names, ports, GPU quantities), and the rendered server
  args, after the kubelet's ``$(VAR)`` expansion, must be accepted by the model server's own
  parsers (argparse, model shape, gate document, tools, expert groups, token cache TTL), with the
  tools and checkpoint path arriving unchanged;
- GateConfig: ``rollout_codec.parse_spec``, ``gate.resolve`` for several model sizes and
  ``gate.stable_from_params``;
- RoutingPolicy: ``policy.build_opa_data``, ``policy_compile.candidate_queries`` /
  ``flow_question`` with pods the policy selects, and ``access_sync.model_document`` parsed back by
  the model server (``request_access.parse_access_document``);
- TelemetryProbe: ``probe_source``, ``plan``, ``observe`` and the agent's ``parse_node_config``.
"""

from __future__ import annotations

import copy
import json
import random
import re
from decimal import Decimal
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from crd_fuzz_loader import crd_fuzz_cases

from sparsegate.domain import access_sync, gate, policy, render
from sparsegate.domain import policy_compile as pc
from sparsegate.domain import rollout_codec as rc
from sparsegate.domain import telemetry_probe as tp
from sparsegate.domain.admin_tls import AdminMaterial
from sparsegate_contracts import gate as gatedoc
from sparsegate_contracts import names, probes, request_access
from sparsegate_workload import server, tools

ROOT = Path(__file__).resolve().parents[3]
SEED = 14
RANDOM_PER_KIND = 300
DELETE = object()

fuzz = crd_fuzz_cases()
SCHEMAS = fuzz.load_schemas(ROOT / "charts" / "sparsegate" / "crds")
BASES = fuzz.full_bases(fuzz.load_examples(ROOT / "examples"))


# ---------------------------------------------------------------- the generator


def _matches(schema: Mapping[str, Any], text: str) -> bool:
    pattern = schema.get("pattern")
    return not pattern or re.search(pattern, text) is not None


def _leaf_values(schema: Mapping[str, Any], value: Any) -> list[Any]:
    kind = fuzz._types(schema)
    out: list[Any] = []
    if kind in ("integer", "number"):
        lo, hi = schema.get("minimum"), schema.get("maximum")
        step = 1 if kind == "integer" else 1e-9
        if lo is not None:
            out.append(lo + step if schema.get("exclusiveMinimum") else lo)
        if hi is not None:
            out.append(hi - step if schema.get("exclusiveMaximum") else hi)
        int32 = schema.get("format") == "int32"
        if hi is None:
            out.append(fuzz.INT32_MAX if int32 else (2**63 - 1 if kind == "integer" else 1e308))
        if lo is None:
            out += [-(2**31) if int32 else (-(2**63) if kind == "integer" else -1e308), 0]
    elif kind == "string":
        if "enum" in schema:
            out += list(schema["enum"])
        elif isinstance(value, str) and value:
            if schema.get("maxLength"):
                out.append(fuzz.long_string(schema, value, schema["maxLength"]))
            if schema.get("minLength") and schema["minLength"] < len(value):
                out.append(value[: schema["minLength"]])
            dollars = value + "$(X)$$"  # kept where the pattern and length allow it
            if len(dollars) <= schema.get("maxLength", len(dollars)):
                out.append(dollars)
        out = [v for v in out if _matches(schema, v)]
    elif kind == "boolean":
        out += [True, False]
    elif kind == "int-or-string":  # a quantity: zero, and its longest spelling of the value's unit
        out += [0, *([fuzz.long_string(schema, str(value), schema["maxLength"])] if schema.get("maxLength") else [])]
        out = [v for v in out if not isinstance(v, str) or _matches(schema, v)]
    return out


def variants(schema: Mapping[str, Any], value: Any, path: tuple = (), required: bool = True) -> list[tuple]:
    """(path, new value or DELETE) for every boundary of the schema beside ``value``."""
    out: list[tuple] = [] if required else [(path, DELETE)]
    kind = fuzz._types(schema)
    if kind == "object" and isinstance(value, dict):
        needed = set(schema.get("required") or ())
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                out += variants(sub, value[key], path + (key,), key in needed)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and value:
            if schema.get("maxProperties"):
                k0, v0 = next(iter(value.items()))
                out.append((path, {fuzz.vary_string(k0, i, None): v0 for i in range(schema["maxProperties"])}))
            for key, sub_value in value.items():
                out += variants(extra, sub_value, path + (key,))
    elif kind == "array" and isinstance(value, list):
        items = schema.get("items") or {}
        for i, item in enumerate(value):
            out += variants(items, item, path + (i,))
        if schema.get("maxItems") and value:
            out.append((path, fuzz.distinct_items(items, value, schema["maxItems"])))
        least = schema.get("minItems", 0)
        if len(value) > least:
            out.append((path, value[:least]))
    else:
        out += [(path, v) for v in _leaf_values(schema, value)]
    return out


def _apply(obj: dict[str, Any], path: tuple, value: Any) -> dict[str, Any]:
    return fuzz.delete_at(obj, path) if value is DELETE else fuzz.set_at(obj, path, copy.deepcopy(value))


def objects(kind: str, *, seed: int = SEED, n_random: int = RANDOM_PER_KIND) -> Iterator[tuple[str, dict[str, Any]]]:
    """(description, object): each single boundary, then seeded combinations of 2 to 8 of them."""
    base = BASES[kind]
    found = variants(SCHEMAS[kind]["properties"]["spec"], base["spec"], ("spec",))
    for path, value in found:
        shown = "absent" if value is DELETE else repr(value)[:60]
        yield f"{fuzz.path_text(path)}={shown}", _apply(copy.deepcopy(base), path, value)
    rng = random.Random(f"{seed}/{kind}")
    for _ in range(n_random):
        obj, deleted, shown = copy.deepcopy(base), [], []
        for path, value in sorted(rng.sample(found, rng.randint(2, 8)), key=lambda pv: len(pv[0])):
            if any(path[: len(d)] == d for d in deleted):
                continue  # a field under one removed: setting it would leave its parent half-built
            try:
                obj = _apply(obj, path, value)
            except (IndexError, KeyError, TypeError):
                continue  # under an array an earlier pick shortened (or a value it replaced)
            if value is DELETE:
                deleted.append(path)
            shown.append(f"{fuzz.path_text(path)}={'absent' if value is DELETE else repr(value)[:40]}")
        yield "; ".join(shown), obj


# ---------------------------------------------------------------- CEL (SparseModel)


def sparsemodel_cel_ok(obj: Mapping[str, Any]) -> bool:
    """The SparseModel CRD's x-kubernetes-validations rules over ``spec`` (sparsemodels.yaml)."""
    spec = obj["spec"]
    model = spec["model"]
    experts, most = model["experts"], model.get("maxExpertsPerToken")
    if most is not None and most > experts:
        return False
    if model.get("minExpertsPerToken") is not None and model["minExpertsPerToken"] > (
            most if most is not None else min(experts, 4)):
        return False
    groups = spec.get("expertGroups") or []
    if len({g["name"] for g in groups}) != len(groups):
        return False
    if any(e >= experts for g in groups for e in g["experts"]) or any(
            len(set(g["experts"])) != len(g["experts"]) for g in groups):
        return False
    tool_names = [t["name"] for t in spec.get("tools") or []]
    if "calculator" in tool_names or len(set(tool_names)) != len(tool_names):
        return False
    if spec.get("servingPort") == names.DEFAULT_ADMIN_PORT:
        return False
    resources = spec.get("resources") or {}
    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    if any(quantity(v) < 0 for part in (requests, limits) for v in part.values()):
        return False
    if any(r in requests and r in limits and quantity(requests[r]) > quantity(limits[r]) for r in ("cpu", "memory")):
        return False
    access = spec.get("access") or {}
    if "tokenCacheSeconds" in access and access.get("requestAuth") != "Enforce":
        return False
    claim = model.get("persistentVolumeClaim")
    if claim:
        mount = claim["mountPath"]
        if re.search(r"//|/[.][.]?(/|$)", mount):
            return False
        held = mount if mount.endswith("/") else mount + "/"
        if any(mount == p or mount.startswith(p + "/") or p.startswith(held)
               for p in ("/etc/sparsegate", "/etc/sparsegate-admin", "/tmp")):
            return False
    return True


_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "n": Decimal("1e-9"),
           "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
           "P": 10**15, "E": 10**18}


def quantity(value: int | str) -> Decimal:
    """A Kubernetes quantity's value (resource.ParseQuantity, for the CRD's pattern)."""
    number, suffix = re.fullmatch(r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(.*)", str(value)).groups()
    if suffix in _SUFFIX:
        return Decimal(number) * _SUFFIX[suffix]
    return Decimal(number + suffix)  # a decimal exponent, e.g. 1e3


# ---------------------------------------------------------------- what Kubernetes accepts

DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
IANA_SVC_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([a-z0-9]|-(?=[a-z0-9]))*$")
GPU_COUNT = re.compile(r"^[0-9]+$")
QUANTITY = re.compile(SCHEMAS["SparseModel"]["properties"]["spec"]["properties"]["resources"]["properties"]
                      ["limits"]["properties"]["cpu"]["pattern"])


def _labels_ok(labels: Mapping[str, str]) -> None:
    for key, value in labels.items():
        assert len(value) <= 63 and LABEL_VALUE.match(value), (key, value)


def assert_kubernetes_accepts(objs: list[dict[str, Any]]) -> None:
    for obj in objs:
        meta = obj["metadata"]
        assert len(meta["name"]) <= 253 and DNS1123_SUBDOMAIN.match(meta["name"]), meta["name"]
        _labels_ok(meta.get("labels") or {})
        if obj["kind"] == "Service":
            assert len(meta["name"]) <= 63 and DNS1035_LABEL.match(meta["name"]), meta["name"]
            for port in obj["spec"]["ports"]:
                assert 1 <= port["port"] <= 65535
        if obj["kind"] == "Deployment":
            template = obj["spec"]["template"]
            _labels_ok(template["metadata"]["labels"])
            assert obj["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
            pod = template["spec"]
            for container in pod["containers"]:
                for env in container["env"]:
                    assert ENV_NAME.match(env["name"]), env["name"]
                for port in container["ports"]:
                    assert 1 <= port["containerPort"] <= 65535, port
                    assert len(port["name"]) <= 15 and IANA_SVC_NAME.match(port["name"]), port
                assert len({p["containerPort"] for p in container["ports"]}) == len(container["ports"])
                for limits in (container.get("resources") or {}).values():
                    for name, value in limits.items():
                        assert isinstance(value, str), (name, value)
                        assert (GPU_COUNT if name == "nvidia.com/gpu" else QUANTITY).match(value), (name, value)
                        assert quantity(value) >= 0, (name, value)
                mounts = [m["mountPath"] for m in container["volumeMounts"]]
                assert len(set(mounts)) == len(mounts), mounts
            for volume in pod["volumes"]:
                assert len(volume["name"]) <= 63 and DNS1123_SUBDOMAIN.match(volume["name"])
            for sysctl in (pod["securityContext"].get("sysctls") or []):
                assert 0 <= int(sysctl["value"]) <= 65535, sysctl
        json.dumps(obj, allow_nan=False)


def _kubelet_expand(arg: str) -> str:
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else "10.0.0.1", arg)


def assert_server_accepts(deployment: Mapping[str, Any], document: gatedoc.GateDocument,
                          spec: Mapping[str, Any]) -> None:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = server.build_parser().parse_args([_kubelet_expand(a) for a in container["args"]])
    num_experts = None
    if not args.model_path:
        num_experts = server.model_config_from_args(args).num_experts
    gatedoc.parse_document(document.to_json(), num_experts=num_experts)
    want_tools = [{k: t[k] for k in ("name", "url", "timeoutMs") if k in t} for t in spec.get("tools") or []]
    assert json.loads(args.tools_json) == want_tools
    tools.parse_tools(json.loads(args.tools_json))
    request_access.parse_expert_groups(json.loads(args.expert_groups_json), num_experts=num_experts)
    source = spec["model"].get("source")
    if source and not source.startswith(render.BUILTIN_SOURCE_PREFIX):
        assert args.model_path == source
    if args.request_auth == "in-cluster":
        assert 0 < args.token_cache_ttl <= 86400, args.token_cache_ttl


# ---------------------------------------------------------------- per kind

MATERIAL = AdminMaterial(token="t", cert_pem="CERT", key_pem="KEY")


def check_sparsemodel(obj: dict[str, Any]) -> None:
    obj["metadata"].update(namespace="ml", uid="0b7c1f6e-1111-2222-3333-444455556666", generation=1)
    experts = obj["spec"]["model"]["experts"]
    for resolution in (gate.resolve(None, referenced=False, num_experts=experts),
                       gate.resolve(BASES["GateConfig"], referenced=True, num_experts=experts)):
        if resolution.document is None:
            assert resolution.error  # a condition, with the reason
            continue
        objs = render.render_applied(obj, resolution.document) + [render.render_secret(obj, material=MATERIAL)]
        assert_kubernetes_accepts(objs)
        assert_server_accepts(objs[2], resolution.document, obj["spec"])


def check_gateconfig(obj: dict[str, Any]) -> None:
    try:
        rc.parse_spec(obj["spec"])
    except rc.SpecError:
        pass  # a condition naming the field
    for experts in (1, 2, 8, 64):
        resolution = gate.resolve(obj, referenced=True, num_experts=experts)
        assert resolution.document is not None or resolution.error
    try:
        gate.stable_from_params(obj["spec"].get("params") or {})
    except gatedoc.GateParamsError:
        pass


def _policy_pods(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    pods = []
    for i, source in enumerate(spec.get("sources") or ()):
        namespace = source.get("namespace") or "ns"
        pods.append({"metadata": {"name": f"src-{i}", "namespace": "other" if namespace == "*" else namespace,
                                  "labels": dict(source.get("matchLabels") or {})},
                     "spec": {"serviceAccountName": source.get("serviceAccount") or "default"},
                     "status": {"podIP": f"10.0.0.{i + 1}"}})
    ports = spec.get("ports") or [{"port": 8080}]
    for i, target in enumerate(spec.get("targets") or ()):
        pods.append({"metadata": {"name": f"model-{i}", "namespace": "ns",
                                  "labels": {names.MODEL_LABEL: target["sparseModel"]}},
                     "spec": {"containers": [{"ports": [{"containerPort": p["port"],
                                                         "protocol": p.get("protocol", "TCP")} for p in ports]}]},
                     "status": {"podIP": f"10.0.1.{i % 250 + 1}"}})
    return pods


def check_routingpolicy(obj: dict[str, Any]) -> None:
    source = policy.PolicySource(namespace="ns", name=obj["metadata"]["name"], generation=1, spec=obj["spec"])
    data, _ = policy.build_opa_data(sources=[source], trust_domain="cluster.local", rego="package x")
    json.dumps(data, allow_nan=False)
    pods = [p for p in map(pc.pod_info, _policy_pods(obj["spec"])) if p is not None]
    pc.candidate_queries(targets=data["targets"], pods=pods, trust_domain="cluster.local")
    pc.flow_question(targets=data["targets"], pods=pods, trust_domain="cluster.local")
    targets = obj["spec"].get("targets") or []
    for target in targets[:1] + targets[-1:]:
        model = copy.deepcopy(BASES["SparseModel"])
        model["metadata"].update(name=target["sparseModel"], namespace="ns")
        model["spec"]["access"] = {"requestAuth": "Enforce"}
        document = access_sync.model_document(model, [source], trust_domain="cluster.local")
        request_access.parse_access_document(json.loads(json.dumps(document, allow_nan=False)))


def check_telemetryprobe(obj: dict[str, Any]) -> None:
    obj["metadata"].update(namespace="ns", generation=1, creationTimestamp="2026-01-01T00:00:00Z")
    probe = tp.probe_source(obj)
    other = tp.ProbeSource(namespace="ns", name="older", generation=1, created="2025-01-01T00:00:00Z",
                           interfaces=probe.interfaces[:1],
                           xdp_mode="generic" if probe.xdp_mode != "generic" else "native")
    nodes = [tp.NodeInfo(name="n1", labels=probe.node_selector), tp.NodeInfo(name="n2")]
    plan = tp.plan(probes=[probe, other], nodes=nodes)
    tp.observe(probe=probe, plan=plan, reports={})
    for document in plan.configs.values():
        probes.parse_node_config(probes.document_text(document))


CHECKS = {"SparseModel": check_sparsemodel, "GateConfig": check_gateconfig,
          "RoutingPolicy": check_routingpolicy, "TelemetryProbe": check_telemetryprobe}


@pytest.mark.parametrize("kind", fuzz.KINDS)
def test_every_valid_object_is_handled(kind):
    checked, failures = 0, []
    for description, obj in objects(kind):
        if kind == "SparseModel" and not sparsemodel_cel_ok(obj):
            continue
        checked += 1
        try:
            CHECKS[kind](obj)
        except Exception as e:  # noqa: BLE001 - any other exception is the bug this test is for
            failures.append(f"{description}: {type(e).__name__}: {e}")
    assert checked >= 150, f"only {checked} {kind} objects generated"
    assert not failures, f"{len(failures)} {kind} objects failed, e.g.\n" + "\n".join(failures[:5])


def test_generator_reaches_the_bounds():
    """The walk finds the bounds it claims to (so a schema change cannot quietly empty it)."""
    paths = {fuzz.path_text(p) for p, _ in variants(SCHEMAS["SparseModel"]["properties"]["spec"],
                                                    BASES["SparseModel"]["spec"], ("spec",))}
    assert {"spec.model.dModel", "spec.model.experts", "spec.servingPort", "spec.expertGroups",
            "spec.tools[0].url", "spec.access.requestAuth"} <= paths
    first = [d for d, _ in objects("GateConfig", n_random=3)]
    assert first == [d for d, _ in objects("GateConfig", n_random=3)]  # seeded
