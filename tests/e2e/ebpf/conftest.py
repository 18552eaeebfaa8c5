"""Fixtures for XDP integration tests: a fresh pair of network namespaces joined by a veth pair
per test, and the program compiled once per session. Without root/BCC/XDP they FAIL loudly."""
from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from sparsegate_ebpf.programs import BpfUnavailable, LoadedProgram
from sparsegate_ebpf.testing import clear_policy, require_program, reset_maps
from sparsegate_ebpf.vethlab import VethLab


def _load(enforce: bool) -> LoadedProgram:
    try:
        return require_program(enforce=enforce)
    except BpfUnavailable as exc:
        pytest.fail(f"XDP program unavailable: {exc} (set up with: sudo dev/setup/bpf.sh)", pytrace=False)


@pytest.fixture
def lab() -> Iterator[VethLab]:
    if shutil.which("ip") is None:
        pytest.fail("iproute2 `ip` is missing (apt-get install iproute2)", pytrace=False)
    with VethLab.create() as lab:
        yield lab


@pytest.fixture(scope="session")
def _enforce_session() -> Iterator[LoadedProgram]:
    prog = _load(True)
    yield prog
    prog.close()


@pytest.fixture(scope="session")
def _telemetry_session() -> Iterator[LoadedProgram]:
    prog = _load(False)
    yield prog
    prog.close()


@pytest.fixture
def enforce_prog(_enforce_session: LoadedProgram) -> LoadedProgram:
    reset_maps(_enforce_session)
    clear_policy(_enforce_session)
    return _enforce_session


@pytest.fixture
def telemetry_prog(_telemetry_session: LoadedProgram) -> LoadedProgram:
    reset_maps(_telemetry_session)
    return _telemetry_session
