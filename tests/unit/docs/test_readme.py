"""The README stays true: its CRD reference is generated from the chart's CRDs and its commands exist."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_crd_reference_is_generated_from_the_crds() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "dev" / "crdref.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_readme_commands_exist_and_ci_runs_the_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    for script in ("./dev/demo.sh", "./dev/test.sh"):
        assert script in readme
        assert os.access(ROOT / script, os.X_OK), f"{script} is not executable"
    assert "./dev/test.sh" in (ROOT / ".ci" / "run").read_text()
