"""Queries against brute-force enumeration (float64 numpy) and exact sampling distributions."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jaxpc
from jaxpc import distributions, queries, structures

from . import oracle
from .conftest import assert_same_result
from .random_circuits import CARD, Generator
from .test_bruteforce import deterministic_circuit
from .tiers import cases

DISCRETE = ("categorical", "bernoulli", "masked", "indicator", "literal", "logistic")
# random circuits of 3 or 4 discrete variables: 2 in the fast tier; with 1 and 7 they hold tied sums and inputs,
# sparse edges, block sizes 1-4, sums over sums, products of three and dense and blockwise partitions of fan-ins 1-6,
# and every discrete leaf
SEEDS = [2, 1, 7]


def make(seed):
    gen = Generator(100 + seed, num_vars=3 + seed % 2, kinds=DISCRETE)
    c = jaxpc.compile(gen.circuit(), seed=seed)
    x, _ = gen.all_assignments()
    return gen, c, x.astype(np.int32)


@pytest.fixture(scope="module", params=cases(SEEDS, fast=[2]))
def case(request):
    return make(request.param)


def joint(c, x):
    _, ll = oracle.forward(c, c.params, x)
    return np.exp(ll)


def test_generator_has_blocks_and_ties():
    tied, bs = 0, set()
    for s in SEEDS:
        _, c, _ = make(s)
        tied += sum(ns.is_tied() for ns in c.nodes)
        bs |= {ns.block_size for ns in c.nodes}
    assert tied > 0 and max(bs) > 1


def test_marginals_hard_and_soft(case):
    gen, c, x = case
    p = joint(c, x)
    rng = np.random.default_rng(0)
    B = 7
    ev = x[rng.integers(0, len(x), B)]
    miss = rng.random(ev.shape) < 0.5
    expect = []
    for b in range(B):
        keep = np.all((x == ev[b]) | miss[b], axis=1)
        expect.append(np.log(p[keep].sum()))
    got = queries.marginal(c, c.params, ev, miss)
    np.testing.assert_allclose(np.asarray(got), expect, rtol=1e-5, atol=1e-5)
    # soft evidence: arbitrary per-value weights, checked against the weighted sum over assignments
    K = int(max(CARD[k] for k in gen.kinds))
    q = rng.random((B, x.shape[1], K))
    weights = np.ones((B, len(x)))
    for v in range(x.shape[1]):
        weights *= q[:, v, :][:, x[:, v]]
    expect_soft = np.log(weights @ p)
    got_soft = c.marginal(c.params, soft_evidence=q)
    np.testing.assert_allclose(np.asarray(got_soft), expect_soft, rtol=1e-5, atol=1e-5)
    # one-hot soft evidence with ones on missing variables is the hard marginal
    onehot = np.where(miss[:, :, None], 1.0, np.eye(K)[ev])
    np.testing.assert_allclose(np.asarray(c.marginal(c.params, soft_evidence=onehot)), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the derivatives' executables (a Hessian among them)
def test_soft_evidence_gradient_where_weights_are_zero():
    """``d log Z / d q[v, k] = Z(x_v = k) / Z``, finite where ``q`` is 0 (one-hot evidence, a masked softmax that
    underflows): checked against the enumerated joint for ``marginal``, the Flax module and a second derivative;
    values past a variable's own range get 0, and max-product's derivative is the indicator of the maximizer."""
    a = jaxpc.inputs(0, num_node_blocks=2, block_size=2, dist=distributions.Categorical(num_cats=3))
    b = jaxpc.inputs(1, num_node_blocks=2, block_size=2, dist=distributions.Categorical(num_cats=4))
    c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=1, block_size=1), seed=2)
    xs = np.array(list(itertools.product(range(3), range(4))), np.int32)
    P = np.exp(np.asarray(c.log_prob(c.params, xs), np.float64)).reshape(3, 4)
    q = np.zeros((1, 2, 4), np.float32)
    q[0, 0, 1] = q[0, 1, 2] = 1.0  # hard evidence x = (1, 2) as one-hot weights
    want = np.zeros((2, 4))
    want[0, :3], want[1] = P[:, 2] / P[1, 2], P[1, :] / P[1, 2]
    # (each derivative in one jitted program: op by op, every operation would compile)
    g = jax.jit(jax.grad(lambda q: c.marginal(c.params, soft_evidence=q).sum()))(jnp.asarray(q))
    np.testing.assert_allclose(np.asarray(g)[0], want, rtol=1e-5)
    pytest.importorskip("flax")
    from jaxpc import nn
    m = nn.CircuitModule(c, normalize=False)
    np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(lambda q: m(soft_evidence=q).sum()))(jnp.asarray(q)))[0],
                               want, rtol=1e-5)
    # d2 log Z / dq[0, k] dq[1, j] = P[k, j] / Z - want[0, k] want[1, j]
    h = np.asarray(jax.jit(jax.hessian(lambda q: c.marginal(c.params, soft_evidence=q).sum()))(jnp.asarray(q)))
    np.testing.assert_allclose(h[0, 0, :3, 0, 1], P / P[1, 2] - np.outer(want[0, :3], want[1]), rtol=1e-4,
                               atol=1e-6)
    mpe = jax.jit(jax.grad(lambda q: c.marginal(c.params, soft_evidence=q, propagation="MPE").sum()))(jnp.asarray(q))
    np.testing.assert_array_equal(np.asarray(mpe)[0], q[0])  # d max / d q at the one-hot maximizer: 1 / q = 1


@pytest.mark.slow
@pytest.mark.parametrize("seed", [5])
def test_soft_evidence_gradient_is_finite_difference(seed):
    gen, c, x = make(seed)
    K = int(max(CARD[k] for k in gen.kinds))
    rng = np.random.default_rng(1)
    q = rng.uniform(0.2, 1.0, (2, x.shape[1], K))

    def f(qq):
        return jnp.sum(queries.marginal(c, c.params, soft_evidence=qq))

    g = np.asarray(jax.jit(jax.grad(f))(jnp.asarray(q, jnp.float32)))  # jit: no op-by-op autodiff
    i = (1, x.shape[1] - 1, 1)
    h = 1e-3
    qp, qm = q.copy(), q.copy()
    qp[i] += h
    qm[i] -= h
    fd = (float(f(jnp.asarray(qp, jnp.float32))) - float(f(jnp.asarray(qm, jnp.float32)))) / (2 * h)
    assert g[i] == pytest.approx(fd, rel=2e-2, abs=2e-3)


@pytest.mark.slow  # (the slow tier runs its first case)
def test_conditionals(case):
    gen, c, x = case
    _check_conditionals(c, x, int(max(CARD[k] for k in gen.kinds)))


@pytest.mark.parametrize("structure", cases(["hclt", "hmm"], fast=[]))
def test_conditionals_of_latent_vectors_per_variable(structure):
    """Input layers of a vector of latents per variable (``InputLayerSpec.run``: an inhomogeneous HMM's emissions, an
    HCLT's leaves) take each variable's conditional as one product per run: against enumeration as the general
    layers are."""
    cat = distributions.Categorical(num_cats=3)
    if structure == "hmm":
        c = jaxpc.compile(structures.HMM(4, 3, 3, homogeneous=False), seed=1)
    else:
        data = np.random.default_rng(0).integers(0, 3, (200, 4))
        c = jaxpc.compile(structures.HCLT(data, num_latents=4, input_dist=cat), seed=1)
    assert any(spec.run > 1 for spec in c.layout.input_layers)
    x = np.array(list(itertools.product(range(3), repeat=4)), np.int32)
    _check_conditionals(c, x, 3)


def _check_conditionals(c, x, K):
    """``c.conditional`` against enumeration over ``x`` (every assignment), with random evidence and masks."""
    p = joint(c, x)
    rng = np.random.default_rng(2)
    B = 6
    ev = x[rng.integers(0, len(x), B)]
    miss = rng.random(ev.shape) < 0.6
    miss[:, 0] = True
    got = np.asarray(c.conditional(c.params, ev, miss))
    assert got.shape == (B, x.shape[1], K)
    for b in range(B):
        keep = np.all((x == ev[b]) | miss[b], axis=1)
        pe = p[keep].sum()
        for v in range(x.shape[1]):
            if miss[b, v]:
                ref = np.array([p[keep & (x[:, v] == k)].sum() for k in range(K)]) / pe
            else:
                ref = np.eye(K)[ev[b, v]]
            np.testing.assert_allclose(got[b, v], ref, rtol=1e-4, atol=1e-5)
    V = x.shape[1]
    for targets in ([V - 1, 0], np.array([V - 1, 0], np.int64), [0, V - 1], [V - 1], None):  # each set its own
        sub = np.asarray(queries.conditional(c, c.params, ev, miss, target_vars=targets))  # device constant
        want = got if targets is None else got[:, np.asarray(targets)]
        np.testing.assert_allclose(sub, want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # conditional, sample and mpe executables
def test_variables_no_leaf_reads():
    """A variable between the ones leaves read: conditioning it raises naming it, as a named target or one of the
    default ones (it has no distribution); sampling and MPE keep its entry of ``x``; the others are exact."""
    cat = distributions.Categorical(num_cats=3)
    a = jaxpc.inputs(0, num_node_blocks=2, block_size=2, dist=cat)
    b = jaxpc.inputs(2, num_node_blocks=2, block_size=2, dist=cat)
    c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=1, block_size=1), seed=3)
    assert c.num_vars == 3
    pairs = np.array(list(itertools.product(range(3), repeat=2)), np.int32)
    p = np.exp(np.asarray(c.log_prob(c.params, np.stack([pairs[:, 0], pairs[:, 0] * 0, pairs[:, 1]], 1)), np.float64))
    ev = np.array([[1, 2, 0], [2, 0, 1]], np.int32)
    miss = np.array([False, True, True])
    got = np.asarray(c.conditional(c.params, ev, miss, target_vars=[0, 2]))
    np.testing.assert_array_equal(got[:, 0], np.eye(3)[ev[:, 0]])
    for r in range(2):
        ref = p[pairs[:, 0] == ev[r, 0]]
        np.testing.assert_allclose(got[r, 1], ref / ref.sum(), rtol=1e-5)
    with pytest.raises(ValueError, match="no leaf reads variable 1"):
        c.conditional(c.params, ev, miss, target_vars=[2, 1])
    for m in (miss, ~miss):  # default targets, the unread variable missing or observed
        with pytest.raises(ValueError, match=r"no leaf reads variable 1 .*without target_vars.*read: \[0, 2\]"):
            c.conditional(c.params, ev, m)
    drawn = np.asarray(c.sample(c.params, jax.random.key(0), x=ev, missing=miss))
    decoded = np.asarray(c.mpe(c.params, ev, miss)[0])
    np.testing.assert_array_equal(drawn[:, 1], ev[:, 1])
    np.testing.assert_array_equal(decoded[:, 1], ev[:, 1])


@pytest.mark.slow  # sample and mpe executables of two circuits
def test_samples_under_evidence_of_probability_zero_are_marked():
    """A row whose evidence has probability 0 has nothing to draw or decode: its missing entries read -1 (NaN for
    float samples) in ``sample`` and ``mpe``, its observed ones stay; the other rows as before. MPE's value is
    -inf."""
    cat = distributions.Categorical(num_cats=3)
    a = jaxpc.inputs(0, num_node_blocks=1, block_size=2, dist=cat)
    b = jaxpc.inputs(1, num_node_blocks=1, block_size=2, dist=cat)
    g = jaxpc.inputs(2, num_node_blocks=1, block_size=2, dist=distributions.Gaussian())
    for leaves, dtype in (((a, b), np.int32), ((a, b, g), np.float32)):
        c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(*leaves), num_node_blocks=1, block_size=1), seed=3)
        lp = c.params["input"]["categorical"]["log_probs"].at[0:2, 2].set(-jnp.inf)  # variable 0 never reads 2
        params = {**c.params, "input": {**c.params["input"], "categorical": {"log_probs": lp}}}
        x = np.zeros((3, len(leaves)), dtype)
        x[:, 0] = [2, 1, 2]
        miss = np.array([[False, True] + [True] * (len(leaves) - 2)] * 2 + [[True] * len(leaves)])
        drawn = np.asarray(c.sample(params, jax.random.key(0), x=x, missing=miss))
        assert drawn.dtype == dtype
        mark = np.isnan(drawn[0, 1:]) if dtype == np.float32 else drawn[0, 1:] == -1
        assert mark.all() and drawn[0, 0] == 2
        assert drawn[1, 0] == 1 and np.all(drawn[1, 1:2] >= 0) and not np.isnan(drawn[1]).any()
        assert drawn[2, 0] in (0, 1) and drawn[2, 1] >= 0 and not np.isnan(drawn[2]).any()
        decoded, value = (np.asarray(a) for a in c.mpe(params, x, miss))
        assert value[0] == -np.inf and np.isfinite(value[1:]).all() and decoded[0, 0] == 2
        assert (np.isnan(decoded[0, 1:]) if dtype == np.float32 else decoded[0, 1:] == -1).all()
        assert decoded[1, 0] == 1 and not (decoded[1:] == -1).any() and not np.isnan(decoded[1:]).any()


@pytest.mark.slow  # (the slow tier runs its first case)
def test_mpe_decoding_and_value(case):
    gen, c, x = case
    rng = np.random.default_rng(3)
    B = 5
    ev = x[rng.integers(0, len(x), B)]
    miss = rng.random(ev.shape) < 0.5
    miss[0] = True  # one fully unobserved row: unconditional MPE
    assign, value = c.mpe(c.params, ev, miss)
    assign, value = np.asarray(assign), np.asarray(value)
    # brute force: max over completions of the max-product value with full evidence
    mp_all = np.asarray(c.log_prob(c.params, x, propagation="MPE"), np.float64)
    for b in range(B):
        keep = np.all((x == ev[b]) | miss[b], axis=1)
        assert value[b] == pytest.approx(mp_all[keep].max(), abs=1e-5)
        assert np.all(assign[b][~miss[b]] == ev[b][~miss[b]])
    # the assignment attains the value
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, assign, propagation="MPE")), value, atol=1e-5)
    # conditional MPE with a [V] mask and without evidence
    a0, v0 = c.mpe(c.params)
    assert float(v0[0]) == pytest.approx(mp_all.max(), abs=1e-5)


@pytest.mark.slow  # (the slow tier runs its first case)
@pytest.mark.parametrize("seed", range(3))
def test_mpe_is_exact_map_on_deterministic_circuits(seed):
    c = jaxpc.compile(deterministic_circuit(seed))
    x = np.asarray(list(itertools.product(range(3), repeat=4)), dtype=np.int32)
    ll = np.asarray(c.log_prob(c.params, x), np.float64)
    assign, value = c.mpe(c.params)
    assert float(value[0]) == pytest.approx(ll.max(), abs=1e-5)
    np.testing.assert_array_equal(np.asarray(assign[0]), x[np.argmax(ll)])
    miss = np.array([False, True, False, True])
    for row in (x[0], x[40], x[77]):
        a, v = c.mpe(c.params, row[None], miss)
        keep = np.all((x == row) | miss, axis=1)
        assert float(v[0]) == pytest.approx(ll[keep].max(), abs=1e-5)
        np.testing.assert_array_equal(np.asarray(a[0]), x[keep][np.argmax(ll[keep])])


def viterbi(alpha, beta, gamma, x, miss):
    """max over z and missing x of log p(z, x); returns (value, decoded x)."""
    T = x.shape[0]
    lb = np.log(beta)
    em = np.where(miss[:, None], lb.max(1)[None, :], lb[:, x].T)  # [T, L]
    arg_em = lb.argmax(1)
    d = np.log(gamma) + em[0]
    back = []
    for t in range(1, T):
        s = d[:, None] + np.log(alpha)
        back.append(s.argmax(0))
        d = s.max(0) + em[t]
    z = [int(d.argmax())]
    for bp in reversed(back):
        z.append(int(bp[z[-1]]))
    z = z[::-1]
    dec = np.where(miss, arg_em[z], x)
    return d.max(), dec


def test_hmm_mpe_is_viterbi():
    rng = np.random.default_rng(4)
    T, L, V = 8, 4, 5
    alpha, beta, gamma = rng.dirichlet(np.ones(L), L), rng.dirichlet(np.ones(V), L), rng.dirichlet(np.ones(L))
    c = jaxpc.compile(structures.HMM(T, L, V, alpha=alpha, beta=beta, gamma=gamma, block_size=2))
    x = rng.integers(0, V, (6, T)).astype(np.int32)
    miss = rng.random((6, T)) < 0.4
    assign, value = c.mpe(c.params, x, miss)
    for b in range(6):
        ref_v, ref_x = viterbi(alpha, beta, gamma, x[b], miss[b])
        assert float(value[b]) == pytest.approx(ref_v, abs=1e-4)
        np.testing.assert_array_equal(np.asarray(assign[b]), ref_x)


# ---------------------------------------------------------------------------------------------
# sampling: chi-square goodness of fit with 100,000 samples
# ---------------------------------------------------------------------------------------------

def _chi_square(samples, x_all, probs):
    idx = {tuple(r): i for i, r in enumerate(x_all)}
    counts = np.zeros(len(x_all))
    for r, n in zip(*np.unique(samples, axis=0, return_counts=True)):
        assert tuple(r) in idx, f"sampled an impossible assignment {r}"
        counts[idx[tuple(r)]] += n
    assert np.all(counts[probs == 0] == 0)
    pos = probs > 0
    return stats.chisquare(counts[pos], probs[pos] / probs[pos].sum() * counts.sum()).pvalue


def _sampling_circuits():
    rng = np.random.default_rng(5)
    T, V = 3, 3
    hmms = {name: structures.HMM(T, L, V, alpha=rng.dirichlet(np.ones(L), L), beta=rng.dirichlet(np.ones(V), L),
                                 gamma=rng.dirichlet(np.ones(L))) for name, L in (("hmm", 3), ("hmm12", 12))}
    gen = Generator(7, num_vars=3, kinds=DISCRETE)
    pd = structures.PD((2, 2), 4, split_intervals=1, input_dist=distributions.Categorical(3), block_size=2)
    return {**hmms, "random": gen.circuit(), "pd": pd}


@pytest.fixture(scope="module")
def sampling_circuit():
    """The sampling circuits, each compiled once (seed 1) for the tests that draw from it: they share its
    executables (none of them counts compiles)."""
    roots, made = {}, {}

    def get(name):
        if name not in made:
            if not roots:  # the node graphs, built once
                roots.update(_sampling_circuits())
            made[name] = jaxpc.compile(roots[name], seed=1)
        return made[name]

    return get


def test_sampled_child_follows_the_reached_parents_posterior():
    """A sum partition's sampled choice for each sample uses the weights of the parent that sample reaches: with
    parent 0 for half the samples and parent 2 for the other half, each half's draws follow ``exp(log w_k +
    value)`` normalized over the 12 children for its own parent ``k``, an impossible child never."""
    from jaxpc.engine import select

    rng = np.random.default_rng(0)
    C, Kp, B = 12, 3, 40_000
    lw = np.log(rng.dirichlet(np.ones(C), size=Kp))  # [Kp, C]
    x = rng.normal(size=C)
    x[5] = -np.inf
    values = jnp.broadcast_to(jnp.asarray(x, jnp.float32)[:, None], (C, B))
    logw = jnp.asarray(lw.T[:, :, None], jnp.float32)  # [C, Kp, 1]: one parameter block per child
    ch = pid = jnp.arange(C, dtype=jnp.int32)[None]
    parent = jnp.asarray(np.repeat([0, 2], B // 2)[None], jnp.int32)
    counts = jnp.zeros((1, Kp, B)).at[0, parent[0], jnp.arange(B)].set(1.0)
    k, w = select.reached_parents(counts)
    np.testing.assert_array_equal(np.asarray(k), np.asarray(parent))
    assert np.all(np.asarray(w) == 1.0)
    (rows,) = jax.jit(select.chosen_children, static_argnames=("Kc", "dense"))(
        values, ch, pid, logw, k, Kc=1, dense=False, key=jax.random.key(0))  # one term: an unfolded table
    rows = np.asarray(rows)
    assert rows.shape == (1, B)
    for half, kp in ((rows[0, :B // 2], 0), (rows[0, B // 2:], 2)):  # (child c sits on row c)
        assert _chi_square(half[:, None], np.arange(C)[:, None], np.exp(lw[kp] + x)) > 1e-3


def test_leaf_choice_writes_distinct_runs_as_the_scatter_max_does():
    """A layer whose runs each hold a variable of their own writes each run's reached leaf (``distinct_runs``);
    the same reached counts give the same choice through the scatter-max over variables, and -1 where no leaf of a
    variable is reached."""
    from jaxpc.engine import select

    data = np.random.default_rng(0).integers(0, 3, (200, 9))
    c = jaxpc.compile(structures.HCLT(data, num_latents=4, input_dist=distributions.Categorical(3)))
    (spec,) = c.layout.input_layers
    assert spec.run == 4 and spec.distinct_runs
    rng = np.random.default_rng(1)
    B, V = 6, c.layout.num_vars
    pick = rng.integers(0, spec.run, (V, B))
    reached = np.zeros((spec.num_nodes, B), np.float32)
    run_var = np.asarray(c.tables["inputs"][0]["vars"])[::spec.run]
    for i, v in enumerate(run_var):
        reached[i * spec.run + pick[v], np.arange(B)] = 1.0
    reached[:, 0] = 0.0  # a sample that reaches no leaf
    got = select.leaf_choice(c.layout, c.tables, [jnp.asarray(reached)], V)[0]
    scatter = dataclasses.replace(c.layout, input_layers=(dataclasses.replace(spec, distinct_runs=False),))
    ref = select.leaf_choice(scatter, c.tables, [jnp.asarray(reached)], V)[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    assert np.all(np.asarray(got)[:, 0] == -1) and np.all(np.asarray(got)[:, 1:] >= 0)


@pytest.mark.parametrize("name", ["hmm12", "hmm", "random", "pd"])
@pytest.mark.slow
def test_sampling_matches_exact_distribution(name, sampling_circuit):
    c = sampling_circuit(name)
    cards = [int(k) for k in c.runtime.var_info.card]
    x_all = np.asarray(list(itertools.product(*[range(k) for k in cards])), dtype=np.int32)
    p = joint(c, x_all)
    n = 20_000
    s = np.asarray(c.sample(c.params, jax.random.key(0), n))
    assert s.shape == (n, c.num_vars) and s.dtype == np.int32
    assert _chi_square(s, x_all, p) > 1e-3
    # conditional: fix variable 0, sample the rest
    v0 = int(x_all[np.argmax(p), 0])
    ev = np.zeros((n, c.num_vars), np.int32)
    ev[:, 0] = v0
    miss = np.ones(c.num_vars, bool)
    miss[0] = False
    sc = np.asarray(c.sample(c.params, jax.random.key(1), x=ev, missing=miss))
    assert np.all(sc[:, 0] == v0)
    cond = np.where(x_all[:, 0] == v0, p, 0.0)
    assert _chi_square(sc, x_all, cond) > 1e-3


def test_sampling_is_pure_and_keyed(sampling_circuit):
    c = sampling_circuit("hmm")  # (9 samples: the padded bucket of 16 the next test draws from too)
    a = np.asarray(c.sample(c.params, jax.random.key(3), 9))
    b = np.asarray(c.sample(c.params, jax.random.key(3), 9))
    d = np.asarray(c.sample(c.params, jax.random.key(4), 9))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, d)


@pytest.mark.slow  # six sample executables per circuit
@pytest.mark.parametrize("name", ["hmm", "pd"])
def test_a_rows_sample_does_not_depend_on_the_batch_size_or_jit(name, sampling_circuit):
    """Row b's draw depends on the key, b and its evidence only: the same under other batch sizes (other padded
    buckets), inside ``jax.jit`` (no padding) and unconditionally (``sample(key, 5) == sample(key, 9)[:5]``)."""
    c = sampling_circuit(name)
    k = jax.random.key(7)
    np.testing.assert_array_equal(np.asarray(c.sample(c.params, k, 5)), np.asarray(c.sample(c.params, k, 9))[:5])
    card = int(c.runtime.var_info.card.min())
    x = np.random.default_rng(0).integers(0, card, (17, c.num_vars)).astype(np.int32)
    m = np.arange(c.num_vars) >= c.num_vars // 2
    rows = [np.asarray(c.sample(c.params, k, x=x[:n], missing=m)) for n in (6, 9, 17)]
    np.testing.assert_array_equal(rows[0], rows[1][:6])
    np.testing.assert_array_equal(rows[1], rows[2][:9])
    jitted = jax.jit(lambda x: c.sample(c.params, k, x=x, missing=m))(jnp.asarray(x[:6]))
    np.testing.assert_array_equal(np.asarray(jitted), rows[0])


@pytest.mark.slow  # 100,000 samples
def test_continuous_samples_and_modes():
    g = jaxpc.inputs(0, 2, dist=distributions.Gaussian(),
                     params={"mu": np.array([-3.0, 4.0]), "sigma": np.array([0.5, 1.0])})
    b = jaxpc.inputs(1, 2, dist=distributions.Categorical(2), params=np.array([[0.9, 0.1], [0.2, 0.8]]))
    root = jaxpc.summate(jaxpc.multiply(g, b), num_nodes=1, params=np.array([[0.3, 0.7]]))
    c = jaxpc.compile(root)
    s = np.asarray(c.sample(c.params, jax.random.key(0), 100_000))
    assert s.dtype == np.float32
    first = s[:, 0] < 0.5
    assert first.mean() == pytest.approx(0.3, abs=0.01)
    assert s[first, 0].mean() == pytest.approx(-3.0, abs=0.02) and s[first, 0].std() == pytest.approx(0.5, abs=0.02)
    assert s[first, 1].mean() == pytest.approx(0.1, abs=0.01)
    assign, value = c.mpe(c.params)
    np.testing.assert_allclose(np.asarray(assign[0]), [4.0, 1.0])
    # conditionals: every variable by default, the continuous one's row 0; p(b | g) from the two components
    x = np.array([[-3.0, 0.0], [4.0, 1.0]], np.float32)
    cond = np.asarray(c.conditional(c.params, x, np.array([False, True])))
    np.testing.assert_array_equal(cond[:, 0], 0)
    for r, g0 in enumerate(x[:, 0]):
        w = np.array([0.3, 0.7]) * stats.norm.pdf(g0, [-3.0, 4.0], [0.5, 1.0])
        want = w @ np.array([[0.9, 0.1], [0.2, 0.8]]) / w.sum()
        np.testing.assert_allclose(cond[r, 1], want, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="variable 0 is continuous"):
        c.conditional(c.params, x, np.array([False, True]), target_vars=[1, 0])


@pytest.mark.slow
@pytest.mark.full
def test_queries_jit_and_vmap_over_params():
    c = jaxpc.compile(structures.HMM(4, 3, 3))
    keys = jax.random.split(jax.random.key(0), 3)
    stacked = jax.vmap(c.init_params)(keys)
    x = np.random.default_rng(0).integers(0, 3, (5, 4)).astype(np.int32)
    miss = np.array([False, True, False, True])
    for fn in (lambda p: c.marginal(p, x, miss), lambda p: c.conditional(p, x, miss),
               lambda p: c.mpe(p, x, miss), lambda p: c.sample(p, jax.random.key(1), x=x, missing=miss)):
        # inside a user's jit (an eager vmap runs op by op: much slower here); both traced, so that a sample at a
        # batch off the bucket sizes draws the same random bits (an eager call draws them for the padded batch)
        batched = jax.jit(jax.vmap(fn))(stacked)
        single = jax.jit(fn)(jax.tree_util.tree_map(lambda a: a[1], stacked))
        for u, v in zip(jax.tree_util.tree_leaves(batched), jax.tree_util.tree_leaves(single)):
            np.testing.assert_allclose(np.asarray(u)[1], np.asarray(v), rtol=1e-5, atol=1e-6)


def test_device_soft_evidence_is_checked_in_the_executable():
    """Soft evidence on the device is checked as a device batch is: no host round trip (the call runs under
    ``jax.transfer_guard("disallow")``), a bad weight's row gives NaN and the others their exact values, the
    circuit's next call (or ``raise_pending``) raises the error naming the weight; ``"sync"`` raises at once and
    ``validate=False`` records nothing."""
    c = jaxpc.compile(structures.HMM(4, 3, 3))
    q = jnp.asarray(np.random.default_rng(0).uniform(0.1, 1.0, (5, 4, 3)), jnp.float32)
    want = np.asarray(c.marginal(c.params, soft_evidence=np.asarray(q)))  # numpy: checked on the host
    c.marginal(c.params, soft_evidence=q)  # (compiles the flag's executable)
    inf = q.at[3, 2, 1].set(jnp.inf)
    with jax.transfer_guard("disallow"):
        got = c.marginal(c.params, soft_evidence=q)
        bad = c.marginal(c.params, soft_evidence=inf)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    bad = np.asarray(bad)
    assert np.isnan(bad[3]) and np.allclose(np.delete(bad, 3), np.delete(want, 3), rtol=1e-6)
    with pytest.raises(ValueError, match=r"soft_evidence\[3, 2, 1\] = inf: .*checked on the device"):
        c.log_prob(c.params, np.zeros((2, 4), np.int32))  # the next call, any entry point
    c.raise_pending()  # (raised once)
    neg = q.at[0, 0, 0].set(-0.5)
    with pytest.raises(ValueError, match=r"soft_evidence\[0, 0, 0\] = -0.5"):
        c.marginal(c.params, soft_evidence=neg, validate="sync")
    assert np.isnan(np.asarray(c.marginal(c.params, soft_evidence=neg, validate=False))[0])
    c.raise_pending()  # nothing recorded without validation
    with pytest.raises(ValueError, match="validate must be True, False or 'sync'"):
        c.marginal(c.params, soft_evidence=q, validate="no")


_QUERIES = {"conditional": lambda c, p, x, i: c.conditional(p, x, np.arange(6) == 2, target_vars=[1, 2]),
            "conditional, all targets": lambda c, p, x, i: c.conditional(p, x),
            "mpe": lambda c, p, x, i: c.mpe(p, x, jnp.asarray(np.arange(6) == 2)),
            "mpe, no mask": lambda c, p, x, i: c.mpe(p, x),
            "mpe, no evidence": lambda c, p, x, i: c.mpe(p, num_samples=5),
            "sample": lambda c, p, x, i: c.sample(p, jax.random.key(i), x=x, missing=np.arange(6) == 2),
            "sample, no evidence": lambda c, p, x, i: c.sample(p, jax.random.key(i), 7)}


@pytest.mark.parametrize("name", cases(list(_QUERIES), fast=["conditional", "mpe, no mask"]))
@pytest.mark.usefixtures("single_compile")  # (the full call and the replay on the same executable, on a GPU too)
def test_repeated_queries_replay_and_stay_exact(name, single_compile):
    """``conditional``, ``mpe`` and ``sample`` repeated with the same options replay their executable
    (``Runtime.replay``; new ``params``, evidence and PRNG keys): outputs equal to the full call's for numpy, device
    and padded batches, with and without a mask, without evidence; a numpy batch's bad value still raises at once
    and a device batch's by the next call; other targets or sizes and traced parameters take the full call."""
    c = jaxpc.compile(structures.HMM(6, 4, 5))
    full = []
    run, replay = c.runtime.run, c.runtime.replay
    c.runtime.run = lambda entry, *a, **k: full.append(entry) or run(entry, *a, **k)

    def full_call(p, x, i):  # the full call path, on the same executables
        c.runtime.replay = lambda *a, **k: None
        try:
            return q(c, p, x, i)
        finally:
            c.runtime.replay = replay

    q = _QUERIES[name]
    rng = np.random.default_rng(0)
    xs = [rng.integers(0, 5, (16, 6)).astype(np.int32) for _ in range(3)]
    params = jax.tree_util.tree_map(lambda a: a * 0.5, c.params)  # other parameters: taken anew
    for put in (np.asarray, jnp.asarray, lambda a: a[:11]):
        q(c, c.params, put(xs[0]), 0)
        for i, x in enumerate(xs):
            for p in (c.params, params):
                n = len(full)
                got = q(c, p, put(x), i)
                assert len(full) == n, full[n:]
                assert_same_result(got, full_call(p, put(x), i))
    n = len(full)
    bad = xs[1].copy()
    bad[4, 0] = 9
    if name == "conditional":
        with pytest.raises(ValueError, match=r"x\[4, 0\] = 9 is out of range"):
            q(c, c.params, bad, 0)
        assert len(full) == n
        c.conditional(c.params, xs[0], np.arange(6) == 2, target_vars=[0, 2])  # other targets
        c.conditional(c.params, xs[0][:8], np.arange(6) == 2, target_vars=[1, 2])  # another size
        jax.jit(lambda p: q(c, p, jnp.asarray(xs[0]), 0))(c.params)  # tracers: inline
        assert len(full) == n + 3
    if name == "mpe, no mask":
        assignment, value = q(c, c.params, jnp.asarray(bad), 0)
        assert (np.asarray(assignment)[4] == -1).all() and np.isnan(np.asarray(value)[4])
        with pytest.raises(ValueError, match=r"x\[4, 0\] = 9 .*circuit\.mpe"):
            q(c, c.params, jnp.asarray(xs[0]), 0)
        assert len(full) == n


def test_query_errors():
    c = jaxpc.compile(structures.HMM(4, 3, 3))
    x = np.zeros((2, 4), np.int32)
    with pytest.raises(ValueError, match="target_vars holds 9"):
        c.conditional(c.params, x, target_vars=[9])
    with pytest.raises(ValueError, match="target_vars is empty"):
        c.conditional(c.params, x, target_vars=[])
    with pytest.raises(TypeError, match="got a boolean mask"):
        c.conditional(c.params, x, target_vars=np.arange(4) < 2)
    with pytest.raises(ValueError, match=r"soft_evidence has an empty batch \(shape \(0, 4, 3\)\)"):
        c.marginal(c.params, soft_evidence=np.ones((0, 4, 3), np.float32))
    with pytest.raises(ValueError, match=r"soft_evidence must have shape \[batch, 4, num_values\]"):
        c.marginal(c.params, soft_evidence=np.ones((2, 3, 3)))
    with pytest.raises(ValueError, match=r"soft_evidence\[0, 0, 0\] = -1.0: .*finite and non-negative \(24 such"):
        c.marginal(c.params, soft_evidence=-np.ones((2, 4, 3)))
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        c.sample(c.params, jax.random.key(0), 0)
    with pytest.raises(ValueError, match="either x .with missing. or soft_evidence"):
        c.marginal(c.params, x, soft_evidence=np.ones((2, 4, 3)))


@pytest.mark.slow  # each query's executable at two precisions
def test_queries_take_the_forwards_options():
    """``conditional``, ``sample``, ``mpe`` and ``marginal`` take ``options`` as ``log_prob`` does: part of the
    executable's key (another precision compiles another executable), the same answers at the default's precision,
    and a propagation that does not apply to the query raises."""
    c = jaxpc.compile(structures.HMM(2, 3, 3), seed=2)  # (two steps: each executable compiles the faster)
    x = np.random.default_rng(0).integers(0, 3, (5, 2)).astype(np.int32)
    miss = np.array([True, False])
    fp32 = jaxpc.Options(precision="fp32")
    key = jax.random.key(1)
    for call in (lambda **kw: c.conditional(c.params, x, miss, **kw),
                 lambda **kw: c.sample(c.params, key, x=x, missing=miss, **kw),
                 lambda **kw: c.mpe(c.params, x, miss, **kw),
                 lambda **kw: c.marginal(c.params, x, miss, **kw)):
        want = call()
        misses = c.cache_info().misses
        got = call(options=fp32)
        assert c.cache_info().misses == misses + 1
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    mpe = jaxpc.Options(propagation="MPE")
    np.testing.assert_array_equal(np.asarray(c.mpe(c.params, x, miss, options=mpe)[0]),
                                  np.asarray(c.mpe(c.params, x, miss)[0]))
    with pytest.raises(ValueError, match=r"sample runs a sum-product .* options.propagation='MPE'"):
        c.sample(c.params, key, x=x, missing=miss, options=mpe)
    with pytest.raises(ValueError, match=r"conditional runs a sum-product .* options.propagation='MPE'"):
        c.conditional(c.params, x, miss, options=mpe)
    with pytest.raises(ValueError, match="mpe decodes by max-product; options.propagation='GeneralLL'"):
        c.mpe(c.params, x, miss, options=jaxpc.Options(propagation="GeneralLL", alpha=0.5))
    with pytest.raises(TypeError, match="options must be a jaxpc.Options"):
        c.sample(c.params, key, 3, options={"precision": "fp32"})


@pytest.mark.slow
@pytest.mark.usefixtures("single_compile")  # (on a GPU a key's quick compile would trace the leaves without it)
def test_mpe_and_sample_write_the_leaves_by_the_kernel_where_it_applies():
    """On the kernels' route the queries' forward writes the leaves into the node buffer with one kernel (Pallas in
    interpret mode here) instead of concatenating the input layers' values: the same assignments, values and
    samples as without it."""
    data = np.random.default_rng(4).integers(0, 4, (300, 10)).astype(np.int32)
    c = jaxpc.compile(structures.HCLT(data, 4, input_dist=distributions.Categorical(4)), seed=1)
    x, miss = data[:12], np.arange(10) % 3 == 0
    kernel, xla_leaves = jaxpc.Options(impl="pallas"), jaxpc.Options(impl="pallas", leaf_kernel=False)
    for name, call in (("mpe", lambda o: c.mpe(c.params, x, miss, options=o)),
                       ("sample", lambda o: c.sample(c.params, jax.random.key(2), x=x, missing=miss, options=o))):
        want = call(xla_leaves)
        assert "jaxpc/leaf_buffer" not in c.compiled(name).as_text()
        got = call(kernel)
        assert "jaxpc/leaf_buffer" in c.compiled(name).as_text()
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
