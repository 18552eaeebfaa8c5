"""The trained demo checkpoint's cache key (dev/trained_model.py) covers the code training runs:
the training package and every project module it imports, transitively, and nothing else, so a
change to the gated block retrains while a change to the HTTP server does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from trained_model import DEMO_ARGS, _key, trainer_sources

DEV = Path(__file__).resolve().parents[3] / "dev"


def test_the_key_covers_what_training_imports_and_nothing_else() -> None:
    names = {f"{f.parent.name}/{f.name}" for f in trainer_sources()}
    for needed in ("training/trainer.py", "training/cli.py", "hf/gated_block.py", "hf/loader.py",
                   "sparsegate_workload/quality.py", "sparsegate_workload/gating.py",
                   "sparsegate_contracts/gate.py"):
        assert needed in names, needed
    for unrelated in ("sparsegate_workload/server.py", "sparsegate_workload/openai_api.py",
                      "sparsegate_workload/request_guard.py"):
        assert unrelated not in names, unrelated


def test_the_key_does_not_depend_on_what_the_process_imported() -> None:
    import sparsegate_workload.server  # noqa: F401 - imported here, not in the child below

    child = subprocess.run([sys.executable, "-c", "import trained_model as t; print(t._key(t.DEMO_ARGS))"],
                           capture_output=True, text=True, check=True, cwd=DEV,
                           env={"PYTHONPATH": str(DEV), "PATH": "/usr/bin:/bin"})
    assert child.stdout.strip() == _key(DEMO_ARGS)
    assert _key(DEMO_ARGS) != _key((*DEMO_ARGS, "--steps", "1"))
