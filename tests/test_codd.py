"""The CoDD step through the public API: ``circuit.flows(..., evidence=..., return_evidence_grad=True)`` gives the
log-likelihoods, the evidence gradient and the parameter flows of one executable, equal to JAX's gradient of the
reference (autodiff) path and to the plain ``flows`` call; buckets and padding are the runtime's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions, structures
from jaxpc.engine import forward


def _topk(rng, x, V, k):
    B, T = x.shape
    ids = np.sort(np.stack([[np.concatenate([[x[b, t]], rng.choice(np.setdiff1d(np.arange(V), [x[b, t]]), k - 1,
                                                                    replace=False)]) for t in range(T)]
                            for b in range(B)]), axis=2).astype(np.int32)
    return ids, rng.normal(size=ids.shape).astype(np.float32)


def _reference(c, params, x, ev, w):
    """Gradients of ``sum_b w_b ll_b`` by autodiff through the reference forward pass: (sum grads, evidence grads,
    ll)."""
    ref = jaxpc.Options(backward="autodiff", precision="fp32")

    def objective(sum_params, logp):
        e = {**ev, "categorical_topk": {**ev["categorical_topk"], "logp": logp}}
        ll = forward.log_prob(c.layout, c.tables, {"sum": sum_params, "input": params["input"]}, jnp.asarray(x), None,
                              ref, evidence=c.check_evidence(e, x.shape[0]))
        return jnp.sum(ll * w), ll

    (_, ll), (g_sum, g_lp) = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))(
        params["sum"], jnp.asarray(ev["categorical_topk"]["logp"]))
    return g_sum, g_lp, ll


@pytest.mark.slow
@pytest.mark.parametrize("homogeneous", [True, False])
def test_codd_step_equals_autodiff_of_the_reference(homogeneous):
    rng = np.random.default_rng(0)
    T, L, V, B, k = 5, 4, 9, 6, 3
    c = jaxpc.compile(structures.GeneralizedHMM(T, L, distributions.SoftEvidenceCategorical(V),
                                                homogeneous=homogeneous, block_size=2), seed=1)
    x = rng.integers(0, V, (B, T)).astype(np.int32)
    ids, lp = _topk(rng, x, V, k)
    ev = {"categorical_topk": {"ids": ids, "logp": lp}}
    w = rng.random(B).astype(np.float32)
    opts = jaxpc.Options(precision="fp32")
    fl, ll, g = c.flows(c.params, jax.device_put(x), evidence=ev, ll_weights=w, return_ll=True,
                        return_evidence_grad=True, options=opts)
    g_sum, g_lp, ll_ref = _reference(c, c.params, x, ev, w)
    np.testing.assert_allclose(np.asarray(ll), np.asarray(ll_ref), rtol=1e-5, atol=1e-5)
    assert g["categorical_topk"]["ids"] is None
    assert g["categorical_topk"]["logp"].shape == (B, T, k)  # cut back from the bucket
    np.testing.assert_allclose(np.asarray(g["categorical_topk"]["logp"]), np.asarray(g_lp), rtol=1e-4, atol=1e-6)
    # sum flows are the gradient w.r.t. the log-parameters
    for key, ref in g_sum.items():
        np.testing.assert_allclose(np.asarray(fl["sum"][key]), np.asarray(ref), rtol=1e-4, atol=1e-6)
    # the same flows as the plain call
    plain = c.flows(c.params, x, evidence=ev, ll_weights=w, options=opts)
    for a, b in zip(jax.tree_util.tree_leaves(fl), jax.tree_util.tree_leaves(plain)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_codd_step_gradient_of_gates_and_dense_evidence():
    rng = np.random.default_rng(1)
    T, L, V, B = 4, 4, 5, 3
    c = jaxpc.compile(structures.GeneralizedHMM(T, L, distributions.SoftEvidenceCategorical(V), block_size=2), seed=3)
    x = rng.integers(0, V, (B, T)).astype(np.int32)
    e = rng.normal(size=(B, T, V)).astype(np.float32)
    gates = {g.key: rng.normal(size=(B, g.num_blocks)).astype(np.float32) for g in c.layout.sum_groups}
    opts = jaxpc.Options(precision="fp32")
    _, g = c.flows(c.params, x, evidence={"categorical_logp": e, "sum_gates": gates}, return_evidence_grad=True,
                   options=opts)

    def total(e_, gates_):
        return jnp.sum(c.log_prob(c.params, x, evidence={"categorical_logp": e_, "sum_gates": gates_}, options=opts))

    ge, gg = jax.jit(jax.grad(total, argnums=(0, 1)))(jnp.asarray(e), jax.tree_util.tree_map(jnp.asarray, gates))
    np.testing.assert_allclose(np.asarray(g["categorical_logp"]), np.asarray(ge), rtol=1e-4, atol=1e-6)
    for key in gates:
        np.testing.assert_allclose(np.asarray(g["sum_gates"][key]), np.asarray(gg[key]), rtol=1e-4, atol=1e-6)


def test_codd_step_needs_evidence_and_marks_bad_rows():
    c = jaxpc.compile(structures.GeneralizedHMM(3, 2, distributions.SoftEvidenceCategorical(4)))
    x = np.zeros((2, 3), np.int32)
    with pytest.raises(ValueError, match="return_evidence_grad=True needs evidence"):
        c.flows(c.params, x, return_evidence_grad=True)
    e = np.zeros((2, 3, 4), np.float32)
    xd = jax.device_put(np.array([[0, 1, 2], [0, 9, 1]], np.int32))  # 9 is out of range: checked on the device
    _, ll, g = c.flows(c.params, xd, evidence={"categorical_logp": e}, return_ll=True, return_evidence_grad=True)
    assert np.isfinite(np.asarray(ll)[0]) and np.isnan(np.asarray(ll)[1])
    ge = np.asarray(g["categorical_logp"])
    assert np.isnan(ge[1]).all() and np.isfinite(ge[0]).all()
    with pytest.raises(ValueError, match=r"x\[1, 1\] = 9"):
        c.raise_pending()
