"""The server's torch thread count: --threads, else $SPARSEGATE_TORCH_THREADS (empty = unset), else
1; a bad value is an argparse error naming its source, never a traceback (and never breaks --help)."""

import pytest

from sparsegate_workload.server import THREADS_ENV, build_parser, main, torch_threads


@pytest.mark.parametrize("flag, env, expected", [
    (None, {}, 1),
    (None, {THREADS_ENV: ""}, 1),
    (None, {THREADS_ENV: "  "}, 1),
    (None, {THREADS_ENV: "3"}, 3),
    (2, {THREADS_ENV: "3"}, 2),        # the flag wins
    (2, {THREADS_ENV: "abc"}, 2),      # a bad variable is not read when the flag is given
])
def test_threads_come_from_the_flag_then_the_variable_then_1(flag, env, expected) -> None:
    assert torch_threads(flag, env) == expected


@pytest.mark.parametrize("value", ["abc", "1.5", "0", "-2"])
def test_a_bad_variable_is_refused_with_its_name(value: str) -> None:
    with pytest.raises(ValueError, match=rf"\${THREADS_ENV} must be an integer of at least 1, "
                                         rf"got '{value}'"):
        torch_threads(None, {THREADS_ENV: value})


@pytest.mark.parametrize("value", ["", "abc", "0"])
def test_help_works_whatever_the_variable_holds(value: str, monkeypatch, capsys) -> None:
    monkeypatch.setenv(THREADS_ENV, value)
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--help"])
    assert info.value.code == 0
    assert "--threads" in capsys.readouterr().out


@pytest.mark.parametrize("argv, env, message", [
    ([], "abc", f"${THREADS_ENV} must be an integer of at least 1, got 'abc'"),
    ([], "0", f"${THREADS_ENV} must be an integer of at least 1, got '0'"),
    (["--threads", "0"], "", "--threads must be at least 1, got 0"),
])
def test_server_exits_2_with_the_reason_before_serving(argv, env, message, monkeypatch,
                                                        capsys) -> None:
    monkeypatch.setenv(THREADS_ENV, env)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
