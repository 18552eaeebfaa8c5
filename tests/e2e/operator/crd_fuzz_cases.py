"""Seeded fuzz cases for the four sparsegate CRDs: invalid objects and valid boundary objects.

Pure: every function takes the CRD schemas and example objects it works from (``load_schemas`` and
``load_examples`` are the only readers of files) and returns new objects; the same seed gives the
same cases in the same order.

Invalid cases (:func:`invalid_cases`) are single mutations of a *full* valid base object per kind
(the repo's example plus every optional field, :func:`full_bases`), found by walking the kind's
OpenAPI schema beside the base object:

- ``wrong_type``: a value of another JSON type at every field (objects, arrays and leaves);
- ``out_of_range``: just past ``minimum``/``maximum`` (the bound itself when exclusive), past
  int32 for ``format: int32``;
- ``bad_format``: strings outside ``enum`` or not matching ``pattern``; names the API server
  refuses;
- ``too_long``: strings one past ``maxLength``;
- ``oversized``: arrays one past ``maxItems`` (distinct valid items) and maps one past
  ``maxProperties``;
- ``undersized``: arrays under ``minItems``, strings under ``minLength``;
- ``missing_required``: each ``required`` property removed;
- ``unknown_field``: an extra property in every object that does not preserve unknown fields.
  The API server *prunes* unknown fields silently unless the request says
  ``fieldValidation=Strict`` (then it answers 400 "strict decoding error: unknown field
  "<path>""), so these cases carry ``strict=True``;
- ``cross_field``: violations of the ``x-kubernetes-validations`` (CEL) rules that relate fields
  (or items of one array). Every CEL rule in the CRDs must have an entry in :data:`CEL_CASES`
  (keyed by kind, schema path and rule text): :func:`invalid_cases` raises on a rule it does not
  know, so a new rule cannot go unfuzzed. Single-field CEL rules (positive durations, SPIFFE dot
  segments, port range) are listed there too, under the category they break.

Each case records the field path it breaks (``spec.rollout.steps[1]``, ``metadata.name``), which
the e2e test expects the API server's message to name.

Valid boundary objects (:func:`valid_edges`) sit at the bounds: minimum and maximum values,
longest names, fullest arrays, optional fields absent. Bounds are read from the schemas, so a
changed CRD moves the edges with it.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

KINDS = ("SparseModel", "GateConfig", "RoutingPolicy", "TelemetryProbe")
CATEGORIES = ("wrong_type", "out_of_range", "bad_format", "too_long", "oversized", "undersized",
              "missing_required", "unknown_field", "cross_field")
CRD_FILES = {"SparseModel": "sparsemodels.yaml", "GateConfig": "gateconfigs.yaml",
             "RoutingPolicy": "routingpolicies.yaml", "TelemetryProbe": "telemetryprobes.yaml"}
EXAMPLE_FILES = {"SparseModel": "sparsemodel.yaml", "GateConfig": "gateconfig.yaml",
                 "RoutingPolicy": "routingpolicy.yaml", "TelemetryProbe": "telemetryprobe.yaml"}
DEFAULT_SEED = 14  # the issue's number; any seed gives a full set
UNKNOWN_KEY = "fuzzUnknownField"
INT32_MAX = 2**31 - 1
# Go's time.Duration holds at most 2562047h47m16.854775807s; CEL's duration() refuses more.
MAX_GO_DURATION = "2562047h"

Token = str | int
FieldPath = tuple[Token, ...]


@dataclasses.dataclass(frozen=True)
class Case:
    """One invalid object and the field it breaks."""

    kind: str
    category: str
    path: str
    """The field the mutation breaks, as the API server spells it: ``spec.steps[1]``."""
    note: str
    obj: dict[str, Any] = dataclasses.field(compare=False, repr=False)
    strict: bool = False
    """Send with ``fieldValidation=Strict`` (unknown fields are pruned silently otherwise)."""

    @property
    def id(self) -> str:
        return f"{self.kind}:{self.category}:{self.path}:{self.note}"


@dataclasses.dataclass(frozen=True)
class Edge:
    """One valid object at a boundary of its schema."""

    kind: str
    note: str
    obj: dict[str, Any] = dataclasses.field(compare=False, repr=False)


# ---------------------------------------------------------------- loading (the only I/O)


def load_schemas(crd_dir: Path) -> dict[str, dict[str, Any]]:
    """kind → its (single version's) ``openAPIV3Schema``."""
    out = {}
    for kind, file in CRD_FILES.items():
        crd = yaml.safe_load((crd_dir / file).read_text())
        assert crd["spec"]["names"]["kind"] == kind, file
        (version,) = crd["spec"]["versions"]
        out[kind] = version["schema"]["openAPIV3Schema"]
    return out


def load_examples(examples_dir: Path) -> dict[str, dict[str, Any]]:
    """kind → the repo's example object of that kind."""
    return {kind: yaml.safe_load((examples_dir / file).read_text()) for kind, file in EXAMPLE_FILES.items()}


# ---------------------------------------------------------------- paths


def path_text(path: FieldPath) -> str:
    out = ""
    for token in path:
        out += f"[{token}]" if isinstance(token, int) else (f".{token}" if out else token)
    return out


def normalise(path: str) -> str:
    """``spec.steps[1]`` → ``spec.steps[]``: the form used to compare paths across items."""
    return re.sub(r"\[\d+\]", "[]", path)


def get_at(obj: Any, path: FieldPath) -> Any:
    for token in path:
        obj = obj[token]
    return obj


def set_at(obj: dict[str, Any], path: FieldPath, value: Any) -> dict[str, Any]:
    """A copy of ``obj`` with ``value`` at ``path`` (missing parent objects are created)."""
    out = copy.deepcopy(obj)
    node: Any = out
    for token in path[:-1]:
        node = node.setdefault(token, {}) if isinstance(token, str) else node[token]
    node[path[-1]] = copy.deepcopy(value)
    return out


def delete_at(obj: dict[str, Any], path: FieldPath) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    del get_at(out, path[:-1])[path[-1]]
    return out


def parse_path(text: str) -> FieldPath:
    """``"spec.sources[1].spiffeID"`` → ``("spec", "sources", 1, "spiffeID")``."""
    out: list[Token] = []
    for part in text.split("."):
        name, *indices = re.split(r"\[", part)
        if name:
            out.append(name)
        out.extend(int(i.rstrip("]")) for i in indices)
    return tuple(out)


# ---------------------------------------------------------------- valid bases


def deep_merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in extra.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) \
            else copy.deepcopy(value)
    return out


# What the examples leave out, so that every field of every schema has a value to mutate.
EXTRAS: dict[str, dict[str, Any]] = {
    "SparseModel": {"spec": {"image": "registry.local/sparsegate-model-server:dev",
                             "model": {"source": "/models/moe/checkpoint",
                                       "persistentVolumeClaim": {"claimName": "moe-weights",
                                                                 "mountPath": "/models"}},
                             "tools": [{"name": "search", "url": "http://search.tools:8080/call",
                                        "timeoutMs": 500}],
                             "expertGroups": [{"name": "math", "experts": [0, 1]},
                                              {"name": "code", "experts": [2, 3]}],
                             "access": {"requestAuth": "Enforce", "tokenCacheSeconds": 30},
                             "service": {"headless": True},
                             "resources": {"requests": {"cpu": "500m", "memory": "1Gi"},
                                           "limits": {"cpu": 2, "memory": "2Gi"}}}},
    "GateConfig": {"spec": {
        "params": {"faultInjection": {"errorRate": 0.0, "addedLatencyMs": 0}, "targetExpertsPerToken": 2,
                   "hardwareCostLambda": 0.5},
        "rollout": {"minRequests": 20, "progressDeadline": "120s", "maxQualityDrop": 0.02,
                    "strategy": "requests", "stickyHeader": "x-session-id",
                    "analysis": {"checks": [
                        {"name": "builtin", "provider": {"builtin": {}}},
                        {"name": "error-ratio", "provider": {"prometheus": {
                            "address": "http://prometheus.monitoring:9090",
                            "query": 'sum(rate(sparsegate_requests_total{pod=~"{{args.canaryPods}}",code=~"5.."}'
                                     '[{{args.window}}]))'}},
                         "successCondition": "result < 0.05", "failureCondition": "result >= 0.1", "count": 3,
                         "interval": "30s", "failureLimit": 1, "inconclusiveLimit": 1, "consecutiveErrorLimit": 4,
                         "dryRun": False},
                        {"name": "quality", "provider": {"web": {
                            "url": "http://judge.default:8080/score", "method": "POST",
                            "body": '{"version": "{{args.canaryVersion}}"}',
                            "headers": [{"name": "X-Scope", "value": "canary"}], "jsonPath": "$.score",
                            "timeout": "5s"}},
                         "successCondition": "result >= 0.9", "dryRun": True},
                    ]}},
    }},
    "RoutingPolicy": {"spec": {
        "sources": [{"namespace": "default", "serviceAccount": "default", "matchLabels": {"app": "web"}},
                    {"spiffeID": "spiffe://cluster.local/ns/web/sa/frontend"}],
        "targets": [{"sparseModel": "moe-small", "expertGroups": ["experts-a"], "routes": ["/v1/infer"]}],
        "ports": [{"port": 8080, "protocol": "TCP"}],
    }},
    "TelemetryProbe": {},
}


def full_bases(examples: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """kind → the example with every optional field filled in (a valid object)."""
    return {kind: deep_merge(examples[kind], EXTRAS[kind]) for kind in KINDS}


# ---------------------------------------------------------------- the schema walk


def _types(schema: Mapping[str, Any]) -> str | None:
    if schema.get("x-kubernetes-int-or-string"):
        return "int-or-string"
    return schema.get("type")


WRONG_TYPE_VALUES: dict[str, list[Any]] = {
    # Per schema type: values of other JSON types (null is not one: the API server drops nulls of
    # non-nullable fields and applies the default, so null is not invalid).
    "integer": ["7", True, 1.5, [1], {"v": 1}],
    "number": ["0.5", True, [0.5], {"v": 0.5}],
    "string": [12345, True, ["x"], {"v": "x"}],
    "boolean": ["true", 1, [True], {"v": True}],
    "object": ["not-an-object", 7, ["x"]],
    "array": ["not-an-array", 7, {"v": 1}],
    "int-or-string": [True, 1.5, ["1"], {"v": 1}],
}

# Strings tried against a pattern; those the pattern refuses (and that fit the length bounds)
# become bad_format cases.
PATTERN_PROBES = ["", " ", "UPPER", "-lead", "trail-", "a b", "a_b", "dots..", "ünïcode", "../up", "a/b",
                  "spiffe://x", "http://h/p", "1m30", "30 s", "-5s", "s30", "1d", "1us", "*x", "eth0!",
                  "sixteen-chars-xx", "no-slash", "a:b:c"]
ENUM_PROBES = ["", "none", "AUTO", "Allow ", "allow", "tcp", "SCTP", "fp16", "turbo"]


class Walker:
    """Collects cases for one kind from its schema and full base object."""

    def __init__(self, *, kind: str, schema: Mapping[str, Any], base: Mapping[str, Any], rng: random.Random) -> None:
        self.kind, self.schema, self.base, self.rng = kind, schema, dict(base), rng
        self.cases: list[Case] = []
        self._seen: set[tuple[str, str, str]] = set()
        self.covered: set[str] = set()

    def add(self, category: str, path: FieldPath | str, note: str, obj: dict[str, Any], *, strict: bool = False) -> None:
        text = path if isinstance(path, str) else path_text(path)
        key = (category, normalise(text), note)
        if key in self._seen:  # the same mutation on another item of an array adds nothing
            return
        self._seen.add(key)
        self.cases.append(Case(self.kind, category, text, note, obj, strict))

    def pick(self, values: Sequence[Any], k: int) -> list[Any]:
        return self.rng.sample(list(values), min(k, len(values)))

    # -- walk ----------------------------------------------------------------------------

    def walk(self, schema: Mapping[str, Any], path: FieldPath) -> None:
        value = get_at(self.base, path)
        self.covered.add(normalise(path_text(path)))
        kind = _types(schema)
        if path and path[0] in ("apiVersion", "kind", "status", "metadata"):
            return  # not the user's to fuzz here (metadata.name: see NAME_CASES)
        if path:
            self.wrong_type(schema, path)
        if kind == "object":
            self.object(schema, path, value)
        elif kind == "array":
            self.array(schema, path, value)
        elif kind in ("integer", "number"):
            self.numeric(schema, path)
        elif kind == "string":
            self.string(schema, path, value)
        elif kind == "int-or-string":  # a Kubernetes quantity: its pattern and length hold for strings
            self.string(schema, path, str(value))

    def wrong_type(self, schema: Mapping[str, Any], path: FieldPath) -> None:
        candidates = WRONG_TYPE_VALUES.get(_types(schema) or "", [])
        for bad in self.pick(candidates, 2):
            self.add("wrong_type", path, f"{type(bad).__name__} {bad!r}"[:40], set_at(self.base, path, bad))

    def object(self, schema: Mapping[str, Any], path: FieldPath, value: Mapping[str, Any]) -> None:
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        if not schema.get("x-kubernetes-preserve-unknown-fields") and not extra:
            self.add("unknown_field", (*path, UNKNOWN_KEY), "unknown property",
                     set_at(self.base, (*path, UNKNOWN_KEY), 1), strict=True)
        for name in schema.get("required") or ():
            if name in value:
                self.add("missing_required", (*path, name), "removed", delete_at(self.base, (*path, name)))
        if isinstance(extra, Mapping):
            self.map_values(schema, extra, path, value)
        for name, sub in props.items():
            if name in value:
                self.walk(sub, (*path, name))

    def map_values(self, schema: Mapping[str, Any], values: Mapping[str, Any], path: FieldPath,
                   value: Mapping[str, Any]) -> None:
        key = next(iter(value))
        if "maxProperties" in schema:
            n = schema["maxProperties"] + 1
            big = {f"key-{i}": "v" for i in range(n)}
            self.add("oversized", path, f"{n} entries > maxProperties", set_at(self.base, path, big))
        for bad in self.pick(WRONG_TYPE_VALUES["string"], 2):
            self.add("wrong_type", (*path, key), f"value {bad!r}"[:40], set_at(self.base, (*path, key), bad))
        if "maxLength" in values:
            self.add("too_long", (*path, key), f"value of {values['maxLength'] + 1} chars",
                     set_at(self.base, (*path, key), "v" * (values["maxLength"] + 1)))
        if "pattern" in values:
            for bad in self.bad_patterns(values):
                self.add("bad_format", (*path, key), f"value {bad!r}", set_at(self.base, (*path, key), bad))

    def array(self, schema: Mapping[str, Any], path: FieldPath, value: Sequence[Any]) -> None:
        items = schema.get("items") or {}
        if "maxItems" in schema:
            n = schema["maxItems"] + 1
            self.add("oversized", path, f"{n} items > maxItems", set_at(self.base, path, distinct_items(items, value, n)))
        if schema.get("minItems", 0) > 0:
            self.add("undersized", path, "no items < minItems",
                     set_at(self.base, path, distinct_items(items, value, schema["minItems"] - 1)))
        for i in range(len(value)):
            self.walk(items, (*path, i))

    def numeric(self, schema: Mapping[str, Any], path: FieldPath) -> None:
        integer = _types(schema) == "integer"
        step = 1 if integer else round(self.rng.uniform(0.001, 1.0), 3)
        if "minimum" in schema:
            lo = schema["minimum"]
            bad = lo if schema.get("exclusiveMinimum") else lo - step
            self.add("out_of_range", path, f"{bad} below minimum", set_at(self.base, path, bad))
        if "maximum" in schema:
            hi = schema["maximum"]
            bad = hi if schema.get("exclusiveMaximum") else hi + step
            self.add("out_of_range", path, f"{bad} above maximum", set_at(self.base, path, bad))
        elif schema.get("format") == "int32":
            self.add("out_of_range", path, "2^31 above int32", set_at(self.base, path, INT32_MAX + 1))
        elif integer:
            self.add("out_of_range", path, "2^63 above int64", set_at(self.base, path, 2**63))

    def string(self, schema: Mapping[str, Any], path: FieldPath, value: str) -> None:
        if "enum" in schema:
            bad = self.pick([p for p in ENUM_PROBES if p not in schema["enum"]], 1)[0]
            self.add("bad_format", path, f"{bad!r} not in enum", set_at(self.base, path, bad))
        for bad in self.bad_patterns(schema):
            self.add("bad_format", path, f"{bad!r} vs pattern", set_at(self.base, path, bad))
        if "maxLength" in schema:
            n = schema["maxLength"] + 1
            self.add("too_long", path, f"{n} chars > maxLength", set_at(self.base, path, long_string(schema, value, n)))
        if schema.get("minLength", 0) > 0:
            self.add("undersized", path, "'' < minLength", set_at(self.base, path, ""))

    def bad_patterns(self, schema: Mapping[str, Any]) -> list[str]:
        if "pattern" not in schema:
            return []
        pattern = re.compile(schema["pattern"])
        lo, hi = schema.get("minLength", 0), schema.get("maxLength", 1 << 30)
        misses = [p for p in PATTERN_PROBES if not pattern.search(p) and lo <= len(p) <= hi]
        return self.pick(misses, 2)


def long_string(schema: Mapping[str, Any], value: str, n: int) -> str:
    """A string of ``n`` characters that still matches the pattern when one can be made by
    repeating the value's last character (so only the length is wrong)."""
    pattern = re.compile(schema.get("pattern") or "")
    for candidate in ((value + value[-1:] * n)[:n], "1" * (n - 1) + value[-1:], "a" * n):
        if len(candidate) == n and pattern.search(candidate):
            return candidate
    return "a" * n


def distinct_items(items: Mapping[str, Any], value: Sequence[Any], n: int) -> list[Any]:
    """``n`` valid items, pairwise distinct, built from the array's first item (increasing
    integers ending at the maximum, so rules like "strictly increasing, ending at 100" still hold)."""
    first = value[0]
    kind = _types(items)
    if kind == "integer":
        hi = items.get("maximum", first + n)
        return list(range(hi - n + 1, hi + 1))
    if kind == "string":
        return [vary_string(first, i, items.get("maxLength")) for i in range(n)]
    out = []
    for i in range(n):
        item = copy.deepcopy(first)
        key = next(k for k, v in item.items() if isinstance(v, (str, int)) and not isinstance(v, bool))
        sub = (items.get("properties") or {}).get(key) or {}
        item[key] = item[key] + i if isinstance(item[key], int) else vary_string(item[key], i, sub.get("maxLength"))
        out.append(item)
    return out


def vary_string(text: str, i: int, max_length: int | None) -> str:
    suffix = str(i)
    if max_length is not None and len(text) + len(suffix) > max_length:
        text = text[: max_length - len(suffix)]
    return text + suffix


# ---------------------------------------------------------------- CEL rules and names

Mutation = Callable[[dict[str, Any]], dict[str, Any]]


def _set(path: str, value: Any) -> Mutation:
    return lambda obj: set_at(obj, parse_path(path), value)


def _sets(*pairs: tuple[str, Any]) -> Mutation:
    def apply(obj: dict[str, Any]) -> dict[str, Any]:
        for path, value in pairs:
            obj = set_at(obj, parse_path(path), value)
        return obj
    return apply


def _drop_then_set(drop: str, path: str, value: Any) -> Mutation:
    return lambda obj: set_at(delete_at(obj, parse_path(drop)), parse_path(path), value)


# (kind, normalised schema path of the rule's holder, rule) → [(category, field path, note, mutation)].
# Field paths name what the API server's message names for that rule (fieldPath, or the holder).
CelCase = tuple[str, str, str, Mutation]
DNS1035 = "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 63"
DURATION_RULE = "duration(self) > duration('0s')"


def _duration_cases(path: str) -> list[CelCase]:
    return [("out_of_range", path, "'0s' not positive", _set(path, "0s")),
            ("out_of_range", path, "'0h0m0.0s' not positive", _set(path, "0h0m0.0s")),
            ("out_of_range", path, "'2562048h' past Go's duration", _set(path, "2562048h"))]


LABEL_KEY_RULE = ("self.all(k, size(k) <= 317 && k.matches('^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]"
                  "([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$'))")


def _label_key_cases(path: str) -> list[CelCase]:
    return [("bad_format", path, f"label key {bad!r}", _set(path, {bad: "v"}))
            for bad in ("-lead", "a b", "Example.com/app", "a/b/c", "/name", "n" * 64)]


CEL_CASES: dict[tuple[str, str, str], list[CelCase]] = {
    ("SparseModel", "", DNS1035): [
        ("bad_format", "metadata.name", f"name {bad!r}", _set("metadata.name", bad))
        for bad in ("1st-model", "moe.small", "moe_small", "moe-", "x" * 64)
    ],
    ("SparseModel", "spec.model",
     "!has(self.minExpertsPerToken) || self.minExpertsPerToken <= "
     "(has(self.maxExpertsPerToken) ? self.maxExpertsPerToken : (self.experts < 4 ? self.experts : 4))"): [
        ("cross_field", "spec.model.minExpertsPerToken", "min 4 > max 2",
         _sets(("spec.model.minExpertsPerToken", 4), ("spec.model.maxExpertsPerToken", 2))),
        ("cross_field", "spec.model.minExpertsPerToken", "min 5 > unset max (4 of 8 experts)",
         _drop_then_set("spec.model.maxExpertsPerToken", "spec.model.minExpertsPerToken", 5)),
        ("cross_field", "spec.model.minExpertsPerToken", "min 3 > unset max (2 of 2 experts)",
         lambda obj: _sets(("spec.model.experts", 2), ("spec.model.minExpertsPerToken", 3))(
             delete_at(obj, parse_path("spec.model.maxExpertsPerToken")))),
    ],
    # A transition rule: a create never breaks it (there is no old object), so no create case
    # can; tests/e2e/operator/test_sparsemodel_lifecycle.py checks that an update is refused.
    ("SparseModel", "spec.service.headless", "self == oldSelf"): [],
    ("SparseModel", "spec.servingPort", "self != 8443"): [
        ("out_of_range", "spec.servingPort", "the admin port 8443", _set("spec.servingPort", 8443)),
    ],
    # The runtime cleans a mount path: each of these would cover the gate, admin or scratch mount.
    ("SparseModel", "spec.model.persistentVolumeClaim.mountPath", "!self.matches('//|/[.][.]?(/|$)')"): [
        ("bad_format", "spec.model.persistentVolumeClaim.mountPath",
         f"mountPath {bad!r} (an empty, '.' or '..' segment)", _set("spec.model.persistentVolumeClaim.mountPath", bad))
        for bad in ("/etc//sparsegate", "/models/../tmp", "/etc/./sparsegate-admin", "/models/..", "/models//")
    ],
    ("SparseModel", "spec.model.persistentVolumeClaim.mountPath",
     "!['/etc/sparsegate', '/etc/sparsegate-admin', '/tmp'].exists(p, self == p || self.startsWith(p + '/') || "
     "p.startsWith(self.endsWith('/') ? self : self + '/'))"): [
        ("bad_format", "spec.model.persistentVolumeClaim.mountPath",
         f"mountPath {bad!r} (the gate, admin or scratch mounts)", _set("spec.model.persistentVolumeClaim.mountPath", bad))
        for bad in ("/etc/sparsegate", "/etc/sparsegate-admin/", "/etc/sparsegate/weights", "/etc", "/", "/tmp",
                    "/tmp/weights")
    ],
    ("SparseModel", "spec.tools", "self.all(t, t.name != 'calculator')"): [
        ("cross_field", "spec.tools", "a tool named calculator (the built-in's name)",
         _set("spec.tools[0].name", "calculator")),
    ],
    ("SparseModel", "spec.expertGroups", "self.all(g, self.exists_one(h, h.name == g.name))"): [
        ("cross_field", "spec.expertGroups", "group name repeated", _set("spec.expertGroups[1].name", "math")),
    ],
    ("SparseModel", "spec.expertGroups[].experts", "self.all(e, self.exists_one(f, f == e))"): [
        ("cross_field", "spec.expertGroups[0].experts", "expert repeated in a group",
         _set("spec.expertGroups[0].experts", [1, 1])),
    ],
    ("SparseModel", "spec",
     "!has(self.expertGroups) || self.expertGroups.all(g, g.experts.all(e, e < self.model.experts))"): [
        ("cross_field", "spec.expertGroups", "expert 8 of a model with 8 experts",
         _set("spec.expertGroups[1].experts", [2, 8])),
        ("cross_field", "spec.expertGroups", "expert 63 of a model with 8 experts",
         _set("spec.expertGroups[0].experts", [63])),
    ],
    ("SparseModel", "spec.access", "!has(self.tokenCacheSeconds) || self.requestAuth == 'Enforce'"): [
        ("cross_field", "spec.access", "a token cache TTL with requestAuth Off",
         _set("spec.access.requestAuth", "Off")),
        ("cross_field", "spec.access", "a token cache TTL with requestAuth defaulted to Off",
         _drop_then_set("spec.access.requestAuth", "spec.access.tokenCacheSeconds", 60)),
    ],
    ("SparseModel", "spec.model", "!has(self.maxExpertsPerToken) || self.maxExpertsPerToken <= self.experts"): [
        ("cross_field", "spec.model.maxExpertsPerToken", "max 9 > experts 8",
         _sets(("spec.model.experts", 8), ("spec.model.maxExpertsPerToken", 9))),
    ],
    ("GateConfig", "spec.params",
     "!has(self.minExpertsPerToken) || self.minExpertsPerToken <= "
     "(has(self.maxExpertsPerToken) ? self.maxExpertsPerToken : 4)"): [
        ("cross_field", "spec.params.minExpertsPerToken", "min 6 > max 4",
         _sets(("spec.params.minExpertsPerToken", 6), ("spec.params.maxExpertsPerToken", 4))),
        ("cross_field", "spec.params.minExpertsPerToken", "min 64 > unset max 4",
         _drop_then_set("spec.params.maxExpertsPerToken", "spec.params.minExpertsPerToken", 64)),
    ],
    ("GateConfig", "spec.params",
     "!has(self.targetExpertsPerToken) || "
     "(self.targetExpertsPerToken >= double(has(self.minExpertsPerToken) ? self.minExpertsPerToken : 1) && "
     "self.targetExpertsPerToken <= double(has(self.maxExpertsPerToken) ? self.maxExpertsPerToken : 4))"): [
        ("cross_field", "spec.params.targetExpertsPerToken", "target 3.5 > max 3",
         _sets(("spec.params.maxExpertsPerToken", 3), ("spec.params.targetExpertsPerToken", 3.5))),
        ("cross_field", "spec.params.targetExpertsPerToken", "target 1.5 < min 2",
         _sets(("spec.params.minExpertsPerToken", 2), ("spec.params.targetExpertsPerToken", 1.5))),
        ("cross_field", "spec.params.targetExpertsPerToken", "target 5 > unset max 4",
         _drop_then_set("spec.params.maxExpertsPerToken", "spec.params.targetExpertsPerToken", 5)),
    ],
    ("GateConfig", "spec.calibration.qpsThreshold.window", DURATION_RULE):
        _duration_cases("spec.calibration.qpsThreshold.window"),
    ("GateConfig", "spec.calibration.errorRateCap.window", DURATION_RULE):
        _duration_cases("spec.calibration.errorRateCap.window"),
    ("GateConfig", "spec.rollout.analysisInterval", DURATION_RULE): _duration_cases("spec.rollout.analysisInterval"),
    ("GateConfig", "spec.rollout.progressDeadline", DURATION_RULE): _duration_cases("spec.rollout.progressDeadline"),
    ("GateConfig", "spec.rollout.steps", "self.isSorted() && self.all(s, self.indexOf(s) == self.lastIndexOf(s))"): [
        ("cross_field", "spec.rollout.steps", "decreasing", _set("spec.rollout.steps", [20, 5, 100])),
        ("cross_field", "spec.rollout.steps", "repeated step", _set("spec.rollout.steps", [5, 5, 100])),
        ("cross_field", "spec.rollout.steps", "100 twice", _set("spec.rollout.steps", [50, 100, 100])),
    ],
    ("GateConfig", "spec.rollout.steps", "self[size(self) - 1] == 100"): [
        ("cross_field", "spec.rollout.steps", "ends at 90", _set("spec.rollout.steps", [5, 20, 90])),
        ("cross_field", "spec.rollout.steps", "single 50", _set("spec.rollout.steps", [50])),
    ],
    ("RoutingPolicy", "spec.sources[].spiffeID", "!self.matches('/[.][.]?(/|$)')"): [
        ("bad_format", "spec.sources[1].spiffeID", f"dot segment in {bad!r}", _set("spec.sources[1].spiffeID", bad))
        for bad in ("spiffe://cluster.local/ns/web/../sa/admin", "spiffe://cluster.local/./ns/web",
                    "spiffe://cluster.local/ns/web/sa/..")
    ],
    ("RoutingPolicy", "spec.sources[]",
     "has(self.spiffeID) || has(self.__namespace__) || has(self.serviceAccount) || has(self.matchLabels)"): [
        ("missing_required", "spec.sources[0]", "empty selector", _set("spec.sources[0]", {})),
    ],
    ("RoutingPolicy", "spec.sources[]",
     "!has(self.spiffeID) || !(has(self.__namespace__) || has(self.serviceAccount) || has(self.matchLabels))"): [
        ("cross_field", "spec.sources[1]", f"spiffeID with {key}",
         _set(f"spec.sources[1].{key}", value))
        for key, value in (("namespace", "web"), ("serviceAccount", "frontend"), ("matchLabels", {"app": "web"}))
    ],
    ("RoutingPolicy", "spec.sources[]", "!has(self.spiffeID) || self.spiffeID.startsWith('spiffe://')"): [
        ("bad_format", "spec.sources[1].spiffeID", "scheme in capitals",
         _set("spec.sources[1].spiffeID", "SPIFFE://cluster.local/ns/web")),
    ],
    ("RoutingPolicy", "spec.targets[].routes[]", "!self.matches('/[.][.]?(/|$)')"): [
        ("bad_format", "spec.targets[0].routes[0]", f"dot segment in {bad!r}", _set("spec.targets[0].routes[0]", bad))
        for bad in ("/v1/../admin/access", "/./v1/infer", "/v1/infer/.", "/v1/..")
    ],
    ("RoutingPolicy", "spec", "size(self.sources) * size(self.targets) <= 256"): [
        ("cross_field", "spec.sources", "17 sources x 16 targets > 256 pairs",
         _sets(("spec.sources", [{"namespace": f"ns-{i}"} for i in range(17)]),
               ("spec.targets", [{"sparseModel": f"m{i}"} for i in range(16)]))),
        ("cross_field", "spec.sources", "64 sources x 64 targets",
         _sets(("spec.sources", [{"namespace": f"ns-{i}"} for i in range(64)]),
               ("spec.targets", [{"sparseModel": f"m{i}"} for i in range(64)]))),
    ],
    ("RoutingPolicy", "spec.sources[].matchLabels", LABEL_KEY_RULE): _label_key_cases("spec.sources[0].matchLabels"),
    ("TelemetryProbe", "spec.nodeSelector", LABEL_KEY_RULE): _label_key_cases("spec.nodeSelector"),
    # The pattern admits them, Linux (dev_valid_name) refuses them as interface names.
    ("TelemetryProbe", "spec.interfaces[]", "self != '.' && self != '..'"): [
        ("bad_format", "spec.interfaces[0]", f"interface {bad!r}", _set("spec.interfaces", [bad]))
        for bad in (".", "..")
    ],
    ("RoutingPolicy", "spec.ports[]", "self.port >= 1 && self.port <= 65535"): [
        ("out_of_range", "spec.ports[0].port", f"port {bad}", _set("spec.ports[0].port", bad))
        for bad in (0, -1, 65536)
    ],
    ("RoutingPolicy", "spec.ports",
     "self.all(p, self.exists_one(q, q.port == p.port"
     " && (has(q.protocol) ? q.protocol : 'TCP') == (has(p.protocol) ? p.protocol : 'TCP')))"): [
        ("cross_field", "spec.ports", "port/protocol repeated",
         _set("spec.ports", [{"port": 8080, "protocol": "TCP"}, {"port": 8080, "protocol": "TCP"}])),
        ("cross_field", "spec.ports", "repeated with the protocol absent (TCP) in one",
         _set("spec.ports", [{"port": 8080}, {"port": 8080, "protocol": "TCP"}])),
        ("cross_field", "spec.ports", "repeated with the protocol absent in both",
         _set("spec.ports", [{"port": 8080}, {"port": 8080}])),
    ],
}

QUANTITY_NOT_NEGATIVE = "!isQuantity(string(self)) || !quantity(string(self)).isLessThan(quantity('0'))"


def _request_over_limit(resource: str, request: Any, limit: Any) -> CelCase:
    return ("cross_field", f"spec.resources.requests.{resource}", f"request {request!r} > limit {limit!r}",
            _sets((f"spec.resources.requests.{resource}", request), (f"spec.resources.limits.{resource}", limit)))


for _part in ("requests", "limits"):
    for _res, _bads in (("cpu", ("-1", "-500m", -2)), ("memory", ("-1Gi", -1))):
        _path = f"spec.resources.{_part}.{_res}"
        CEL_CASES[("SparseModel", _path, QUANTITY_NOT_NEGATIVE)] = [
            ("out_of_range", _path, f"negative {bad!r}", _set(_path, bad)) for bad in _bads]
for _res, _pairs in (("cpu", (("2001m", 2), (3, "2"), ("1.5", "1499m"))),
                     ("memory", (("2Gi", "2G"), (1025, "1Ki"), ("1Ti", "1e12")))):
    _rule = (f"!has(self.requests) || !has(self.requests.{_res}) || !has(self.limits) || !has(self.limits.{_res}) || "
             f"!isQuantity(string(self.requests.{_res})) || !isQuantity(string(self.limits.{_res})) || "
             f"!quantity(string(self.requests.{_res})).isGreaterThan(quantity(string(self.limits.{_res})))")
    CEL_CASES[("SparseModel", "spec.resources", _rule)] = [_request_over_limit(_res, *pair) for pair in _pairs]

# GateConfig spec.rollout.analysis.checks (full base: [0] builtin, [1] prometheus, [2] web).
_CHECKS = "spec.rollout.analysis.checks"


def _drop_all(*paths: str) -> Mutation:
    def apply(obj: dict[str, Any]) -> dict[str, Any]:
        for path in paths:
            obj = delete_at(obj, parse_path(path))
        return obj
    return apply


CEL_CASES.update({
    ("GateConfig", _CHECKS, "self.all(c, self.exists_one(d, d.name == c.name))"): [
        ("cross_field", _CHECKS, "two checks named error-ratio", _set(f"{_CHECKS}[2].name", "error-ratio")),
    ],
    ("GateConfig", _CHECKS, "self.filter(c, has(c.provider.builtin)).size() <= 1"): [
        ("cross_field", _CHECKS, "two builtin checks", _set(f"{_CHECKS}[1]", {"name": "b2", "provider": {"builtin": {}}})),
    ],
    ("GateConfig", f"{_CHECKS}[]",
     "has(self.provider.builtin) || has(self.successCondition) || has(self.failureCondition)"): [
        ("missing_required", f"{_CHECKS}[1].successCondition", "prometheus check with both conditions empty",
         _drop_all(f"{_CHECKS}[1].successCondition", f"{_CHECKS}[1].failureCondition")),
        ("missing_required", f"{_CHECKS}[2].successCondition", "web check without a condition",
         _drop_all(f"{_CHECKS}[2].successCondition")),
    ],
    ("GateConfig", f"{_CHECKS}[]",
     "!has(self.provider.builtin) || !(has(self.successCondition) || has(self.failureCondition) || "
     "has(self.count) || has(self.interval) || has(self.failureLimit) || has(self.inconclusiveLimit) || "
     "has(self.consecutiveErrorLimit))"): [
        ("cross_field", f"{_CHECKS}[0].provider.builtin", "builtin check with a successCondition",
         _set(f"{_CHECKS}[0].successCondition", "result < 1")),
        ("cross_field", f"{_CHECKS}[0].provider.builtin", "builtin check with a count", _set(f"{_CHECKS}[0].count", 2)),
    ],
    ("GateConfig", f"{_CHECKS}[].provider",
     "(has(self.builtin) ? 1 : 0) + (has(self.prometheus) ? 1 : 0) + (has(self.web) ? 1 : 0) == 1"): [
        ("missing_required", f"{_CHECKS}[1].provider", "no provider", _set(f"{_CHECKS}[1].provider", {})),
        ("bad_format", f"{_CHECKS}[1].provider", "unknown provider datadog (pruned: none left)",
         _set(f"{_CHECKS}[1].provider", {"datadog": {"query": "avg:errors"}})),
        ("cross_field", f"{_CHECKS}[1].provider", "prometheus and web at once",
         _set(f"{_CHECKS}[1].provider.web", {"url": "http://judge:8080/score"})),
        ("cross_field", f"{_CHECKS}[0].provider", "builtin and prometheus at once",
         _set(f"{_CHECKS}[0].provider.prometheus", {"query": "up"})),
    ],
    ("GateConfig", f"{_CHECKS}[].interval", DURATION_RULE): _duration_cases(f"{_CHECKS}[1].interval"),
    ("GateConfig", f"{_CHECKS}[].provider.web.timeout", DURATION_RULE):
        _duration_cases(f"{_CHECKS}[2].provider.web.timeout"),
})

# The table keyed by rule text with its whitespace folded, as cel_rules() yields it.
KNOWN_RULES = {(kind, holder, " ".join(rule.split())): known for (kind, holder, rule), known in CEL_CASES.items()}

# Strings a field's pattern must refuse, besides the PATTERN_PROBES drawn at random: values that
# can never match (a route is compared exactly with the server's request path, a SPIFFE ID exactly
# with the caller's ID), so a Deny written with one would silently do nothing.
PATTERN_CASES: dict[tuple[str, str], list[str]] = {
    ("RoutingPolicy", "spec.targets[0].routes[0]"): [
        "/v1/infer/", "/v1//infer", "//v1/infer", "/v1/%69nfer", "/v1/infer;x", "/v1/infer?stream=1",
        "/V1/Infer", "/v1/*", "/v1/infer*", "/", "v1/infer", "/v1/infer#frag", "/v1/in fer", "/v1/~x"],
    ("RoutingPolicy", "spec.sources[1].spiffeID"): [
        "spiffe://Cluster.local/ns/web/sa/frontend", "spiffe://cluster.local/ns/web/sa/frontend/",
        "spiffe://cluster.local/ns//sa/frontend", "spiffe://cluster.local/ns/web/sa/front%20end",
        "spiffe://cluster.local/ns/web/sa/front~end", "spiffe://cluster.local/ns/web/sa/a@b",
        "spiffe://cluster.local:8443/ns/web", "spiffe://user@cluster.local/ns/web", "spiffe://cluster.local",
        "spiffe://cluster.local/ns/web?x=1", "spiffe:///ns/web", "spiffe://cluster.local/ns/web/sa/fr*"],
    # Linux refuses ':' (an alias label like eth0:1 is no device), '/' and whitespace in interface names.
    ("TelemetryProbe", "spec.interfaces[0]"): ["eth0:1", ":", "eth/0", "eth 0", "eth0\t", "eth0\n"],
    # Not Kubernetes quantities: the Deployment would refuse them (spelled as people write them).
    ("SparseModel", "spec.resources.requests.cpu"): ["2 cores", "0.5cpu", "500M ", "1,5", "1..5", "0x10", "m"],
    ("SparseModel", "spec.resources.limits.memory"): ["1GB", "1gi", "1 Gi", "4GiB", "Ki", "1e", "1E+"],
    # The HTTP client refuses control characters in a header value (the request is never sent).
    ("GateConfig", f"{_CHECKS}[2].provider.web.headers[0].value"): [
        "canary\r\nX-Injected: 1", "canary\n", "a\rb", "a\x00b", "a\x1bb", "a\x7fb", "\x01"],
}

# Object names: the API server's own rule for every kind (a DNS-1123 subdomain of at most 253).
NAME_CASES: list[tuple[str, str, Any]] = [
    ("bad_format", "uppercase name", "Bad-Name"),
    ("bad_format", "underscore in name", "bad_name"),
    ("too_long", "254-char name", "n" * 254),
]


def spec_paths(schema: Mapping[str, Any], path: str = "") -> Iterator[str]:
    """Normalised paths of every field under ``spec`` (objects, arrays, items and leaves)."""
    for name, sub in (schema.get("properties") or {}).items():
        sub_path = f"{path}.{name}" if path else name
        if sub_path.split(".")[0] == "spec":
            yield sub_path
            yield from spec_paths(sub, sub_path)
    if "items" in schema:
        yield f"{path}[]"
        yield from spec_paths(schema["items"], f"{path}[]")


def cel_rules(schema: Mapping[str, Any], path: str = "") -> Iterator[tuple[str, str]]:
    """(normalised holder path, rule) for every x-kubernetes-validations rule under ``schema``."""
    for rule in schema.get("x-kubernetes-validations") or ():
        yield path, " ".join(rule["rule"].split())
    for name, sub in (schema.get("properties") or {}).items():
        yield from cel_rules(sub, f"{path}.{name}" if path else name)
    if "items" in schema:
        yield from cel_rules(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), Mapping):
        yield from cel_rules(schema["additionalProperties"], f"{path}{{}}")


# ---------------------------------------------------------------- the two generators


def invalid_cases(schemas: Mapping[str, Mapping[str, Any]], examples: Mapping[str, Mapping[str, Any]], *,
                  seed: int = DEFAULT_SEED) -> list[Case]:
    """Every invalid case for the four kinds, in a stable order for ``seed``."""
    rng = random.Random(seed)
    bases = full_bases(examples)
    cases: list[Case] = []
    for kind in KINDS:
        walker = Walker(kind=kind, schema=schemas[kind], base=bases[kind], rng=rng)
        walker.walk(schemas[kind], ())
        # Every field the user writes must have had a value in the full base to mutate.
        missing = sorted(set(spec_paths(schemas[kind])) - walker.covered)
        if missing:
            raise AssertionError(f"{kind}: the full base has no {', '.join(missing)}; add them to EXTRAS")
        for category, note, name in NAME_CASES:
            walker.add(category, "metadata.name", note, set_at(bases[kind], parse_path("metadata.name"), name))
        for (case_kind, path), bads in PATTERN_CASES.items():
            if case_kind == kind:
                for bad in bads:
                    walker.add("bad_format", path, f"{bad!r} vs pattern", set_at(bases[kind], parse_path(path), bad))
        for holder, rule in cel_rules(schemas[kind]):
            if holder.startswith("status"):
                continue
            known = KNOWN_RULES.get((kind, holder, rule))
            if known is None:
                raise KeyError(f"{kind}: no fuzz cases for the CEL rule at {holder or '<root>'}: {rule!r}")
            for category, path, note, mutate in known:
                walker.add(category, path, note, mutate(bases[kind]))
        cases += walker.cases
    return cases


def schema_at(schema: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    for token in parse_path(path):
        schema = schema["items"] if isinstance(token, int) else schema["properties"][token]
    return schema


def valid_edges(schemas: Mapping[str, Mapping[str, Any]], examples: Mapping[str, Mapping[str, Any]]) -> list[Edge]:
    """Valid objects at the schemas' bounds (names are unique per kind, so all can be created)."""
    def bound(kind: str, path: str, key: str) -> Any:
        return schema_at(schemas[kind], path)[key]

    def named(kind: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": examples[kind]["apiVersion"], "kind": kind, "metadata": {"name": name}, "spec": spec}

    edges: list[Edge] = []
    # SparseModel: replicas 0 (no containers start on this machine) except one asking for more
    # GPUs than any node has (Pending, nothing runs).
    max_experts = bound("SparseModel", "spec.model.experts", "maximum")
    max_image = bound("SparseModel", "spec.image", "maxLength")
    edges += [
        Edge("SparseModel", "63-char name, smallest model, optional fields absent",
             named("SparseModel", "m" + "0" * 61 + "x", {
                 "replicas": 0,
                 "model": {"dModel": bound("SparseModel", "spec.model.dModel", "minimum"),
                           "experts": 1, "maxExpertsPerToken": 1}})),
        Edge("SparseModel", "largest model, widest gate, lowest port, longest image, gate from a 253-char GateConfig",
             named("SparseModel", "sm-largest", {
                 "replicas": 0, "image": "r/" + "i" * (max_image - 2),
                 "servingPort": bound("SparseModel", "spec.servingPort", "minimum"),
                 "resources": {"gpus": 0},
                 "model": {"dModel": bound("SparseModel", "spec.model.dModel", "maximum"), "experts": max_experts,
                           "minExpertsPerToken": max_experts, "maxExpertsPerToken": max_experts},
                 "gateConfigRef": {"name": "g" * 253}})),
        Edge("SparseModel", "gateConfigRef to a GateConfig that does not exist",
             named("SparseModel", "sm-missing-gate", {
                 "replicas": 0, "model": {"dModel": 8, "experts": 2, "maxExpertsPerToken": 2},
                 "gateConfigRef": {"name": "no-such-gate"}})),
        Edge("SparseModel", "2 experts, maxExpertsPerToken unset, gate from a GateConfig that leaves it unset",
             named("SparseModel", "sm-two-experts", {
                 "replicas": 0, "model": {"dModel": 8, "experts": 2},
                 "gateConfigRef": {"name": "gc-defaults"}})),
        Edge("SparseModel", "cpu/memory requests equal to limits spelled otherwise (integers, millicores, bytes)",
             named("SparseModel", "sm-cpu-memory", {
                 "replicas": 0, "model": {"dModel": 8, "experts": 2, "maxExpertsPerToken": 2},
                 "resources": {"requests": {"cpu": 1, "memory": 1073741824},
                               "limits": {"cpu": "1000m", "memory": "1Gi"}}})),
        Edge("SparseModel", "most GPUs per instance (no node has them: Pending), highest port",
             named("SparseModel", "sm-max-gpus", {
                 "replicas": 1, "servingPort": bound("SparseModel", "spec.servingPort", "maximum"),
                 "resources": {"gpus": bound("SparseModel", "spec.resources.gpus", "maximum")},
                 "model": {"dModel": 8, "experts": 2, "maxExpertsPerToken": 2}})),
    ]
    # GateConfig: no model references them except sm-largest (the 253-char one) and
    # sm-two-experts (gc-defaults).
    steps_max = bound("GateConfig", "spec.rollout.steps", "maxItems")
    edges += [
        Edge("GateConfig", "253-char name, every gate parameter at its upper bound, longest durations",
             named("GateConfig", "g" * 253, {
                 "params": {"toolGateThreshold": 0.999999, "entropyBeta": bound("GateConfig", "spec.params.entropyBeta", "maximum"),
                            "confidenceThreshold": 0.999999,
                            "capacityFactor": bound("GateConfig", "spec.params.capacityFactor", "maximum"),
                            "minExpertsPerToken": max_experts, "maxExpertsPerToken": max_experts,
                            "targetExpertsPerToken": max_experts, "precisionPolicy": "int8",
                            "faultInjection": {"errorRate": 1, "addedLatencyMs": bound(
                                "GateConfig", "spec.params.faultInjection.addedLatencyMs", "maximum")}},
                 "calibration": {"qpsThreshold": {"initial": 1e308, "decay": 0.999999, "window": MAX_GO_DURATION},
                                 "errorRateCap": {"initial": 1, "decay": 0.999999, "window": MAX_GO_DURATION}},
                 "rollout": {"steps": [100], "analysisInterval": MAX_GO_DURATION, "slaP99LatencyMs": 1e308,
                             "maxDrift": bound("GateConfig", "spec.rollout.maxDrift", "maximum"),
                             "minRequests": 2**63 - 1, "progressDeadline": MAX_GO_DURATION,
                             "autoRollback": False}})),
        Edge("GateConfig", "every parameter at its lower bound, shortest durations",
             named("GateConfig", "gc-lowest", {
                 "params": {"toolGateThreshold": 1e-9, "entropyBeta": 0, "confidenceThreshold": 1e-9,
                            "capacityFactor": 1e-9, "minExpertsPerToken": 1, "maxExpertsPerToken": 1,
                            "targetExpertsPerToken": 1,
                            "faultInjection": {"errorRate": 0, "addedLatencyMs": 0}},
                 "calibration": {"qpsThreshold": {"initial": 1e-9, "decay": 1e-9, "window": "0.001ms"},
                                 "errorRateCap": {"initial": 0, "decay": 1e-9, "window": "1ms"}},
                 "rollout": {"analysisInterval": "0.001ms", "slaP99LatencyMs": 1e-9, "maxDrift": 0,
                             "minRequests": 1, "progressDeadline": "1ms"}})),
        Edge("GateConfig", f"{steps_max} steps, paused",
             named("GateConfig", "gc-most-steps", {
                 "rollout": {"steps": list(range(100 - 5 * (steps_max - 1), 101, 5)), "paused": True}})),
        Edge("GateConfig", "empty spec (every default; maxExpertsPerToken has none)",
             named("GateConfig", "gc-defaults", {})),
    ]
    # RoutingPolicy: the fullest and the emptiest. Sources x targets is capped by a CEL rule (256
    # pairs): 16 x 16, every other list full.
    max_sources = max_targets = 16
    max_groups = bound("RoutingPolicy", "spec.targets[0].expertGroups", "maxItems")
    max_routes = bound("RoutingPolicy", "spec.targets[0].routes", "maxItems")
    max_ports = bound("RoutingPolicy", "spec.ports", "maxItems")
    spiffe_len = bound("RoutingPolicy", "spec.sources[0].spiffeID", "maxLength")
    spiffe_head = "spiffe://cluster.local/ns/web/sa/"
    edges += [
        Edge("RoutingPolicy", "most (source, target) pairs, every other list full, longest strings, top priority",
             named("RoutingPolicy", "rp-fullest", {
                 "action": "Allow", "priority": bound("RoutingPolicy", "spec.priority", "maximum"),
                 "sources": [
                     {"spiffeID": spiffe_head + "s" * (spiffe_len - len(spiffe_head))},
                     {"namespace": "*", "serviceAccount": "a" * 253,
                      "matchLabels": {f"example.com/k{i}": "v" * 63 for i in range(16)}},
                     *({"namespace": f"ns-{i}"} for i in range(max_sources - 2))],
                 "targets": [
                     {"sparseModel": "*", "expertGroups": [f"{i:02d}" + "g" * 61 for i in range(max_groups)],
                      "routes": [f"/{i:02d}" + "r" * 253 for i in range(max_routes)]},
                     *({"sparseModel": f"model-{i}"} for i in range(max_targets - 1))],
                 "ports": [{"port": 65535 - i // 2, "protocol": ("TCP", "UDP")[i % 2]} for i in range(max_ports - 1)]
                          + [{"port": 1}]})),
        Edge("RoutingPolicy", "every route the model server serves, SPIFFE IDs at the spec's character edges",
             named("RoutingPolicy", "rp-exact-paths", {
                 "action": "Deny",
                 "sources": [{"spiffeID": "spiffe://my_td.example-1/ns/Web-1/sa/front_end.v2"},
                             {"spiffeID": "spiffe://td/.../a..b/.hidden/x."}],
                 "targets": [{"sparseModel": "m", "routes": [
                     "/v1/infer", "/v1/model", "/v1/models", "/v1/completions", "/v1/chat/completions", "/healthz",
                     "/readyz", "/metrics", "/admin/access", "/.well-known/x_y", "/a..b/...", "/-/_/0"]}]})),
        Edge("RoutingPolicy", "one port twice, TCP with the protocol absent and UDP",
             named("RoutingPolicy", "rp-protocol-absent", {
                 "action": "Allow", "sources": [{"namespace": "default"}], "targets": [{"sparseModel": "m"}],
                 "ports": [{"port": 53}, {"port": 53, "protocol": "UDP"}]})),
        Edge("RoutingPolicy", "one empty-label selector, one target, no ports, lowest priority, Deny",
             named("RoutingPolicy", "rp-emptiest", {
                 "action": "Deny", "priority": bound("RoutingPolicy", "spec.priority", "minimum"),
                 "sources": [{"matchLabels": {}}], "targets": [{"sparseModel": "m"}]})),
    ]
    # TelemetryProbe: API server only (no controller yet).
    max_ifaces = bound("TelemetryProbe", "spec.interfaces", "maxItems")
    edges += [
        Edge("TelemetryProbe", "most interfaces, 15-char names, generic mode",
             named("TelemetryProbe", "tp-most", {
                 "interfaces": [f"if{i:02d}" + "x" * 11 for i in range(max_ifaces)],
                 "xdpMode": "generic", "nodeSelector": {f"example.com/k{i}": "v" * 63 for i in range(16)}})),
        Edge("TelemetryProbe", "one interface, defaults", named("TelemetryProbe", "tp-least", {"interfaces": ["lo"]})),
    ]
    return edges


def counts(cases: Sequence[Case]) -> tuple[dict[str, int], dict[str, int]]:
    """(per kind, per category) numbers of cases."""
    by_kind = {k: sum(c.kind == k for c in cases) for k in KINDS}
    by_category = {c: sum(x.category == c for x in cases) for c in CATEGORIES}
    return by_kind, by_category
