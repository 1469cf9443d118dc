"""EM variants, partial evaluation and HMM chains on the cases the other suites leave out, against exact float64
answers: hard EM's first-maximizer flows where every term ties (a top-down oracle over the children in node
order), tempered and GeneralLL flows through zero weights, impossible samples and zero sample weights at extreme
temperatures, TDP rescaling of tied sums and Gaussian leaves with missing values and sample weights, partial
evaluation over every subset of variables with missing values and repeated updates, and 500-step HMMs (both flow
paths) against the forward-backward and Viterbi recursions."""

import itertools

import jax
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions, structures

from . import oracle
from .random_circuits import Generator

# ---- hard (Viterbi) EM -------------------------------------------------------------------------------------------

def mpe_flows(c, params, x, weights, missing=None):
    """Hard EM's flows in float64 (:func:`oracle.flows` with ``hard``): the edge flows by source vector id (pooled
    over tied vectors) and the input node flows by node id."""
    edge, inputs, _ = oracle.flows(c, params, x, missing, weights, hard=True)
    return oracle.tied_edge_flows(c, edge), inputs


def untied_sums(c):
    return [ns for ns in c.nodes if ns.is_sum() and ns.source is ns
            and not any(m.is_tied() and m.source is ns for m in c.nodes)]


@pytest.mark.slow
@pytest.mark.full  # (in CI: test_em_variants.py's hard EM)
@pytest.mark.parametrize("seed", [0, 9])
def test_hard_em_of_tied_terms_takes_each_nodes_first_child(seed):
    """Max-product flows and hard EM's update on random circuits (tied sums and leaves, sparse edges) whose every
    weight and leaf probability is 1, so that every sum's terms tie: each flow goes to the node's first child, with
    sample weights; the trained parameters (no ties) too, and hard EM's update from them, with
    ``keep_zero_params`` and without."""
    gen = Generator(seed, 3, kinds=("categorical", "indicator"))
    c = jaxpc.compile(gen.circuit(), seed=seed)
    x = gen.sample_data(7)
    w = np.random.default_rng(seed).uniform(0.5, 2.0, 7)
    ones = jax.tree_util.tree_map(jax.numpy.zeros_like, c.params)  # every log-weight and log-probability 0
    hard = jaxpc.Options(propagation="MPE")
    for params in (ones, c.params):
        want, _ = mpe_flows(c, params, x, w)
        fl = c.flows(params, x.astype(np.int32), ll_weights=w, options=hard)
        for ns in c.nodes:
            if ns.is_sum() and ns.source is ns:
                np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, ns)), want[ns.id], rtol=1e-5, atol=1e-5)
    want, _ = mpe_flows(c, c.params, x, w)
    for keep in (False, True):
        new = c.em_step(c.params, x.astype(np.int32), ll_weights=w, step_size=0.6, pseudocount=0.2,
                        keep_zero_params=keep, options=hard)
        for ns in untied_sums(c):
            W = np.asarray(c.get_node_params(c.params, ns), np.float64)
            ref = oracle.em_sum_update(W, want[ns.id], oracle.edge_mask(ns), ns.ch_block_size, 0.6, 0.2)
            np.testing.assert_allclose(np.asarray(c.get_node_params(new, ns)), ref, rtol=1e-4, atol=1e-6)


# ---- tempered and GeneralLL flows through zero weights ---------------------------------------------------------

def zero_weight_circuit():
    """A sum over a sum over products of two categoricals, with zero weights and zero leaf probabilities: the
    batch has an impossible sample (x = [2, 1]), missing values and a sample of weight 0."""
    a = jaxpc.inputs(0, 1, 3, distributions.Categorical(3),
                     params=np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 1.0, 0.0]]))
    b = jaxpc.inputs(1, 1, 3, distributions.Categorical(2), params=np.array([[0.5, 0.5], [0.9, 0.1], [0.5, 0.5]]))
    inner = jaxpc.summate(jaxpc.multiply(a, b), num_nodes=2, params=np.array([[0.6, 0.0, 0.4], [0.0, 0.0, 1.0]]))
    root = jaxpc.summate(inner, num_nodes=1, params=np.array([[0.5, 0.5]]))
    x = np.array([[0, 0], [2, 1], [1, 0], [0, 1], [2, 0]], np.int32)
    miss = np.array([[False, False], [False, False], [True, False], [False, True], [False, False]])
    w = np.array([1.0, 2.0, 0.5, 1.5, 0.0])
    return jaxpc.compile(root), (a, inner, root), x, miss, w


@pytest.mark.slow
@pytest.mark.parametrize("log", [False, True], ids=["linear", "logspace"])
@pytest.mark.full
def test_tempered_and_general_ll_flows_through_zero_weights(log):
    """Tempered flows at temperatures far from 1 (0.01 to 50, each of the two alone and both), and GeneralLL flows
    at alpha 0.1 to 30, in linear and log space: the edge flows and the leaf counts equal the oracle's
    ``(w p)^(1/T)`` splits, zero weights get no flow (``-inf`` in log space), and EM with
    ``keep_zero_params`` from tempered flows keeps the zeros."""
    c, (a, inner, root), x, miss, w = zero_weight_circuit()
    xf = x.astype(np.float64)
    variants = [(dict(pflow_temperature=tp, eflow_temperature=te), dict(tp=tp, te=te))
                for tp, te in ((0.01, 1.0), (1.0, 0.01), (50.0, 50.0), (0.3, 7.0))]
    variants += [(dict(propagation="GeneralLL", alpha=al), dict(alpha=al)) for al in (0.1, 3.0, 30.0)]
    for opts, kw in variants:
        fl = c.flows(c.params, x, miss, ll_weights=w, options=jaxpc.Options(logspace_flows=log, **opts))
        edge, F, _ = oracle.flows(c, c.params, xf, miss, weights=w, **kw)
        counts = oracle.input_stats(a, c.get_node_params(c.params, a), xf, miss, F[a.id])
        for ns, want in ((root, edge[root.id]), (inner, edge[inner.id]), (a, counts)):
            got = np.asarray(c.get_node_flows(fl, ns), np.float64)
            if log:
                np.testing.assert_array_equal(np.isneginf(got), want == 0, err_msg=str(opts))
                got = np.exp(got)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=str(opts))
        assert np.asarray(edge[inner.id])[0, 1] == 0 and np.asarray(edge[inner.id])[1, :2].sum() == 0
    if not log:
        new = c.em_step(c.params, x, miss, ll_weights=w, pseudocount=0.3, keep_zero_params=True,
                        options=jaxpc.Options(pflow_temperature=0.5))
        edge, _, _ = oracle.flows(c, c.params, xf, miss, weights=w, tp=0.5)
        for ns in (root, inner):
            W = np.asarray(c.get_node_params(c.params, ns), np.float64)
            cnt = np.where(W > 0, edge[ns.id] + 0.3 / (W > 0).sum(1, keepdims=True), 0.0)
            np.testing.assert_allclose(np.asarray(c.get_node_params(new, ns)), cnt / cnt.sum(1, keepdims=True),
                                       rtol=1e-5, atol=1e-7)


# ---- TDP rescaling ----------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.full  # (in CI: test_em_variants.py's TDP rescaling)
@pytest.mark.parametrize("seed", [8, 5])
def test_tdp_rescaling_of_tied_sums_and_gaussian_leaves(seed):
    """``rescale="tdp"`` on circuits with tied sums and Gaussian leaves (the cases the closed-form test leaves
    out), with missing values: every source vector's new parameters, sums and leaves, are EM's update of
    ``s * flows / B + (1 - s) * TDP`` at step 1, the flows and TDP pooled over tied vectors."""
    gen = Generator(seed, 3, kinds=("categorical", "bernoulli", "gaussian"))
    c = jaxpc.compile(gen.circuit(), seed=seed)
    x = gen.sample_data(6)
    miss = np.random.default_rng(0).random(x.shape) < 0.3
    s, pc = 0.4, 0.05
    xin = x.astype(np.float32) if "gaussian" in gen.kinds else x.astype(np.int32)
    new = c.em_step(c.params, xin, miss, step_size=s, pseudocount=pc, rescale="tdp")
    sums, ins, _ = oracle.flow_totals(c, c.params, x, miss)
    tsums, tins, _ = oracle.flow_totals(c, c.params, np.zeros((1, 3)), np.ones((1, 3), bool))
    checked = 0
    for ns in c.nodes:
        if ns.source is not ns:
            continue
        if ns.is_sum():
            W = np.asarray(c.get_node_params(c.params, ns), np.float64)
            mixed = s * sums[ns.id] / 6 + (1 - s) * tsums[ns.id]
            ref = oracle.em_sum_update(W, mixed, oracle.edge_mask(ns), ns.ch_block_size, 1.0, pc)
            np.testing.assert_allclose(np.asarray(c.get_node_params(new, ns)), ref, rtol=1e-4, atol=1e-6)
            checked += 1
        elif ns.id in ins:
            st, ts = ins[ns.id], tins[ns.id]
            mixed = ({k: s * st[k] / 6 + (1 - s) * ts[k] for k in st} if isinstance(st, dict)
                     else s * st / 6 + (1 - s) * ts)
            ref = oracle.em_input_update(ns.dist, c.get_node_params(c.params, ns), mixed, 1.0, pc)
            got = c.get_node_params(new, ns)
            for k in (ref if isinstance(ref, dict) else [None]):
                np.testing.assert_allclose(np.asarray(got if k is None else got[k]), ref if k is None else ref[k],
                                           rtol=1e-4, atol=1e-5)
            checked += 1
    assert checked >= 4 and any(ns.is_tied() and ns.is_sum() for ns in c.nodes)


@pytest.mark.slow
def test_tdp_rescaling_at_odd_batches_with_weights_and_missing():
    """TDP's data term divides the flows by the batch's total weight (the number of samples without weights), at
    batch sizes 1 and 5 (padded to the next bucket inside)."""
    gen = Generator(4, 3, kinds=("categorical", "bernoulli"))
    c = jaxpc.compile(gen.circuit())
    s, pc = 0.3, 0.1
    tdp, _, _ = oracle.flows(c, c.params, np.zeros((1, 3)), np.ones((1, 3), bool))
    for B, weighted in ((1, False), (5, True), (5, False)):
        rng = np.random.default_rng(B)
        x = gen.sample_data(B)
        miss = rng.random(x.shape) < 0.3
        w = rng.uniform(0.5, 2.0, B) if weighted else None
        new = c.em_step(c.params, x.astype(np.int32), miss, step_size=s, pseudocount=pc, rescale="tdp", ll_weights=w)
        edge, _, _ = oracle.flows(c, c.params, x, miss, weights=w)
        total = B if w is None else w.sum()
        for ns in untied_sums(c):
            mask = oracle.edge_mask(ns)
            cnt = np.where(mask, s * edge[ns.id] / total + (1 - s) * tdp[ns.id] + pc / mask.sum(1, keepdims=True), 0)
            np.testing.assert_allclose(np.asarray(c.get_node_params(new, ns)), cnt / cnt.sum(1, keepdims=True),
                                       rtol=1e-4, atol=1e-6)


# ---- partial evaluation -----------------------------------------------------------------------------------------

def _subsets(n):
    return [list(s) for k in range(1, n + 1) for s in itertools.combinations(range(n), k)]


@pytest.mark.full
@pytest.mark.filterwarnings("ignore:jaxpc. 'partial' has been compiled for:RuntimeWarning")  # (one plan per subset)
@pytest.mark.parametrize("seed", [0, 9, 14])
def test_partial_evaluation_of_every_subset_with_missing_values(seed):
    """Partial evaluation chained over every subset of four variables (each update on top of the buffer the last
    returned, new values and new missing marks on the subset only), at batch sizes 1 and 5, on random circuits of
    every leaf kind: each log-likelihood equals the oracle's and the buffer equals ``node_values`` of the data."""
    gen = Generator(seed, 4)
    c = jaxpc.compile(gen.circuit(), seed=seed)
    cast = (lambda a: a.astype(np.float32)) if "gaussian" in gen.kinds else (lambda a: a.astype(np.int32))
    for B in (1, 5):
        rng = np.random.default_rng(seed + B)
        x = gen.sample_data(B)
        miss = rng.random(x.shape) < 0.3
        values = c.node_values(c.params, cast(x), miss)
        for vs in _subsets(4):
            x, miss = x.copy(), miss.copy()
            x[:, vs] = gen.sample_data(B)[:, vs]
            miss[:, vs] = rng.random((B, len(vs))) < 0.3
            ll, values = c.partial(vs).log_prob(c.params, cast(x), values, miss)
            _, want = oracle.forward(c, c.params, x, miss)
            np.testing.assert_allclose(np.asarray(ll), want, rtol=1e-4, atol=1e-4, err_msg=str(vs))
            np.testing.assert_allclose(np.asarray(values), np.asarray(c.node_values(c.params, cast(x), miss)),
                                       rtol=1e-5, atol=1e-5, err_msg=str(vs))


@pytest.mark.slow
@pytest.mark.full
def test_partial_evaluation_under_mpe_and_general_ll_and_missing_per_variable():
    """A plan re-evaluates under the propagation of its options (on a buffer of the same propagation), and takes
    ``missing`` as ``bool[V]``, each against the oracle."""
    gen = Generator(3, 4)
    c = jaxpc.compile(gen.circuit(), seed=3)
    x, other = gen.sample_data(5), gen.sample_data(5)
    plan = c.partial([1])
    nx = x.copy()
    nx[:, 1] = other[:, 1]
    for prop, alpha in (("MPE", None), ("GeneralLL", 1.7)):
        o = jaxpc.Options(propagation=prop, alpha=alpha)
        ll, _ = plan.log_prob(c.params, nx.astype(np.float32), c.node_values(c.params, x.astype(np.float32), options=o),
                              options=o)
        np.testing.assert_allclose(np.asarray(ll), oracle.forward(c, c.params, nx, mode=prop, alpha=alpha)[1],
                                   rtol=1e-5, atol=1e-5)
    m = np.array([False, True, False, False])
    ll, _ = plan.log_prob(c.params, nx.astype(np.float32), c.node_values(c.params, x.astype(np.float32)), m)
    np.testing.assert_allclose(np.asarray(ll), oracle.forward(c, c.params, nx, np.broadcast_to(m, nx.shape))[1],
                               rtol=1e-5, atol=1e-5)


def test_partial_evaluation_argument_errors():
    c = jaxpc.compile(structures.HMM(6, 2, 3), seed=1)
    x = np.zeros((3, 6), np.int32)
    values = c.node_values(c.params, x)
    plan = c.partial([2])
    bad = x.copy()
    bad[0, 2] = 7
    with pytest.raises(ValueError, match=r"x\[0, 2\] = 7 is out of range"):
        plan.log_prob(c.params, bad, values)
    with pytest.raises(ValueError, match=r"values must be the node buffer \[\d+, 2\]"):
        plan.log_prob(c.params, x[:2], values)
    with pytest.raises(ValueError, match=r"missing must have shape \[6\] or \[3, 6\]"):
        plan.log_prob(c.params, x, values, np.zeros((3, 5), bool))
    with pytest.raises(ValueError, match="x has 5 variables"):
        plan.log_prob(c.params, x[:, :5], values)
    with pytest.raises(TypeError, match="values must be the node buffer that circuit.node_values returns"):
        plan.log_prob(c.params, x, None)
    with pytest.raises(ValueError, match="needs at least one variable"):
        c.partial([])
    with pytest.raises(TypeError, match="variables must be a sequence"):
        c.partial(np.int64(3))
    assert c.partial([3, 3]).variables == (3,)


@pytest.mark.slow
def test_partial_evaluation_of_an_hmm_with_missing_values_over_repeated_updates():
    """An HMM's plans (first step, last step, a middle run, both ends, every step) chained on one buffer, values
    and missing marks changing: each equals the full log-likelihood."""
    T = 30
    c = jaxpc.compile(structures.HMM(T, 4, 5), seed=1)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5, (3, T)).astype(np.int32)
    miss = rng.random((3, T)) < 0.2
    values = c.node_values(c.params, x, miss)
    for vs in ([0], [T - 1], [5, 6, 20], [0, T - 1], list(range(T))):
        x, miss = x.copy(), miss.copy()
        x[:, vs] = rng.integers(0, 5, (3, len(vs)))
        miss[:, vs] = rng.random((3, len(vs))) < 0.5
        ll, values = c.partial(vs).log_prob(c.params, x, values, miss)
        np.testing.assert_allclose(np.asarray(ll), np.asarray(c.log_prob(c.params, x, miss)), rtol=1e-6, atol=1e-5)


# ---- HMM chains -------------------------------------------------------------------------------------------------

def forward_backward(alpha, beta, gamma, x, miss, w):
    """Scaled forward-backward of a homogeneous HMM with missing emissions (probability 1) and sample weights:
    ``(ll [B], initial counts [L], transition counts [L, L], emission counts [L, V])``, a missing emission
    counting its posterior times the emission probabilities."""
    B, T = x.shape
    em = np.where(miss[:, :, None], 1.0, np.stack([beta[:, x[:, t]].T for t in range(T)], 1))
    fwd, scale = np.zeros((B, T, len(gamma))), np.zeros((B, T))
    for t in range(T):
        a = gamma[None] * em[:, 0] if t == 0 else (fwd[:, t - 1] @ alpha) * em[:, t]
        scale[:, t] = a.sum(1)
        fwd[:, t] = a / scale[:, t:t + 1]
    bwd = np.ones_like(fwd)
    for t in range(T - 2, -1, -1):
        bwd[:, t] = ((em[:, t + 1] * bwd[:, t + 1]) @ alpha.T) / scale[:, t + 1:t + 2]
    post = fwd * bwd
    xi = sum(np.einsum("b,bi,ij,bj->ij", w, fwd[:, t], alpha, em[:, t + 1] * bwd[:, t + 1] / scale[:, t + 1:t + 2])
             for t in range(T - 1))
    ec = np.zeros(beta.shape)
    for b, t in np.ndindex(B, T):
        if miss[b, t]:
            ec += w[b] * post[b, t][:, None] * beta
        else:
            ec[:, x[b, t]] += w[b] * post[b, t]
    return np.log(scale).sum(1), (w[:, None] * post[:, 0]).sum(0), xi, ec


def _hmm_params(c):
    trans = next(ns for ns in c.nodes if ns.name.startswith("trans"))
    emit = next(ns for ns in c.nodes if ns.name.startswith("emit"))
    get = lambda ns: np.asarray(c.get_node_params(c.params, ns), np.float64)  # noqa: E731
    return trans, emit, get(trans), get(emit), get(c.root)[0]


def _hmm_cases(rng, L, V):
    a, b, g = rng.dirichlet(np.ones(L), L), rng.dirichlet(np.ones(V), L), rng.dirichlet(np.ones(L))
    near = np.eye(L) + 1e-6
    low = b.copy()
    low[:, 0] = 1e-7  # an emission near 0
    return {"random": (a, b, g), "identity": (np.eye(L), b, g), "near-deterministic": (near, b, g),
            "emission-near-0": (a, low / low.sum(1, keepdims=True), g)}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["random", "identity", "near-deterministic", "emission-near-0"])
def test_500_step_hmm_with_missing_values_and_weights(case):
    """A 500-step HMM in float32, by the chain's scan and layer by layer, against the float64 forward-backward:
    log-likelihoods and expected counts with no missing values, missing runs at the start and the end, missing
    values everywhere, and all but one value missing, with sample weights."""
    T, L, V, B = 500, 4, 5, 3
    rng = np.random.default_rng(0)
    a, b, g = _hmm_cases(rng, L, V)[case]
    c = jaxpc.compile(structures.HMM(T, L, V, alpha=a, beta=b, gamma=g, block_size=2))
    trans, emit, a64, b64, g64 = _hmm_params(c)
    x = rng.integers(0, V, (B, T)).astype(np.int32)
    w = np.array([1.0, 0.5, 2.0])
    patterns = {"none": np.zeros((B, T), bool), "start": np.arange(T)[None].repeat(B, 0) < 50,
                "end": np.arange(T)[None].repeat(B, 0) >= T - 50, "everywhere": rng.random((B, T)) < 0.5,
                "all-but-one": np.ones((B, T), bool)}
    patterns["all-but-one"][1, 3] = False
    for name, miss in patterns.items():
        ll_ref, init_ref, xi_ref, ec_ref = forward_backward(a64, b64, g64, x, miss, w)
        for chain_scan in (True, False):
            msg = f"{name}, chain_scan={chain_scan}"
            fl, ll = c.flows(c.params, x, miss, ll_weights=w, options=jaxpc.Options(chain_scan=chain_scan),
                             return_ll=True)
            np.testing.assert_allclose(np.asarray(ll, np.float64), ll_ref, rtol=1e-5, atol=1e-4, err_msg=msg)
            for ns, want in ((trans, xi_ref), (emit, ec_ref), (c.root, init_ref[None])):
                got = np.asarray(c.get_node_flows(fl, ns), np.float64)
                np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-3 + 2e-5 * want.sum(), err_msg=msg)


def viterbi(alpha, beta, gamma, x, miss):
    """Viterbi in float64 (first maximizers; a missing emission scores its largest probability): the best paths'
    log-probabilities ``[B]`` and the transition and observed-emission counts along them."""
    with np.errstate(divide="ignore"):
        la, lb, lg = np.log(alpha), np.log(beta), np.log(gamma)
    B, T = x.shape
    best, tc, ec = np.zeros(B), np.zeros(alpha.shape), np.zeros(beta.shape)
    for b in range(B):
        e = [np.where(miss[b, t], lb.max(1), lb[:, x[b, t]]) for t in range(T)]
        d, back = lg + e[0], []
        for t in range(1, T):
            sc = d[:, None] + la
            back.append(sc.argmax(0))
            d = sc.max(0) + e[t]
        best[b] = d.max()
        z = [int(d.argmax())]
        for bp in reversed(back):
            z.append(int(bp[z[-1]]))
        z = z[::-1]
        for t in range(T - 1):
            tc[z[t], z[t + 1]] += 1
        for t in range(T):
            if not miss[b, t]:
                ec[z[t], x[b, t]] += 1
    return best, tc, ec


@pytest.mark.slow
@pytest.mark.full  # (in CI: the shorter chains' Viterbi and log flows)
def test_500_step_hmm_viterbi_and_log_flows():
    """A 500-step HMM: max-product values and hard EM's transition counts against Viterbi (missing values at both
    ends and inside), emission counts without missing values, and log-space flows against the forward-backward."""
    T, L, V, B = 500, 4, 5, 3
    rng = np.random.default_rng(1)
    a, b, g = _hmm_cases(rng, L, V)["random"]
    c = jaxpc.compile(structures.HMM(T, L, V, alpha=a, beta=b, gamma=g, block_size=2))
    trans, emit, a64, b64, g64 = _hmm_params(c)
    x = rng.integers(0, V, (B, T)).astype(np.int32)
    miss = rng.random((B, T)) < 0.2
    miss[:, :5] = miss[:, -5:] = True
    hard = jaxpc.Options(propagation="MPE")
    best, tc, _ = viterbi(a64, b64, g64, x, miss)
    fl, ll = c.flows(c.params, x, miss, options=hard, return_ll=True)
    np.testing.assert_allclose(np.asarray(ll, np.float64), best, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, trans)), tc, atol=1e-3)
    none = np.zeros_like(miss)
    _, tc, ec = viterbi(a64, b64, g64, x, none)
    fl = c.flows(c.params, x, options=hard)
    np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, trans)), tc, atol=1e-3)
    np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, emit)), ec, atol=1e-3)
    w = np.array([1.0, 0.5, 2.0])
    _, _, xi_ref, ec_ref = forward_backward(a64, b64, g64, x, miss, w)
    lg = c.flows(c.params, x, miss, ll_weights=w, options=jaxpc.Options(logspace_flows=True))
    for ns, want in ((trans, xi_ref), (emit, ec_ref)):
        np.testing.assert_allclose(np.exp(np.asarray(c.get_node_flows(lg, ns, logspace=True), np.float64)), want,
                                   rtol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("flow", ["scan", "layers", "tempered", "general-ll", "log", "autodiff"])
def test_chain_impossible_samples_of_weight_zero_and_one_every_flow_variant(flow):
    """An untied HMM whose symbol 2 is never emitted, with impossible samples of weight 0 and 1 (at the first
    step and inside) among possible ones of weight 0, 1 and 2: every flow variant's flows are finite and equal
    the oracle's (the impossible samples add nothing), their log-likelihoods are ``-inf``, and EM's step stays
    finite."""
    rng = np.random.default_rng(0)
    T, L, V = 12, 4, 3
    beta = rng.dirichlet(np.ones(V), L)
    beta[:, 2] = 0
    beta /= beta.sum(1, keepdims=True)
    c = jaxpc.compile(structures.HMM(T, L, V, beta=beta, block_size=2, homogeneous=False), seed=2)
    x = rng.integers(0, 2, (5, T)).astype(np.int32)
    x[1, 7] = x[3, 0] = 2
    miss = rng.random(x.shape) < 0.2
    miss[1, 7] = miss[3, 0] = False
    w = np.array([1.0, 0.0, 2.0, 1.0, 0.0])
    opts, kw = {"scan": ({}, {}), "layers": ({"chain_scan": False}, {}),
                "tempered": ({"pflow_temperature": 0.5, "eflow_temperature": 1.5}, {"tp": 0.5, "te": 1.5}),
                "general-ll": ({"propagation": "GeneralLL", "alpha": 2.0}, {"alpha": 2.0}),
                "log": ({"logspace_flows": True}, {}), "autodiff": ({"backward": "autodiff"}, {})}[flow]
    o = jaxpc.Options(**opts)
    fl, ll = c.flows(c.params, x, miss, ll_weights=w, options=o, return_ll=True)
    assert np.isneginf(np.asarray(ll)[[1, 3]]).all() and np.isfinite(np.delete(np.asarray(ll), [1, 3])).all()
    edge, _, _ = oracle.flows(c, c.params, x.astype(np.float64), miss, weights=w, **kw)
    want = oracle.tied_edge_flows(c, edge)
    for ns in c.nodes:
        if ns.is_sum() and ns.source is ns:
            got = np.asarray(c.get_node_flows(fl, ns, logspace=flow == "log"), np.float64)
            if flow == "log":
                got = np.exp(got)
            np.testing.assert_allclose(got, want[ns.id], rtol=1e-4, atol=1e-5, err_msg=ns.name)
    if flow != "log":
        assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree_util.tree_leaves(fl))
        new = c.em_step(c.params, x, miss, ll_weights=w, options=o, pseudocount=0.1)
        assert all((np.isfinite(v) | np.isneginf(v)).all() for v in map(np.asarray, jax.tree_util.tree_leaves(new)))


@pytest.mark.full
def test_chain_node_flows_against_the_oracle():
    """``Options(node_flows=True)`` on HMM chains (tied and untied, categorical and Gaussian emissions), by the
    chain's scan and layer by layer, linear and in log space, with missing values and a sample of weight 0: each
    node total equals the oracle's."""
    from .test_flow_variants import dense_node_totals, oracle_totals

    rng = np.random.default_rng(0)
    T, L, V, B = 6, 4, 3, 5
    for homogeneous in (True, False):
        for gauss in (False, True):
            root = (structures.GeneralizedHMM(T, L, distributions.Gaussian(), homogeneous=homogeneous, block_size=2)
                    if gauss else structures.HMM(T, L, V, homogeneous=homogeneous, block_size=2))
            c = jaxpc.compile(root, seed=1)
            x = rng.normal(size=(B, T)).astype(np.float32) if gauss else rng.integers(0, V, (B, T)).astype(np.int32)
            miss = rng.random((B, T)) < 0.3
            w = rng.uniform(0, 2, B)
            w[0] = 0
            _, _, nodes = oracle_totals(c, x.astype(np.float64), miss, w)
            for chain_scan, log in ((True, False), (False, False)) + (() if gauss else ((True, True),)):
                fl = c.flows(c.params, x, miss, ll_weights=w,
                             options=jaxpc.Options(node_flows=True, chain_scan=chain_scan, logspace_flows=log))
                for ns in c.nodes:
                    if ns.source is not ns or not (ns.is_sum() or ns.id in nodes):
                        continue
                    mask = oracle.edge_mask(ns) if ns.is_sum() else np.ones(ns.num_nodes, bool)
                    got = dense_node_totals(c, fl["node"], ns)
                    np.testing.assert_allclose(np.exp(got[mask]) if log else got[mask], nodes[ns.id][mask],
                                               rtol=1e-4, atol=1e-5, err_msg=f"{ns.name} {chain_scan} {log}")


@pytest.mark.parametrize("log", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["linear", "logspace"])
def test_hard_em_counts_the_decoded_value_of_a_missing_variable(log):
    """Hard EM counts the max-product induced tree, leaves included: a missing categorical counts its node's flow
    at the node's first most probable value (the value ``mpe`` decodes), not spread over its probabilities; a
    missing Gaussian counts its mean (second moment ``mu^2``, no variance). Observed values count as in soft EM.
    The update from these counts is hard EM's."""
    a = jaxpc.inputs(0, 1, 2, distributions.Categorical(3), params=np.array([[0.2, 0.5, 0.3], [0.4, 0.2, 0.4]]))
    b = jaxpc.inputs(1, 1, 2, distributions.Categorical(2), params=np.array([[0.3, 0.7], [0.8, 0.2]]))
    root = jaxpc.summate(jaxpc.multiply(a, b), num_nodes=1, params=np.array([[0.45, 0.55]]))
    c = jaxpc.compile(root)
    x = np.array([[0, 1], [0, 0], [2, 1], [1, 0]], np.int32)
    miss = np.array([[True, False], [True, False], [False, False], [True, True]])
    w = np.array([1.0, 2.0, 0.5, 1.5])
    hard = jaxpc.Options(propagation="MPE", logspace_flows=log)
    fl = c.flows(c.params, x, miss, ll_weights=w, options=hard)
    _, F = mpe_flows(c, c.params, x.astype(np.float64), w, miss)
    wants = {}
    for ns in (a, b):
        P = np.asarray(c.get_node_params(c.params, ns), np.float64)
        want = np.zeros_like(P)
        for i, s in np.ndindex(ns.num_nodes, x.shape[0]):
            want[i, int(np.argmax(P[i])) if miss[s, ns.var] else x[s, ns.var]] += F[ns.id][i, s]
        wants[ns.id] = want
        got = np.asarray(c.get_node_flows(fl, ns), np.float64)
        np.testing.assert_allclose(np.exp(got) if log else got, want, rtol=1e-5, atol=1e-6)
    if not log:
        new = c.em_step(c.params, x, miss, ll_weights=w, options=hard)
        for ns in (a, b):
            np.testing.assert_allclose(np.asarray(c.get_node_params(new, ns)),
                                       wants[ns.id] / wants[ns.id].sum(1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_hard_em_counts_the_mean_of_a_missing_gaussian():
    """Hard EM's statistics of a missing Gaussian are those of its mean, the value the max-product decoding takes:
    ``s1 += F mu``, ``s2 += F mu^2`` (no variance); observed values count as in soft EM."""
    mu = np.array([-1.0, 2.0])
    g = jaxpc.inputs(0, 1, 2, distributions.Gaussian(), params={"mu": mu, "sigma": np.array([0.5, 1.5])})
    h = jaxpc.inputs(1, 1, 2, distributions.Categorical(2), params=np.array([[0.3, 0.7], [0.8, 0.2]]))
    c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(g, h), num_nodes=1, params=np.array([[0.45, 0.55]])))
    x = np.array([[0.3, 1], [0.0, 0], [-2.0, 1], [0.0, 0]], np.float32)
    miss = np.array([[True, False], [True, False], [False, False], [True, True]])
    w = np.array([1.0, 2.0, 0.5, 1.5])
    fl = c.flows(c.params, x, miss, ll_weights=w, options=jaxpc.Options(propagation="MPE"))
    _, F = mpe_flows(c, c.params, x.astype(np.float64), w, miss)
    vals = np.where(miss[:, 0][None, :], mu[:, None], x[:, 0][None, :])
    got = c.get_node_flows(fl, g)
    np.testing.assert_allclose(np.asarray(got["s0"]), F[g.id].sum(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got["s1"]), (F[g.id] * vals).sum(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got["s2"]), (F[g.id] * vals ** 2).sum(1), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_log_flows_refuse_negative_weights():
    """Log-space flows need non-negative sample weights (a negative weight makes negative counts, which have no
    logarithm): a negative one is a ``ValueError`` naming it, from host weights at once and from device weights
    under ``validate="sync"``, in ``flows`` and ``parallel.flows``; linear flows still take it."""
    import jax.numpy as jnp

    c = jaxpc.compile(structures.HMM(4, 2, 3), seed=1)
    x = np.zeros((4, 4), np.int32)
    w = np.array([1.0, -0.5, 2.0, 1.0])
    log = jaxpc.Options(logspace_flows=True)
    match = r"ll_weights of log-space flows .*must be >= 0 .*ll_weights\[1\] is -0.5"
    with pytest.raises(ValueError, match=match):
        c.flows(c.params, x, ll_weights=w, options=log)
    with pytest.raises(ValueError, match=match):
        c.flows(c.params, x, ll_weights=jnp.asarray(w), options=log, validate="sync")
    with pytest.raises(ValueError, match=match):
        jaxpc.parallel.flows(c, c.params, x, ll_weights=w, options=log)
    fl = c.flows(c.params, x, ll_weights=w)
    assert np.isfinite(np.asarray(c.get_node_flows(fl, c.root))).all()
