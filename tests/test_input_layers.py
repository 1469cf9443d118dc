"""Input layers laid out in runs of nodes over one variable: the run detection and the sufficient statistics
computed per run (a batched one-hot product) against the per-node scatter."""

import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions, structures
from jaxpc.compiler.compile import _variable_run
from jaxpc.engine import em

from .tiers import slow


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
    return data, jaxpc.compile(structures.HCLT(data, 4, input_dist=distributions.Categorical(num_cats=5)), seed=1)


def _per_node_case(c, data, missing: str):
    """``(layout, x, missing)``: ``c``'s layout with its input layers' runs undone (the per-node scatter), 37
    samples and their missing mask (``"none"``, ``"per_sample"``, ``"per_variable"``)."""
    per_node = dataclasses.replace(
        c.layout, input_layers=tuple(dataclasses.replace(s, run=1) for s in c.layout.input_layers))
    rng = np.random.default_rng(2)
    miss = {"none": None, "per_sample": jnp.asarray(rng.random((37, 10)) < 0.3),
            "per_variable": jnp.asarray(rng.random(10) < 0.3)}[missing]
    return per_node, jnp.asarray(data[:37], jnp.int32), miss


def _flows_and_ll(c, layout, x, miss, options):
    """``em.flows_and_ll`` of ``c``'s parameters on ``layout`` as one program (op by op, every operation would
    compile on its own, and an interpreted kernel would run operation by operation)."""
    return jax.jit(lambda p, xb, m: em.flows_and_ll(layout, c.tables, p, xb, m, None, options))(c.params, x, miss)


# (missing, precision, chunk): every precision and chunk with per-sample masks (fast), and each other kind of
# mask with each precision and each chunk once (slow)
RUN_COUNT_CASES = [("per_sample", "fp32", None), ("per_sample", "tf32", 3 * 37 * 5)] + [
    pytest.param("per_sample", p, k, marks=slow) for p, k in (("fp32", 3 * 37 * 5), ("tf32", None))] + [
    pytest.param(m, p, k, marks=slow) for m, p, k in (("none", "fp32", None), ("none", "tf32", 3 * 37 * 5),
                                                      ("per_variable", "fp32", 3 * 37 * 5),
                                                      ("per_variable", "tf32", None))]


@pytest.mark.parametrize("missing,precision,chunk", RUN_COUNT_CASES)
@pytest.mark.slow
def test_run_counts_equal_scatter(hclt, precision, missing, chunk):
    # with chunk: one-hot matrices of 3 variables at a time (10 variables: a last chunk of one)
    tuning = jaxpc.Tuning(onehot_chunk=chunk) if chunk else jaxpc.Tuning()
    data, c = hclt
    assert [s.run for s in c.layout.input_layers] == [4]
    per_node, x, miss = _per_node_case(c, data, missing)
    opts = jaxpc.Options(precision=precision, tuning=tuning)
    got, ll = _flows_and_ll(c, c.layout, x, miss, opts)
    ref, ll_ref = _flows_and_ll(c, per_node, x, miss, opts)
    np.testing.assert_array_equal(np.asarray(ll), np.asarray(ll_ref))
    g, r = np.asarray(got["input"]["categorical"]["counts"]), np.asarray(ref["input"]["categorical"]["counts"])
    assert g.shape == r.shape == (40, 5)
    np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)
    # every sample's flow reaches each variable's vector once: the counts of a run add up to the batch
    np.testing.assert_allclose(g.reshape(10, 4, 5).sum(axis=(1, 2)), np.full(10, 37.0), rtol=1e-5)


@slow
def test_default_runs_path_for_other_leaves():
    """Leaves without their own per-run statistics (here Gaussians) repeat the run's values per node."""
    rng = np.random.default_rng(3)
    xs = [jaxpc.inputs(v, num_node_blocks=3, dist=distributions.Gaussian()) for v in range(2)]
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


@pytest.mark.parametrize("missing,precision", [("per_variable", "tf32")] + [
    pytest.param(m, p, marks=slow) for m, p in (("none", "fp32"), ("per_sample", "tf32"), ("per_variable", "fp32"))])
@pytest.mark.slow
def test_counts_kernel_equals_scatter(hclt, precision, missing, monkeypatch):
    """The Pallas route (interpret mode here) takes the counts of categorical leaves in runs from one kernel
    (``pallas_leaf.categorical_counts``, the one-hot matrices in registers): equal to the per-node scatter, with
    missing values counted through their marginals."""
    from jaxpc.ops import pallas_leaf

    calls = []
    real = pallas_leaf.categorical_counts
    monkeypatch.setattr(pallas_leaf, "categorical_counts", lambda *a, **k: calls.append(1) or real(*a, **k))
    data, c = hclt
    per_node, x, miss = _per_node_case(c, data, missing)
    opts = jaxpc.Options(precision=precision, impl="pallas_forward")
    ref, ll_ref = _flows_and_ll(c, per_node, x, miss, opts.replace(impl="xla"))
    # the flows read in the flow pass's buffer (the leaf kernel's), or as the input layer's own array (autodiff)
    for o in (opts, opts.replace(backward="autodiff")):
        got, ll = _flows_and_ll(c, c.layout, x, miss, o)
        assert calls
        del calls[:]
        np.testing.assert_allclose(np.asarray(ll), np.asarray(ll_ref), rtol=1e-6)
        g, r = np.asarray(got["input"]["categorical"]["counts"]), np.asarray(ref["input"]["categorical"]["counts"])
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree_util.tree_leaves(got["sum"]), jax.tree_util.tree_leaves(ref["sum"])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.full
def test_counts_kernel_route_and_shapes():
    """``pallas_leaf.categorical_counts`` against exact counts over runs, categories and batches that are not
    multiples of its tiles (values out of range count nowhere; fp32 splits the flows, exact to float32 rounding),
    its errors, and which options route a layer to it (``routing.counts_kernel``)."""
    from jaxpc.engine import routing
    from jaxpc.ops import pallas_leaf

    rng = np.random.default_rng(0)
    small = pallas_leaf.CountsConfig(block_r=16, block_k=16, block_b=16)
    for G, run, B, K in [(3, 8, 5, 4), (2, 70, 77, 5), (1, 1, 1, 1), (2, 16, 130, 300)]:
        f = rng.random((G * run, B)).astype(np.float32) * 10.0 ** rng.integers(-3, 3, (G * run, 1))
        x = rng.integers(-1, K + 1, (G, B)).astype(np.int32)
        want = np.zeros((G, run, K))
        for g in range(G):
            for b in range(B):
                if 0 <= x[g, b] < K:
                    want[g, :, x[g, b]] += f.reshape(G, run, B)[g, :, b]
        for precision, tol in (("fp32", 1e-6), ("tf32", 1e-3)):
            # read in place: rows 3 on of a buffer whose other rows are NaN
            buf = np.full((G * run + 5, B), np.nan, np.float32)
            buf[3:3 + G * run] = f
            for cfg, flows, offset in ((pallas_leaf.CountsConfig(), f, 0), (small, f, 0), (small, buf, 3)):
                got = pallas_leaf.categorical_counts(jnp.asarray(flows), jnp.asarray(x), run=run, num_cats=K,
                                                     precision=precision, offset=offset, config=cfg)
                assert got.shape == (G, run, K) and got.dtype == jnp.float32
                np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol * np.abs(want).max())
            ref = pallas_leaf.categorical_counts_reference(jnp.asarray(buf), jnp.asarray(x), run=run, num_cats=K,
                                                           precision=precision, offset=3)
            np.testing.assert_allclose(np.asarray(ref), want, rtol=tol, atol=tol * np.abs(want).max())
    f, x = jnp.ones((8, 3), jnp.float32), jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="offset \\+ G \\* run"):
        pallas_leaf.categorical_counts(f, x, run=3, num_cats=2, offset=3)
    with pytest.raises(ValueError, match="rows \\[0, 10\\)"):
        pallas_leaf.categorical_counts(f, x, run=5, num_cats=2)
    with pytest.raises(TypeError, match="float32"):
        pallas_leaf.categorical_counts(f.astype(jnp.float16), x, run=4, num_cats=2)
    with pytest.raises(TypeError, match="integer"):
        pallas_leaf.categorical_counts(f, x.astype(jnp.float32), run=4, num_cats=2)

    c = jaxpc.compile(structures.HCLT(np.random.default_rng(0).integers(0, 5, (50, 6)), 4,
                                      input_dist=distributions.Categorical(num_cats=5)), seed=1)
    spec = c.layout.input_layers[0]
    fl = jnp.zeros((spec.num_nodes, jaxpc.Tuning().counts_batch), jnp.float32)
    o = jaxpc.Options(impl="pallas_forward")
    assert routing.counts_kernel(spec, o, fl) and routing.counts_kernel(spec, o.replace(impl="pallas"), fl[:, :1])
    assert routing.counts_kernel(spec, jaxpc.Options(), fl) == (jax.default_backend() == "gpu")
    assert not routing.counts_kernel(spec, jaxpc.Options(), fl[:, 1:])  # auto: batches of at least counts_batch
    for other in (o.replace(impl="xla"), o.replace(leaf_kernel=False)):
        assert not routing.counts_kernel(spec, other, fl)
    assert not routing.counts_kernel(spec, o, fl.astype(jnp.float16))
    assert not routing.counts_kernel(dataclasses.replace(spec, run=1), o, fl)
    assert not routing.counts_kernel(dataclasses.replace(spec, dist=distributions.Gaussian()), o, fl)  # not categorical
    # impl="auto" as on a GPU: the counts follow Tuning.counts_batch, the buffer's leaf kernel Tuning.leaf_batch
    with mock.patch.object(routing, "on_gpu", lambda: True), mock.patch.object(routing, "kernels_available",
                                                                               lambda: True):
        small = fl[:, :16]
        assert not routing.counts_kernel(spec, jaxpc.Options(), small)
        assert routing.counts_kernel(spec, jaxpc.Options(tuning=jaxpc.Tuning(counts_batch=16)), small)
        assert not routing.counts_kernel(spec, jaxpc.Options(tuning=jaxpc.Tuning(leaf_batch=16)), small)
        assert routing.leaf_kernel(c.layout, c.params, jaxpc.Options(tuning=jaxpc.Tuning(leaf_batch=16)), batch=16)
        assert not routing.leaf_kernel(c.layout, c.params, jaxpc.Options(tuning=jaxpc.Tuning(counts_batch=16)),
                                       batch=16)


def test_gaussian_sigma_below_min_sigma_is_an_error():
    """A given sigma below min_sigma raises (lifting it would silently change the density); one a float32 rounding
    below it (as read back from a circuit's parameters) is taken as min_sigma; random initialization stays above."""
    g = distributions.Gaussian(min_sigma=0.5)
    want = r"lo: Gaussian sigma must be >= min_sigma=0.5, got \[0.1\] at node\(s\) \[1\]"
    with pytest.raises(ValueError, match=want):
        jaxpc.inputs(0, 2, dist=g, params={"mu": [0.0, 0.0], "sigma": [1.0, 0.1]}, name="lo")
    x = jaxpc.inputs(0, 1, dist=g, params={"mu": [0.0], "sigma": [0.5 * (1 - 1e-7)]})
    c = jaxpc.compile(jaxpc.summate(x, num_nodes=1))
    np.testing.assert_allclose(c.get_node_params(c.params, x)["sigma"], [0.5], rtol=1e-6)
    wide = jaxpc.inputs(0, 8, dist=distributions.Gaussian(min_sigma=1.2))
    c = jaxpc.compile(jaxpc.summate(wide, num_nodes=1), seed=0)
    assert np.all(np.asarray(c.get_node_params(c.params, wide)["sigma"]) >= 1.2 * (1 - 1e-6))


def test_moment_em_keeps_the_variance_of_values_far_from_zero():
    """EM of Gaussian and discretized logistic leaves on values far from zero gives the flow-weighted variance: a
    float32 ``sum F x^2 / sum F - mean^2`` would be rounding noise (values 1e4 +- 1: sigma collapsed to min_sigma)."""
    rng = np.random.default_rng(0)
    x = (1e4 + rng.normal(size=(500, 1))).astype(np.float32)
    g = jaxpc.inputs(0, 1, dist=distributions.Gaussian(min_sigma=1e-3), params={"mu": [1e4 + 0.3], "sigma": [1.5]})
    c = jaxpc.compile(jaxpc.summate(g, num_nodes=1))
    got = c.get_node_params(c.em_step(c.params, x, step_size=1.0, pseudocount=0.0), g)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(float(got["mu"][0]), x64.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(got["sigma"][0]), x64.std(), rtol=1e-3)
    # with a pseudocount: (S2 + c (mu^2 + sigma^2)) / (S0 + c) - mu'^2 in float64
    got = c.get_node_params(c.em_step(c.params, x, step_size=1.0, pseudocount=10.0), g)
    mu, var, n = 1e4 + 0.3, 1.5 ** 2, x64.size
    new_mu = (x64.sum() + 10.0 * mu) / (n + 10.0)
    new_var = (np.sum(x64 ** 2) + 10.0 * (mu * mu + var)) / (n + 10.0) - new_mu ** 2
    np.testing.assert_allclose(float(got["sigma"][0]), np.sqrt(new_var), rtol=1e-3)
    # bin centers far from zero: 1000 bins of width 10, values within a few bins of 9000
    d = distributions.DiscreteLogistic((0.0, 1e4), 1000, min_std=1e-3)
    leaf = jaxpc.inputs(0, 1, dist=d, params={"mu": [9000.0], "s": [20.0]})
    c = jaxpc.compile(jaxpc.summate(leaf, num_nodes=1))
    xi = rng.integers(898, 903, (500, 1)).astype(np.int32)
    got = c.get_node_params(c.em_step(c.params, xi, step_size=1.0, pseudocount=0.0), leaf)
    centers = (xi + 0.5) * 10.0
    np.testing.assert_allclose(float(got["s"][0]), centers.std() * np.sqrt(3) / np.pi, rtol=1e-3)


def test_gaussian_initialization_follows_the_data_scale_hints(tmp_path):
    """``Gaussian(mu, sigma)`` draws each node's mean from N(mu, sigma^2) and its sigma from sigma * U[0.5, 1.5), on
    the host (``jaxpc.compile``) and on the device (``init_params``); without hints the draw is the N(0, 1) one.
    Structure files keep the hints."""
    hinted = jaxpc.inputs(0, 4000, dist=distributions.Gaussian(mu=1e4, sigma=2.0))
    plain = jaxpc.inputs(0, 4000, dist=distributions.Gaussian())
    for leaf in (hinted, plain):
        c = jaxpc.compile(jaxpc.summate(leaf, num_nodes=1), seed=3)
        loc, scale = (1e4, 2.0) if leaf is hinted else (0.0, 1.0)
        for p in (c.params, c.init_params(jax.random.key(1))):
            got = c.get_node_params(p, leaf)
            mu, sigma = np.asarray(got["mu"], np.float64), np.asarray(got["sigma"], np.float64)
            assert abs(mu.mean() - loc) < 4 * scale / np.sqrt(mu.size)  # N(loc, scale^2): the mean's 4 sigma
            assert abs(mu.std() / scale - 1.0) < 0.05
            assert sigma.min() >= 0.5 * scale * (1 - 1e-6) and sigma.max() < 1.5 * scale * (1 + 1e-6)
            assert abs(sigma.mean() / scale - 1.0) < 0.02  # U[0.5, 1.5): mean 1
    c_h = jaxpc.compile(jaxpc.summate(hinted, num_nodes=1), seed=3)
    c_p = jaxpc.compile(jaxpc.summate(plain, num_nodes=1), seed=3)
    h, p = c_h.get_node_params(c_h.params, hinted), c_p.get_node_params(c_p.params, plain)
    np.testing.assert_allclose((np.asarray(h["mu"], np.float64) - 1e4) / 2.0, p["mu"], atol=2e-3)  # same draw
    np.testing.assert_allclose(np.asarray(h["sigma"]) / 2.0, p["sigma"], rtol=1e-6)
    assert repr(distributions.Gaussian(sigma=3)) == "Gaussian(sigma=3.0, min_sigma=0.01)"
    jaxpc.io.save_structure(jaxpc.summate(hinted, num_nodes=1), tmp_path / "g.npz")
    loaded = jaxpc.io.load_structure(tmp_path / "g.npz")
    assert loaded.children[0].dist == distributions.Gaussian(mu=1e4, sigma=2.0)
    assert distributions.Gaussian(mu=1.0) != distributions.Gaussian()
    for kw, what in (({"mu": float("nan")}, "mu"), ({"mu": "1"}, "mu"), ({"sigma": 0.0}, "sigma"),
                     ({"sigma": -2.0}, "sigma"), ({"sigma": float("inf")}, "sigma")):
        with pytest.raises(ValueError, match=f"Gaussian: {what} .* must be"):
            distributions.Gaussian(**kw)


def test_continuous_leaf_arguments_are_checked():
    assert distributions.Gaussian(min_sigma=np.float32(0.25)).min_sigma == 0.25
    assert distributions.Gaussian(min_sigma=1).min_sigma == 1.0
    for bad in (float("inf"), float("nan"), 0.0, -1.0, True, "0.1"):
        with pytest.raises(ValueError, match="Gaussian: min_sigma must be a positive finite float"):
            distributions.Gaussian(min_sigma=bad)
    with pytest.raises(ValueError, match="val_range must be finite"):
        distributions.DiscreteLogistic((0.0, float("inf")), 4)
    with pytest.raises(ValueError, match="min_std must be a positive finite float"):
        distributions.DiscreteLogistic((0.0, 1.0), 4, min_std=float("inf"))
    with pytest.raises(ValueError, match="num_cats must be an int >= 2"):
        distributions.DiscreteLogistic((0.0, 1.0), True)
