"""The request-level canary's selection at its edges (sparsegate_contracts.canary, which the model
server's choose_gate calls): a point is in [0, 1) for every digest, weight 1 takes every request,
weight 0 none, and a point exactly on the weight stays on the stable version."""

from __future__ import annotations

import hashlib

import pytest

from sparsegate_contracts import canary
from sparsegate_contracts.canary import canary_point, routes_to_canary


class _Digest:
    def __init__(self, value: int) -> None:
        self.value = value

    def digest(self) -> bytes:
        return self.value.to_bytes(8, "big")


def _with_digest(monkeypatch: pytest.MonkeyPatch, value: int) -> None:
    """Make BLAKE2b answer ``value`` (an 8-byte integer) for every key."""
    class FakeHashlib:
        @staticmethod
        def blake2b(data: bytes, *, digest_size: int) -> _Digest:
            assert digest_size == 8
            return _Digest(value)
    monkeypatch.setattr(canary, "hashlib", FakeHashlib)


# The top of the digest range: 2**64 - 1 divided by 2**64 as floats rounded to 1.0 (1,024 of the
# 2**64 digests did), so such a key was not below weight 1 and stayed on the stable version.
@pytest.mark.parametrize("value", [2**64 - 1, 2**64 - 1024, 2**64 - 2048, 0])
def test_every_digest_maps_into_the_half_open_interval(monkeypatch, value):
    _with_digest(monkeypatch, value)
    point = canary_point("any-session")
    assert 0.0 <= point < 1.0
    assert routes_to_canary("any-session", 1.0)       # 100 %: every request
    assert not routes_to_canary("any-session", 0.0)   # 0 %: none


def test_a_point_on_the_weight_stays_stable_and_one_step_below_goes_to_the_canary(monkeypatch):
    # Points are exact multiples of 2**-53, so [0, w) holds a share w to within 2**-53.
    half = 1 << 63
    _with_digest(monkeypatch, half)
    assert canary_point("k") == 0.5 and not routes_to_canary("k", 0.5)
    _with_digest(monkeypatch, half - (1 << 11))
    assert canary_point("k") == 0.5 - 2**-53 and routes_to_canary("k", 0.5)


def test_points_are_the_digest_s_top_53_bits_exactly():
    for key in ("session-0", "x", "", "\udcff-surrogate"):
        n = int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")
        assert canary_point(key) == (n >> 11) / 2**53
