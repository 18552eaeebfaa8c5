"""`--version` of every entry point prints the installed build's version (sparsegate_contracts.version)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest

VERSION = metadata.version("sparsegate")


def test_operator_cli_version(capsys: pytest.CaptureFixture[str]) -> None:
    from sparsegate import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"sparsegate {VERSION}\n"
    assert cli.main(["version"]) == 0
    assert capsys.readouterr().out == f"sparsegate {VERSION}\n"


def test_operator_console_script_version() -> None:
    """The installed `sparsegate` script (what users and the chart run)."""
    script = metadata.distribution("sparsegate").entry_points.select(group="console_scripts", name="sparsegate")
    assert [ep.value for ep in script] == ["sparsegate.cli:main"]
    out = subprocess.run([sys.executable, "-m", "sparsegate.cli", "version"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out == f"sparsegate {VERSION}\n"


def test_model_server_version(capsys: pytest.CaptureFixture[str]) -> None:
    from sparsegate_workload import server

    with pytest.raises(SystemExit) as exit_:
        server.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"sparsegate_workload.server {VERSION}\n"


def test_agent_version(capsys: pytest.CaptureFixture[str]) -> None:
    from sparsegate_ebpf import agent

    with pytest.raises(SystemExit) as exit_:
        agent.parse_args(["--version"])  # --interfaces and a policy source are not needed for it
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"sparsegate_ebpf.agent {VERSION}\n"


def test_agent_module_version() -> None:
    out = subprocess.run([sys.executable, "-m", "sparsegate_ebpf.agent", "--version"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out == f"sparsegate_ebpf.agent {VERSION}\n"
