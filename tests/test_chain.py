"""Chain-structured circuits (HMMs): compile-time detection and the forward-backward scan of
:mod:`jaxpc.engine.chain`, against the float64 oracle and the layer-by-layer path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions, structures
from jaxpc.engine import chain as chain_engine
from jaxpc.engine import forward
from jaxpc.nodes import summate

from . import oracle
from .tiers import cases

LAYERS = jaxpc.Options(chain_scan=False)


@pytest.mark.parametrize("T,L,bs,homogeneous", [(2, 4, 2, True), (5, 6, 3, False), (40, 8, 8, True),
                                                 (12, 4, 1, False)])
def test_hmms_are_detected_as_chains(T, L, bs, homogeneous):
    c = jaxpc.compile(structures.HMM(T, L, 3, homogeneous=homogeneous, block_size=bs))
    ch = c.layout.chain
    assert ch is not None and (ch.K, ch.R, ch.tied) == (L, T - 1, homogeneous or T == 2)
    assert sorted(ch.order) == list(range(T))
    assert c.tables["chain"]["pid"].ndim == (2 if ch.tied else 3)


def test_other_circuits_are_not_chains():
    x = np.random.default_rng(0).integers(0, 3, (200, 6))
    assert jaxpc.compile(structures.HCLT(x, 4, input_dist=distributions.Categorical(3))).layout.chain is None
    assert jaxpc.compile(structures.HMM(1, 4, 3)).layout.chain is None  # no transition
    # a mixture of two HMMs is no longer a chain (it still compiles and runs, layer by layer)
    c = jaxpc.compile(summate(structures.HMM(4, 4, 3), structures.HMM(4, 4, 3), num_nodes=1))
    assert c.layout.chain is None and c.log_prob(c.params, np.zeros((2, 4), np.int32)).shape == (2,)


def _check_against_oracle(c, params, x, miss=None, weights=None, options=None):
    fl = c.flows(params, x, miss, ll_weights=weights, options=options)
    sums, ins, _ = oracle.flow_totals(c, params, x, miss, weights=weights)
    assert oracle.check_flows(c, fl, sums, ins, rtol=2e-4, atol=1e-5) >= 3
    _, ref = oracle.forward(c, params, x, miss)
    got = np.asarray(c.log_prob(params, x, miss, options=options))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
    np.testing.assert_allclose(got[np.isfinite(ref)], ref[np.isfinite(ref)], rtol=1e-5)
    return fl


@pytest.mark.parametrize("unroll", cases([1, 4], fast=[1]), ids=["loop", "unrolled"])
@pytest.mark.parametrize("stack", cases([True, False], fast=[False]), ids=["stacked", "accumulated"])
@pytest.mark.parametrize("case", ["tied", "untied", "gaussian"])
def test_chain_flows_equal_exact_expected_counts(case, stack, unroll):
    """The scan's flows against the oracle: transition flows stacked or accumulated, the scans' loops one step per
    iteration or unrolled (4 steps per iteration of 5: a remainder), the input flows written over the emissions."""
    opts = jaxpc.Options(tuning=jaxpc.Tuning(chain_stack_limit=10**9 if stack else 0, chain_unroll=unroll,
                                             chain_unroll_batch=0))
    rng = np.random.default_rng(1)
    T, L, V, B = 6, 4, 5, 11
    if case == "gaussian":
        root = structures.GeneralizedHMM(T, L, distributions.Gaussian(), block_size=2)
        x = rng.normal(size=(B, T)).astype(np.float32)
    else:
        root = structures.HMM(T, L, V, homogeneous=case == "tied", block_size=2)
        x = rng.integers(0, V, (B, T)).astype(np.int32)
    c = jaxpc.compile(root, seed=2)
    assert c.layout.chain is not None
    miss = rng.random((B, T)) < 0.2
    w = rng.uniform(0.5, 2.0, B)
    _check_against_oracle(c, c.params, x, miss, w, options=opts)


@pytest.mark.slow
def test_any_block_order_of_the_input_layer():
    """The scan reads emission blocks through ``ChainSpec.order``: permuting the layer's blocks together with
    the order changes nothing (values, sum flows, and the input flows permuted back)."""
    c = jaxpc.compile(structures.HMM(6, 4, 5, homogeneous=False, block_size=2))
    spec, ctab = c.layout.chain, c.tables["chain"]
    x = jnp.asarray(np.random.default_rng(0).integers(0, 5, (7, 6)).astype(np.int32))
    vals = forward.input_values(c.layout, c.tables, c.params, x, None, jaxpc.Options())[0]
    perm = np.array([3, 0, 5, 1, 4, 2])  # new block j holds old block perm[j]
    inv = np.argsort(perm)
    shuffled = spec.__class__(**{**spec.__dict__, "order": tuple(int(inv[b]) for b in spec.order)})
    vals2 = vals.reshape(6, 4, -1)[perm].reshape(24, -1)

    def run(sp, v):
        def total(sp_, v_):
            return jnp.sum(chain_engine.root_values(sp, ctab, sp_, [v_], jaxpc.Options()))

        return jax.jit(jax.value_and_grad(total, argnums=(0, 1)))(c.params["sum"], v)

    (l1, (s1, v1)), (l2, (s2, v2)) = run(spec, vals), run(shuffled, vals2)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    for k in s1:
        np.testing.assert_allclose(s1[k], s2[k], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(v1.reshape(6, 4, -1)[perm].reshape(24, -1), v2, rtol=1e-5, atol=1e-7)


KERNELS = jaxpc.Options(impl="pallas")  # the persistent chain kernels (interpret mode off a GPU)


@pytest.mark.parametrize("options", [None, KERNELS], ids=["scan", "kernels"])
@pytest.mark.slow
def test_impossible_samples_get_minus_inf_and_zero_flows(options):
    L, V, T = 4, 3, 5
    beta = np.random.default_rng(0).dirichlet(np.ones(V), L)
    beta[:, 2] = 0.0
    beta /= beta.sum(1, keepdims=True)
    c = jaxpc.compile(structures.HMM(T, L, V, beta=beta, block_size=2))
    x = np.random.default_rng(1).integers(0, 2, (6, T)).astype(np.int32)
    x[[1, 4], 2] = 2  # symbol 2 is never emitted
    fl = _check_against_oracle(c, c.params, x, options=options)
    assert all(np.all(np.isfinite(np.asarray(a))) for a in jax.tree_util.tree_leaves(fl))
    ll = np.asarray(c.log_prob(c.params, x, options=options))
    assert np.isneginf(ll[[1, 4]]).all() and np.isfinite(np.delete(ll, [1, 4])).all()


@pytest.mark.parametrize("options", cases([jaxpc.Options(tuning=jaxpc.Tuning(chain_kernel_batch=0)),
                                           KERNELS.replace(tuning=jaxpc.Tuning(chain_side_by_side=False)), KERNELS],
                                          fast=[jaxpc.Options(tuning=jaxpc.Tuning(chain_kernel_batch=0))]),
                         ids=["scan", "kernels", "side_by_side"])
@pytest.mark.every_case  # (the kernels' cases in the slow tier, each of its own route)
def test_forward_shares_that_underflow_give_finite_exact_flows(options, monkeypatch):
    """A state whose forward share underflows to 0 (identity transitions, emissions 0.999 / 0.001: 20 zeros then 25
    ones keep state 1; state 0's share falls below float32's range after a dozen ones) has no posterior: exact
    flows and EM step, where its backward message once overflowed and made every flow NaN (and EM, reading NaN
    totals as no mass, kept the old parameters). The side-by-side launch's backward, normalized on its own, loses
    the other state to underflow: its posteriors fail the check and the one-way backward replaces them."""
    from jaxpc.engine import chain

    checked = []
    hold = chain.posteriors_hold

    def spy(*a):
        ok = hold(*a)
        jax.debug.callback(lambda v: checked.append(bool(v)), ok)
        return ok

    monkeypatch.setattr(chain, "posteriors_hold", spy)
    n0, n1 = 20, 25
    T = n0 + n1
    em = np.array([[0.999, 0.001], [0.001, 0.999]])
    c = jaxpc.compile(structures.HMM(T, 2, 2, alpha=np.eye(2), beta=em, gamma=np.array([0.5, 0.5])))
    emit = next(ns for ns in c.nodes if ns.name == f"emit{T - 1}")
    x = np.concatenate([np.zeros(n0), np.ones(n1)]).astype(np.int32)[None]
    fl, ll = c.flows(c.params, x, options=options, return_ll=True)
    np.testing.assert_allclose(float(ll[0]), np.log(0.5) + n0 * np.log(1e-3) + n1 * np.log(0.999), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, emit)), [[0, 0], [n0, n1]], atol=1e-4)
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree_util.tree_leaves(fl))
    new = c.em_step(c.params, x, step_size=1.0, options=options)
    np.testing.assert_allclose(np.asarray(c.get_node_params(new, emit))[1], [n0 / T, n1 / T], rtol=1e-5)
    assert checked == ([False, False] if options is KERNELS else [])
    if options is KERNELS:  # a sample whose messages keep the same states: the launch's own posteriors hold
        x = np.concatenate([np.zeros(5), np.ones(5), np.zeros(T - 10)]).astype(np.int32)[None]
        c2 = jaxpc.compile(structures.HMM(T, 2, 2, beta=em), seed=0)
        fl2 = c2.flows(c2.params, x, options=options)
        ref = c2.flows(c2.params, x, options=options.replace(tuning=jaxpc.Tuning(chain_side_by_side=False)))
        assert checked[2:] == [True]
        for a, b in zip(jax.tree_util.tree_leaves(fl2), jax.tree_util.tree_leaves(ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", cases(["fp32", "tf32", "bf16"], fast=["bf16"]))
@pytest.mark.slow
def test_chain_matches_layer_path_and_autodiff(precision):
    """The same numbers three ways: the chain scan, the layer-by-layer flows pass, and JAX's autodiff through
    the layer-by-layer forward (grad of the weighted log-likelihood with respect to every parameter)."""
    c = jaxpc.compile(structures.HMM(9, 8, 6, homogeneous=False, block_size=4), seed=5)
    x = jnp.asarray(np.random.default_rng(2).integers(0, 6, (13, 9)).astype(np.int32))
    # CPU runs fp32 and tf32 exactly; bf16 rounds different operands in the two paths (the chain rounds the
    # normalized state, the layer path each layer's shifted children)
    tol = 2e-2 if precision == "bf16" else 1e-4

    def grads(options):
        def f(p):
            return jnp.sum(forward.log_prob(c.layout, c.tables, p, x, None, options) * jnp.arange(13.0))
        return jax.jit(jax.value_and_grad(f))(c.params)

    ref_v, ref_g = grads(jaxpc.Options(backward="autodiff", precision=precision))
    for opts in (jaxpc.Options(precision=precision), LAYERS.replace(precision=precision)):
        v, g = grads(opts)
        np.testing.assert_allclose(v, ref_v, rtol=tol / 10)
        for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(ref_g)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol / 10)


@pytest.mark.slow
def test_without_param_flows_and_em_step_agree_with_layer_path():
    c = jaxpc.compile(structures.HMM(7, 4, 5, block_size=2))
    x = np.random.default_rng(3).integers(0, 5, (10, 7)).astype(np.int32)
    fl = c.flows(c.params, x, options=jaxpc.Options(compute_param_flows=False))
    ref = c.flows(c.params, x, options=LAYERS)
    assert all(float(jnp.abs(v).max()) == 0.0 for v in fl["sum"].values())
    np.testing.assert_allclose(fl["input"]["categorical"]["counts"], ref["input"]["categorical"]["counts"],
                               rtol=1e-5, atol=1e-6)
    new = c.em_step(c.params, x, step_size=0.5, pseudocount=0.1)
    new_ref = c.em_step(c.params, x, step_size=0.5, pseudocount=0.1, options=LAYERS)
    for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(new_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_queries_and_other_propagations_use_the_layer_path():
    """MPE / GeneralLL values and the node buffer are not chain-scan business: they equal the layer path."""
    c = jaxpc.compile(structures.HMM(6, 4, 5, block_size=2))
    x = np.random.default_rng(4).integers(0, 5, (5, 6)).astype(np.int32)
    opts = jaxpc.Options()
    assert chain_engine.applies(c.layout, opts, False)
    assert not chain_engine.applies(c.layout, opts.replace(propagation="MPE"), False)
    assert not chain_engine.applies(c.layout, opts.replace(pflow_temperature=0.5), False)
    assert not chain_engine.applies(c.layout, opts, True)
    for prop, kw in (("MPE", {}), ("GeneralLL", {"alpha": 2.0})):
        np.testing.assert_allclose(c.log_prob(c.params, x, propagation=prop, **kw),
                                   c.log_prob(c.params, x, propagation=prop, options=LAYERS, **kw), rtol=1e-6)


# ---- the persistent kernels (jaxpc.ops.pallas_chain) ------------------------------------------------------------

@pytest.mark.parametrize("side", cases([True, False], fast=[False]), ids=["side-by-side", "one-way"])
@pytest.mark.every_case  # (the side-by-side launch in the slow tier)
def test_persistent_kernels_equal_exact_expected_counts(side):
    """The kernels' path (both directions in one launch, or one launch per direction) against the oracle: LL,
    transition, root and emission flows, with missing values and sample weights, at a latent count and batch that
    the kernels pad (5 -> 16, 11 -> 16)."""
    rng = np.random.default_rng(4)
    T, L, V, B = 7, 5, 6, 11
    c = jaxpc.compile(structures.HMM(T, L, V, homogeneous=True), seed=5)
    options = KERNELS.replace(tuning=jaxpc.Tuning(chain_side_by_side=side))
    assert chain_engine.persistent(c.layout.chain, B, jnp.float32, options)
    assert chain_engine.side_by_side(c.layout.chain, B, jnp.float32, options) == side
    x = rng.integers(0, V, (B, T)).astype(np.int32)
    miss = rng.random((B, T)) < 0.2
    _check_against_oracle(c, c.params, x, miss, rng.uniform(0.5, 2.0, B), options=options)


def test_kernels_route():
    """Where the kernels run: a tied float32 chain up to ``Tuning.chain_kernel_batch`` samples, ``impl="pallas"``
    anywhere, ``"auto"`` only on a GPU; never untied, wider, in float64 or on the XLA route."""
    tied = jaxpc.compile(structures.HMM(4, 4, 3)).layout.chain
    untied = jaxpc.compile(structures.HMM(4, 4, 3, homogeneous=False)).layout.chain
    f32 = jnp.float32
    assert chain_engine.persistent(tied, 64, f32, KERNELS)
    assert not chain_engine.persistent(tied, 65, f32, KERNELS)
    assert not chain_engine.persistent(tied, 8, f32, jaxpc.Options(impl="pallas",
                                                                   tuning=jaxpc.Tuning(chain_kernel_batch=0)))
    assert not chain_engine.persistent(untied, 8, f32, KERNELS)
    assert not chain_engine.persistent(tied, 8, jnp.float64, KERNELS)
    assert not chain_engine.persistent(tied, 8, f32, jaxpc.Options(impl="xla"))
    assert chain_engine.persistent(tied, 8, f32, jaxpc.Options()) == (jax.default_backend() == "gpu")
    from jaxpc.ops import pallas_chain  # a program's tiles: 1,024 latents up to 16 samples, 256 up to 64

    assert pallas_chain.fits(1024, 16) and not pallas_chain.fits(1024, 17) and not pallas_chain.fits(2048, 8)
    assert pallas_chain.fits(256, 64) and not pallas_chain.fits(256, 65)


def test_kernel_messages_equal_the_recurrences():
    """:func:`pallas_chain.forward` and :func:`pallas_chain.backward` against the recurrences of their docstring in
    float64, with padding (K 20 -> 32, B 3 -> 16) and a sample whose emissions are all zero at one step (its
    states stay zero: no NaN)."""
    from jaxpc.ops import pallas_chain

    rng = np.random.default_rng(6)
    R, K, B = 5, 20, 3
    A = rng.uniform(0.1, 1.0, (K, K))
    Et = rng.uniform(0.0, 1.0, (R + 1, K, B))
    Et[3, :, 1] = 0.0
    P = [Et[0]]
    for r in range(R):
        c = P[r].sum(0)
        P.append(A @ (P[r] / np.where(c == 0, 1, c)) * Et[r + 1])
    P = np.stack(P)
    got = np.asarray(pallas_chain.forward(jnp.asarray(A, jnp.float32), jnp.asarray(Et, jnp.float32), "fp32"))
    np.testing.assert_allclose(got, P, rtol=1e-5, atol=1e-7)
    c = P.sum(1)
    beta = [rng.uniform(0.0, 1.0, (K, B))]
    for r in reversed(range(R)):
        beta.insert(0, A.T @ (beta[0] / np.where(c[r + 1] == 0, 1, c[r + 1]) * Et[r + 1]))
    beta = np.stack(beta)
    Ec = Et / np.where(c == 0, 1, c)[:, None, :]
    got, dy = pallas_chain.backward(jnp.asarray(A, jnp.float32), jnp.asarray(Ec, jnp.float32),
                                    jnp.asarray(beta[-1], jnp.float32), "fp32")
    np.testing.assert_allclose(np.asarray(got), beta, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(dy), beta * Ec, rtol=1e-5, atol=1e-7)


def test_side_by_side_messages_equal_the_backward_up_to_their_factors():
    """:func:`pallas_chain.forward_backward` against the float64 recurrences, with padding (K 20 -> 32, B 3 -> 16)
    and a sample impossible from one step on: its states equal :func:`forward`'s, and its backward messages times
    the factors ``F`` of its docstring (as :mod:`jaxpc.engine.chain` computes them) equal :func:`backward`'s for
    ``beta_R = g groot``; the impossible sample's are zero, never NaN."""
    from jaxpc.ops import pallas_chain

    rng = np.random.default_rng(7)
    R, K, B = 5, 20, 3
    A = rng.uniform(0.1, 1.0, (K, K))
    A /= A.sum(1, keepdims=True)
    Et = rng.uniform(0.0, 1.0, (R + 1, K, B))
    Et[3, :, 1] = 0.0
    g = rng.dirichlet(np.ones(K))
    groot = np.array([0.7, 0.0, 1.3])  # the impossible sample's cotangent, as the engine zeroes it
    P = [Et[0]]
    for r in range(R):
        c = P[r].sum(0)
        P.append(A @ (P[r] / np.where(c == 0, 1, c)) * Et[r + 1])
    P = np.stack(P)
    c = np.where(P.sum(1) == 0, 1, P.sum(1))
    beta = [g[:, None] * groot[None, :]]
    for r in reversed(range(R)):
        beta.insert(0, A.T @ (beta[0] / c[r + 1] * Et[r + 1]))
    beta = np.stack(beta)
    out = pallas_chain.forward_backward(*(jnp.asarray(a, jnp.float32) for a in (A, Et, g)), "fp32")
    got_p, got_b, got_dy = (np.asarray(a, np.float64) for a in out)
    np.testing.assert_allclose(got_p, P, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got_dy, got_b * Et, rtol=1e-6, atol=1e-9)
    n = got_dy.sum(1)
    lr = np.log(np.where(n == 0, 1, n)) - np.log(c)
    F = np.where(groot == 0, 0.0, groot * np.exp(np.cumsum(lr[::-1], 0)[::-1] - lr))
    np.testing.assert_allclose(got_b * F[:, None, :], beta, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got_dy * (F / c)[:, None, :], beta * Et / c[:, None, :], rtol=1e-5, atol=1e-7)
    assert np.isfinite(got_b).all() and np.isfinite(got_dy).all()


def _pallas_grids(jaxpr) -> list:
    """The grids of every ``pallas_call`` in ``jaxpr`` and its sub-jaxprs."""
    grids = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            grids.append(tuple(eqn.params["grid_mapping"].grid))
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else [v]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    grids += _pallas_grids(inner)
    return grids


@pytest.mark.slow
@pytest.mark.full
def test_kernels_under_vmap_run_one_unbatched_launch_per_element():
    """Under ``vmap`` (over parameter sets) the kernels run once per element: a batched ``pallas_call`` would add a
    grid axis that the grid-wide barrier does not count. Values and gradients equal the XLA route's."""
    from jaxpc.ops import pallas_chain

    c = jaxpc.compile(structures.HMM(5, 4, 3), seed=1)
    x = np.random.default_rng(0).integers(0, 3, (6, 5)).astype(np.int32)
    stack = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *[c.init_params(jax.random.key(i)) for i in range(3)])

    def run(impl):
        o = jaxpc.Options(impl=impl)
        ll = jax.vmap(lambda p: c.log_prob(p, x, options=o))(stack)
        return ll, jax.vmap(jax.grad(lambda p: c.log_prob(p, x, options=o).sum()))(stack)

    for a, b in zip(jax.tree_util.tree_leaves(run("pallas")), jax.tree_util.tree_leaves(run("xla"))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    A = jnp.ones((3, 4, 4)) / 4
    Et = jnp.ones((6, 4, 2))
    for f in (lambda a: pallas_chain.forward(a, Et, "fp32"),
              lambda a: pallas_chain.backward(a, Et, jnp.ones((4, 2)), "fp32"),
              lambda a: pallas_chain.forward_backward(a, Et, jnp.ones(4) / 4, "fp32")):
        grids = _pallas_grids(jax.make_jaxpr(jax.vmap(f))(A).jaxpr)
        assert grids and all(len(g) == 1 for g in grids), grids
