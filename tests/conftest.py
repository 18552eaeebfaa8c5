"""Fixtures shared by several test areas.

The XDP programs (unit tests through BPF_PROG_TEST_RUN, e2e tests on veth pairs) are compiled once
per session and their maps reset per test. Without root/BCC/XDP these fixtures FAIL (never skip)
with the reason and the setup command. bcc itself is imported only when a fixture is used.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from sparsegate_ebpf.programs import BpfUnavailable, LoadedProgram
from sparsegate_ebpf.testing import clear_policy, require_program, reset_maps


def _load(enforce: bool, audit: bool = False) -> LoadedProgram:
    try:
        return require_program(enforce=enforce, audit=audit)
    except BpfUnavailable as exc:
        pytest.fail(f"XDP program unavailable: {exc} (set up with: sudo dev/setup/bpf.sh)", pytrace=False)


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


@pytest.fixture(scope="session")
def _audit_session() -> Iterator[LoadedProgram]:
    prog = _load(True, audit=True)
    yield prog
    prog.close()


@pytest.fixture
def audit_prog(_audit_session: LoadedProgram) -> LoadedProgram:
    """Judges like enforce_prog, drops nothing (policy-audit mode)."""
    reset_maps(_audit_session)
    clear_policy(_audit_session)
    return _audit_session


@pytest.fixture
def enforce_prog(_enforce_session: LoadedProgram) -> LoadedProgram:
    reset_maps(_enforce_session)
    clear_policy(_enforce_session)
    return _enforce_session


@pytest.fixture
def telemetry_prog(_telemetry_session: LoadedProgram) -> LoadedProgram:
    reset_maps(_telemetry_session)
    return _telemetry_session
