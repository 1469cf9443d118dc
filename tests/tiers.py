"""Test tiers: keep a few representative cases of a parametrization in the fast tier and mark the rest slow.

A plain ``pytest`` deselects tests marked ``slow`` (tests/conftest.py); ``pytest --slow`` (CI) adds the slow tier,
one case of each test function, and ``pytest --full`` every case."""

import pytest

slow = pytest.mark.slow


def cases(values, fast, *, unpack=False):
    """``values`` as ``pytest.param``s: those equal to one in ``fast`` stay in the fast tier, the others are marked
    slow. ``unpack``: each value is a tuple of several arguments (``parametrize("a,b", ...)``)."""
    fast = list(fast)
    out = []
    for v in values:
        args = tuple(v) if unpack else (v,)
        out.append(pytest.param(*args, marks=() if v in fast else (slow,)))
    return out
