"""Deep circuits of distinct levels (learned structures): every level is a stage of its own, unrolled in the
executables. Results against the float64 oracle, and the sampling pass's draws: one shared Gumbel draw for the
unrolled stages' sum partitions instead of one each (each draw is a kernel that XLA compiles)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jaxpc
from jaxpc import distributions
from jaxpc.engine import select
from jaxpc.queries import queries

from . import oracle

CARD = 3


def deep_chain(levels: int, seed: int = 0):
    """``levels`` sum levels over three variables, each a sum over a product of the level below, with block sizes
    and block counts drawn per level (no two neighbours alike, so nothing scans)."""
    rng = np.random.default_rng(seed)
    cat = distributions.Categorical(num_cats=CARD)
    bs, nb = 2, 2
    leaves = [jaxpc.inputs(v, num_node_blocks=nb, block_size=bs, dist=cat) for v in range(3)]
    prev = jaxpc.multiply(*leaves)
    for i in range(levels):
        last = i == levels - 1
        nbs = 1 if last else int(rng.integers(1, 4))
        bs = 1 if last else int(rng.choice([b for b in (1, 2, 3, 4) if b != bs]))
        prev = jaxpc.summate(prev, num_node_blocks=nbs, block_size=bs)
        if not last:
            prev = jaxpc.multiply(prev)
    return prev


def _draws(fn, *args) -> int:
    """How many random-bit draws the jaxpr of ``fn(*args)`` holds (inner jaxprs included)."""
    def count(jaxpr) -> int:
        n = 0
        for eqn in jaxpr.eqns:
            n += eqn.primitive.name in ("random_bits", "threefry2x32")
            for v in eqn.params.values():
                for sub in v if isinstance(v, (list, tuple)) else (v,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        n += count(sub)
        return n
    return count(jax.make_jaxpr(fn)(*args).jaxpr)


def _unrolled_partitions(layout) -> int:
    return sum(len(st.sums) for st in layout.steps if not hasattr(st, "period"))


def test_deep_chain_sampling_draws_its_noise_once():
    c = jaxpc.compile(deep_chain(12))
    plan, ptables = queries._select_plan(c.layout, c.tables)
    assert _unrolled_partitions(plan) >= 12
    values = jnp.zeros((plan.num_rows, 4))
    noise = select._shared_noise(plan, ptables, jax.random.key(0), select.NOISE_BUFFERS * plan.num_rows, 4,
                                 jnp.float32)
    assert len(noise) == _unrolled_partitions(plan)
    n = _draws(lambda v, k: select.reached_leaves(plan, ptables, c.params, v, k), values, jax.random.key(0))
    assert n == 1
    assert _draws(lambda v: select.reached_leaves(plan, ptables, c.params, v, None), values) == 0


def test_shared_noise_stays_within_the_node_buffer():
    """Partitions past the limit of noise values per sample draw their own; the shared slices are disjoint."""
    c = jaxpc.compile(deep_chain(12))
    plan, ptables = queries._select_plan(c.layout, c.tables)
    def noise(limit):
        return jax.jit(lambda k: select._shared_noise(plan, ptables, k, limit, 3, jnp.float32))(jax.random.key(0))

    full = noise(select.NOISE_BUFFERS * plan.num_rows)
    assert len(full) == _unrolled_partitions(plan)
    sizes = sorted(int(np.prod(a.shape[1:])) for a in full.values())
    cap = sum(sizes[:-1])
    some = noise(cap)
    assert 2 <= len(some) < len(full)
    assert sum(int(np.prod(a.shape[1:])) for a in some.values()) <= cap
    flat = np.concatenate([np.asarray(a).reshape(3, -1) for a in full.values()], axis=1)
    assert np.unique(flat).size == flat.size


def _joint(c, params):
    x_all = np.asarray(list(itertools.product(range(CARD), repeat=3)), np.int32)
    _, ll = oracle.forward(c, params, x_all)
    return x_all, np.exp(ll)


def _chi_square(samples, x_all, probs) -> float:
    idx = {tuple(r): i for i, r in enumerate(x_all)}
    counts = np.zeros(len(x_all))
    for r, n in zip(*np.unique(samples, axis=0, return_counts=True)):
        counts[idx[tuple(r)]] += n
    return stats.chisquare(counts, probs / probs.sum() * counts.sum()).pvalue


@pytest.mark.slow
@pytest.mark.full
def test_deep_irregular_chain_matches_the_oracle():
    """log_prob, flows, MPE's value and sampling of a 24-level chain of distinct levels, against the oracle."""
    c = jaxpc.compile(deep_chain(24, seed=1), seed=2)
    assert not any(hasattr(st, "period") for st in c.layout.steps)
    x_all, p = _joint(c, c.params)
    assert p.sum() == pytest.approx(1.0, rel=1e-5)
    rng = np.random.default_rng(0)
    x = rng.integers(0, CARD, (16, 3)).astype(np.int32)
    miss = np.array([False, True, False])
    _, ref = oracle.forward(c, c.params, x, miss=np.broadcast_to(miss, x.shape))
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x, missing=miss)), ref, rtol=1e-5, atol=1e-5)
    fl = c.flows(c.params, x)
    sums, ins, _ = oracle.flow_totals(c, c.params, x)
    assert oracle.check_flows(c, fl, sums, ins, rtol=2e-4, atol=1e-5) >= 24
    _, value = c.mpe(c.params, x, miss)
    _, mref = oracle.forward(c, c.params, x, miss=np.broadcast_to(miss, x.shape), mode="MPE")
    np.testing.assert_allclose(np.asarray(value), mref, rtol=1e-5, atol=1e-5)
    n = 20_000
    s = np.asarray(c.sample(c.params, jax.random.key(0), n))
    assert _chi_square(s, x_all, p) > 1e-3
    v0 = int(x_all[np.argmax(p), 0])
    ev = np.zeros((n, 3), np.int32)
    ev[:, 0] = v0
    sc = np.asarray(c.sample(c.params, jax.random.key(1), x=ev, missing=np.array([False, True, True])))
    assert np.all(sc[:, 0] == v0)
    keep = x_all[:, 0] == v0
    assert _chi_square(sc[:, 1:], x_all[keep][:, 1:], p[keep]) > 1e-3
