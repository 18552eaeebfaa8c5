"""Operator metrics bookkeeping and the `sparsegate run` command line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sparsegate import cli, metrics


def sample(name: str, **labels: str) -> float:
    value = metrics.prometheus_client.REGISTRY.get_sample_value(name, labels)
    return value or 0.0


def test_observe_counts_outcomes_errors_and_durations():
    ok0 = sample("sparsegate_operator_reconciles_total", kind="UnitKind", outcome="success")
    deg0 = sample("sparsegate_operator_reconciles_total", kind="UnitKind", outcome="degraded")
    err0 = sample("sparsegate_operator_reconcile_errors_total", kind="UnitKind")
    n0 = sample("sparsegate_operator_reconcile_duration_seconds_count", kind="UnitKind")
    with metrics.observe("UnitKind"):
        pass
    with metrics.observe("UnitKind") as outcome:
        outcome.value = "degraded"
    with pytest.raises(RuntimeError), metrics.observe("UnitKind"):
        raise RuntimeError("boom")
    assert sample("sparsegate_operator_reconciles_total", kind="UnitKind", outcome="success") == ok0 + 1
    assert sample("sparsegate_operator_reconciles_total", kind="UnitKind", outcome="degraded") == deg0 + 1
    assert sample("sparsegate_operator_reconcile_errors_total", kind="UnitKind") == err0 + 1
    assert sample("sparsegate_operator_reconcile_duration_seconds_count", kind="UnitKind") == n0 + 3


def test_a_kinds_error_outcome_exists_at_zero_before_its_first_error():
    """rate()/increase() count a series from its first sample: an `error` outcome born at 1 lost
    the kind's first failed reconcile on the "Reconciles by kind and outcome" panel."""
    with metrics.observe("UnitFirstErrorKind"):
        pass
    get = metrics.prometheus_client.REGISTRY.get_sample_value
    assert get("sparsegate_operator_reconciles_total", {"kind": "UnitFirstErrorKind", "outcome": "error"}) == 0


def test_reconcile_durations_of_minutes_land_in_finite_buckets(monkeypatch: pytest.MonkeyPatch):
    # At 10,000 models reconciles take seconds to minutes: one of 45 s must not fall only in +Inf,
    # where histogram_quantile answers the last finite bound (10 s) whatever the real time.
    clock = iter([1000.0, 1045.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    with metrics.observe("UnitSlowKind"):
        pass
    assert sample("sparsegate_operator_reconcile_duration_seconds_bucket", kind="UnitSlowKind", le="30.0") == 0
    assert sample("sparsegate_operator_reconcile_duration_seconds_bucket", kind="UnitSlowKind", le="60.0") == 1
    assert sample("sparsegate_operator_reconcile_duration_seconds_bucket", kind="UnitSlowKind", le="300.0") == 1

def test_gc_pauses_are_timed_by_generation_once_installed():
    import gc

    metrics.time_gc()
    metrics.time_gc()  # idempotent: one callback, one observation per collection
    assert sum(cb is metrics._gc_timer for cb in gc.callbacks) == 1
    full0 = sample("sparsegate_operator_gc_pause_seconds_count", generation="2")
    young0 = sample("sparsegate_operator_gc_pause_seconds_count", generation="0")
    sum0 = sample("sparsegate_operator_gc_pause_seconds_sum", generation="2")
    gc.collect(2)
    gc.collect(0)
    assert sample("sparsegate_operator_gc_pause_seconds_count", generation="2") == full0 + 1
    assert sample("sparsegate_operator_gc_pause_seconds_count", generation="0") >= young0 + 1
    assert sample("sparsegate_operator_gc_pause_seconds_sum", generation="2") > sum0


def test_cli_scope_flags():
    parse = cli._parser().parse_args
    assert parse(["run"]).namespace == [] and not parse(["run"]).standalone
    assert parse(["run", "-n", "a", "--namespace", "b"]).namespace == ["a", "b"]
    with pytest.raises(SystemExit):
        parse(["run", "--namespace", "a", "--all-namespaces"])
    args = parse(["run", "--standalone", "--metrics-port", "9090", "--leader-elect",
                  "--lease-name", "x", "--liveness", "http://0.0.0.0:8081/healthz"])
    assert (args.metrics_port, args.lease_name, args.leader_elect) == (9090, "x", True)


@pytest.mark.parametrize("flag, default, good, bad, message", [
    ("--reapply-interval", 3600.0, ("0", 0.0), "-5", "must be 0 or more, not -5"),
    ("--gc-young-threshold", 700, ("10000", 10_000), "0", "must be at least 1, not 0"),
])
def test_tuning_flags_default_and_refuse_out_of_range(capsys: pytest.CaptureFixture[str], flag: str, default: float,
                                                       good: tuple[str, float], bad: str, message: str) -> None:
    parse = cli._parser().parse_args
    dest = flag.removeprefix("--").replace("-", "_")
    assert getattr(parse(["run"]), dest) == default
    assert getattr(parse(["run", flag, good[0]]), dest) == good[1]
    with pytest.raises(SystemExit):
        parse(["run", flag, bad])
    assert f"{flag}: {message}" in capsys.readouterr().err


def test_metrics_and_liveness_bind_the_given_address():
    """The chart passes the pod IP: pods sharing a network namespace never collide on a port."""
    parse = cli._parser().parse_args
    assert parse(["run"]).metrics_address == "0.0.0.0"
    assert parse(["run", "--metrics-address", "127.0.0.3"]).metrics_address == "127.0.0.3"
    standby = cli._standby_server("http://127.0.0.1:0/healthz")
    try:
        assert standby is not None and standby.server_address[0] == "127.0.0.1"
    finally:
        standby.shutdown()
        standby.server_close()
    assert cli._standby_server(None) is None


@pytest.mark.parametrize("args, message", [
    (["--metrics-port", "70000"], "argument --metrics-port: must be a port number 0..65535, not 70000"),
    (["--metrics-port", "-1"], "argument --metrics-port: must be a port number 0..65535, not -1"),
    (["--liveness", "http://0.0.0.0:99999/healthz"], "Port out of range 0-65535"),
    (["--liveness", "https://0.0.0.0:8081/healthz"], "argument --liveness: must be an http:// URL"),
    (["--liveness", "0.0.0.0:8081"], "argument --liveness: must be an http:// URL"),
])
def test_listener_flags_refuse_what_could_not_be_bound(capsys: pytest.CaptureFixture[str], args: list[str],
                                                       message: str) -> None:
    """A port out of range or a liveness URL Kopf's endpoint refuses (it serves http:// only) is a
    usage error, not a traceback from the metrics server, the standby endpoint or Kopf later."""
    with pytest.raises(SystemExit) as exc:
        cli._parser().parse_args(["run", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def _run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sparsegate.cli", "run", "--standalone", *args],
                          env={**os.environ, "KUBECONFIG": "/nonexistent", **(env or {})},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("env, args, message", [
    ({"SPARSEGATE_ROLLOUT_TICK_S": "5s"}, (),
     "error: environment: SPARSEGATE_ROLLOUT_TICK_S: must be a positive number of seconds (e.g. 5 or 0.5), got '5s'"),
    ({"POD_IPS": "10.0.0"}, (), "error: environment: POD_IPS: not an IPv4 or IPv6 address: '10.0.0'"),
    ({}, ("--metrics-port", "9999", "--metrics-address", "999.0.0.1"),
     "error: --metrics-address / --metrics-port: cannot listen on 999.0.0.1:9999"),
])
def test_sparsegate_run_names_a_bad_setting_without_a_traceback(env: dict[str, str], args: tuple[str, ...],
                                                                 message: str) -> None:
    proc = _run_cli(*args, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert message in proc.stderr.strip().splitlines()[-1]


def test_api_request_and_tick_durations_up_to_the_request_timeout_land_in_finite_buckets() -> None:
    """An API request attempt may take up to REQUEST_TIMEOUT_S (30 s) and a rollout tick waits on
    several: both histograms reach that far, so a slow control plane reads as slow, not as 10 s."""
    from sparsegate.clients import kube
    from sparsegate.controllers import rollout

    assert max(kube.API_REQUEST_SECONDS._upper_bounds[:-1]) >= kube.REQUEST_TIMEOUT_S
    assert max(rollout.TICK_SECONDS._upper_bounds[:-1]) >= 2 * kube.REQUEST_TIMEOUT_S
