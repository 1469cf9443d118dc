"""EM variants against their closed forms: tempered flows, keep_zero_params, TDP step-size rescaling,
hard (Viterbi) EM."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions, structures

from . import oracle
from .random_circuits import Generator
from .tiers import cases

sum_layer = importlib.import_module("jaxpc.ops.sum_layer")  # the module: ``jaxpc.ops`` exports its function


@pytest.mark.parametrize("tp, te", cases([(0.5, 1.0), (2.0, 2.0), (0.7, 0.3)], fast=[(0.7, 0.3)], unpack=True))
@pytest.mark.slow
def test_tempered_flows(tp, te):
    gen = Generator(11, 4, kinds=("categorical", "bernoulli"))
    c = jaxpc.compile(gen.circuit())
    x = gen.sample_data(9).astype(np.int32)
    fl = c.flows(c.params, x, options=jaxpc.Options(pflow_temperature=tp, eflow_temperature=te))
    edge, F, _ = oracle.flows(c, c.params, x.astype(np.float64), tp=tp, te=te)
    totals = oracle.tied_edge_flows(c, edge)
    for ns in c.nodes:
        if ns.is_sum() and ns.source is ns:
            np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, ns)), totals[ns.id], rtol=1e-4, atol=1e-5)
    for ns in c.nodes:  # leaf statistics follow the tempered element flows
        if ns.is_input() and not ns.is_tied() and isinstance(ns.dist, distributions.Categorical) and \
                not any(m.is_tied() and m.source is ns for m in c.nodes):
            ref = oracle.input_stats(ns, c.get_node_params(c.params, ns), x.astype(np.float64), None, F[ns.id])
            np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, ns)), ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="applies to propagation='LL'"):
        jaxpc.Options(propagation="MPE", pflow_temperature=0.5)


@pytest.mark.slow
def test_keep_zero_params():
    a = jaxpc.inputs(0, 3, dist=distributions.Categorical(3), params=np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5],
                                                                       [0.0, 1.0, 0.0]]))
    b = jaxpc.inputs(1, 3, dist=distributions.Categorical(2))
    root = jaxpc.summate(jaxpc.multiply(a, b), num_nodes=1, params=np.array([[0.6, 0.0, 0.4]]))
    c = jaxpc.compile(root)
    x = np.random.default_rng(0).integers(0, 2, (20, 2)).astype(np.int32)
    pc = 0.3
    fl = c.flows(c.params, x)
    new = c.em_step(c.params, x, pseudocount=pc, keep_zero_params=True)
    W = np.asarray(c.get_node_params(new, root))
    counts = np.asarray(c.get_node_flows(fl, root))
    mask = np.array([[True, False, True]])
    ref = np.where(mask, counts + pc / 2, 0.0)
    np.testing.assert_allclose(W, ref / ref.sum(), rtol=1e-5)
    P = np.asarray(c.get_node_params(new, a))
    cnt = np.asarray(c.get_node_flows(fl, a))
    m = np.asarray(c.get_node_params(c.params, a)) > 0
    ref_a = np.where(m, cnt + pc / m.sum(1, keepdims=True), 0.0)
    np.testing.assert_allclose(P, ref_a / ref_a.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
    # without the flag the zeros fill in
    assert np.all(np.asarray(c.get_node_params(c.em_step(c.params, x, pseudocount=pc), root)) > 0)


@pytest.mark.slow
def test_tdp_step_size_rescaling():
    gen = Generator(4, 3, kinds=("categorical", "bernoulli"))
    c = jaxpc.compile(gen.circuit())
    x = gen.sample_data(12).astype(np.int32)
    s, pc = 0.3, 0.1
    new = c.em_step(c.params, x, step_size=s, pseudocount=pc, rescale="tdp")
    edge, _, _ = oracle.flows(c, c.params, x.astype(np.float64))
    x0 = np.zeros((1, 3))
    tdp, _, _ = oracle.flows(c, c.params, x0, np.ones((1, 3), bool))
    for ns in c.nodes:
        if ns.is_sum() and ns.source is ns and not any(m.is_tied() and m.source is ns for m in c.nodes):
            mask = oracle.edge_mask(ns)
            mixed = s * edge[ns.id] / 12 + (1 - s) * tdp[ns.id]
            nch = mask.sum(1, keepdims=True)
            cnt = np.where(mask, mixed + pc / nch, 0)
            np.testing.assert_allclose(np.asarray(c.get_node_params(new, ns)), cnt / cnt.sum(1, keepdims=True),
                                       rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="rescale must be"):
        c.em_step(c.params, x, rescale="adam")


def viterbi_path(alpha, beta, gamma, x):
    T = len(x)
    d = np.log(gamma) + np.log(beta[:, x[0]])
    back = []
    for t in range(1, T):
        sc = d[:, None] + np.log(alpha)
        back.append(sc.argmax(0))
        d = sc.max(0) + np.log(beta[:, x[t]])
    z = [int(d.argmax())]
    for bp in reversed(back):
        z.append(int(bp[z[-1]]))
    return z[::-1]


@pytest.mark.slow
def test_hard_em_counts_viterbi_paths():
    rng = np.random.default_rng(3)
    T, L, V = 6, 3, 4
    alpha, beta, gamma = rng.dirichlet(np.ones(L), L), rng.dirichlet(np.ones(V), L), rng.dirichlet(np.ones(L))
    root = structures.HMM(T, L, V, alpha=alpha, beta=beta, gamma=gamma)
    c = jaxpc.compile(root)
    x = rng.integers(0, V, (25, T)).astype(np.int32)
    hard = jaxpc.Options(propagation="MPE")
    fl = c.flows(c.params, x, options=hard)
    trans = [ns for ns in c.nodes if ns.name.startswith("trans")][0]
    emit = [ns for ns in c.nodes if ns.name.startswith("emit")][0]
    tc, ec, ic = np.zeros((L, L)), np.zeros((L, V)), np.zeros(L)
    for row in x:
        z = viterbi_path(alpha, beta, gamma, row)
        ic[z[0]] += 1
        for t in range(T - 1):
            tc[z[t], z[t + 1]] += 1
        for t in range(T):
            ec[z[t], row[t]] += 1
    np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, trans)), tc, atol=1e-5)
    np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, emit)), ec, atol=1e-5)
    np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, root))[0], ic, atol=1e-5)
    new = c.em_step(c.params, x, options=hard)
    np.testing.assert_allclose(np.asarray(c.get_node_params(new, trans)),
                               np.where(tc.sum(1, keepdims=True) > 0, tc / np.maximum(tc.sum(1, keepdims=True), 1),
                                        alpha), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dense", [False, True])
def test_hard_flows_go_to_each_parents_first_maximizer(dense):
    """``mpe_split`` against a loop over parents and samples: each parent's flow goes whole to its first child
    whose term equals its value, also where terms tie (children 0 and 1 equal under equal weights) and nowhere
    from an impossible parent; jitted, and without the parameter flows."""
    rng = np.random.default_rng(4)
    n, Kp, CK, B = 3, 4, 6, 5
    x = rng.normal(size=(CK, B) if dense else (n, CK, B)).astype(np.float32)
    lw = rng.normal(size=(n, Kp, CK)).astype(np.float32)
    lw[:, :, 1], x[..., 1, :] = lw[:, :, 0], x[..., 0, :]
    lw[0, 0, 2] = 9.0  # parent (0, 0) takes child 2 alone, ahead of the tied pair
    t = lw[..., None] + (x[None, None] if dense else x[:, None])
    vp = t.max(axis=2)
    vp[1, 2, 3] = -np.inf
    fp = rng.random((n, Kp, B)).astype(np.float32)
    rcf, rpf = np.zeros((CK, B) if dense else (n, CK, B)), np.zeros((n, Kp, CK))
    for i, k, b in np.ndindex(n, Kp, B):
        if np.isfinite(vp[i, k, b]):
            c = int(np.flatnonzero(t[i, k, :, b] == vp[i, k, b])[0])
            rcf[(c, b) if dense else (i, c, b)] += fp[i, k, b]
            rpf[i, k, c] += fp[i, k, b]
    split = jax.jit(sum_layer.mpe_split, static_argnums=(4, 5))
    cf, pf = split(x, lw, vp, fp, dense, True)
    np.testing.assert_allclose(np.asarray(cf), rcf, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(pf), rpf, rtol=1e-6)
    assert rpf[..., 0].sum() > 0 and rpf[..., 1].sum() == 0 and rpf[0, 0, 2] > 0
    assert split(x, lw, vp, fp, dense, False)[1] is None


def test_max_and_first_is_the_max_and_its_first_maximizer():
    """One variadic reduction gives ``first_max``'s values bit for bit (NaN kept) and ``first_maximizer``'s
    children: the first of tied terms, ``C*Kc`` for a parent of no finite term or a NaN one."""
    rng = np.random.default_rng(5)
    n, Kp, CK, B = 3, 4, 7, 5
    t = rng.normal(size=(n, Kp, CK, B)).astype(np.float32)
    t[:, :, 4] = t[:, :, 2]  # ties: child 2 comes first
    t[:, :, 2] += np.where(rng.random((n, Kp, B)) < 0.5, 5.0, 0.0).astype(np.float32)
    t[:, :, 4] = np.maximum(t[:, :, 4], t[:, :, 2])
    t[0, 1, :, 2] = -np.inf  # an impossible parent
    t[2, 3, 5, 4] = np.nan
    out, first = jax.jit(sum_layer.max_and_first)(t)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(sum_layer.first_max(t)))
    np.testing.assert_array_equal(np.asarray(first), np.asarray(sum_layer.first_maximizer(t, out)))
    assert int(first[0, 1, 2]) == CK and int(first[2, 3, 4]) == CK and np.isnan(out[2, 3, 4])
    assert (np.asarray(first) == 2).sum() > 0 and (np.asarray(first) == 4).sum() == 0
    # differentiated as first_max, in both modes (a hard-EM flow pass's derivative on a GPU's kernel routes is the
    # forward-mode derivative of XLA's route, whose forward keeps the maximizers)
    def value(u):
        return sum_layer.max_and_first(u)[0]

    dt = jnp.asarray(rng.normal(size=t.shape).astype(np.float32))
    got, want = (np.asarray(jax.jvp(f, (t,), (dt,))[1]) for f in (value, sum_layer.first_max))
    ok = ~np.isnan(np.asarray(out))
    np.testing.assert_array_equal(got[ok], want[ok])
    ct = jnp.where(jnp.asarray(ok), 1.0, 0.0) * jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    got, want = (np.asarray(jax.vjp(f, t)[1](ct)[0]) for f in (value, sum_layer.first_max))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("options", cases([{"gather_chunk": 64}, {}, {"scan_stages": False}], fast=[]))
def test_hard_flows_read_the_forwards_first_maximizers(options):
    """The flow pass of hard EM takes each parent's first maximizer from its forward (``Options.kernel_shifts``)
    and passes the same flows as when it searches the terms again: on an HCLT of uniform weights, where every
    parent's terms tie, and on its trained parameters; searched, the jaxpr holds the search's min-reduction."""
    data = np.random.default_rng(6).integers(0, 3, (60, 6))
    c = jaxpc.compile(structures.HCLT(data, 4, input_dist=distributions.Categorical(3)), seed=2)
    x = data[:9].astype(np.int32)
    uniform = jax.tree_util.tree_map(jax.numpy.zeros_like, c.params)
    for params in (c.params, c.em_step(c.params, data.astype(np.int32)), uniform):
        kept = jaxpc.Options(propagation="MPE", **options)
        searched = kept.replace(kernel_shifts=False)
        a, b = c.flows(params, x, options=kept), c.flows(params, x, options=searched)
        jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)
        assert float(c.get_node_flows(a, c.root)[0].sum()) == x.shape[0]
    jaxprs = [str(jax.make_jaxpr(lambda p, o=o: c.flows(p, x, options=o))(c.params)) for o in (kept, searched)]
    assert "reduce_min" not in jaxprs[0] and "reduce_min" in jaxprs[1]


@pytest.mark.parametrize("backward", ["flows", "autodiff", "searched"])
def test_hard_flows_of_tied_paths_count_the_first(backward):
    """An HMM with uniform parameters ties every path: hard EM counts the path of the first maximizing state at
    every sum (state 0 throughout, the path ``mpe`` decodes), by the top-down pass (its forward's first
    maximizers kept, or searched for again) and by autodiff alike."""
    T, L, V, B = 5, 3, 4, 6
    root = structures.HMM(T, L, V, alpha=np.full((L, L), 1 / L), beta=np.full((L, V), 1 / V),
                          gamma=np.full(L, 1 / L))
    c = jaxpc.compile(root)
    x = np.random.default_rng(0).integers(0, V, (B, T)).astype(np.int32)
    hard = (jaxpc.Options(propagation="MPE", kernel_shifts=False) if backward == "searched"
            else jaxpc.Options(propagation="MPE", backward=backward))
    fl = c.flows(c.params, x, options=hard)
    trans = [ns for ns in c.nodes if ns.name.startswith("trans")][0]
    emit = [ns for ns in c.nodes if ns.name.startswith("emit")][0]
    want = np.zeros((L, L))
    want[0, 0] = B * (T - 1)
    np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, trans)), want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, emit))[0], np.bincount(x.ravel(), minlength=V),
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, emit))[1:], 0.0, atol=1e-6)


@pytest.mark.slow
def test_nodes_without_flow_keep_their_sum_parameters():
    """EM's update moves a sum node only where its flows and the pseudocount carry mass: with the flows of one node
    vector zeroed and no pseudocount its parameters stay, the others' are blended toward their normalized flows;
    any pseudocount moves the zeroed ones toward uniform."""
    c = jaxpc.compile(structures.PD((2, 4), 8, split_intervals=(1, 1), input_dist=distributions.Categorical(5)),
                      seed=1)
    x = np.random.default_rng(0).integers(0, 5, (6, 8)).astype(np.int32)
    fl = c.flows(c.params, x)
    sums = [ns for ns in c.nodes if ns.is_sum() and ns.source is ns and ns.num_nodes > 1]
    zeroed, moved = sums[0], sums[-1]
    assert zeroed is not moved and float(np.asarray(c.get_node_flows(fl, zeroed)).sum()) > 0
    pl = c._struct.sum_placement[zeroed.id]
    fl = {**fl, "sum": {**fl["sum"], pl.group: fl["sum"][pl.group].at[pl.start:pl.start + pl.num_edge_blocks].set(0)}}
    for pc in (0.0, 0.3):
        new = c.em_update(c.params, fl, step_size=0.5, pseudocount=pc)
        old_z = np.asarray(c.get_node_params(c.params, zeroed), np.float64)
        got_z = np.asarray(c.get_node_params(new, zeroed), np.float64)
        want_z = old_z if pc == 0 else 0.5 * old_z + 0.5 / old_z.shape[1]
        np.testing.assert_allclose(got_z, want_z, rtol=1e-5, atol=1e-6)
        fm = np.asarray(c.get_node_flows(fl, moved), np.float64) + pc / c.get_node_params(c.params, moved).shape[1]
        old_m = np.asarray(c.get_node_params(c.params, moved), np.float64)
        want_m = 0.5 * old_m + 0.5 * fm / fm.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(np.asarray(c.get_node_params(new, moved)), want_m, rtol=1e-5, atol=1e-6)


def test_block_totals_are_each_segments_sums_and_differentiate():
    """The node totals behind the EM update and the normalization: per segment and parent row, the sum over its
    blocks' children (blocks in any order, segments of one to three blocks), jit-compiled and differentiated."""
    import jax.numpy as jnp

    from jaxpc.distributions.base import block_totals

    rng = np.random.default_rng(0)
    seg = np.array([2, 0, 2, 1, 2, 0], np.int32)
    values = rng.random((6, 3, 4)).astype(np.float32)
    want = np.stack([values[seg == s].sum(axis=(0, 2)) for s in range(3)])
    got = jax.jit(block_totals, static_argnums=2)(jnp.asarray(values), jnp.asarray(seg), 3)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    weights = rng.random((3, 3)).astype(np.float32)
    grad = jax.grad(lambda v: jnp.sum(weights * block_totals(v, jnp.asarray(seg), 3)))(jnp.asarray(values))
    np.testing.assert_allclose(np.asarray(grad), np.broadcast_to(weights[seg][:, :, None], values.shape), rtol=1e-6)


@pytest.mark.slow
def test_single_block_segments_take_each_blocks_own_totals():
    """Groups whose every normalization segment is one parameter block (``SumGroupSpec.single_segments``, set from
    the segment table) normalize by each block's own row sums, with no scatter: the EM update (plain and with
    ``keep_zero_params``), the node flows and the logits' normalization equal those of the segment path."""
    import dataclasses
    import functools

    import jax.numpy as jnp

    from jaxpc.engine import em as em_engine
    from jaxpc.engine import logflows
    from jaxpc.optim import normalize_params

    x = np.random.default_rng(0).integers(0, 4, (64, 6)).astype(np.int32)
    hclt = jaxpc.compile(structures.HCLT(x, 8, input_dist=distributions.Categorical(4)), seed=2)
    pd = jaxpc.compile(structures.PD((2, 4), 8, split_intervals=(1, 1), input_dist=distributions.Categorical(4)),
                       seed=1)
    for c in (hclt, pd):
        for g in c.layout.sum_groups:
            sizes = np.bincount(np.asarray(c.tables["groups"][g.key]["seg"]), minlength=g.num_segments)
            assert g.single_segments == bool(np.all(sizes == 1)), (g, sizes)
    assert all(g.single_segments for g in hclt.layout.sum_groups)
    assert not any(g.single_segments for g in pd.layout.sum_groups)

    c = hclt
    general = dataclasses.replace(c.layout, sum_groups=tuple(dataclasses.replace(g, single_segments=False)
                                                             for g in c.layout.sum_groups))
    fl = c.flows(c.params, x)
    zeroed = {**c.params, "sum": {k: v.at[0, 0, :2].set(-jnp.inf) for k, v in c.params["sum"].items()}}

    def both(fn):  # fn(layout, *args) on the single-segment layout and on the general one, each jitted whole
        return [jax.jit(functools.partial(fn, lay)) for lay in (c.layout, general)]

    for params, keep in ((c.params, False), (zeroed, True)):
        got, want = (f(c.tables, params, fl) for f in both(
            lambda lay, t, p, f: em_engine.em_update(lay, t, p, f, 0.3, 0.1, keep_zero_params=keep)))
        for k in got["sum"]:
            np.testing.assert_allclose(np.asarray(got["sum"][k]), np.asarray(want["sum"][k]), rtol=1e-6, atol=1e-6)
    inputs = [jnp.ones((spec.num_nodes, 3), jnp.float32) for spec in c.layout.input_layers]
    for log in (False, True):
        got, want = (f(c.tables, fl["sum"], inputs)["sum"] for f in both(
            lambda lay, t, f, i: logflows.node_totals(lay, t, f, i, log=log)))
        for k in got:
            np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6)
    logits = {**c.params, "sum": {k: v * 1.7 + 0.3 for k, v in c.params["sum"].items()}}
    got, want = (f(c.tables, logits) for f in both(normalize_params))
    for k in got["sum"]:
        np.testing.assert_allclose(np.asarray(got["sum"][k]), np.asarray(want["sum"][k]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.exp(np.asarray(got["sum"][k])).sum(axis=2), 1.0, rtol=1e-5)


@pytest.mark.slow
def test_compute_param_flows_false_keeps_the_sums_on_every_em_path():
    """``Options(compute_param_flows=False)`` refits the leaves and keeps every sum parameter on each path that
    runs EM with options: ``em_step``, ``optim.fit`` (EM, full-batch EM, anemone), ``parallel.em_step`` and the Flax
    module (zero sum flows plus a pseudocount would make every sum node uniform); the leaves move as
    ``em_step``'s do."""
    from jaxpc import optim, parallel

    c = jaxpc.compile(structures.HMM(4, 3, 5), seed=1)
    x = np.random.default_rng(0).integers(0, 5, (12, 4)).astype(np.int32)
    opts = jaxpc.Options(compute_param_flows=False)
    ref = c.em_step(c.params, x, step_size=1.0, pseudocount=0.5, options=opts)
    steps = {
        "fit em": optim.fit(c, c.params, x, 1, 12, step_size=1.0, pseudocount=0.5, options=opts, shuffle=False,
                            progress=False).params,
        "fit full batch": optim.fit(c, c.params, x, 1, 6, optimizer=optim.full_batch_em(c, 2, 0.5), options=opts,
                                    shuffle=False, progress=False).params,
        "fit anemone": optim.fit(c, c.params, x, 1, 12, optimizer=optim.anemone(c, 1.0, 0.5), options=opts,
                                 shuffle=False, progress=False).params,
        "parallel": parallel.em_step(c, c.params, x, step_size=1.0, pseudocount=0.5, options=opts),
    }
    if importlib.util.find_spec("flax") is not None:
        from jaxpc import nn
        m = nn.CircuitModule(c, normalize=False, options=opts)
        m.em_step(x, step_size=1.0, pseudocount=0.5)
        steps["nn"] = m.get_params()
    for name, got in steps.items():
        for g in c.params["sum"]:
            np.testing.assert_array_equal(np.asarray(got["sum"][g]), np.asarray(c.params["sum"][g]), err_msg=name)
        if name != "fit anemone":  # (anemone's leaves take their own per-row step)
            np.testing.assert_allclose(np.asarray(got["input"]["categorical"]["log_probs"]),
                                       np.asarray(ref["input"]["categorical"]["log_probs"]), rtol=1e-5, atol=1e-6,
                                       err_msg=name)
        else:
            assert not np.allclose(np.asarray(got["input"]["categorical"]["log_probs"]),
                                   np.asarray(c.params["input"]["categorical"]["log_probs"]))


def test_fit_refuses_a_full_batch_count_other_than_its_epoch():
    """``fit`` with ``full_batch_em(num_batches)`` that is not the epoch's number of batches raises, naming it (its
    EM updates would straddle epochs); the matching count runs, and ``compiled("optim.fit")`` finds its epoch."""
    from jaxpc import optim

    c = jaxpc.compile(structures.HMM(4, 3, 5), seed=1)
    x = np.random.default_rng(0).integers(0, 5, (37, 4)).astype(np.int32)
    for nb, kw, per in ((3, {}, 4), (4, {"drop_remainder": True}, 3)):
        with pytest.raises(ValueError, match=rf"full_batch_em\(num_batches={nb}\) does not match fit's {per} batches "
                                             rf"per epoch .*pass num_batches={per}"):
            optim.fit(c, c.params, x, 1, 10, optimizer=optim.full_batch_em(c, nb), progress=False, **kw)
    optim.fit(c, c.params, x, 1, 10, optimizer=optim.full_batch_em(c, 4), progress=False)
    assert c.compiled("optim.fit") is not None
    with pytest.raises(ValueError, match=r"compiled: 'optim.fits' is not an entry point; entry points: \[.*'flows'"):
        c.compiled("optim.fits")



def _nan_flows_circuit():
    """A circuit with an inner sum vector under the root, its flows on 12 rows, and those flows with a NaN in the
    inner vector's first parameter block."""
    import jax.numpy as jnp

    a = jaxpc.inputs(0, 2, 2, distributions.Categorical(3))
    b = jaxpc.inputs(1, 2, 2, distributions.Categorical(3))
    inner = jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=2, block_size=2)
    root = jaxpc.summate(inner, num_nodes=1)
    c = jaxpc.compile(root, seed=0)
    x = np.random.default_rng(0).integers(0, 3, (12, 2)).astype(np.int32)
    fl = c.flows(c.params, x)
    pl = c._struct.sum_placement[inner.id]
    bad = {**fl, "sum": {**fl["sum"], pl.group: fl["sum"][pl.group].at[pl.start, 0, 0].set(jnp.nan)}}
    return c, root, inner, x, fl, bad


def test_nan_flows_make_nan_parameters_not_a_silent_keep():
    """EM reads a node total of exactly 0 as "no mass" (the node keeps its parameters) but a NaN total as NaN
    parameters, which the parameter checks then name: NaN flows are never a silent no-op. The nodes with finite
    flows update as with clean flows."""
    c, root, inner, _, fl, bad = _nan_flows_circuit()
    clean = c.em_update(c.params, fl, step_size=0.5)
    new = c.em_update(c.params, bad, step_size=0.5)
    w = np.asarray(c.get_node_params(new, inner))
    assert np.isnan(w[0]).all() and np.isfinite(w[1:]).all()  # the parent whose edge flow is NaN, not the others
    np.testing.assert_allclose(np.asarray(c.get_node_params(new, root)), c.get_node_params(clean, root), rtol=1e-6)
    with pytest.raises(ValueError, match=r"params\['sum'\]\['\w+'\]\[.*\] is nan"):
        c.check_params(new)


@pytest.mark.slow
def test_nan_flows_reach_the_parameters_on_every_em_path():
    """NaN flows give NaN parameters through the EM transformations (``em``, ``anemone``) and from an unchecked NaN
    weight (``validate=False``); TDP rescaling on weights that are all 0 (no data term: ``(1 - s) TDP`` normalizes
    back to the parameters) keeps the parameters, finite."""
    import jax.numpy as jnp

    from jaxpc import optim

    c, root, inner, x, _, bad = _nan_flows_circuit()
    tx, an = optim.em(c, 0.5), optim.anemone(c, 1.0)
    for new in (tx.step(bad, tx.init(c.params), c.params)[0],
                an.step(bad, an.init(c.params), c.params, num_samples=12)[0]):
        w = np.asarray(c.get_node_params(new, inner))
        assert np.isnan(w[0]).all() and np.isfinite(w[1:]).all()
    w_nan = jnp.asarray(np.where(np.arange(12) == 3, np.nan, 1.0), jnp.float32)
    new = c.em_step(c.params, x, step_size=0.5, ll_weights=w_nan, validate=False)
    assert np.isnan(np.asarray(c.get_node_params(new, root))).all()
    new = c.em_step(c.params, x, step_size=0.5, ll_weights=np.zeros(12), rescale="tdp")
    for ns in (root, inner):
        np.testing.assert_allclose(np.asarray(c.get_node_params(new, ns)), c.get_node_params(c.params, ns), rtol=1e-5)
