"""HMM circuits against the forward algorithm and forward-backward posteriors (float64 numpy)."""

import numpy as np
import pytest

import jaxpc
from jaxpc import structures

from .tiers import cases


def forward_backward(alphas, betas, gamma, x):
    """Scaled forward-backward. ``alphas[t]``: transitions t -> t+1, ``betas[t]``: emissions at t.
    Returns (ll [B], init counts [L], transition counts per t [T-1, L, L], emission counts per t [T, L, V])."""
    B, T = x.shape
    L = gamma.shape[0]
    V = betas[0].shape[1]
    em = np.stack([betas[t][:, x[:, t]].T for t in range(T)], 1)  # [B, T, L]
    fwd = np.zeros((B, T, L))
    scale = np.zeros((B, T))
    a = gamma[None] * em[:, 0]
    for t in range(T):
        if t > 0:
            a = (fwd[:, t - 1] @ alphas[t - 1]) * em[:, t]
        scale[:, t] = a.sum(1)
        fwd[:, t] = a / scale[:, t:t + 1]
    bwd = np.ones((B, T, L))
    for t in range(T - 2, -1, -1):
        bwd[:, t] = ((em[:, t + 1] * bwd[:, t + 1]) @ alphas[t].T) / scale[:, t + 1:t + 2]
    post = fwd * bwd  # gamma_t
    xi = np.zeros((T - 1, L, L))
    for t in range(T - 1):
        xi[t] = np.einsum("bi,ij,bj->ij", fwd[:, t], alphas[t], em[:, t + 1] * bwd[:, t + 1] / scale[:, t + 1:t + 2])
    emit = np.zeros((T, L, V))
    for t in range(T):
        for v in range(V):
            emit[t, :, v] = post[:, t][x[:, t] == v].sum(0)
    return np.log(scale).sum(1), post[:, 0].sum(0), xi, emit


def _nodes(c, prefix):
    return {int(ns.name[len(prefix):]): ns for ns in c.nodes if ns.name.startswith(prefix)}


@pytest.mark.parametrize("homogeneous", cases([True, False], fast=[True]))
@pytest.mark.slow
def test_hmm_ll_and_em_counts(homogeneous):
    """Both flow paths (the chain's scan and the layers) on one compiled HMM against one forward-backward."""
    rng = np.random.default_rng(0)
    T, L, V, B = 7, 4, 5, 33
    root = structures.HMM(T, L, V, homogeneous=homogeneous, block_size=2)
    c = jaxpc.compile(root, seed=3)
    params = c.init_params(__import__("jax").random.key(1))
    trans, emit = _nodes(c, "trans"), _nodes(c, "emit")
    alphas = [np.asarray(c.get_node_params(params, trans[t]), np.float64) for t in range(T - 1)]
    betas = [np.asarray(c.get_node_params(params, emit[t]), np.float64) for t in range(T)]
    gamma = np.asarray(c.get_node_params(params, root), np.float64)[0]
    if homogeneous:
        assert all(np.array_equal(alphas[0], a) for a in alphas) and all(np.array_equal(betas[0], b) for b in betas)
    else:
        assert not np.allclose(alphas[0], alphas[1])
    x = rng.integers(0, V, (B, T)).astype(np.int32)
    ll_ref, init_ref, xi_ref, emit_ref = forward_backward(alphas, betas, gamma, x)
    assert c.layout.chain is not None
    for chain_scan in (True, False):
        opts = jaxpc.Options(chain_scan=chain_scan)
        msg = f"chain_scan={chain_scan}"
        np.testing.assert_allclose(np.asarray(c.log_prob(params, x, options=opts)), ll_ref, rtol=1e-5, err_msg=msg)

        fl = c.flows(params, x, options=opts)
        np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, root))[0], init_ref, rtol=1e-4, atol=1e-5,
                                   err_msg=msg)
        if homogeneous:
            np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, trans[0])), xi_ref.sum(0), rtol=1e-4,
                                       atol=1e-4, err_msg=msg)
            np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, emit[0])), emit_ref.sum(0), rtol=1e-4,
                                       atol=1e-4, err_msg=msg)
        else:
            for t in range(T - 1):
                np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, trans[t])), xi_ref[t], rtol=1e-4,
                                           atol=1e-4, err_msg=msg)
            for t in range(T):
                np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, emit[t])), emit_ref[t], rtol=1e-4,
                                           atol=1e-4, err_msg=msg)

        # one EM step is the Baum-Welch update
        new = c.em_step(params, x, options=opts)
        if homogeneous:
            xs = xi_ref.sum(0)
            np.testing.assert_allclose(np.asarray(c.get_node_params(new, trans[0])), xs / xs.sum(1, keepdims=True),
                                       rtol=1e-4, atol=1e-6, err_msg=msg)
            es = emit_ref.sum(0)
            np.testing.assert_allclose(np.asarray(c.get_node_params(new, emit[0])), es / es.sum(1, keepdims=True),
                                       rtol=1e-4, atol=1e-6, err_msg=msg)
        np.testing.assert_allclose(np.asarray(c.get_node_params(new, root))[0], init_ref / B, rtol=1e-4, atol=1e-6,
                                   err_msg=msg)


@pytest.mark.slow
@pytest.mark.parametrize("chain_scan", [True, False])  # the chain's scan (the default), then the layers
@pytest.mark.full
def test_hmm_10000_steps_float32(chain_scan):
    """A 10,000-step HMM's log-likelihoods and flows in float32 against the float64 forward-backward."""
    T, L, V = 10_000, 6, 4
    rng = np.random.default_rng(0)
    alpha = rng.dirichlet(np.ones(L) * 2, L)
    beta = rng.dirichlet(np.ones(V), L)
    gamma = rng.dirichlet(np.ones(L))
    c = jaxpc.compile(structures.HMM(T, L, V, alpha=alpha, beta=beta, gamma=gamma))
    x = rng.integers(0, V, (2, T)).astype(np.int32)
    ll_ref, init_ref, xi_ref, emit_ref = forward_backward([alpha] * (T - 1), [beta] * T, gamma, x)
    assert ll_ref.min() < -10_000
    trans = _nodes(c, "trans")[0]
    opts = jaxpc.Options(chain_scan=chain_scan)
    ll = np.asarray(c.log_prob(c.params, x, options=opts), np.float64)
    assert np.all(np.isfinite(ll))
    np.testing.assert_allclose(ll, ll_ref, rtol=1e-5)
    fl = c.flows(c.params, x, options=opts)
    got = np.asarray(c.get_node_flows(fl, trans), np.float64)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, xi_ref.sum(0), rtol=2e-4, atol=1e-3)
    assert got.sum() == pytest.approx(2 * (T - 1), rel=1e-4)
