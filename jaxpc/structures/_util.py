"""Helpers shared by the structure builders."""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np

from ..distributions.base import real_array


def largest_pow2_divisor(n: int) -> int:
    """The largest power of two dividing ``n`` (PyJuice's default block size rule)."""
    if n <= 0:
        raise ValueError(f"expected a positive int, got {n}")
    return n & -n


def default_block_size(num_latents: int, cap: int) -> int:
    return min(largest_pow2_divisor(num_latents), cap)


def check_int(where: str, name: str, value, lo: int = 1) -> int:
    """``value`` as a Python int where it is an integer >= ``lo`` (a Python or NumPy integer, not a bool), else a
    ``ValueError`` naming ``where`` and ``name``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < lo:
        what = "a positive int" if lo == 1 else f"an int >= {lo}"
        raise ValueError(f"{where}: {name} must be {what}, got {value!r}")
    return int(value)


def check_bool(where: str, name: str, value) -> bool:
    """``value`` as a Python bool where it is one (or a NumPy bool), else a ``TypeError`` naming ``where`` and
    ``name`` (a string such as ``"no"`` is not read as true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: {name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def check_seed(where: str, seed) -> int:
    """``seed`` as a Python int where it is an integer >= 0 (not a bool), else a ``ValueError`` naming ``where``."""
    return check_int(where, "seed", seed, lo=0)


def check_weights(where: str, name: str, a) -> np.ndarray:
    """Weights ``a`` (probabilities, or proportions such as counts) as a float64 array: real numbers
    (:func:`jaxpc.distributions.base.real_array`: booleans, strings and other non-numbers raise a ``TypeError``,
    ragged lists a ``ValueError``), finite and non-negative (else a ``ValueError``), naming ``where`` and ``name``."""
    out = real_array(a, f"{where}: {name} must hold real numbers (probabilities or proportions)")
    if not np.all(np.isfinite(out)) or np.any(out < 0):
        raise ValueError(f"{where}: {name} must be finite and non-negative")
    return out


def check_numbers(where: str, name: str, a: np.ndarray) -> None:
    """Raise a ``TypeError`` naming ``where`` and ``name`` unless array ``a`` holds numbers: booleans, integers or
    floats (bfloat16 too), not strings or objects."""
    dt = a.dtype
    if dt.kind in "biuf" or jnp.issubdtype(dt, jnp.floating):  # (bfloat16: kind "V")
        return
    raise TypeError(f"{where}: {name} must be numbers (ints or floats), got dtype {dt}; convert it first, e.g. "
                    f"{name}.astype(np.int32)")


def check_latents(name: str, num_latents: int, block_size: int | None, cap: int) -> tuple[int, int]:
    """``(block_size, num_node_blocks)`` with a clear error when they do not fit."""
    num_latents = check_int(name, "num_latents", num_latents)
    bs = default_block_size(num_latents, cap) if block_size is None else block_size
    if not isinstance(bs, numbers.Integral) or isinstance(bs, bool) or bs < 1:
        raise ValueError(f"{name}: block_size must be a positive int dividing num_latents={num_latents} (or None), "
                         f"got {bs!r}")
    if num_latents % bs:
        raise ValueError(f"{name}: num_latents={num_latents} must be a multiple of block_size={bs}")
    return int(bs), num_latents // int(bs)


def check_leaf_values(name: str, x: np.ndarray, dist) -> None:
    """Raise a ``ValueError`` naming the first entry of data ``x`` that leaf ``dist`` does not admit, where it is
    discrete (an integer in ``dist.value_range()``); non-finite entries are left to the caller's own check."""
    r = dist.value_range()
    if r is None or x.size == 0:
        return
    lo, hi = r
    top = np.inf if hi is None else hi - 1
    if x.dtype.kind in "iub":
        if x.min() >= lo and x.max() <= top:
            return
        bad = (x < lo) | (x > top)
    else:
        with np.errstate(invalid="ignore"):
            bad = np.isfinite(x) & ((x != np.round(x)) | (x < lo) | (x > top))
        if not bad.any():
            return
    b, v = (int(i) for i in np.argwhere(bad)[0])
    n_bad = int(bad.sum())
    more = f" ({n_bad} bad entries in all)" if n_bad > 1 else ""
    raise ValueError(f"{name}: x[{b}, {v}] = {x[b, v]} is not a value of the leaves ({dist!r} accepts "
                     f"{dist.describe_values()}){more}")
