"""Queries probed as a user calls them, against exact answers: a variable no leaf reads, evidence that is bad but
unchecked, a missing ``x``, float64 circuits at batch sizes 1, odd and large."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import structures

from . import oracle
from .random_circuits import Generator

DISCRETE = ("categorical", "bernoulli", "masked", "indicator", "literal", "logistic")


def test_unchecked_bad_evidence_rows_are_marked_not_decoded():
    """With ``validate=False`` an out-of-range observed value makes its row's value NaN; ``mpe`` and ``sample`` then
    decode or draw nothing for that row (its missing entries read -1, as for evidence of probability 0; its observed
    ones stay), and the other rows are those of the call whose bad value is replaced by a good one."""
    c = jaxpc.compile(structures.HMM(4, 3, 3), seed=2)
    x = np.array([[0, 9, 0, 0], [1, 2, 0, 1], [2, 0, 1, 1]], np.int32)
    good = x.copy()
    good[0, 1] = 1
    miss = np.array([True, False, True, False])
    key = jax.random.key(0)
    assign, value = (np.asarray(a) for a in c.mpe(c.params, x, miss, validate=False))
    drawn = np.asarray(c.sample(c.params, key, x=x, missing=miss, validate=False))
    assert np.isnan(value[0]) and np.isfinite(value[1:]).all()
    for out in (assign, drawn):
        assert (out[0, miss] == -1).all()
        np.testing.assert_array_equal(out[:, ~miss], x[:, ~miss])
    good_assign, good_value = (np.asarray(a) for a in c.mpe(c.params, good, miss, validate=False))
    np.testing.assert_array_equal(assign[1:], good_assign[1:])
    np.testing.assert_array_equal(value[1:], good_value[1:])
    np.testing.assert_array_equal(drawn[1:], np.asarray(c.sample(c.params, key, x=good, missing=miss,
                                                                 validate=False))[1:])
    assert (good_assign >= 0).all() and (drawn[1:] >= 0).all()


def test_conditional_without_evidence_says_so():
    c = jaxpc.compile(structures.HMM(4, 3, 3), seed=2)
    with pytest.raises(ValueError, match=r"conditional needs evidence x \[B, 4\].*missing=np.ones\(4, bool\)"):
        c.conditional(c.params, None)


@pytest.mark.full
def test_float64_queries_are_exact_at_batch_sizes_one_odd_and_large():
    """Under ``jax_enable_x64`` a float64 circuit's marginal, conditional and MPE agree with float64 enumeration to
    ~1e-12, in float64, at batch sizes 1, 7 and 1000; samples keep the evidence and stay in its support."""
    with jax.enable_x64(True):
        gen = Generator(101, num_vars=4, kinds=DISCRETE)
        c = jaxpc.compile(gen.circuit(), seed=1, dtype=jnp.float64)
        xs, _ = gen.all_assignments()
        xs = xs.astype(np.int32)
        _, ll = oracle.forward(c, c.params, xs)
        p = np.exp(ll)
        _, mp = oracle.forward(c, c.params, xs, mode="MPE")
        K, V = int(c.runtime.var_info.card.max()), xs.shape[1]
        rng = np.random.default_rng(0)
        for B in (1, 7, 1000):
            ev = xs[rng.choice(len(xs), B, p=p / p.sum())]
            miss = rng.random(ev.shape) < 0.5
            keep = np.all((xs[None] == ev[:, None]) | miss[:, None], axis=2)  # [B, assignments]
            marg = c.marginal(c.params, ev, miss)
            cond = c.conditional(c.params, ev, miss)
            assign, value = c.mpe(c.params, ev, miss)
            assert marg.dtype == cond.dtype == value.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(marg), np.log(keep @ p), rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(np.asarray(value), np.where(keep, mp, -np.inf).max(1), rtol=1e-12)
            for b in range(min(B, 20)):
                pe = p[keep[b]].sum()
                for v in range(V):
                    ref = (np.array([p[keep[b] & (xs[:, v] == k)].sum() for k in range(K)]) / pe if miss[b, v]
                           else np.eye(K)[ev[b, v]])
                    np.testing.assert_allclose(np.asarray(cond)[b, v], ref, rtol=1e-12, atol=1e-14)
            assign = np.asarray(assign)
            np.testing.assert_array_equal(assign[~miss], ev[~miss])
            np.testing.assert_allclose(oracle.forward(c, c.params, assign, mode="MPE")[1], np.asarray(value),
                                       rtol=1e-12)
            drawn = np.asarray(c.sample(c.params, jax.random.key(B), x=ev, missing=miss))
            np.testing.assert_array_equal(drawn[~miss], ev[~miss])
            assert (np.exp(oracle.forward(c, c.params, drawn)[1]) > 0).all()
