"""``calibrate.numbers``: the one rounding of results (JSON) and of tables (text)."""

from __future__ import annotations

import doctest
import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

import calibrate.numbers as numbers
from calibrate.numbers import rounded, rounded_interval, rounded_triple

ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)


def test_doctests():
    assert doctest.testmod(numbers).failed == 0


@settings(derandomize=True, max_examples=200, deadline=None)
@given(ANY_FLOAT, st.integers(0, 8))
def test_rounded_is_a_json_number_or_null(x, digits):
    """A finite value keeps ``digits`` decimals as Python's round does; NaN and infinities (JSON has
    neither) become None; whatever comes out survives a JSON round trip unchanged."""
    out = rounded(x, digits)
    if math.isfinite(x):
        assert out == round(x, digits) and type(out) is float
    else:
        assert out is None
    assert json.loads(json.dumps(out)) == out


@settings(derandomize=True, max_examples=100, deadline=None)
@given(st.floats(-1e6, 1e6), st.one_of(st.none(), st.tuples(st.floats(-1e6, 1e6), st.floats(-1e6, 1e6))))
def test_a_triple_and_its_interval(mean, ends):
    """``[mean, lo, hi]`` rounds each entry; its interval is ``[lo, hi]``, None when the bootstrap gave none."""
    triple = [mean, None, None] if ends is None else [mean, *ends]
    assert rounded_triple(triple) == [rounded(v) if v is not None else None for v in triple]
    assert rounded_interval(triple) == (None if ends is None else [rounded(ends[0]), rounded(ends[1])])
    assert rounded_triple(None) is None and rounded_interval(None) is None
