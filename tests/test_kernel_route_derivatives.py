"""Derivatives of the flows on the kernel routes (the Pallas kernels in interpret mode on the CPU): the kernels have
no derivative of their own (in-place buffers, barriers), so ``jax.jvp`` of the flows, ``jax.grad`` through an EM
step and of log flows take XLA's route's derivative at the same point, and equal the ``impl="xla"`` ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import Options, distributions, structures
from jaxpc.engine import chain as chain_engine
from jaxpc.engine import routing

pytestmark = pytest.mark.slow  # (the Pallas kernels in interpret mode: 3 to 11 s a case)


def _hmm():
    c = jaxpc.compile(structures.HMM(5, 4, 3, block_size=2), seed=0)
    x = np.random.default_rng(0).integers(0, 3, (6, 5)).astype(np.int32)
    assert chain_engine.persistent(c.layout.chain, x.shape[0], jnp.float32, Options(impl="pallas"))
    return c, x


def _pd():
    c = jaxpc.compile(structures.PD((2, 3), 4, split_intervals=1, input_dist=distributions.Categorical(3)), seed=0)
    return c, np.random.default_rng(1).integers(0, 3, (4, 6)).astype(np.int32)


MODELS = {"hmm": _hmm, "pd": _pd}


def _score(tree):
    """A scalar that weighs every finite entry of ``tree`` differently."""
    total = 0.0
    for i, a in enumerate(jax.tree_util.tree_leaves(tree)):
        coef = jnp.cos(jnp.arange(a.size, dtype=a.dtype).reshape(a.shape) + i)
        total = total + jnp.sum(jnp.where(jnp.isfinite(a), a, 0.0) * coef)
    return total


def _close(a, b, tol=2e-5):
    for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
        u, v = np.asarray(u), np.asarray(v)
        assert np.isfinite(u).all(), jax.tree_util.keystr(path)
        np.testing.assert_allclose(u, v, rtol=0, atol=tol * max(1.0, float(np.abs(v).max())),
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("model", [*MODELS])  # (--slow: the first case)
def test_grad_through_an_em_step(model):
    c, x = MODELS[model]()
    assert routing.may_run_kernels(Options(impl="pallas")) and not routing.may_run_kernels(Options(impl="xla"))

    def grad(impl):
        def f(p):
            return _score(c.em_step(p, x, step_size=0.5, pseudocount=0.1, options=Options(impl=impl)))
        return jax.jit(jax.value_and_grad(f))(c.params)

    (v, g), (v_ref, g_ref) = grad("pallas"), grad("xla")
    assert float(v) == pytest.approx(float(v_ref), rel=1e-5)
    _close(g, g_ref)


@pytest.mark.full  # (12-14 s a case in CI; test_jvp_of_hard_em_flows runs forward mode there)
@pytest.mark.parametrize("model", [*reversed(MODELS)])
def test_jvp_of_the_flows(model):
    c, x = MODELS[model]()
    tangent = jax.tree_util.tree_map(lambda a: jnp.sin(jnp.arange(a.size, dtype=a.dtype).reshape(a.shape)), c.params)

    def jvp(impl):
        return jax.jit(lambda p, t: jax.jvp(lambda q: c.flows(q, x, options=Options(impl=impl)), (p,), (t,)))(
            c.params, tangent)

    (fl, t), (fl_ref, t_ref) = jvp("pallas"), jvp("xla")
    _close(fl, fl_ref)
    _close(t, t_ref)
    assert max(float(jnp.abs(a).max()) for a in jax.tree_util.tree_leaves(t)) > 0


def test_jvp_of_hard_em_flows():
    """Max-product flows (hard EM): XLA's route keeps each parent's first maximizer in its forward, differentiated
    as the first maximizing term."""
    c, x = _pd()
    t = jax.tree_util.tree_map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype).reshape(a.shape)), c.params)

    def jvp(impl):
        opts = Options(impl=impl, propagation="MPE")
        return jax.jit(lambda p, t: jax.jvp(lambda q: c.flows(q, x, options=opts), (p,), (t,)))(c.params, t)

    (fl, tan), (fl_ref, tan_ref) = jvp("pallas"), jvp("xla")
    _close(fl, fl_ref)
    _close(tan, tan_ref)


@pytest.mark.full  # (16 s in CI; log flows take the linear flows' custom derivative, test_grad_through_an_em_step)
def test_grad_of_log_flows():
    c, x = _hmm()

    def grad(impl):
        def f(p):
            return _score(c.flows(p, x, options=Options(impl=impl, logspace_flows=True)))
        return jax.jit(jax.grad(f))(c.params)

    _close(grad("pallas"), grad("xla"))


def test_reverse_mode_only_where_the_kernels_hold_refs(monkeypatch):
    """Where the tree's cluster kernels run (their buffers are JAX refs), the flows' derivative is XLA's in reverse
    mode; forward mode raises JAX's custom_vjp error."""
    c, x = _hmm()
    monkeypatch.setattr(routing, "holds_refs", lambda *a, **k: True)
    pallas, xla = Options(impl="pallas"), Options(impl="xla")

    def grad(opts):
        return jax.jit(jax.grad(lambda p: _score(c.em_step(p, x, step_size=0.5, pseudocount=0.1, options=opts))))(
            c.params)

    _close(grad(pallas), grad(xla))
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda p: c.flows(p, x, options=pallas), (c.params,), (c.params,))


def test_grad_through_the_cluster_kernels_lowers_for_cuda():
    """``jax.grad`` through an EM step whose tree levels run on thread-block clusters (Hopper's default) traces and
    lowers for an H200 with the cluster kernels in it."""
    from .test_x64 import _tree, on_gpu

    tree = _tree()
    x = jnp.zeros((16, tree.num_vars), jnp.int32)
    clusters = Options(precision="tf32", tuning=jaxpc.Tuning(tree_clusters=True))
    with on_gpu():
        assert routing.holds_refs(tree.layout, clusters, 16, jnp.float32)

        def f(p):
            return _score(tree.em_step(p, x, step_size=0.5, pseudocount=0.1, options=clusters, validate=False))

        text = jax.jit(jax.grad(f)).trace(tree.params).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu_v2" in text
