"""``sparsegate train``: the operator CLI hands the command to the trainer's module in a new
program image (it never imports sparsegate_workload), so the trainer's own errors come back."""

from __future__ import annotations

import subprocess
import sys

from sparsegate.cli import TRAIN_MODULE, train_command


def _sparsegate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sparsegate.cli", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_train_runs_the_trainer_module_with_the_same_interpreter() -> None:
    assert train_command(["--steps", "5"]) == [sys.executable, "-m", TRAIN_MODULE,
                                               "--steps", "5"]


def test_bad_training_flags_come_back_from_the_trainer() -> None:
    done = _sparsegate("train", "--output", "/nonexistent/out", "--steps", "0")
    assert done.returncode == 2
    assert "sparsegate-train: error: argument --steps: must be >= 1, got 0" in done.stderr


def test_train_help_is_the_trainers() -> None:
    done = _sparsegate("train", "--help")
    assert done.returncode == 0, done.stderr
    assert "--entropy-beta" in done.stdout


def test_top_level_help_lists_train() -> None:
    done = _sparsegate("--help")
    assert done.returncode == 0 and "train" in done.stdout
