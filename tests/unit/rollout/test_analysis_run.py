"""Declared checks and their AnalysisRun record (domain.analysis_run): parsing, judging one
measurement, count / failureLimit / inconclusiveLimit / error limits, dry-run, scheduling and the
status shape."""

from __future__ import annotations

import pytest

from sparsegate.domain.analysis_run import (
    BUILTIN_CHECK,
    AnalysisRun,
    Measured,
    MeasurementPhase,
    Provider,
    RunPhase,
    due_checks,
    finish,
    judge,
    measure_args,
    new_run,
    parse_checks,
    record,
    release_dry_runs,
    render_args,
    run_phase,
)

PROM = {"name": "errors", "provider": {"prometheus": {"query": 'sum(rate(x{pod=~"{{args.canaryPods}}"}[{{args.window}}]))'}},
        "successCondition": "result < 0.05"}


def check(**fields: object) -> dict:
    return {**PROM, **fields}


def one(**fields: object):
    (c,) = parse_checks({"checks": [check(**fields)]})
    return c


# ---------------------------------------------------------------- parsing


def test_no_checks_means_the_builtin_one() -> None:
    assert parse_checks(None) == (BUILTIN_CHECK,)
    assert parse_checks({}) == (BUILTIN_CHECK,)


def test_parse_every_provider_with_defaults() -> None:
    checks = parse_checks({"checks": [
        PROM,
        {"name": "quality", "provider": {"web": {"url": "http://judge:8080/score?v={{args.canaryVersion}}",
                                                  "method": "post", "body": '{"v": "{{args.canaryVersion}}"}',
                                                  "headers": [{"name": "X-Key", "value": "k"}],
                                                  "jsonPath": "$.score", "timeout": "2s"}},
         "successCondition": "result >= 0.9", "failureCondition": "result < 0.5", "count": 3, "interval": "10s",
         "failureLimit": 1, "inconclusiveLimit": 2, "consecutiveErrorLimit": 0, "dryRun": True},
        {"name": "builtin-metrics", "provider": {"builtin": {}}},
    ]})
    prom, web, builtin = checks
    assert prom.provider == Provider.PROMETHEUS and prom.count == 1 and prom.interval_s is None
    assert prom.failure_limit == 0 and prom.inconclusive_limit == 0 and prom.consecutive_error_limit == 4
    assert prom.prometheus.address is None and not prom.dry_run
    assert web.web.method == "POST" and web.web.headers == (("X-Key", "k"),) and web.web.json_path.steps == ("score",)
    assert web.web.timeout_s == 2 and web.interval_s == 10 and web.count == 3 and web.dry_run
    assert builtin.provider == Provider.BUILTIN and builtin.success is None


@pytest.mark.parametrize(("fields", "error"), [
    ({"provider": {}}, r"checks\[0\]\.provider must set exactly one of builtin, prometheus, web"),
    ({"provider": {"datadog": {}}}, r"checks\[0\]\.provider must set exactly one"),
    ({"provider": {"prometheus": {"query": "up"}, "web": {"url": "http://x"}}}, "exactly one"),
    ({"provider": {"prometheus": {}}}, r"checks\[0\]\.provider\.prometheus\.query must be a non-empty"),
    ({"provider": {"prometheus": {"query": "up", "address": "prom:9090"}}}, r"address must be an http\(s\) URL"),
    ({"provider": {"web": {"url": "ftp://x"}}}, r"provider\.web\.url must be an http\(s\) URL"),
    ({"provider": {"web": {"url": "http://x", "method": "DELETE"}}}, "method must be GET or POST"),
    ({"provider": {"web": {"url": "http://x", "jsonPath": "$..a"}}}, r"provider\.web\.jsonPath: cannot parse"),
    ({"successCondition": None}, "set successCondition, failureCondition or both"),
    ({"successCondition": ""}, "set successCondition, failureCondition or both"),
    ({"successCondition": "result <"}, r"checks\[0\]\.successCondition 'result <': unexpected end"),
    ({"failureCondition": "os.system('x')"}, r"checks\[0\]\.failureCondition .*unknown name 'os'"),
    ({"count": 0}, r"checks\[0\]\.count must be an integer ≥ 1"),
    ({"count": -2}, r"count must be an integer ≥ 1"),
    ({"failureLimit": -1}, r"failureLimit must be an integer ≥ 0"),
    ({"inconclusiveLimit": 1.5}, "inconclusiveLimit must be an integer"),
    ({"interval": "0s"}, r"checks\[0\]\.interval"),
    ({"name": "Bad Name!"}, r"checks\[0\]\.name must be"),
    ({"provider": {"prometheus": {"query": "x{pod=~'{{args.podz}}'}"}}}, r"unknown placeholder \{\{args\.podz\}\}"),
    ({"provider": {"prometheus": {"query": "x{pod=~'{{canaryPods}}'}"}}}, r"unknown placeholder \{\{canaryPods\}\}"),
    ({"provider": {"builtin": {}}, "count": 2}, "a builtin check takes no successCondition, count"),
    # What the HTTP client refuses at every measurement (the CRD refuses it too).
    ({"provider": {"web": {"url": "http://x", "headers": [{"name": "X-Key", "value": "k\r\nX-Injected: 1"}]}}},
     r"checks\[0\]\.provider\.web\.headers\[0\]\.value must hold no control characters"),
    ({"provider": {"web": {"url": "http://x", "headers": [{"name": "X-Ok", "value": "\t"},
                                                          {"name": "X-Key", "value": "a\x00b"}]}}},
     r"headers\[1\]\.value must hold no control characters"),
    ({"provider": {"web": {"url": "http://x", "headers": [{"name": "X Key", "value": "k"}]}}},
     r"headers\[0\]\.name must be an HTTP header name"),
    ({"provider": {"web": {"url": "http://x", "headers": [{"name": "X-Key\n", "value": "k"}]}}},
     r"headers\[0\]\.name must be an HTTP header name"),
])
def test_bad_checks_are_refused_naming_the_field(fields: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_checks({"checks": [check(**fields)]})


def test_names_unique_and_one_builtin() -> None:
    with pytest.raises(ValueError, match="names must be unique, repeated: errors"):
        parse_checks({"checks": [PROM, PROM]})
    b = {"provider": {"builtin": {}}}
    with pytest.raises(ValueError, match="at most one builtin"):
        parse_checks({"checks": [{"name": "a", **b}, {"name": "b", **b}]})
    with pytest.raises(ValueError, match="non-empty list"):
        parse_checks({"checks": []})


def test_placeholders_render() -> None:
    args = measure_args(namespace="ns", gate_config="gate", models=["m"], canary_pods=["m-1.x", "m-0"],
                        stable_pods=[], canary_version="g-new", stable_version="g-old", step=2, percent=20,
                        window_s=4.2)
    assert args["canaryPods"] == "m-0|m-1\\\\.x" and args["stablePods"] == "_" and args["window"] == "5s"
    text = render_args('x{namespace="{{args.namespace}}",pod=~"{{ args.canaryPods }}"}[{{args.window}}] '
                       '{{args.canaryVersion}}/{{args.stableVersion}} {{args.step}} {{args.canaryPercent}}', args)
    assert text == 'x{namespace="ns",pod=~"m-0|m-1\\\\.x"}[5s] g-new/g-old 2 20'


# ---------------------------------------------------------------- one measurement


@pytest.mark.parametrize(("success", "failure", "value", "phase"), [
    ("result < 0.05", None, 0.01, MeasurementPhase.SUCCESSFUL),
    ("result < 0.05", None, 0.2, MeasurementPhase.FAILED),  # only success: false → failed
    (None, "result > 0.1", 0.05, MeasurementPhase.SUCCESSFUL),  # only failure: false → successful
    (None, "result > 0.1", 0.5, MeasurementPhase.FAILED),
    ("result < 0.05", "result > 0.1", 0.07, MeasurementPhase.INCONCLUSIVE),  # neither
    ("result < 0.05", "result > 0.1", 0.01, MeasurementPhase.SUCCESSFUL),
    ("result < 0.05", "result > 0.1", 0.2, MeasurementPhase.FAILED),
    ("result >= 0", "result >= 0", 1.0, MeasurementPhase.FAILED),  # both true: failure wins
])
def test_judge_follows_argo(success: str | None, failure: str | None, value: float, phase: MeasurementPhase) -> None:
    fields = {"successCondition": success, "failureCondition": failure}
    m = judge(one(**fields), Measured(value=value), now=5.0)
    assert m.phase == phase and m.value == value and m.at == 5.0


def test_judge_no_data_and_errors() -> None:
    c = one()
    assert judge(c, Measured(value=None), now=1).phase == MeasurementPhase.INCONCLUSIVE
    assert judge(c, Measured(value=float("nan")), now=1).message == "no data"
    err = judge(c, Measured(error="HTTP 500"), now=1)
    assert err.phase == MeasurementPhase.ERROR and err.message == "HTTP 500"
    zero = judge(one(successCondition="1 / result > 2"), Measured(value=0.0), now=1)
    assert zero.phase == MeasurementPhase.ERROR and "division by zero" in zero.message


# ---------------------------------------------------------------- counts and limits


def run_of(*checks) -> AnalysisRun:
    return new_run(checks, step=1, percent=5, canary_version="g-new", now=100.0)


def feed(run: AnalysisRun, c, values: list[object]) -> AnalysisRun:
    for i, v in enumerate(values):
        measured = Measured(error=v) if isinstance(v, str) else Measured(value=v)
        run = record(run, c, judge(c, measured, now=100.0 + 10 * (i + 1)))
    return run


def test_count_successes_finish_the_check() -> None:
    c = one(count=3)
    run = feed(run_of(c), c, [0.01, 0.02])
    assert run.check("errors").phase == RunPhase.RUNNING and run_phase(run, [c])[0] == RunPhase.RUNNING
    run = feed(run, c, [0.03])
    cr = run.check("errors")
    assert cr.phase == RunPhase.SUCCESSFUL and cr.taken == 3 and cr.successful == 3
    assert run_phase(run, [c]) == (RunPhase.SUCCESSFUL, "every check passed")


def test_failure_limit() -> None:
    c = one(count=5, failureLimit=1)
    run = feed(run_of(c), c, [0.5])
    assert run.check("errors").phase == RunPhase.RUNNING  # one failure tolerated
    run = feed(run, c, [0.01, 0.6])
    cr = run.check("errors")
    assert cr.phase == RunPhase.FAILED and cr.failed == 2 and "2 failed measurement(s) > failureLimit 1" in cr.message
    phase, why = run_phase(run, [c])
    assert phase == RunPhase.FAILED and why.startswith("check errors failed")


def test_inconclusive_limit_and_no_data() -> None:
    c = one(count=3, failureCondition="result > 0.1", inconclusiveLimit=1)
    run = feed(run_of(c), c, [0.07])
    assert run.check("errors").phase == RunPhase.RUNNING
    run = feed(run, c, [None])  # no data counts as inconclusive too
    cr = run.check("errors")
    assert cr.phase == RunPhase.INCONCLUSIVE and cr.inconclusive == 2
    assert run_phase(run, [c])[0] == RunPhase.INCONCLUSIVE


def test_consecutive_errors_make_the_check_inconclusive_not_failed() -> None:
    c = one(count=2, consecutiveErrorLimit=2)
    run = feed(run_of(c), c, ["timeout", "timeout", 0.01, "HTTP 503", "HTTP 503"])
    cr = run.check("errors")
    # Errors do not count towards `count`; the success in between reset the streak.
    assert cr.phase == RunPhase.RUNNING and cr.errors == 4 and cr.consecutive_errors == 2
    run = feed(run, c, ["HTTP 503"])
    cr = run.check("errors")
    assert cr.phase == RunPhase.INCONCLUSIVE and "3 provider errors in a row > consecutiveErrorLimit 2" in cr.message


def test_dry_run_checks_are_recorded_but_never_decide() -> None:
    deciding, dry = parse_checks({"checks": [check(), check(name="shadow", dryRun=True)]})
    run = feed(run_of(deciding, dry), dry, [0.9])  # the dry-run check fails
    assert run.check("shadow").phase == RunPhase.FAILED and run.check("shadow").dry_run
    assert run_phase(run, [deciding, dry])[0] == RunPhase.RUNNING  # waits for the deciding check
    run = feed(run, deciding, [0.01])
    assert run_phase(run, [deciding, dry]) == (
        RunPhase.SUCCESSFUL, "every check passed (dry-run checks recorded, not deciding)")


def test_dry_run_checks_are_waited_for() -> None:
    deciding, dry = parse_checks({"checks": [check(), check(name="shadow", dryRun=True, count=2)]})
    run = feed(feed(run_of(deciding, dry), deciding, [0.01]), dry, [0.01])
    assert run_phase(run, [deciding, dry]) == (RunPhase.RUNNING, "measuring shadow")


def test_a_dry_run_check_without_a_result_does_not_hold_the_step() -> None:
    """Measured, but only no data or provider errors: once every deciding check has finished it is
    closed Inconclusive (it once held the step until its limits ran out, a step per measurement)."""
    deciding, dry = parse_checks({"checks": [check(), check(name="shadow", dryRun=True, count=3, inconclusiveLimit=5)]})
    run = feed(run_of(deciding, dry), dry, [None, "HTTP 503"])
    assert release_dry_runs(run, [deciding, dry]) == run  # the deciding check is still measuring
    run = feed(run, deciding, [0.01])
    assert run_phase(run, [deciding, dry]) == (RunPhase.RUNNING, "measuring shadow")
    released = release_dry_runs(run, [deciding, dry])
    shadow = released.check("shadow")
    assert shadow.phase == RunPhase.INCONCLUSIVE and shadow.taken == 2 and "no result" in shadow.message
    assert run_phase(released, [deciding, dry]) == (
        RunPhase.SUCCESSFUL, "every check passed (dry-run checks recorded, not deciding)")
    # Not yet measured, or with a value to record: waited for.
    fresh = feed(run_of(deciding, dry), deciding, [0.01])
    assert release_dry_runs(fresh, [deciding, dry]) == fresh
    valued = feed(feed(run_of(deciding, dry), deciding, [0.01]), dry, [None, 0.01])  # 1 of 3 successful
    assert release_dry_runs(valued, [deciding, dry]) == valued


def test_due_checks_schedule_from_the_recorded_times() -> None:
    fast, slow = parse_checks({"checks": [check(name="fast", interval="5s", count=2), check(name="slow")]})
    b = BUILTIN_CHECK
    run = run_of(fast, slow, b)
    assert due_checks([fast, slow, b], run, now=104.9, default_interval_s=30) == ()
    assert due_checks([fast, slow, b], run, now=105, default_interval_s=30) == (fast,)
    run = record(run, fast, judge(fast, Measured(value=0.01), now=105.5))
    assert due_checks([fast, slow, b], run, now=110, default_interval_s=30) == ()  # 5 s after 105.5
    assert due_checks([fast, slow, b], run, now=130, default_interval_s=30) == (fast, slow)
    # A finished check is not measured again; a finished run measures nothing.
    run = record(run, fast, judge(fast, Measured(value=0.01), now=130))
    assert run.check("fast").phase == RunPhase.SUCCESSFUL
    assert due_checks([fast, slow, b], run, now=140, default_interval_s=30) == (slow,)
    assert due_checks([fast, slow], finish(run, RunPhase.TERMINATED, "x", now=131), now=200,
                      default_interval_s=30) == ()


def test_a_measurement_in_the_future_makes_the_next_one_due_now() -> None:
    """Status keeps wall-clock times: the clock moved back past the last measurement must not
    hold the check for the length of the jump (a 5 s check measured at 120 would wait until 125
    of the new clock, however far back it went)."""
    fast, slow = parse_checks({"checks": [check(name="fast", interval="5s", count=3), check(name="slow")]})
    run = record(run_of(fast, slow), fast, judge(fast, Measured(value=0.01), now=120))
    assert due_checks([fast, slow], run, now=122, default_interval_s=30) == ()
    # The clock went back 12 s: 110 is before the measurement at 120 (slow's 30 s since the run's
    # start at 100 are not up yet, so it is not due).
    assert due_checks([fast, slow], run, now=110, default_interval_s=30) == (fast,)


def test_status_record_shape_and_round_trip() -> None:
    deciding, dry = parse_checks({"checks": [check(count=2), check(name="shadow", dryRun=True)]})
    run = feed(run_of(deciding, dry), deciding, [0.01, "boom"])
    run = feed(run, dry, [0.5])
    run = finish(run, RunPhase.TERMINATED, "Aborted: by annotation", now=200.0)
    raw = run.to_status()
    assert raw["step"] == 1 and raw["canaryPercent"] == 5 and raw["canaryVersion"] == "g-new"
    assert raw["phase"] == "Terminated" and raw["startedAt"] == "1970-01-01T00:01:40.000Z"
    assert raw["finishedAt"] == "1970-01-01T00:03:20.000Z" and raw["message"] == "Aborted: by annotation"
    errors, shadow = raw["checks"]
    assert errors["name"] == "errors" and errors["provider"] == "prometheus" and errors["dryRun"] is False
    assert errors["phase"] == "Terminated" and errors["count"] == 2 and errors["errors"] == 1
    assert [m["phase"] for m in errors["measurements"]] == ["Successful", "Error"]
    assert errors["measurements"][0] == {"phase": "Successful", "time": "1970-01-01T00:01:50.000Z", "value": 0.01,
                                         "message": "result 0.01"}
    assert errors["measurements"][1]["message"] == "boom" and "value" not in errors["measurements"][1]
    assert shadow["dryRun"] is True and shadow["phase"] == "Failed"
    assert AnalysisRun.from_status(raw) == run


def test_measurement_history_is_bounded() -> None:
    c = one(count=50)
    run = feed(run_of(c), c, [0.01] * 25)
    cr = run.check("errors")
    assert cr.taken == 25 and len(cr.measurements) == 10 and cr.measurements[-1].at == 100.0 + 250
