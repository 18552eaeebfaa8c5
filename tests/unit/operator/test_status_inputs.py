"""controllers.status_inputs: what a model's status was last written from."""

from __future__ import annotations

from sparsegate.controllers.status_inputs import StatusInputs

INPUTS = (("d-uid", 1, 1, 2, 2, 2), ())


def test_matches_only_the_last_record_for_the_same_model_uid():
    seen = StatusInputs()
    assert not seen.matches("ns", "m", uid="u1", inputs=INPUTS)  # nothing recorded (a fresh operator)
    seen.record("ns", "m", uid="u1", inputs=INPUTS)
    assert seen.matches("ns", "m", uid="u1", inputs=INPUTS)
    assert not seen.matches("ns", "m", uid="u2", inputs=INPUTS)  # re-created under the name
    assert not seen.matches("ns", "m", uid=None, inputs=INPUTS)  # owner unknown: never skipped
    assert not seen.matches("ns", "other", uid="u1", inputs=INPUTS)
    seen.record("ns", "m", uid="u1", inputs=(None, ()))
    assert not seen.matches("ns", "m", uid="u1", inputs=INPUTS)
    seen.forget("ns", "m")
    assert not seen.matches("ns", "m", uid="u1", inputs=(None, ()))


def test_settled_is_false_while_a_check_or_write_of_the_model_is_in_flight():
    seen = StatusInputs()
    seen.record("ns", "m", uid="u1", inputs=INPUTS)
    assert seen.settled("ns", "m", uid="u1", inputs=INPUTS)
    with seen.guard("ns", "m"):
        assert not seen.settled("ns", "m", uid="u1", inputs=INPUTS)
        assert seen.matches("ns", "m", uid="u1", inputs=INPUTS)  # the check under the guard itself
    assert seen.settled("ns", "m", uid="u1", inputs=INPUTS)
