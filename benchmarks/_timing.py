"""Host seconds spent inside chosen functions, for the benchmarks that split a call's time."""

from __future__ import annotations

import time


def timed(spent: dict, name: str, fn):
    """``fn`` wrapped to add the seconds of each of its calls to ``spent[name]`` (a ``defaultdict(float)``)."""
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[name] += time.perf_counter() - t
    return wrapper
