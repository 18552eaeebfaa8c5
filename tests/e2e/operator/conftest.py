"""Fixtures for the operator e2e tests: the operator is the chart's Deployment on the shared dev
stack (``stack`` in tests/e2e/conftest.py), in-cluster from its image with the chart's
ServiceAccount, RBAC and Lease; no operator process runs on the host.
"""

from __future__ import annotations

from typing import Any

import pytest
from devstack import Stack

from operator_e2e_support import leader


@pytest.fixture
def operator(stack: Stack) -> dict[str, Any]:
    """The operator pod that leads when the test starts (Ready, holding the Lease, Kopf live)."""
    return leader(stack)
