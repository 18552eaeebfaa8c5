"""The schema hash each CRD in charts/sparsegate/crds/ carries (annotation sparsegate.dev/schema-hash).

Helm installs crds/ only where a CRD is absent and never upgrades one, so the chart's
templates/crds-check.yaml compares this annotation on the installed CRDs with the chart's own copy
at `helm install`/`upgrade` and fails, naming the upgrade command, when they differ.

`python tests/unit/chart/crd_hash.py` rewrites the annotations after a CRD's spec changed;
test_crd_upgrade.py fails when one is out of date.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import yaml

CRD_DIR = Path(__file__).resolve().parents[3] / "charts" / "sparsegate" / "crds"
ANNOTATION = "sparsegate.dev/schema-hash"


def schema_hash(crd: dict) -> str:
    """sha256 of the CRD's spec as canonical JSON: comments and formatting do not count."""
    text = json.dumps(crd["spec"], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def stamped(text: str) -> str:
    """``text`` (one CRD file) with its annotation set to the hash of its spec."""
    line = f"    {ANNOTATION}: {schema_hash(yaml.safe_load(text))}"
    if ANNOTATION in text:
        return re.sub(rf"^    {re.escape(ANNOTATION)}: .*$", line, text, count=1, flags=re.M)
    # A new file: the annotations block goes right after metadata.name.
    return re.sub(r"^(metadata:\n  name: .*\n)", rf"\1  annotations:\n{line}\n", text, count=1, flags=re.M)


if __name__ == "__main__":
    for path in sorted(CRD_DIR.glob("*.yaml")):
        text = path.read_text()
        new = stamped(text)
        if new != text:
            path.write_text(new)
            sys.stdout.write(f"wrote {path}\n")
