"""CRDs across `helm upgrade`: Helm never upgrades crds/, so the chart says how and checks it did.

What needs a cluster was run by hand against the local control plane (dev/localcluster): after a
`helm upgrade` to a chart whose SparseModel status schema gained a field, the CRD kept the old
schema and a status patch with that field was answered `Warning: unknown field` and the field
dropped; `kubectl apply --server-side -f crds/` was refused (`conflict with "helm" ...
.spec.versions`) and passed with `--force-conflicts`; templates/crds-check.yaml failed that upgrade
naming the CRD and the command, passed once the CRDs were applied, and passed a fresh install.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from crd_hash import ANNOTATION, CRD_DIR, schema_hash

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "sparsegate"
BIN = Path(os.environ.get("SPARSEGATE_BIN", Path.home() / ".cache" / "sparsegate" / "bin"))
CRD_FILES = sorted(p.name for p in CRD_DIR.glob("*.yaml"))


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    exe = BIN / "helm"
    assert exe.exists(), f"helm not found at {exe}: run dev/setup/binaries.sh helm"
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", CRD_FILES)
def test_every_crd_carries_the_hash_of_its_spec(name: str) -> None:
    """The annotation crds-check.yaml compares with the installed CRD's: stale, it would let an old
    schema through (or refuse a current one)."""
    crd = yaml.safe_load((CRD_DIR / name).read_text())
    assert (crd["metadata"].get("annotations") or {}).get(ANNOTATION) == schema_hash(crd), \
        "run: python tests/unit/chart/crd_hash.py"


def test_helm_show_crds_yields_every_crd() -> None:
    """`helm show crds` (the upgrade command for a chart from a repository) concatenates the files
    as they are: without a leading `---` each, the four CRDs read as one YAML document, and
    `kubectl apply -f -` applied only the last (telemetryprobes)."""
    out = helm("show", "crds", str(CHART))
    assert out.returncode == 0, out.stderr
    names = [d["metadata"]["name"] for d in yaml.safe_load_all(out.stdout) if d]
    assert names == [yaml.safe_load((CRD_DIR / n).read_text())["metadata"]["name"] for n in CRD_FILES]


def test_crd_check_renders_nothing_without_a_cluster_and_can_be_turned_off() -> None:
    """`helm template` (Argo CD) cannot look up: the check passes there and renders no object."""
    for extra in ((), ("--set", "crds.check=false")):
        out = helm("template", "rel", str(CHART), "--namespace", "sg", *extra)
        assert out.returncode == 0, out.stderr
        assert "templates/crds-check.yaml" not in out.stdout
    bad = helm("template", "rel", str(CHART), "--set", "crds.check=maybe")
    assert bad.returncode != 0 and "/crds/check" in bad.stderr, bad.stderr


def test_crd_check_survives_reuse_values_from_a_chart_without_it() -> None:
    """`helm upgrade --reuse-values` renders with the previous chart's values, which have no crds
    map: `.Values.crds.check` failed that upgrade (nil pointer evaluating interface {}.check, seen
    on the local control plane). `crds=null` drops the map the same way."""
    out = helm("template", "rel", str(CHART), "--namespace", "sg", "--set", "crds=null")
    assert out.returncode == 0, out.stderr


def test_the_check_names_every_crd_file_and_the_upgrade_command() -> None:
    template = (CHART / "templates" / "crds-check.yaml").read_text()
    assert '.Files.Glob "crds/*.yaml"' in template and ANNOTATION in template
    assert "kubectl apply --server-side --force-conflicts -f -" in template


@pytest.mark.parametrize("readme", ["README.md", "charts/sparsegate/README.md"])
def test_documented_crd_upgrade_takes_the_fields_over_from_helm(readme: str) -> None:
    """Helm created the CRDs and owns their fields: a server-side apply that changes a schema
    without --force-conflicts is refused, so no documented command may leave it out."""
    text = (ROOT / readme).read_text()
    commands = re.findall(r"kubectl apply --server-side[^`\n]*crds", text)
    assert commands and all("--force-conflicts" in c for c in commands), commands
