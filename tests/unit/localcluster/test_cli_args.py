"""`python -m localcluster` argument handling (no cluster needed)."""

from pathlib import Path

import pytest

from localcluster import __main__ as cli


def test_podrunner_options_pass_through(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = {}

    def fake_main(argv: list[str], *, state_dir: Path) -> int:
        seen.update(argv=argv, state_dir=state_dir)
        return 0

    from localcluster import podrunner

    monkeypatch.setattr(podrunner, "main", fake_main)
    assert cli.main(["--state-dir", str(tmp_path), "podrunner", "--work-dir", "/w"]) == 0
    assert seen == {"argv": ["--work-dir", "/w"], "state_dir": tmp_path}


def test_unknown_options_are_rejected_for_other_commands(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--state-dir", str(tmp_path), "down", "--bogus"])


def test_status_of_a_never_started_cluster_reports_stopped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--state-dir", str(tmp_path), "status"]) == 1
    out = capsys.readouterr().out
    assert "kube-apiserver" in out and "stopped" in out


def test_up_without_binaries_fails_naming_the_setup_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SPARSEGATE_BIN", str(tmp_path / "no-bin"))
    assert cli.main(["--state-dir", str(tmp_path / "s"), "up"]) == 1
    assert "dev/setup/binaries.sh" in capsys.readouterr().err
