"""Memory comes back: after one large batch, small steps hold no more device memory than before it (the circuit
keeps nothing per batch: no padded copy, no output, no pending check of the large batch)."""

import gc

import jax
import numpy as np
import pytest

import jaxpc
from jaxpc import structures


def _live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


@pytest.mark.slow
def test_small_steps_after_a_large_batch_hold_what_they_held_before():
    c = jaxpc.compile(structures.HMM(16, 8, 32))
    rng = np.random.default_rng(0)
    small = jax.device_put(rng.integers(0, 32, (16, 16)).astype(np.int32))
    params = c.params
    for _ in range(3):
        params = jax.block_until_ready(c.em_step(params, small))
    before = _live_bytes()
    large = jax.device_put(rng.integers(0, 32, (4000, 16)).astype(np.int32))  # padded to a bucket of 4096
    params = jax.block_until_ready(c.em_step(params, large))
    ll = c.log_prob(params, large)
    assert ll.shape == (4000,)
    del large, ll
    for _ in range(3):
        params = jax.block_until_ready(c.em_step(params, small))
    c.raise_pending()
    after = _live_bytes()
    # what may stay per bucket: the valid-rows weights ([4096] float32) and the input check's one-byte flags
    assert after - before <= 4 * 4096 + 64, (before, after)
