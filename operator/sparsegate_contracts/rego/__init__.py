"""The zero-trust routing policy (Rego) as package data, and the names OPA knows it by.

One source: ``policies/routing/src.rego`` (where ``opa test`` and the Rego tests read it).
``routing.rego`` in this package is a relative symlink to that file, so the source tree, an
editable install and the wheel all read the same text: setuptools copies the symlink's target
as a regular file into the wheel (``tests/unit/packaging/test_wheel_install.py`` checks that the
installed text equals the source file).
"""

from __future__ import annotations

import os
from importlib import resources

POLICY_ID = "sparsegate-routing"  # OPA policy module id (PUT /v1/policies/<id>)
PACKAGE = "sparsegate.routing"  # the Rego's package
DATA_PATH = "sparsegate/policies"  # data.sparsegate.policies, pushed whole by the operator
ROUTING_RESOURCE = "routing.rego"
OVERRIDE_ENV = "SPARSEGATE_ROUTING_REGO"  # a file to use instead (operator setting)


def routing_policy(path: str | os.PathLike[str] | None = None) -> str:
    """The Rego text: from ``path`` when given, else the copy shipped in this package."""
    if path is not None:
        with open(path, encoding="utf-8") as f:
            return f.read()
    return resources.files(__name__).joinpath(ROUTING_RESOURCE).read_text(encoding="utf-8")
