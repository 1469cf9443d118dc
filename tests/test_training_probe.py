"""Training loops against EM computed by brute force: expected counts from the posterior over every induced tree
(each sum node's choice of child) of small random circuits, enumerated in float64 numpy. One step of
``Circuit.em_step``, ``optim.em``, ``parallel.em_step`` over 1, 2 and 4 devices (batches that do not split evenly
included) and ``optim.fit`` equals it; ``fit`` over a mesh trains as on one device; the pure step and the
data-parallel steps name their bad arguments."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpc
from jaxpc import distributions, optim, parallel
from jaxpc.nodes import topological_order

from .random_circuits import Generator
from .tiers import cases

four_devices = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (fake) devices")


def _leaf_table(circuit, params, ns):
    p = np.asarray(circuit.get_node_params(params, ns), np.float64)
    return np.stack([1 - p, p], 1) if isinstance(ns.dist, distributions.Bernoulli) else p


def _induced_trees(circuit, W, T, row):
    """Every induced tree of the circuit on one sample ``row``: ``[(probability, choices)]``, the choices a tuple
    of ``("sum", source id, node, child)`` and ``("in", source id, node, value)``."""
    memo = {}

    def trees(ns, i):
        if (ns.id, i) in memo:
            return memo[ns.id, i]
        if ns.is_input():
            v = int(row[ns.var])
            out = [(T[ns.id][i, v], (("in", ns.source.id, i, v),))]
        elif ns.is_prod():
            b, k = divmod(i, ns.block_size)
            parts = [trees(c, int(ns.edge_ids[b, j]) * ns.block_size + k) for j, c in enumerate(ns.children)]
            out = [(np.prod([t[0] for t in combo]), sum((t[1] for t in combo), ()))
                   for combo in itertools.product(*parts)]
        else:
            out, off = [], 0
            for c in ns.children:
                for r in range(c.num_nodes):
                    if W[ns.id][i, off + r] > 0:
                        out += [(W[ns.id][i, off + r] * p, ch + (("sum", ns.source.id, i, off + r),))
                                for p, ch in trees(c, r)]
                off += c.num_nodes
        memo[ns.id, i] = out
        return out

    return trees(circuit.root, 0)


def brute_force_em(circuit, params, x, weights=None, step=1.0, pc=0.0, anemone=False):
    """EM's new parameters by source vector id (``get_node_params``' dense form) and the samples' log-likelihoods,
    from the expected counts of every induced tree: ``theta <- (1 - s) theta + s normalize(counts + pc / children)``
    with ``s = step`` (``anemone``: ``t / (1 + t)``, ``t = step * (node's counts + pc) / total weight``)."""
    order = topological_order(circuit.root)
    W = {ns.id: np.asarray(circuit.get_node_params(params, ns), np.float64) for ns in order if ns.is_sum()}
    T = {ns.id: _leaf_table(circuit, params, ns) for ns in order if ns.is_input()}
    w = np.ones(len(x)) if weights is None else np.asarray(weights, np.float64)
    counts, lls = {}, []
    for b, row in enumerate(x):
        trees = _induced_trees(circuit, W, T, row)
        z = sum(p for p, _ in trees)
        lls.append(np.log(z))
        for p, choices in trees:
            for ch in choices:
                counts[ch] = counts.get(ch, 0.0) + w[b] * p / z
    new = {}
    for ns in circuit.nodes:
        if ns.source is not ns or ns.is_prod():
            continue
        if ns.is_sum():
            old = W[ns.id]
            mask = np.zeros((ns.num_node_blocks, ns.num_ch_node_blocks), bool)
            mask[ns.edge_ids[0], ns.edge_ids[1]] = True
            mask = np.repeat(np.repeat(mask, ns.block_size, 0), ns.ch_block_size, 1)
        else:
            old = T[ns.id]
            mask = np.ones(old.shape, bool)
        c = np.zeros(old.shape)
        for (_, sid, i, j), v in counts.items():
            if sid == ns.id:
                c[i, j] += v
        c = np.where(mask, c + pc / mask.sum(1, keepdims=True), 0.0)
        tot = c.sum(1, keepdims=True)
        target = np.where(tot > 0, c / np.where(tot > 0, tot, 1), old)
        s = step
        if anemone:
            t = step * tot / w.sum()
            s = t / (1 + t)
        out = (1 - s) * old + s * target
        new[ns.id] = out[:, 1] if ns.is_input() and isinstance(ns.dist, distributions.Bernoulli) else out
    return new, np.asarray(lls)


def assert_params(circuit, params, want, atol=2e-6):
    """``params`` hold ``want`` (by source vector id, as :func:`brute_force_em` returns)."""
    for ns in circuit.nodes:
        if ns.id in want:
            np.testing.assert_allclose(np.asarray(circuit.get_node_params(params, ns), np.float64), want[ns.id],
                                       atol=atol, err_msg=ns.name)


def _case(seed, n=7):
    gen = Generator(seed, num_vars=3, kinds=("categorical", "bernoulli"), max_blocks=2, block_sizes=(1, 2))
    circuit = jaxpc.compile(gen.circuit(), seed=seed)
    x = gen.sample_data(n).astype(np.int32)
    w = np.random.default_rng(seed).uniform(0.1, 2.0, n)
    return circuit, x, w


def test_brute_force_em_is_the_textbook_update_on_a_mixture():
    """The enumeration itself, on a mixture of two products of Bernoullis, against the update written out by hand:
    responsibilities ``r_k(x) = pi_k prod_v p_kv^x_v (1 - p_kv)^(1 - x_v) / p(x)``."""
    leaves = [jaxpc.inputs(v, 1, 2, distributions.Bernoulli(), params=np.array([0.2 + 0.3 * v, 0.7 - 0.1 * v]))
              for v in range(2)]
    root = jaxpc.summate(jaxpc.multiply(*leaves), num_nodes=1, params=np.array([[0.35, 0.65]]))
    circuit = jaxpc.compile(root)
    x = np.array([[0, 1], [1, 1], [1, 0]], np.int32)
    new, ll = brute_force_em(circuit, circuit.params, x)
    p = np.array([[0.2, 0.5], [0.7, 0.6]])  # [component, variable]
    joint = np.array([0.35, 0.65])[None, :] * np.prod(np.where(x[:, None, :] == 1, p[None], 1 - p[None]), axis=2)
    r = joint / joint.sum(1, keepdims=True)
    np.testing.assert_allclose(ll, np.log(joint.sum(1)))
    np.testing.assert_allclose(new[root.id], r.mean(0)[None])
    for v, leaf in enumerate(leaves):
        np.testing.assert_allclose(new[leaf.id], (r * x[:, v:v + 1]).sum(0) / r.sum(0))


@pytest.mark.parametrize("seed", cases([1, 0, 3], fast=[]))
@pytest.mark.slow
def test_one_em_step_of_every_path_is_brute_force_em(seed):
    """``Circuit.em_step``, ``optim.em`` applied to ``Circuit.flows`` and ``fit`` with one batch and one epoch all
    take the EM step of the enumeration (weighted, with a step size and a pseudocount); ``fit``'s ``epoch_ll`` is
    the weighted mean log-likelihood before the step."""
    circuit, x, w = _case(seed)
    want, ll = brute_force_em(circuit, circuit.params, x, w, 0.3, 0.5)
    assert_params(circuit, circuit.em_step(circuit.params, x, step_size=0.3, pseudocount=0.5, ll_weights=w), want)
    tx = optim.em(circuit, 0.3, 0.5)
    new, _ = optim.apply(tx, circuit.flows(circuit.params, x, ll_weights=w), tx.init(circuit.params), circuit.params)
    assert_params(circuit, new, want)
    r = optim.fit(circuit, circuit.params, x, 1, 7, step_size=0.3, pseudocount=0.5, ll_weights=w, progress=False)
    assert_params(circuit, r.params, want)
    assert r.epoch_ll[0] == pytest.approx(np.sum(w * ll) / np.sum(w), abs=1e-5)


@pytest.mark.slow
def test_fit_epochs_are_brute_force_em_on_the_batches_of_epoch_batches():
    """Two epochs of 7 rows in batches of 3 (the last padded): each batch's step is the enumeration's EM step on
    the rows ``epoch_batches`` draws from the key, each row weighing its ``ll_weights``; the same key repeats the
    run bit for bit."""
    circuit, x, w = _case(1)
    key = jax.random.key(5)
    got = optim.fit(circuit, circuit.params, x, 2, 3, step_size=0.5, pseudocount=0.1, key=key, ll_weights=w,
                    progress=False)
    params, lls = circuit.params, []
    for epoch in range(2):
        idx, pad = (np.asarray(a) for a in optim.epoch_batches(key, epoch, 7, 3))
        total = 0.0
        for rows, keep in zip(idx, pad):
            want, ll = brute_force_em(circuit, params, x[rows], keep * w[rows], 0.5, 0.1)
            total += np.sum(keep * w[rows] * ll)
            params = circuit.em_step(params, x[rows], step_size=0.5, pseudocount=0.1, ll_weights=keep * w[rows])
            assert_params(circuit, params, want)
        lls.append(total / w.sum())
    np.testing.assert_allclose(got.epoch_ll, lls, atol=1e-5)
    assert_params(circuit, got.params, {ns.id: np.asarray(circuit.get_node_params(params, ns), np.float64)
                                        for ns in circuit.nodes if ns.source is ns and not ns.is_prod()})
    again = optim.fit(circuit, circuit.params, x, 2, 3, step_size=0.5, pseudocount=0.1, key=jax.random.key(5),
                      ll_weights=w, progress=False)
    for a, b in zip(jax.tree_util.tree_leaves(got.params), jax.tree_util.tree_leaves(again.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("make", [lambda c: optim.full_batch_em(c, 3, 0.2, 0.6), lambda c: optim.anemone(c, 1.7, 0.3)],
                         ids=["full_batch_em", "anemone"])
@pytest.mark.slow
def test_full_batch_em_and_anemone_in_fit_are_brute_force(make):
    """``full_batch_em`` over an epoch of three batches (the last partial) is one EM step on all the rows;
    ``anemone`` on one batch moves each node by its own step ``t / (1 + t)``."""
    circuit, x, w = _case(2)
    tx = make(circuit)
    if tx.config.kind == "full_batch":
        r = optim.fit(circuit, circuit.params, x, 1, 3, optimizer=tx, ll_weights=w, progress=False)
        want, _ = brute_force_em(circuit, circuit.params, x, w, 0.6, 0.2)
    else:
        r = optim.fit(circuit, circuit.params, x, 1, 7, optimizer=tx, ll_weights=w, progress=False)
        want, _ = brute_force_em(circuit, circuit.params, x, w, 1.7, 0.3, anemone=True)
    assert_params(circuit, r.params, want)


@four_devices
@pytest.mark.parametrize("n", cases([4, 1, 2], fast=[]))
@pytest.mark.slow
def test_parallel_em_step_is_brute_force_em_on_batches_the_devices_do_not_split(n):
    """7 rows (and 1 row) over 1, 2 and 4 devices: the batch is padded with zero-weight rows, and the step is the
    enumeration's EM step on the real rows."""
    circuit, x, w = _case(0)
    mesh = parallel.data_mesh(n)
    want, ll = brute_force_em(circuit, circuit.params, x, w, 0.7, 0.2)
    new, got_ll = parallel.em_step(circuit, circuit.params, x, mesh=mesh, step_size=0.7, pseudocount=0.2,
                                   ll_weights=w, return_ll=True)
    assert_params(circuit, new, want)
    np.testing.assert_allclose(got_ll, ll, atol=1e-5)
    assert_params(circuit, parallel.em_step(circuit, circuit.params, x[:1], mesh=mesh),
                  brute_force_em(circuit, circuit.params, x[:1])[0])


@four_devices
@pytest.mark.parametrize("n, rows", cases([(4, 3), (4, 7), (2, 7)], fast=[], unpack=True))
@pytest.mark.slow
@pytest.mark.full
def test_fit_on_a_mesh_with_a_batch_of_every_row_trains_as_one_device(n, rows):
    """A ``batch_size`` of at least the rows is one batch of every row on a mesh too (padded with zero-weight rows
    to a multiple of the devices), also with fewer rows than devices and with ``drop_remainder`` (nothing is left
    over): one epoch is one EM step on all the rows, as without a mesh, and ``full_batch_em(num_batches=1)`` fits
    it."""
    circuit, x, w = _case(1, rows)
    mesh = parallel.data_mesh(n)
    want, ll = brute_force_em(circuit, circuit.params, x, w, 0.5, 0.1)
    for kw in ({}, {"drop_remainder": True}):
        r = optim.fit(circuit, circuit.params, x, 1, 100, step_size=0.5, pseudocount=0.1, ll_weights=w, mesh=mesh,
                      progress=False, **kw)
        assert_params(circuit, r.params, want)
        assert r.epoch_ll[0] == pytest.approx(np.sum(w * ll) / np.sum(w), abs=1e-5)
    r = optim.fit(circuit, circuit.params, x, 1, rows, optimizer=optim.full_batch_em(circuit, 1, 0.1, 0.5),
                  ll_weights=w, mesh=mesh, progress=False)
    assert_params(circuit, r.params, want)


@four_devices
@pytest.mark.slow
@pytest.mark.full
def test_make_step_on_a_mesh_takes_no_weights_and_names_bad_arguments():
    """A data-parallel pure step without weights counts every row, for an optax transformation as for EM (the
    optax one failed on the missing weights); a mesh that is not one, or a ``missing_ndim`` other than None, 1 or 2,
    is named when the step is made."""
    circuit, x, _ = _case(1, 8)
    mesh = parallel.data_mesh(4)
    xj = jnp.asarray(x)
    for tx in (optax.adam(0.1), optim.em(circuit, 0.5, 0.1)):
        state = tx.init(circuit.params)
        split = jax.jit(optim.make_step(circuit.layout, tx, mesh=mesh))  # (made to run under jit, as fit does)
        one = jax.jit(optim.make_step(circuit.layout, tx))
        got = split(circuit.tables, circuit.params, state, xj, None, None)
        want = one(circuit.tables, circuit.params, state, xj, None, None)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    tx = optim.em(circuit)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        optim.make_step(circuit.layout, tx, mesh="data")
    for bad in (3, 0, True, "2"):
        with pytest.raises(ValueError, match=rf"make_step: missing_ndim must be None, 1 or 2.*got {bad!r}"):
            optim.make_step(circuit.layout, tx, mesh=mesh, missing_ndim=bad)


@four_devices
@pytest.mark.slow
@pytest.mark.full  # (in CI: the other weight checks of the data-parallel steps)
def test_data_parallel_gradient_steps_refuse_weights_without_a_positive_total():
    """The loss of ``loss_and_grad`` and of ``train_step`` with an optax transformation is the weighted mean
    log-likelihood: weights that sum to zero (or less) made it NaN (or flipped its sign) and an adam step NaN
    parameters; host weights raise at once, device weights at the circuit's next call. EM steps take them (a
    zero-weight batch moves nothing)."""
    circuit, x, w = _case(1)
    mesh = parallel.data_mesh(4)
    tx = optax.adam(0.1)
    state = tx.init(circuit.params)
    for bad in (np.zeros(7), np.array([1.0, -1.0, 0, 0, 0, 0, 0]), -w):
        with pytest.raises(ValueError, match="parallel.loss_and_grad: ll_weights must sum to a positive total"):
            parallel.loss_and_grad(circuit, circuit.params, x, mesh=mesh, ll_weights=bad)
        with pytest.raises(ValueError, match="parallel.train_step: ll_weights must sum to a positive total"):
            parallel.train_step(circuit, tx, circuit.params, state, x, mesh=mesh, ll_weights=bad)
    parallel.loss_and_grad(circuit, circuit.params, x, mesh=mesh, ll_weights=jnp.zeros(7))
    with pytest.raises(ValueError, match=r"sum to a positive total.*got a sum of 0.0 \(checked on the device"):
        circuit.raise_pending()
    em = optim.em(circuit, 0.5)
    p, _, _ = parallel.train_step(circuit, em, circuit.params, em.init(circuit.params), x, mesh=mesh,
                                  ll_weights=np.zeros(7))
    assert_params(circuit, p, {ns.id: np.asarray(circuit.get_node_params(circuit.params, ns), np.float64)
                               for ns in circuit.nodes if ns.source is ns and not ns.is_prod()})
    loss, _ = parallel.loss_and_grad(circuit, circuit.params, x, mesh=mesh, ll_weights=w)
    _, ll = brute_force_em(circuit, circuit.params, x)
    assert float(loss) == pytest.approx(-np.sum(w * ll) / np.sum(w), abs=1e-5)


def test_em_transformations_name_a_schedule_that_is_not_count_to_scalar():
    """A step size schedule must map the update count to a scalar: one returning a vector broadcast against the
    parameters (a cryptic shape error, or silently a step per column where the shapes matched), None failed inside
    jnp, and one of the wrong signature inside the jitted step; each is named when the optimizer is made. Scalar
    schedules (optax's, Python floats, ints) pass."""
    circuit, x, _ = _case(1)
    for make, where in ((optim.em, "em"), (lambda c, s: optim.full_batch_em(c, 1, step_size=s), "full_batch_em"),
                        (optim.anemone, "anemone")):
        for bad, err, match in ((lambda t: jnp.full((3,), 0.5), ValueError, r"got shape \(3,\) and dtype float32"),
                                (lambda t: None, ValueError, "got NoneType"),
                                (lambda: 0.5, TypeError, "calling it on a traced int32 count failed: TypeError")):
            with pytest.raises(err, match=rf"{where}: .*schedule.*{match}"):
                make(circuit, bad)
        for good in (optax.linear_schedule(0.9, 0.1, 4), lambda t: 0.5, lambda t: 1):
            make(circuit, good)
    with pytest.raises(ValueError, match=r"em: a step_size schedule must return a scalar float.*shape \(1,\)"):
        optim.fit(circuit, circuit.params, x, 1, 7, step_size=lambda t: jnp.array([0.5]), progress=False)


@pytest.mark.slow
def test_em_update_and_step_name_flows_or_a_state_that_are_not_theirs():
    """``update``/``step`` of an EM transformation (the optax protocol) take flows and the optimizer's own state:
    flows without their entries failed with a ``KeyError``, a None state with an ``AttributeError``, and another EM
    optimizer's state was taken silently; each is a ``ValueError`` naming the argument. The right ones still give
    the EM step."""
    circuit, x, _ = _case(1)
    flows = circuit.flows(circuit.params, x)
    tx, fb = optim.em(circuit, 0.5), optim.full_batch_em(circuit, 2)
    state = tx.init(circuit.params)
    for fn in (tx.step, tx.update):
        with pytest.raises(ValueError, match=r"em: flows must be the expected counts.*got dict with keys \['sum'\]"):
            fn({"sum": flows["sum"]}, state, circuit.params)
        with pytest.raises(ValueError, match="em: flows must be the expected counts.*got list"):
            fn([flows], state, circuit.params)
        for bad, got in ((None, "NoneType"), (fb.init(circuit.params), "FullBatchEMState"), ({"count": 0}, "dict")):
            with pytest.raises(ValueError, match=rf"em: state must be this optimizer's EMState .*got {got}"):
                fn(flows, bad, circuit.params)
    with pytest.raises(ValueError, match="full_batch_em: state must be this optimizer's FullBatchEMState"):
        fb.step(flows, state, circuit.params)
    new, _ = tx.step(flows, state, circuit.params)
    assert_params(circuit, new, brute_force_em(circuit, circuit.params, x, step=0.5)[0])
