"""Generate the README's CRD reference from the chart's CRDs (the single source of truth).

``python dev/crdref.py`` rewrites the block between the ``crd-reference`` markers in README.md;
``python dev/crdref.py --check`` exits 1 when the README is stale (the unit tests run it), so the
reference can never drift from the schemas the API server enforces.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CRD_DIR = ROOT / "charts" / "sparsegate" / "crds"
README = ROOT / "README.md"
BEGIN, END = "<!-- crd-reference:begin -->", "<!-- crd-reference:end -->"
ORDER = ("sparsemodels", "gateconfigs", "routingpolicies", "telemetryprobes")


def _fields(schema: dict, prefix: str) -> Iterator[tuple[str, str, str, str]]:
    """(path, type, default, description) for every property below ``schema``, depth first."""
    for name, prop in (schema.get("properties") or {}).items():
        path = f"{prefix}.{name}"
        typ = "int-or-string" if prop.get("x-kubernetes-int-or-string") else prop.get("type", "object")
        if typ == "array":
            typ = f"[]{prop.get('items', {}).get('type', 'object')}"
        default = "" if "default" not in prop else f"`{json.dumps(prop['default'])}`"
        description = " ".join(str(prop.get("description", "")).split())
        yield path, typ, default, description
        if prop.get("type") == "object":
            yield from _fields(prop, path)
        elif prop.get("type") == "array" and prop.get("items", {}).get("type") == "object":
            yield from _fields(prop["items"], path + "[]")


def _rules(schema: dict, prefix: str) -> Iterator[tuple[str, str]]:
    for rule in schema.get("x-kubernetes-validations") or []:
        yield prefix + rule.get("fieldPath", ""), rule.get("message", rule["rule"])
    for name, prop in (schema.get("properties") or {}).items():
        yield from _rules(prop, f"{prefix}.{name}")
        if prop.get("type") == "array":
            yield from _rules(prop.get("items", {}), f"{prefix}.{name}[]")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    out: list[str] = []
    for stem in ORDER:
        crd = yaml.safe_load((CRD_DIR / f"{stem}.yaml").read_text())
        names, version = crd["spec"]["names"], crd["spec"]["versions"][0]
        schema = version["schema"]["openAPIV3Schema"]
        out.append(f"### {names['kind']} (`{crd['spec']['group']}/{version['name']}`, "
                   f"short names: {', '.join(names.get('shortNames', [])) or '-'})\n")
        out.append(" ".join(str(schema.get("description", "")).split()) + "\n")
        columns = [c["name"] for c in version.get("additionalPrinterColumns", [])]
        out.append(f"Printer columns: {', '.join(columns)}.\n")
        out.append("| field | type | default | description |\n|---|---|---|---|")
        for section in ("spec", "status"):
            if section in schema.get("properties", {}):
                for path, typ, default, desc in _fields(schema["properties"][section], section):
                    out.append(f"| `{path}` | {typ} | {_cell(default)} | {_cell(desc)} |")
        rules = list(_rules(schema, ""))
        if rules:
            out.append("\nValidation rules (CEL, enforced by the API server):\n")
            out.extend(f"- `{path.lstrip('.') or '(object)'}`: {_cell(msg)}" for path, msg in rules)
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if README.md is out of date")
    args = parser.parse_args(argv)
    text = README.read_text()
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        print(f"README.md lacks the {BEGIN} / {END} markers", file=sys.stderr)
        return 1
    new = f"{head}{BEGIN}\n{render()}\n{END}{tail}"
    if args.check:
        if new != text:
            print("README.md's CRD reference is stale: run python dev/crdref.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
