"""The chart's stated minimum Kubernetes (Chart.yaml kubeVersion) against what the chart and the
operator use: each feature below with the first Kubernetes minor whose API server accepts it in a
*new* object. CEL libraries count from the release after their "introduced" version: an API server
compiles new expressions in the environment of its previous minor (k8s.io/apiserver
pkg/cel/environment/base.go, DefaultCompatibilityVersion), so a library introduced at 1.31 is
refused in a CRD or policy created on a 1.31 API server.

Checked by hand against the real validation code: the four CRDs and the rendered admission policy
compiled with k8s.io/apiextensions-apiserver and k8s.io/apiserver v0.30.0, v0.31.0, v0.32.0 and
v0.37.2. v0.30 and v0.31 refused routingpolicies.sparsegate.dev while its rules read
``self.namespace`` ("undefined field 'namespace'"); written ``self.__namespace__``, as now, every
version accepts it.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "sparsegate"
BIN = Path(os.environ.get("SPARSEGATE_BIN", Path.home() / ".cache" / "sparsegate" / "bin"))
# Objects the operator renders itself (Deployments, Services, ConfigMaps, Secrets, Leases).
OPERATOR_RENDER = [ROOT / "operator" / "sparsegate" / "domain" / "render.py",
                   ROOT / "operator" / "sparsegate" / "domain" / "lease.py"]

# CEL's reserved words. A CRD rule reaches a property of that name only as __name__ before 1.32: a
# plain self.namespace is "undefined field" there (kubernetes/kubernetes#122777; the type provider
# recognises keywords as field names from compatibility version 1.31, so new rules from 1.32).
CEL_RESERVED = ("true false null in as break const continue else for function if import let loop "
                "package namespace return var void while").split()

# (feature, first minor that accepts it in a new object, pattern). CEL patterns are searched in
# expressions with their string literals blanked.
CEL_FEATURES: list[tuple[str, int, str]] = [
    ("Kubernetes list library (isSorted, indexOf, sum, min, max)", 25,
     r"\.(isSorted|indexOf|lastIndexOf|sum|min|max)\("),
    ("optional types (.?field, optional.of)", 29, r"\.\?|\boptional\.(of|none|ofNonZeroValue)\("),
    ("quantity library", 29, r"\b(quantity|isQuantity)\("),
    ("strings extension v2 (format, quote)", 30, r"\.format\(|\bstrings\.quote\("),
    ("sets extension", 30, r"\bsets\.(contains|equivalent|intersects)\("),
    ("ip / cidr libraries", 31,
     r"\b(ip|cidr|isIP|isCIDR)\(|\.(isCanonical|family|isLoopback|isUnspecified|isGlobalUnicast"
     r"|isLinkLocalMulticast|isLinkLocalUnicast|containsIP|containsCIDR|prefixLength|masked)\("),
    ("format library", 32, r"\bformat\.\w+\("),
    ("authorizer field/label selectors", 32, r"\.(fieldSelector|labelSelector)\("),
    ("two-variable comprehensions", 33,
     r"\.(all|exists|existsOne|exists_one)\(\s*\w+\s*,\s*\w+\s*,|\.(transformList|transformMap"
     r"|transformMapEntry)\("),
    ("semver library", 34, r"\b(semver|isSemver)\("),
    ("CEL lists extension v3 (distinct, flatten, sort, slice, first, last, reverse, lists.range)", 35,
     r"\.(distinct|flatten|sort|sortBy|slice|first|last|reverse)\(|\blists\.range\("),
    ("list includes()", 38, r"\.includes\("),
]
# Features of the CRD schemas and the chart's and operator's objects, searched in their text.
MANIFEST_FEATURES: list[tuple[str, int, str]] = [
    ("x-kubernetes-validations messageExpression", 27, r"\bmessageExpression:"),
    ("x-kubernetes-validations reason / fieldPath", 28, r"^\s*(-\s*)?(reason|fieldPath):\s*['\"]?[.A-Z]"),
    ("ValidatingAdmissionPolicy admissionregistration.k8s.io/v1beta1", 28,
     r"admissionregistration\.k8s\.io/v1beta1"),
    ("ValidatingAdmissionPolicy admissionregistration.k8s.io/v1", 30,
     r"kind:\s*ValidatingAdmissionPolicy"),
    ("sidecar containers (initContainers restartPolicy Always)", 29,
     r"initContainers[\s\S]{0,2000}restartPolicy[\"']?:\s*[\"']?Always"),
    ("downward API status.hostIPs", 29, r"status\.hostIPs"),
    ("x-kubernetes-validations optionalOldSelf (ratcheting)", 30, r"\boptionalOldSelf\b"),
    ("securityContext appArmorProfile", 30, r"\bappArmorProfile\b"),
    ("lifecycle sleep action", 30, r"\bsleep[\"']?:\s*\{?\s*[\"']?seconds"),
    ("CRD selectableFields", 31, r"\bselectableFields\b"),
    ("Service trafficDistribution", 31, r"\btrafficDistribution\b"),
]


def chart_minimum() -> int:
    """The minor version of Chart.yaml's kubeVersion lower bound (">=1.N.0-0")."""
    kube_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    m = re.fullmatch(r">=\s*1\.(\d+)(\.\d+)?(-0)?", kube_version.strip())
    assert m, f"kubeVersion {kube_version!r}: expected a single lower bound >=1.N.0-0"
    return int(m.group(1))


def blank_literals(expr: str) -> str:
    return re.sub(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", "''", expr)


def crd_rules() -> list[tuple[str, str]]:
    """(CRD file, rule or messageExpression) for every x-kubernetes-validations entry."""
    out: list[tuple[str, str]] = []

    def walk(node, where):
        if isinstance(node, dict):
            for rule in node.get("x-kubernetes-validations") or ():
                out.extend((where, rule[k]) for k in ("rule", "messageExpression") if k in rule)
            for value in node.values():
                walk(value, where)
        elif isinstance(node, list):
            for value in node:
                walk(value, where)

    for path in sorted((CHART / "crds").glob("*.yaml")):
        walk(yaml.safe_load(path.read_text()), path.name)
    return out


def rendered_chart() -> list[str]:
    """Every CI scenario rendered by helm (at the stated minimum, so kubeVersion must admit it)."""
    exe = BIN / "helm"
    assert exe.exists(), f"helm not found at {exe}: run dev/setup/binaries.sh helm"
    texts = []
    for values in [None, *sorted((CHART / "ci").glob("*.yaml"))]:
        args = [str(exe), "template", "rel", str(CHART), "--namespace", "sg-system",
                "--kube-version", f"1.{chart_minimum()}.0"] + (["-f", str(values)] if values else [])
        proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        texts.append(proc.stdout)
    return texts


def policy_expressions(texts: list[str]) -> list[str]:
    out = []
    for text in texts:
        for doc in yaml.safe_load_all(text):
            if doc and doc.get("kind") == "ValidatingAdmissionPolicy":
                spec = doc["spec"]
                out += [v["expression"] for v in spec.get("variables") or ()]
                out += [m["expression"] for m in spec.get("matchConditions") or ()]
                for v in spec.get("validations") or ():
                    out += [v[k] for k in ("expression", "messageExpression") if k in v]
                out += [a["valueExpression"] for a in spec.get("auditAnnotations") or ()]
    return out


def needs(cel: list[tuple[str, str]], crd_cel: list[tuple[str, str]],
          manifests: list[tuple[str, str]]) -> list[tuple[int, str, str]]:
    """(minor, feature, where) for each feature found."""
    found = []
    for where, expr in cel + crd_cel:
        bare = blank_literals(expr)
        for feature, minor, pattern in CEL_FEATURES:
            if re.search(pattern, bare):
                found.append((minor, feature, f"{where}: {expr.strip()[:100]}"))
    for where, expr in crd_cel:
        m = re.search(r"\.(%s)\b" % "|".join(CEL_RESERVED), blank_literals(expr))
        if m:
            found.append((32, f"CEL reserved word {m.group(1)!r} as a field name in a CRD rule "
                              f"(use __{m.group(1)}__ for older API servers)",
                          f"{where}: {expr.strip()[:100]}"))
    for where, text in manifests:
        for feature, minor, pattern in MANIFEST_FEATURES:
            if re.search(pattern, text, re.MULTILINE):
                found.append((minor, feature, where))
    return found


def test_chart_kube_version_admits_every_feature_used():
    texts = rendered_chart()
    cel = [("admission policy", e) for e in policy_expressions(texts)]
    manifests = [(p.name, p.read_text()) for p in sorted((CHART / "crds").glob("*.yaml"))]
    manifests += [(f"rendered chart #{i}", t) for i, t in enumerate(texts)]
    manifests += [(p.name, p.read_text()) for p in OPERATOR_RENDER]
    found = needs(cel, crd_rules(), manifests)
    assert any("ValidatingAdmissionPolicy" in f for _, f, _ in found)  # the scan sees the chart
    minimum = chart_minimum()
    too_new = sorted({(minor, feature, where) for minor, feature, where in found if minor > minimum})
    assert not too_new, (f"Chart.yaml kubeVersion says >=1.{minimum}, but these need newer API servers:\n"
                         + "\n".join(f"  1.{m}: {f} ({w})" for m, f, w in too_new))


@pytest.mark.parametrize("expr,minor", [
    ("has(self.namespace) || has(self.spiffeID)", 32),
    ("self.metadata.namespace != ''", 32),
    ("self.__namespace__ != '' && self.name == 'namespace.x'", None),
    ("self.all(k, v, v > 0)", 33),
    ("self.all(k, k > 0)", None),
    ("ip(self).family() == 4", 31),
    ("self.ip != ''", None),
    ("format.dns1123Label().validate(self).hasValue()", 32),
    ("self.distinct() == self", 35),
    ("self.isSorted()", 25),
    ("'%s'.format([self])", 30),
])
def test_detector(expr, minor):
    found = needs([], [("t", expr)], [])
    assert max((m for m, _, _ in found), default=None) == minor
