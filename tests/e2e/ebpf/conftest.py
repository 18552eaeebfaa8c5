"""Fixtures for XDP integration tests: a fresh pair of network namespaces joined by a veth pair
per test. The programs come from tests/conftest.py (compiled once per session, shared with the
unit tests). Without root/BCC/XDP/iproute2 they FAIL loudly."""
from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from sparsegate_ebpf.vethlab import VethLab


@pytest.fixture
def lab() -> Iterator[VethLab]:
    if shutil.which("ip") is None:
        pytest.fail("iproute2 `ip` is missing (apt-get install iproute2)", pytrace=False)
    with VethLab.create() as lab:
        yield lab
