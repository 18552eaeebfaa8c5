"""The CRD fuzz-case generator (tests/e2e/operator/crd_fuzz_cases.py) for the unit tests that read it.

Loaded from its file once, under its own name: the e2e tests import it by its bare name, and a
second copy under that name would be another module object. Importable as ``crd_fuzz_loader``
(pytest puts ``tests/``, the directory of tests/conftest.py, on the path).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

GENERATOR = Path(__file__).resolve().parent / "e2e" / "operator" / "crd_fuzz_cases.py"


@functools.cache
def crd_fuzz_cases() -> ModuleType:
    spec = importlib.util.spec_from_file_location("crd_fuzz_cases_for_unit_tests", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
