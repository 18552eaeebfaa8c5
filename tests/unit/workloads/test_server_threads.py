"""The server's torch thread count: --threads, else $SPARSEGATE_TORCH_THREADS (empty = unset), else
the container's CPU limit (cgroup cpu.max, rounded up), else 1; a bad value is an argparse error naming its source, never a traceback (and never breaks --help)."""

import pytest

from sparsegate_workload.server import (SHUTDOWN_DELAY_ENV, THREADS_ENV, build_parser, main, shutdown_delay,
                                       torch_threads)


@pytest.mark.parametrize("flag, env, expected", [
    (None, {}, 1),
    (None, {THREADS_ENV: ""}, 1),
    (None, {THREADS_ENV: "  "}, 1),
    (None, {THREADS_ENV: "3"}, 3),
    (2, {THREADS_ENV: "3"}, 2),        # the flag wins
    (2, {THREADS_ENV: "abc"}, 2),      # a bad variable is not read when the flag is given
])
def test_threads_come_from_the_flag_then_the_variable_then_1(flag, env, expected, tmp_path) -> None:
    assert torch_threads(flag, env, cgroup_root=str(tmp_path)) == expected  # no cgroup limit


@pytest.mark.parametrize("flag, env, cpu_max, expected", [
    (None, {}, "400000 100000", 4),           # 4 CPUs of a many-core node: 4 threads, not 1
    (None, {}, "150000 100000", 2),           # rounded up
    (None, {}, "50000 100000", 1),            # at least 1
    (None, {}, "max 100000", 1),              # no limit: 1, many servers share a machine
    (None, {THREADS_ENV: "3"}, "400000 100000", 3),   # the variable wins
    (2, {}, "400000 100000", 2),              # the flag wins
])
def test_default_threads_follow_the_container_cpu_limit(flag, env, cpu_max, expected, tmp_path,
                                                        monkeypatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))  # a 64-core node
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    assert torch_threads(flag, env, cgroup_root=str(tmp_path)) == expected


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
    (["--keepalive-timeout", "nan"], "", "--keepalive-timeout must be in (0, 3600] seconds, got nan"),
    (["--keepalive-timeout", "0"], "", "--keepalive-timeout must be in (0, 3600] seconds, got 0.0"),
    (["--max-connections", "0"], "", "--max-connections must be at least 1, got 0"),
])
def test_server_exits_2_with_the_reason_before_serving(argv, env, message, monkeypatch,
                                                        capsys) -> None:
    monkeypatch.setenv(THREADS_ENV, env)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag, env, expected", [
    (None, {}, 0.0),
    (None, {SHUTDOWN_DELAY_ENV: " "}, 0.0),
    (None, {SHUTDOWN_DELAY_ENV: "5"}, 5.0),
    (1.5, {SHUTDOWN_DELAY_ENV: "5"}, 1.5),     # the flag wins
    (0.0, {SHUTDOWN_DELAY_ENV: "abc"}, 0.0),   # a bad variable is not read when the flag is given
])
def test_shutdown_delay_comes_from_the_flag_then_the_variable_then_0(flag, env, expected) -> None:
    assert shutdown_delay(flag, env) == expected


@pytest.mark.parametrize("flag, env, message", [
    (None, "abc", f"${SHUTDOWN_DELAY_ENV} must be a number of seconds, got 'abc'"),
    (None, "nan", f"${SHUTDOWN_DELAY_ENV} must be in [0, 3600] seconds"),
    (-1.0, "", "--shutdown-delay must be in [0, 3600] seconds"),
    (float("inf"), "", "--shutdown-delay must be in [0, 3600] seconds"),
])
def test_a_bad_shutdown_delay_is_refused_with_its_source(flag, env, message) -> None:
    with pytest.raises(ValueError) as info:
        shutdown_delay(flag, {SHUTDOWN_DELAY_ENV: env})
    assert message in str(info.value)
