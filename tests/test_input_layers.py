"""Input layers laid out in runs of nodes over one variable: the run detection and the sufficient statistics
computed per run (a batched one-hot product) against the per-node scatter."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import dists, structures
from jaxpc.compiler.compile import _variable_run
from jaxpc.distributions import categorical
from jaxpc.engine import em


def test_variable_run():
    ar = np.arange
    assert _variable_run(np.repeat([5, 2, 7], 4), ar(12)) == 4
    assert _variable_run(np.array([1, 1, 1, 2, 2, 2, 2, 2, 2]), ar(9)) == 3  # a variable twice in a row: 6
    assert _variable_run(np.array([1, 1, 2, 2, 2]), ar(5)) == 1
    assert _variable_run(np.repeat([5, 2], 4), np.repeat([0, 1], 4)) == 1  # tied rows
    assert _variable_run(np.repeat([5, 2], 4), ar(8)[::-1].copy()) == 1  # shuffled rows
    assert _variable_run(np.zeros(0, np.int32), ar(0)) == 1


@pytest.fixture(scope="module")
def hclt():
    data = np.random.default_rng(0).integers(0, 5, (300, 10))
    return data, jaxpc.compile(structures.HCLT(data, 4, input_dist=dists.Categorical(num_cats=5)), seed=1)


@pytest.mark.parametrize("chunk", [None, 3 * 37 * 5])
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("missing", ["none", "per_sample", "per_variable"])
def test_run_counts_equal_scatter(hclt, precision, missing, chunk, monkeypatch):
    if chunk:  # one-hot matrices of 3 variables at a time (10 variables: a last chunk of one)
        monkeypatch.setattr(categorical, "ONEHOT_CHUNK", chunk)
    data, c = hclt
    assert [s.run for s in c.layout.input_layers] == [4]
    per_node = dataclasses.replace(
        c.layout, input_layers=tuple(dataclasses.replace(s, run=1) for s in c.layout.input_layers))
    rng = np.random.default_rng(2)
    x = jnp.asarray(data[:37], jnp.int32)
    miss = {"none": None, "per_sample": jnp.asarray(rng.random((37, 10)) < 0.3),
            "per_variable": jnp.asarray(rng.random(10) < 0.3)}[missing]
    opts = jaxpc.Options(precision=precision)
    got, ll = em.flows_and_ll(c.layout, c.tables, c.params, x, miss, None, opts)
    ref, ll_ref = em.flows_and_ll(per_node, c.tables, c.params, x, miss, None, opts)
    np.testing.assert_array_equal(np.asarray(ll), np.asarray(ll_ref))
    g, r = np.asarray(got["input"]["categorical"]["counts"]), np.asarray(ref["input"]["categorical"]["counts"])
    assert g.shape == r.shape == (40, 5)
    np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)
    # every sample's flow reaches each variable's vector once: the counts of a run add up to the batch
    np.testing.assert_allclose(g.reshape(10, 4, 5).sum(axis=(1, 2)), np.full(10, 37.0), rtol=1e-5)


def test_default_runs_path_for_other_leaves():
    """Leaves without their own per-run statistics (here Gaussians) repeat the run's values per node."""
    rng = np.random.default_rng(3)
    xs = [jaxpc.inputs(v, num_node_blocks=3, dist=dists.Gaussian()) for v in range(2)]
    prods = jaxpc.multiply(*xs)
    root = jaxpc.summate(prods, num_node_blocks=1)
    c = jaxpc.compile(root, seed=0)
    assert c.layout.input_layers[0].run == 3
    per_node = dataclasses.replace(
        c.layout, input_layers=tuple(dataclasses.replace(s, run=1) for s in c.layout.input_layers))
    x = jnp.asarray(rng.standard_normal((9, 2)), jnp.float32)
    got, _ = em.flows_and_ll(c.layout, c.tables, c.params, x, None, None, jaxpc.Options())
    ref, _ = em.flows_and_ll(per_node, c.tables, c.params, x, None, None, jaxpc.Options())
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6), got, ref)
