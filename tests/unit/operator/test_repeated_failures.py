"""The one rule for failures tried again every tick: news once, repeats at DEBUG, success forgets."""

from sparsegate.repeated_failures import repeats


def test_a_failure_is_news_once_then_repeats_until_it_changes_or_succeeds() -> None:
    last: dict[str, str] = {}
    assert repeats(last, "pod-a", "401") is False  # news: WARNING
    assert repeats(last, "pod-a", "401") is True   # the same again: DEBUG
    assert repeats(last, "pod-b", "401") is False  # per key
    assert repeats(last, "pod-a", "timeout") is False  # changed: news again
    assert repeats(last, "pod-a", None) is False and last == {"pod-b": "401"}  # success: forgotten
    assert repeats(last, "pod-a", "timeout") is False  # after a success, news again
