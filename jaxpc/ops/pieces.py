"""Work split into pieces that run one after the other, so that one piece's temporaries are alive at a time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax import lax


def ranges(n: int, most: int) -> list[tuple[int, int]]:
    """``[a, b)`` ranges of near-equal sizes, each at most ``most`` long, covering ``range(n)``."""
    k = -(-n // max(1, most))
    if k <= 1:
        return [(0, n)]
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


def in_order(spans: list[tuple[int, int]], inputs: Callable[[int, int], Any], step: Callable, carry):
    """``carry = step(carry, a, b, inputs(a, b))`` over ``spans`` in order. The next span's inputs come out of an
    optimization barrier together with the carry, so XLA cannot start that piece (or allocate its temporaries)
    before this one is done; without it the scheduler may run the pieces side by side."""
    nxt = inputs(*spans[0])
    for i, (a, b) in enumerate(spans):
        carry = step(carry, a, b, nxt)
        if i + 1 < len(spans):
            carry, nxt = lax.optimization_barrier((carry, inputs(*spans[i + 1])))
    return carry
