"""The folded plan (``Options(fold_products=True)``, the default: products folded into the sums' gathers) against the
float64 oracle and the full layout, on random circuits and the ready structures."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions, structures
from jaxpc.compiler import ScanSpec
from jaxpc.engine import flows as engine_flows
from jaxpc.engine import forward as engine_forward
from jaxpc.engine import routing, stages
from jaxpc.nodes import inputs, multiply, summate

from . import oracle
from .conftest import tf32_unit
from .test_bruteforce import B, as_input, check_flows_and_ll, make
from .tiers import cases

FOLD = jaxpc.Options(fold_products=True)
FULL = jaxpc.Options(fold_products=False)
SEEDS = [0, 5, 15]  # random DAGs (test_bruteforce's generator): 0 in the fast tier


@pytest.fixture(scope="module", params=cases(SEEDS, fast=[0]))
def case(request):
    return make(request.param)


def test_full_layout_flows_match_exact_expected_counts(case):
    """The full layout against the oracle (test_bruteforce checks the default, the folded plan)."""
    check_flows_and_ll(*case, options=FULL)


@pytest.mark.slow
def test_product_kernels_on_the_full_layout_match_exact_expected_counts(case):
    """The full layout with its product layers written and their flows passed down by the in-place kernels of
    ``jaxpc.ops.pallas_product`` (interpret mode here), against the oracle; ``Tuning.product_kernel_batch=0`` routes
    them back to XLA's layers."""
    options = jaxpc.Options(impl="pallas", fold_products=False)
    assert routing.product_kernels(options, jnp.zeros((2, B), jnp.float32))
    off = options.replace(tuning=jaxpc.Tuning(product_kernel_batch=0))
    assert not routing.product_kernels(off, jnp.zeros((2, B), jnp.float32))
    assert not routing.product_kernels(jaxpc.Options(impl="xla"), jnp.zeros((2, B), jnp.float32))
    check_flows_and_ll(*case, options=options)


@pytest.mark.slow
def test_full_layout_runs_where_products_have_many_readers(monkeypatch):
    """``Tuning.full_layout_reads``: with ``fold_products`` (the default) the flow pass runs the full layout where the
    products have at least that many reading edge blocks per block and run as kernels, within int32 offsets and a
    quarter of the device's memory; the oracle's flows then."""
    gen, c = make(0)
    lay = c.layout
    assert lay.fold is not None and lay.product_reads > 0
    many = jaxpc.Options(impl="pallas", tuning=jaxpc.Tuning(full_layout_reads=1))
    assert routing.buffer_plan(lay, many, B) is lay
    assert routing.buffer_plan(lay, many, 2**31 // lay.num_rows + 1) is lay.fold  # past int32 offsets
    assert routing.buffer_plan(lay, many.replace(impl="xla"), B) is lay.fold  # XLA's products: no kernels
    assert routing.buffer_plan(lay, jaxpc.Options(impl="pallas"), B) is lay.fold  # default: 8 readers
    assert routing.buffer_plan(lay, many.replace(fold_products=False), B) is lay
    monkeypatch.setattr(routing, "device_memory", lambda: 4 * 8 * lay.num_rows * B)
    assert routing.buffer_plan(lay, many, B) is lay
    monkeypatch.setattr(routing, "device_memory", lambda: 4 * 8 * lay.num_rows * B - 4)
    assert routing.buffer_plan(lay, many, B) is lay.fold
    monkeypatch.undo()
    check_flows_and_ll(gen, c, options=many)


def test_product_reads_count_the_edge_blocks_into_products():
    """:attr:`Layout.product_reads`: the sums' edge blocks whose child block is a product's, per product block."""
    xs = [inputs(v, num_node_blocks=1, block_size=2, dist=distributions.Categorical(3)) for v in range(4)]
    p1 = multiply(xs[0], xs[1])  # one product block
    p2 = multiply(xs[2], xs[3], edge_ids=np.zeros((2, 2), np.int64))  # two product blocks, the same children
    s1 = summate(p1, num_node_blocks=3, block_size=2)  # 3 edge blocks into p1
    s2 = summate(p2, num_node_blocks=2, block_size=2)  # 4 edge blocks into p2
    top = multiply(s1, s2, edge_ids=np.zeros((1, 2), np.int64))
    root = summate(top, num_node_blocks=1, block_size=1)  # 1 edge block into top
    assert jaxpc.compile(root).layout.product_reads == pytest.approx((3 + 4 + 1) / 4)


@pytest.mark.slow
def test_product_kernels_in_scanned_stages_equal_xla():
    """An HMM's full layout without the chain scan, its repeated stages under ``lax.scan`` (a traced first row per
    step), each with a product partition: the product kernels' log-likelihoods and flows equal XLA's layers'."""
    c = jaxpc.compile(structures.HMM(12, 4, 5), seed=2)
    assert any(isinstance(s, ScanSpec) and any(p.prods for p in s.period) for s in c.layout.steps)
    x = np.random.default_rng(0).integers(0, 5, (7, 12)).astype(np.int32)
    got, want = (c.flows(c.params, x, options=jaxpc.Options(impl=impl, chain_scan=False, fold_products=False),
                         return_ll=True) for impl in ("pallas", "xla"))
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_product_kernels_write_and_pass_down_in_place():
    """:func:`pallas_product.forward` and :func:`pallas_product.backward` against the product layer's definition,
    at a traced row offset, with a product that reads a padding row (its flow stays out of the padding) and children
    shared by several products (their flows add up)."""
    from jaxpc.ops import pallas_product

    rng = np.random.default_rng(3)
    K, B, first = 4, 5, 8
    buf = jnp.asarray(rng.normal(size=(40, B)), jnp.float32)
    ch = jnp.asarray([[8, 12], [12, 16], [0, 20], [16, 8]], jnp.int32)  # row 0: padding; rows 8, 12, 16 shared
    got = jax.jit(lambda b, r: pallas_product.forward(b, ch, r, K=K))(buf, jnp.int32(24))
    rows = np.asarray(ch)[:, :, None] + np.arange(K)
    want = np.asarray(buf).copy()
    want[24:40] = np.asarray(buf)[rows].sum(1).reshape(16, B)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    fl = jnp.asarray(rng.uniform(size=(40, B)), jnp.float32)
    got = jax.jit(lambda f, r: pallas_product.backward(f, ch, r, K=K, first_row=first))(fl, jnp.int32(24))
    want = np.asarray(fl).copy()
    for i, (a, b) in enumerate(np.asarray(ch)):
        for r0 in (a, b):
            if r0 >= first:
                want[r0:r0 + K] += np.asarray(fl)[24 + i * K:24 + (i + 1) * K]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


@pytest.mark.parametrize("fold", [True, False], ids=["fold", "full"])
def test_reduced_precision_flows_match_exact_expected_counts(case, fold):
    """Below fp32 the flow pass takes each sum node's local sum from its stored value (no recomputed product).
    On the CPU a tf32 product is exact, so that is the only difference from the oracle's counts here; on a GPU
    TF32 rounds the products' operands, and the results are held to that rounding's bound (``_tf32_bounds``)."""
    options = jaxpc.Options(precision="tf32", fold_products=fold)
    ll_atol, flow_rtol = _tf32_bounds(case[1].layout, tf32_unit())  # (0 on the CPU: the oracle's tolerances)
    check_flows_and_ll(*case, options=options, flow_rtol=flow_rtol, ll_atol=ll_atol)


def _tf32_bounds(layout, u: float) -> tuple[float, float]:
    """Worst-case errors of a ``precision="tf32"`` call whose products round each operand to TF32 with relative
    error at most ``u`` (tests/conftest.py's ``tf32_unit``), the float32 rounding aside: ``(ll_atol, flow_rtol)``.
    A sum layer's products of positive terms (weights, children's values) are then within ``2u`` relative, ``2u``
    absolute in the log domain, and a log-likelihood gathers that from each of the ``D`` sum layers nested under the
    root (``D``: the layout's stages of sums, each nesting one). A flow is a ratio of two stored values (a node's and
    the root's, ``2uD`` each) times the backward's products down ``D`` sum layers and the leaves' counts' (``2u``
    each): ``2u (3D + 1)`` relative. (An H100 erred by under 3% of the log-likelihoods' bound here.)"""
    depth = sum(1 for spec in layout.stages() if spec.sums)
    return 2 * u * depth, 2 * u * (3 * depth + 1)


@pytest.mark.parametrize("kw", cases([{"propagation": "GeneralLL", "alpha": 2.5}, {"chain_scan": False}],
                                     fast=[{"chain_scan": False}]),
                         ids=["GeneralLL", "hmm-layers"])
@pytest.mark.slow
def test_reduced_precision_flows_equal_fp32(kw):
    """The stored-value local sums of GeneralLL (``exp(alpha (value - m))``) and of dense partitions (an HMM's
    layers) against the recomputed ones at fp32."""
    root = structures.HMM(7, 6, 5, block_size=3)
    c = jaxpc.compile(root, seed=2)
    x = np.random.default_rng(4).integers(0, 5, (13, 7)).astype(np.int32)
    assert any(p.dense for s in c.layout.stages() for p in s.sums)
    got = c.flows(c.params, x, options=jaxpc.Options(precision="tf32", **kw), return_ll=True)
    ref = c.flows(c.params, x, options=jaxpc.Options(precision="fp32", **kw), return_ll=True)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    # tempered flows split by another exponent than the forward's: their local sums are recomputed at any precision
    tempered = jaxpc.Options(precision="tf32", eflow_temperature=0.5, chain_scan=False)
    for a, b in zip(jax.tree_util.tree_leaves(c.flows(c.params, x, options=tempered)),
                    jax.tree_util.tree_leaves(c.flows(c.params, x, options=tempered.replace(precision="fp32")))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


def test_sum_layers_in_pieces_match_exact_expected_counts(case):
    """``Options(gather_chunk=1)``: every sum partition of more than one block runs one parent block at a time,
    forward and backward (random DAGs with tying and padded fan-ins), against the oracle's exact counts."""
    gen, c = case
    plan = c.layout.fold if c.layout.fold is not None else c.layout
    for p in (p for s in plan.stages() for p in s.sums):
        assert routing.pieces(p, B, 1) == ([(0, p.n)] if p.dense else [(i, i + 1) for i in range(p.n)])
    check_flows_and_ll(gen, c, options=jaxpc.Options(gather_chunk=1))


@pytest.mark.parametrize("mode", ["inline", "batched"])
def test_param_flow_passes_match_exact_expected_counts(case, mode):
    """``Options.param_flow_pass``: the parameter flows computed level by level with the element flows
    (``inline``) or after them in one batched product per block shape and fan-in (``batched``; the default,
    ``auto``, batches fan-in 1 at this batch), on random DAGs with tying and padded fan-ins, against the
    oracle's exact counts."""
    check_flows_and_ll(*case, options=jaxpc.Options(param_flow_pass=mode))


def _batched_blocks(monkeypatch, c, x, opts) -> int:
    """Parent blocks whose parameter flows the batched pass computes when the flow step is traced with ``opts``."""
    from jaxpc.engine import em

    seen = []
    real = engine_flows._batched_param_flows

    def spy(values, flows, dp, logw, spec, tab, options, *rest, **kw):
        seen.append(spec.n)
        return real(values, flows, dp, logw, spec, tab, options, *rest, **kw)

    monkeypatch.setattr(engine_flows, "_batched_param_flows", spy)
    jax.make_jaxpr(lambda p, xb: em.flows_and_ll(c.layout, c.tables, p, xb, None, None, opts))(c.params, x)
    return sum(seen)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hclt", "pd"])
@pytest.mark.full
def test_batched_param_flows_equal_the_inline_ones(monkeypatch, name):
    """The batched parameter-flow pass covers exactly the sum blocks gathered block by block (a scanned HCLT's
    levels and its single-block top levels, a PD's fan-ins of 1 to 3 child blocks and its root; by default those
    of fan-in 1), gives the inline pass's flows (LL, GeneralLL, tempered, tf32 stored local sums, pieces, unrolled
    stages, full layout), and stands aside for max-product, ``compute_param_flows=False``, the Pallas backward
    and batches above ``Options.tuning.pflow_batch``. The HCLT's tables cover their groups in parameter order (the flows
    written whole, no scatter)."""
    if name == "hclt":
        c, x = _chain_hclt()
    else:
        c = jaxpc.compile(structures.PD((2, 4), 8, split_intervals=(1, 1), input_dist=distributions.Categorical(5)),
                          seed=3)
        x = np.random.default_rng(0).integers(0, 5, (11, 8)).astype(np.int32)
    opts = jaxpc.Options(chain_scan=False)
    for fold in (True, False):
        plan = c.layout.fold if fold else c.layout
        o = opts.replace(fold_products=fold)
        blocks = sum(p.n for s in plan.stages() for p in s.sums if p.blockwise)
        assert blocks > 1 and _batched_blocks(monkeypatch, c, x, o.replace(param_flow_pass="batched")) == blocks
        # auto: tree levels (fan-in 1) only
        blocks = sum(p.n for s in plan.stages() for p in s.sums if p.blockwise and p.C == 1)
        assert blocks > 1 and _batched_blocks(monkeypatch, c, x, o) == blocks
        if name == "hclt":
            sizes = {g.key: g.num_blocks for g in plan.sum_groups}
            assert all(s.start == 0 and s.unique and s.n * s.C == sizes[s.group] for s in plan.pflows)
        else:
            assert sorted(s.C for s in plan.pflows if s.group == "8x8") == [1, 2, 3]
    assert _batched_blocks(monkeypatch, c, x, opts.replace(param_flow_pass="inline")) == 0
    assert _batched_blocks(monkeypatch, c, x, opts.replace(propagation="MPE")) == 0
    assert _batched_blocks(monkeypatch, c, x, opts.replace(compute_param_flows=False)) == 0
    assert _batched_blocks(monkeypatch, c, x, opts.replace(impl="pallas")) == 0
    below = opts.replace(tuning=jaxpc.Tuning(pflow_batch=len(x) - 1))
    assert _batched_blocks(monkeypatch, c, x, below) == 0  # auto: inline above tuning.pflow_batch
    assert _batched_blocks(monkeypatch, c, x, below.replace(param_flow_pass="batched")) > 0  # forced: at any batch
    for kw in ({"propagation": "GeneralLL", "alpha": 2.5, "precision": "tf32", "gather_chunk": 2 * 8 * 11},
               {"pflow_temperature": 0.5, "eflow_temperature": 0.7, "scan_stages": False, "fold_products": False}):
        o = opts.replace(**kw)
        got = c.flows(c.params, x, options=o.replace(param_flow_pass="batched"), return_ll=True)
        ref = c.flows(c.params, x, options=o.replace(param_flow_pass="inline"), return_ll=True)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.filterwarnings("ignore:jaxpc. 'flows' has been compiled")
@pytest.mark.slow
@pytest.mark.full
def test_the_summed_param_flow_kernel_equals_the_matrix_products(monkeypatch):
    """``Tuning.pflow_sum_batch``: on a Hopper GPU (here the kernel on the interpreter), up to that batch, the
    batched pass computes the blocks of fan-in 1 by :func:`jaxpc.ops.mosaic_tree.summed_param_flows`, in pieces,
    and gives the matrix products' flows within TF32's rounding; never at fp32, with GeneralLL, above that batch,
    or off a Hopper GPU."""
    from jaxpc.ops import mosaic_tree

    c, x = _chain_hclt(64)  # (the kernel's blocks: multiples of 64 parents)
    blocks = []
    real = mosaic_tree.summed_param_flows

    def spy(*args, **kw):
        blocks.append(args[0].shape[0])
        return real(*args, **kw)

    monkeypatch.setattr(mosaic_tree, "summed_param_flows", spy)
    no_clusters = jaxpc.Tuning(tree_clusters=False)  # (the tree's levels on clusters: tests/test_mosaic_tree.py)
    base = jaxpc.Options(chain_scan=False, param_flow_pass="batched", tuning=no_clusters)
    tf32 = base.replace(precision="tf32", gather_chunk=2 * 64 * 16)
    matrix = tf32.replace(tuning=jaxpc.Tuning(tree_clusters=False, pflow_sum_batch=0))
    ref = c.flows(c.params, x, options=matrix, return_ll=True)
    monkeypatch.setattr(routing, "on_hopper", lambda: True)
    got = c.flows(c.params, x, options=tf32, return_ll=True)
    assert blocks and max(blocks) < sum(blocks)  # in pieces of gather_chunk
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=1e-7)
    blocks.clear()
    for o in (base.replace(precision="fp32"), tf32.replace(propagation="GeneralLL", alpha=2.5),
              tf32.replace(tuning=jaxpc.Tuning(tree_clusters=False, pflow_sum_batch=8))):  # (11 samples: 16)
        c.flows(c.params, x, options=o)
    assert not blocks
    monkeypatch.setattr(routing, "on_hopper", lambda: False)
    c.flows(c.params, x, options=tf32.replace(gather_chunk=1 << 20))
    assert not blocks  # off a Hopper GPU


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, {"propagation": "GeneralLL", "alpha": 0.5}, {"precision": "bf16"}],
                         ids=["tf32", "GeneralLL", "bf16"])
@pytest.mark.full
def test_batched_param_flows_kernel_equals_xla(monkeypatch, kw):
    """Where the in-place forward kept every batched block's shift, the batched pass runs its Pallas kernel
    (interpret mode here; on a GPU with the default impl) and gives XLA's batched flows, and for tf32 the inline
    ones too (tf32 and bf16 stored local sums, GeneralLL with an exponent up to 1: above it the sum layers run the
    exact path on XLA), on a PD (its partitions hold every kind of block an HCLT's do); which options route to it."""
    from jaxpc.engine import em
    from jaxpc.ops import pallas_sum

    c = jaxpc.compile(structures.PD((2, 4), 8, split_intervals=(1, 1), input_dist=distributions.Categorical(5)),
                      seed=3)
    x = np.random.default_rng(0).integers(0, 5, (11, 8)).astype(np.int32)
    route, f32 = routing.pflow_kernel, jax.numpy.float32
    o = jaxpc.Options(precision="tf32")
    assert route(o.replace(impl="pallas_forward"), f32) and route(o.replace(impl="pallas"), f32)
    assert not route(o.replace(impl="xla"), f32) and not route(o.replace(impl="pallas_forward"), jnp.bfloat16)
    assert not route(o.replace(impl="pallas_forward", precision="fp32"), f32)
    assert not route(o.replace(impl="pallas_forward", pflow_temperature=0.5), f32)
    assert route(o, f32) == (jax.default_backend() == "gpu")
    calls = []
    real = pallas_sum.param_flows_after
    monkeypatch.setattr(pallas_sum, "param_flows_after", lambda *a, **k: calls.append(1) or real(*a, **k))

    def flows(o):  # traced afresh each time
        return jax.jit(lambda p, xb: em.flows_and_ll(c.layout, c.tables, p, xb, None, None, o))(c.params, x)

    o = jaxpc.Options(chain_scan=False, param_flow_pass="batched", impl="pallas_forward",
                      **{"precision": "tf32", **kw})
    got = flows(o)
    assert calls  # the kernel ran (every block of fan-in 1 kept its shift)
    del calls[:]
    with monkeypatch.context() as m:  # the same forward, XLA's batched pass
        m.setattr(routing, "pflow_kernel", lambda options, dtype: False)
        xla = flows(o)
    assert not calls  # the route was taken away: XLA's pass ran
    # and XLA's inline pass, once (test_batched_param_flows_equal_the_inline_ones compares the two XLA passes)
    inline = o.replace(param_flow_pass="inline", tuning=jaxpc.Tuning(fanin_kernel_batch=0))
    refs = (xla, flows(inline)) if not kw else (xla,)
    tol = 2e-2 if o.precision == "bf16" else 1e-5  # bfloat16 operands: 2^-8 per product, rounded in other places
    for ref in refs:
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol / 10)
    del calls[:]
    jax.eval_shape(lambda p, xb: em.flows_and_ll(c.layout, c.tables, p, xb, None, None,
                                                 o.replace(kernel_shifts=False)), c.params, x)
    assert not calls  # no kept shifts: XLA's batched pass


def test_batched_param_flows_refuse_max_product():
    from jaxpc.ops.sum_layer import sum_layer_param_flows_reference

    z = jax.numpy.zeros((8, 2))
    with pytest.raises(ValueError, match="MPE"):
        sum_layer_param_flows_reference(z, z, jax.numpy.zeros((1, 1), int), jax.numpy.zeros((1, 1), int),
                                        jax.numpy.zeros((1, 2, 2)), jax.numpy.zeros(1, int), Kp=2, Kc=2,
                                        propagation="MPE")


PIECE_VARIANTS = ({}, {"propagation": "MPE"}, {"backward": "autodiff"})


def _pieces_equal_whole(c, x, opts, variants=PIECE_VARIANTS):
    for kw in variants:
        got = c.flows(c.params, x, options=opts.replace(**kw), return_ll=True)
        ref = c.flows(c.params, x, options=opts.replace(gather_chunk=1 << 30, **kw), return_ll=True)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("fold", [True, False], ids=["fold", "full"])
@pytest.mark.full
def test_pd_sum_layers_in_pieces(fold):
    """A PD (levels of four parent blocks, a dense root) in pieces of two parent blocks:
    log-likelihoods against the oracle, flows equal to the partitions run whole (max-product and autodiff's
    backward on the folded plan)."""
    c = jaxpc.compile(structures.PD((4, 4), 8, split_intervals=(2, 2), input_dist=distributions.Categorical(5)), seed=3)
    x = np.random.default_rng(0).integers(0, 5, (11, 16)).astype(np.int32)
    plan = c.layout.fold if fold else c.layout
    limit = 2 * 8 * 11  # two blocks of one child block (Kc = 8) per piece
    split = [p for s in plan.stages() for p in s.sums if len(routing.pieces(p, 11, limit)) > 1]
    assert len(split) >= 2
    opts = jaxpc.Options(fold_products=fold, gather_chunk=limit)
    _, ref = oracle.forward(c, c.params, x)
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x, options=opts)), ref, rtol=1e-5, atol=1e-5)
    _pieces_equal_whole(c, x, opts, variants=PIECE_VARIANTS if fold else ({},))


def test_pieces_cover_the_partition_within_the_limit():
    part = jaxpc.compiler.layout.SumPart(n=10, C=3, Kp=4, Kc=2, group="g", dense=False)
    B = 5  # 30 floats gathered per parent block
    assert routing.pieces(part, B, 1 << 25) == [(0, 10)]
    for limit in (1, 29, 30, 31, 60, 89, 90, 299, 300):
        r = routing.pieces(part, B, limit)
        assert r[0][0] == 0 and r[-1][1] == 10 and all(a < b for a, b in r)
        assert all(r[i][1] == r[i + 1][0] for i in range(len(r) - 1))
        sizes = [b - a for a, b in r]
        assert max(sizes) * 30 <= max(limit, 30) and max(sizes) - min(sizes) <= max(sizes) // 2 + 1
    dense = jaxpc.compiler.layout.SumPart(n=10, C=3, Kp=4, Kc=2, group="g", dense=True)
    assert routing.pieces(dense, B, 1) == [(0, 10)]  # its children are gathered once for all blocks
    # at most MAX_PIECES pieces: past that the pieces outgrow the limit (a 2B-edge PD's stage at a large batch)
    big = jaxpc.compiler.layout.SumPart(n=2784, C=16, Kp=32, Kc=32, group="g", dense=False)
    r = routing.pieces(big, 8192, 1 << 24)
    assert len(r) == routing.MAX_PIECES and r[0][0] == 0 and r[-1][1] == 2784
    assert all(r[i][1] == r[i + 1][0] for i in range(len(r) - 1))


def test_in_order_chains_the_pieces_through_barriers():
    from jaxpc.ops.pieces import in_order, ranges

    assert ranges(10, 3) == [(0, 2), (2, 5), (5, 7), (7, 10)] and ranges(10, 10) == [(0, 10)]
    assert ranges(5, 0) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    x = jax.numpy.arange(10.0)
    seen = []

    def step(done, a, b, xs):
        seen.append((a, b))
        return done + [xs * (a + 1)]

    def f(x):
        return jax.numpy.concatenate(in_order(ranges(10, 4), lambda a, b: x[a:b], step, []))

    expect = np.r_[np.arange(3.0), 4 * np.arange(3.0, 6), 7 * np.arange(6.0, 10)]
    np.testing.assert_array_equal(np.asarray(f(x)), expect)
    assert seen == [(0, 3), (3, 6), (6, 10)]
    assert str(jax.make_jaxpr(f)(x)).count("optimization_barrier") == 2


def test_auto_impl_picks_the_pallas_forward_on_a_gpu_for_fan_ins_and_small_batches(monkeypatch):
    SumPart = jaxpc.compiler.layout.SumPart
    fan_in = SumPart(n=8, C=4, Kp=4, Kc=4, group="g", dense=False, U=20, D=3)
    tree = SumPart(n=8, C=1, Kp=4, Kc=4, group="g", dense=False, U=8, D=1)
    dense = SumPart(n=8, C=4, Kp=4, Kc=4, group="g", dense=True, U=4, D=8)
    auto = jaxpc.Options()
    assert auto.impl == "auto"
    monkeypatch.setattr(routing, "on_gpu", lambda: False)
    assert [routing.kernel_choice(auto, p, 16) for p in (fan_in, tree, dense)] == [("xla", None)] * 3  # off a GPU
    monkeypatch.setattr(routing, "on_gpu", lambda: True)
    assert [routing.kernel_choice(auto, p, 128)[0] for p in (fan_in, tree, dense)] == [
        "pallas_forward", "xla", "xla"]
    # at small batches tree levels run the kernel too (one kernel per level instead of XLA's four)
    small = jaxpc.Tuning().small_batch
    assert [routing.kernel_choice(auto, p, small)[0] for p in (fan_in, tree, dense)] == [
        "pallas_forward", "pallas_forward", "xla"]
    assert routing.kernel_choice(auto, tree, small + 1)[0] == "xla"
    assert routing.kernel_choice(auto, fan_in, 16, np.float64)[0] == "xla"
    # an explicit impl and a tuned route win over the rule
    assert routing.kernel_choice(auto.replace(impl="xla"), fan_in, 16)[0] == "xla"
    tuned = auto.replace(kernels=((routing.partition_key(fan_in, 16), ("xla",)),))
    assert routing.kernel_choice(tuned, fan_in, 16)[0] == "xla"


@pytest.mark.slow
@pytest.mark.full
def test_auto_impl_as_on_a_gpu(pallas_forward_calls):
    """The default options with the GPU rule on (the Pallas kernels in interpret mode): at a small batch every
    partition of a PD that is not dense runs the in-place Pallas forward (at a large one its fan-in partitions
    only), the values and flows are those of the XLA path, and reverse-mode autodiff (which the kernels do not
    support) runs on XLA."""
    calls = pallas_forward_calls
    root = structures.PD((6, 6), 4, split_intervals=(2, 2), input_dist=distributions.Categorical(3))
    x = np.random.default_rng(1).integers(0, 3, (9, 36)).astype(np.int32)
    auto = jaxpc.Options()
    c = jaxpc.compile(root, seed=1)
    got = c.flows(c.params, x, options=auto, return_ll=True)
    sparse = [p for s in c.layout.fold.stages() for p in s.sums if not p.dense]
    assert any(p.C == 1 for p in sparse) and any(p.C > 1 for p in sparse)
    assert len(calls) == len(sparse) and all(o is not None for o in calls)
    del calls[:]
    c.flows(c.params, np.tile(x, (4, 1)), options=auto)  # 36 samples: above tuning.small_batch
    assert len(calls) == sum(p.C > 1 for p in sparse)
    ref = jaxpc.compile(root, seed=1)
    want = ref.flows(ref.params, x, options=auto.replace(impl="xla"), return_ll=True)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    del calls[:]
    ad = c.flows(c.params, x, options=auto.replace(backward="autodiff"), return_ll=True)
    assert not calls
    for a, b in zip(jax.tree_util.tree_leaves(ad), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.full
def test_max_product_kernels_give_xlas_values_exactly(pallas_forward_calls):
    """With ``Tuning(max_product_kernels=True)`` and ``impl="auto"`` as on a GPU, the max-product sum layers of a
    PD that are not dense run Pallas's max-plus forward in place (interpret mode here): ``mpe``'s assignments and
    values, and the hard-EM (``propagation="MPE"``) log-likelihoods and flows, whose pass finds the maximizing
    children by equality with the parents' values, equal XLA's bit for bit. Off (the default), they run on XLA."""
    calls = pallas_forward_calls
    # (a PD of four sum partitions: tree levels, a fan-in of 2 and the dense root)
    root = structures.PD((4, 6), 4, split_intervals=(2, 2), input_dist=distributions.Categorical(3))
    x = np.random.default_rng(2).integers(0, 3, (9, 24)).astype(np.int32)
    miss = np.arange(24) % 3 == 0
    c = jaxpc.compile(root, seed=1)
    on = jaxpc.Options(tuning=jaxpc.Tuning(max_product_kernels=True))
    got = c.mpe(c.params, x, miss, options=on)
    assert calls and all(o is not None for o in calls)
    want = c.mpe(c.params, x, miss, options=jaxpc.Options(impl="xla"))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    del calls[:]
    hard = on.replace(propagation="MPE")
    got = c.flows(c.params, x, options=hard, return_ll=True)
    assert calls
    want = c.flows(c.params, x, options=hard.replace(impl="xla"), return_ll=True)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # by default (None) the kernels where they were faster: 128 samples and more for layers of several child
    # blocks, 512 for layers of one where the stages run unrolled
    mpe = jaxpc.Options(propagation="MPE")
    unrolled = mpe.replace(scan_stages=False)
    fanin = next(p for st in c.layout.fold.stages() for p in st.sums if not p.dense and p.C > 1)
    single = dataclasses.replace(fanin, C=1)
    no_kernels = unrolled.replace(tuning=jaxpc.Tuning(max_product_kernels=False))
    cases = ((mpe, fanin, 9, False), (mpe, fanin, 128, True), (mpe, single, 512, False), (unrolled, fanin, 64, False),
             (unrolled, fanin, 128, True), (unrolled, single, 256, False), (unrolled, single, 512, True),
             (unrolled.replace(impl="pallas"), fanin, 512, False), (no_kernels, fanin, 512, False),
             (on.replace(propagation="MPE"), fanin, 9, True))
    for options, part, batch, kernel in cases:
        impl = routing.kernel_choice(options, part, batch)[0]
        assert routing.runs_inplace(impl, options, jnp.zeros((1, batch))) == kernel, (options, part.C, batch)


@pytest.mark.parametrize("kw", [{"propagation": "MPE"}, {"propagation": "GeneralLL", "alpha": 2.5},
                                {"pflow_temperature": 0.5, "eflow_temperature": 2.0}],
                         ids=["MPE", "GeneralLL", "tempered"])
def test_other_propagations_equal_the_full_layout(case, kw):
    gen, c = case
    x = as_input(gen, gen.sample_data(B))
    got = c.flows(c.params, x, options=FOLD.replace(**kw), return_ll=True)
    ref = c.flows(c.params, x, options=FULL.replace(**kw), return_ll=True)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", cases(["hclt", "pd", "hmm", "rat"], fast=["hmm"]))
def test_structures_fold_to_sum_stages_with_fewer_rows(name):
    rng = np.random.default_rng(0)
    cat = distributions.Categorical(4)
    if name == "hclt":
        data = rng.integers(0, 4, (300, 10))
        root = structures.HCLT(data, 4, input_dist=cat)
    elif name == "pd":
        data = rng.integers(0, 4, (20, 16))
        root = structures.PD((4, 4), 3, split_intervals=(2, 2), input_dist=cat)
    elif name == "hmm":
        data = rng.integers(0, 4, (20, 7))
        root = structures.HMM(7, 4, 4, block_size=2)
    else:
        data = rng.integers(0, 4, (20, 8))
        root = structures.RAT_SPN(8, num_latents=3, depth=2, num_repetitions=2, input_dist=cat)
    c = jaxpc.compile(root)
    fold = c.layout.fold
    assert fold is not None and fold.num_rows < c.layout.num_rows
    assert all(not s.prods for s in fold.stages())
    assert len(list(fold.stages())) < len(list(c.layout.stages()))
    x = data[:9].astype(np.int32)
    opts = FOLD.replace(chain_scan=False)
    got = c.flows(c.params, x, options=opts, return_ll=True)
    ref = c.flows(c.params, x, options=FULL.replace(chain_scan=False), return_ll=True)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_no_fold_without_products_or_with_a_product_root():
    a = inputs(0, num_nodes=2, dist=distributions.Bernoulli())
    b = inputs(1, num_nodes=2, dist=distributions.Bernoulli())
    assert jaxpc.compile(summate(a, num_nodes=1)).layout.fold is None  # nothing to fold
    assert jaxpc.compile(multiply(summate(a, num_nodes=1), summate(b, num_nodes=1))).layout.fold is None


def test_nested_products_and_mixed_children_fold():
    """A sum over a product of a product (expanded recursively) and a plain input, with padding zero rows."""
    x0, x1, x2 = (inputs(v, num_nodes=2, dist=distributions.Categorical(3)) for v in range(3))
    inner = multiply(x0, x1)
    outer = multiply(inner, x2)
    s = summate(outer, multiply(summate(multiply(x0, x1), num_nodes=2), x2), num_nodes=1)
    c = jaxpc.compile(s, seed=4)
    assert max(p.M for st in c.layout.fold.stages() for p in st.sums) == 3
    x = np.random.default_rng(1).integers(0, 3, (B, 3))
    fl = c.flows(c.params, x.astype(np.int32), options=FOLD)
    sums, ins, _ = oracle.flow_totals(c, c.params, x)
    assert oracle.check_flows(c, fl, sums, ins) > 0


FUSED = jaxpc.Options(fold_products=True, impl="pallas")


@pytest.mark.parametrize("seed", cases(SEEDS[:3], fast=[0]))
@pytest.mark.slow
def test_fused_kernels_match_exact_expected_counts(seed):
    """The folded plan on the Pallas kernels (interpret mode here), writing the node and flow buffers in place."""
    check_flows_and_ll(*make(seed), options=FUSED)


def test_fused_plan_runs_the_in_place_kernels():
    gen, c = make(SEEDS[0])
    x = as_input(gen, gen.sample_data(B))
    text = str(jax.make_jaxpr(lambda p: c.flows(p, x, options=FUSED))(c.params))
    assert "jaxpc_sum_forward_inplace" in text and "jaxpc_sum_backward_children_inplace" in text
    assert "scatter-add" not in text.split("jaxpc_sum_forward_inplace")[0]  # no XLA sum layer on the way up


@pytest.mark.parametrize("batch,precision,kernel",
                         cases([(B, "fp32", "level"), (B, "tf32", "level"), (70, "fp32", "slots_inplace")],
                               fast=[(B, "tf32", "level")], unpack=True))
@pytest.mark.slow
def test_tree_levels_run_the_level_or_slot_kernel(batch, precision, kernel):
    """An HCLT's folded levels are exclusive (one child per parent, one parent per row block): the Pallas
    backward writes each parent's child flows to all row blocks of its child, in one kernel per level (parameter
    flows added in place, local sums recomputed at fp32 and read from the stored values below) up to
    ``LEVEL_BATCH`` samples and in three above; its flows equal the reference's."""
    data = np.random.default_rng(5).integers(0, 4, (200, 7))
    c = jaxpc.compile(structures.HCLT(data, 4, input_dist=distributions.Categorical(num_cats=4)), seed=2)
    parts = [p for st in c.layout.fold.stages() for p in st.sums]
    assert sum(routing.exclusive(p) for p in parts) >= len(parts) - 1  # all but (maybe) the root's
    x = data[:batch].astype(np.int32)
    fused, fold = FUSED.replace(precision=precision), FOLD.replace(precision=precision)
    text = str(jax.make_jaxpr(lambda p: c.flows(p, x, options=fused))(c.params))
    assert f"jaxpc_sum_backward_{kernel}" in text
    got = c.flows(c.params, x, options=fused, return_ll=True)
    ref = c.flows(c.params, x, options=fold, return_ll=True)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-5)


def _sum_parts(plan, tables):
    """Every (SumPart, its index tables as numpy) of a plan, scans unstacked."""
    for step, tab in zip(plan.steps, tables["steps"]):
        if isinstance(step, ScanSpec):
            for r in range(step.repeats):
                for st, t in zip(step.period, tab):
                    t = jax.tree_util.tree_map(lambda a: np.asarray(a)[r], t)
                    yield from zip(st.sums, t["sums"])
        else:
            yield from zip(step.sums, jax.tree_util.tree_map(np.asarray, tab["sums"]))


@pytest.mark.parametrize("name", ["hclt", "pd", "rat", "random"])
def test_conflict_free_scatters_are_conflict_free(name):
    """The backward's scatters run without atomic adds where the compiler says a partition reads each child row
    block once (``D == 1``) or uses each parameter block once (``unique_pid``); on the GPU a wrong claim would
    lose updates silently, so the claim is checked on the tables themselves."""
    cat = distributions.Categorical(4)
    if name == "hclt":
        c = jaxpc.compile(structures.HCLT(np.random.default_rng(0).integers(0, 4, (300, 12)), 4, input_dist=cat))
    elif name == "pd":
        c = jaxpc.compile(structures.PD((4, 4), 3, split_intervals=(2, 2), input_dist=cat))
    elif name == "rat":
        c = jaxpc.compile(structures.RAT_SPN(8, num_latents=3, depth=2, num_repetitions=2, input_dist=cat))
    else:  # random DAGs: shared children, tied parameters, padding
        c = make(5)[1]
    flagged = {"distinct": 0, "unique_pid": 0}
    for plan, tables in ((c.layout, c.tables), (c.layout.fold, c.tables.get("fold"))):
        if plan is None:
            continue
        for part, t in _sum_parts(plan, tables):
            ch = t["ch"] if t["ch"].ndim == 3 else t["ch"][:, :, None]
            if part.D == 1 and not part.dense:
                flagged["distinct"] += 1
                starts = ch[ch >= 2 * plan.kmax]
                assert np.unique(starts).size == starts.size, part
            if part.unique_pid:
                flagged["unique_pid"] += 1
                assert np.unique(t["pid"]).size == t["pid"].size and not np.any(ch[:, :, 0] == plan.ninf_row), part
    if name == "hclt":  # every tree level takes both fast paths
        assert flagged["distinct"] > 0 and flagged["unique_pid"] > 0


@pytest.mark.parametrize("fold", cases([True, False], fast=[False]), ids=["fold", "full"])
def test_single_reader_flows_match_exact_expected_counts(fold):
    """In a tree (an HCLT) every row has one reader (``Layout.single_reader``, in both plans), so the flow pass's
    XLA scatters write the child flows instead of adding them: flows with missing values and weights against the
    oracle. A PD, a RAT-SPN and a random DAG, whose nodes have several parents, keep the adding scatters."""
    cat = distributions.Categorical(4)
    rng = np.random.default_rng(3)
    c = jaxpc.compile(structures.HCLT(rng.integers(0, 4, (300, 10)), 4, input_dist=cat))
    assert c.layout.single_reader and c.layout.fold.single_reader
    for dag in (jaxpc.compile(structures.PD((4, 4), 3, split_intervals=(2, 2), input_dist=cat)),
                jaxpc.compile(structures.RAT_SPN(8, num_latents=3, depth=2, num_repetitions=2, input_dist=cat)),
                make(5)[1]):
        assert not dag.layout.single_reader and not dag.layout.fold.single_reader
    x = rng.integers(0, 4, (B, 10)).astype(np.int32)
    miss = rng.random(x.shape) < 0.3
    w = rng.uniform(0.5, 2.0, B)
    fl = c.flows(c.params, x, missing=miss, ll_weights=w, options=jaxpc.Options(fold_products=fold, impl="xla"))
    totals, in_totals, _ = oracle.flow_totals(c, c.params, x, miss, weights=w)
    assert oracle.check_flows(c, fl, totals, in_totals) > 0


def test_flow_buffer_zeroes_its_gaps_in_one_scatter(monkeypatch):
    """On a GPU the unset flow buffer gets every gap zeroed by one scatter (a slice update per gap was a kernel
    each), and is plain zeros where the unset buffer would start as zeros anyway (below ``Tuning.min_unset``
    elements): no scatter then."""
    from jaxpc.ops import buffers

    rng = np.random.default_rng(3)
    data = rng.integers(0, 4, (300, 30))
    c = jaxpc.compile(structures.HCLT(data, 16, input_dist=distributions.Categorical(4)))
    o = jaxpc.Options(impl="xla")
    plan = routing.buffer_plan(c.layout, o, 16)
    gaps = plan.flow_gaps
    assert gaps is not None and len(gaps) > 1
    values = jnp.ones((plan.num_rows, 16), jnp.float32)
    monkeypatch.setattr(buffers, "_on_gpu", lambda: True)

    def scatters(opts):
        jaxpr = jax.make_jaxpr(lambda v: engine_flows.flow_buffer(plan, opts, v))(values)
        return sum(e.primitive.name == "scatter" for e in jaxpr.eqns), np.asarray(jax.jit(
            lambda v: engine_flows.flow_buffer(plan, opts, v))(values))

    n, buf = scatters(o.replace(tuning=jaxpc.Tuning(min_unset=1)))
    assert n == 1
    for a, b in gaps:
        assert (buf[a:b] == 0).all()
    n, buf = scatters(o.replace(tuning=jaxpc.Tuning(min_unset=values.size + 1)))
    assert n == 0 and (buf == 0).all()


@pytest.mark.parametrize("fold", cases([True, False], fast=[False]), ids=["fold", "full"])
def test_single_reader_flow_pass_writes_every_row_it_reads(monkeypatch, fold):
    """A single-reader layout's flow pass starts from an unset buffer (``flows.flow_buffer``: uninitialized on a
    GPU, NaN off one, as here on every device) with only its gaps zeroed (``Layout.flow_gaps``: the padding rows in
    a tree; None in a DAG). Every row's one reader writes it before it is read: the whole flow buffer equals the
    zero-started pass's, without a NaN left, the dense one-block top partitions' writes included."""
    from jaxpc.ops import buffers

    monkeypatch.setattr(buffers, "_on_gpu", lambda: False)  # NaN where a read comes before its write, on a GPU too
    cat = distributions.Categorical(4)
    rng = np.random.default_rng(5)
    c = jaxpc.compile(structures.HCLT(rng.integers(0, 4, (300, 10)), 4, input_dist=cat))
    o = jaxpc.Options(fold_products=fold, impl="xla")
    plan = routing.buffer_plan(c.layout, o, 16)
    assert plan.flow_gaps == ((0, 2 * plan.kmax),)
    assert any(p.dense and p.n == 1 for spec in plan.stages() for p in spec.sums)
    assert jaxpc.compile(structures.PD((4, 4), 3, split_intervals=(2, 2), input_dist=cat)).layout.flow_gaps is None
    x = jnp.asarray(rng.integers(0, 4, (B, 10)).astype(np.int32))
    buf = stages.input_buffer(plan, engine_forward.input_values(c.layout, c.tables, c.params, x, None, o),
                                      jnp.float32)
    start = engine_flows.flow_buffer(plan, o, buf)
    assert (np.asarray(start[:2 * plan.kmax]) == 0).all() and np.isnan(np.asarray(start[2 * plan.kmax:])).all()
    tabs = c.tables if plan is c.layout else c.tables["fold"]

    def whole_flows():  # under the options o holds at the call
        def flows_of(b):
            _, vjp = jax.vjp(lambda b_: engine_flows.root_values(plan, tabs, c.params["sum"], b_, o, True), b)
            return vjp(jnp.ones(B))[0]

        return np.asarray(jax.jit(flows_of)(buf))

    unset = whole_flows()
    o = o.replace(tuning=jaxpc.Tuning(unset_rows=False))
    assert (np.asarray(engine_flows.flow_buffer(plan, o, buf)) == 0).all()
    zeroed = whole_flows()
    assert not np.isnan(unset).any() and np.abs(unset[2 * plan.kmax:]).sum() > 0
    np.testing.assert_array_equal(unset[2 * plan.kmax:], zeroed[2 * plan.kmax:])


def test_unset_buffers_are_nan_here_and_uninitialized_only_when_large_on_a_gpu(monkeypatch):
    from jaxpc.ops import buffers

    monkeypatch.setattr(buffers, "_on_gpu", lambda: False)  # here: off a GPU, whatever runs the test
    assert np.isnan(np.asarray(buffers.uninitialized((3, 2), jnp.float32))).all()
    monkeypatch.setattr(buffers, "_on_gpu", lambda: True)
    small = str(jax.make_jaxpr(lambda: buffers.uninitialized((4, 4), jnp.float32))())
    large = str(jax.make_jaxpr(lambda: buffers.uninitialized((buffers.MIN_UNSET // 2, 2), jnp.float32))())
    assert "empty" in large and "empty" not in small and "nan" not in small


def test_without_the_triton_backend_kernels_fall_back_to_xla_with_one_warning(monkeypatch):
    from jaxpc.ops import pallas_sum

    monkeypatch.setattr(pallas_sum, "plgpu", None)
    monkeypatch.setattr(routing, "_WARNED_UNAVAILABLE", [])
    monkeypatch.setattr(routing, "on_gpu", lambda: True)
    root = structures.PD((4, 6), 8, split_intervals=(2, 2), input_dist=distributions.Categorical(3))
    x = np.random.default_rng(3).integers(0, 3, (5, 24)).astype(np.int32)
    c, ref = jaxpc.compile(root, seed=5), jaxpc.compile(root, seed=5)
    want = ref.flows(ref.params, x, options=jaxpc.Options(impl="xla"), return_ll=True)
    with pytest.warns(RuntimeWarning, match="Triton backend"):
        got = c.flows(c.params, x, options=jaxpc.Options(impl="pallas"), return_ll=True)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: no second warning
        got = c.flows(c.params, x, return_ll=True)  # impl="auto" with the GPU rule on
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def _chain_hclt(latents: int = 8):
    """An HCLT over a chain of 12 variables (each copies the one before with probability 0.8): a path-shaped tree
    whose repeated levels the compiler scans."""
    rng = np.random.default_rng(0)
    x = np.zeros((400, 12), np.int32)
    x[:, 0] = rng.integers(0, 3, 400)
    for i in range(1, 12):
        x[:, i] = np.where(rng.random(400) < 0.8, x[:, i - 1], rng.integers(0, 3, 400))
    return jaxpc.compile(structures.HCLT(x, latents, input_dist=distributions.Categorical(3)), seed=1), x[:11]


@pytest.mark.slow
@pytest.mark.parametrize("name,fold,impl", [("hclt", True, "xla"), ("pd", True, "pallas_forward")],
                         ids=["xla-scanned-fold", "pallas_forward-fan-ins-fold"])  # each impl, each structure once
@pytest.mark.full
def test_kept_shifts_equal_the_recomputed_ones(name, fold, impl):
    """``Options(kernel_shifts=True)`` (the default): the forward (the in-place Pallas kernels in interpret mode, or
    XLA's) keeps each block's children max and the XLA flow pass reads it instead of recomputing it. An HCLT whose
    levels run under a scan, and a PD with fan-ins of up to 3 child blocks; each with a dense root block of one
    node, which recomputes its max: every kept shift is its block's children max (at row first parent row /
    unit), and values and flows equal the recomputed path's (LL, GeneralLL, tempered flows, tf32 stored local
    sums, partitions in pieces), with fewer children maxes in the step."""
    from jaxpc.engine import em
    from jaxpc.ops.sum_layer import gather_children

    if name == "hclt":
        c, x = _chain_hclt()
    else:
        c = jaxpc.compile(structures.PD((2, 4), 8, split_intervals=(1, 1), input_dist=distributions.Categorical(5)),
                          seed=3)
        x = np.random.default_rng(0).integers(0, 5, (11, 8)).astype(np.int32)
    plan = c.layout.fold if fold else c.layout
    unit = routing.shift_unit(plan)
    assert unit >= routing.SHIFT_MIN_UNIT
    sums = [p for s in plan.stages() for p in s.sums]
    assert any(not routing._keeps_shift(p) for p in sums)
    if name == "hclt":
        assert any(isinstance(s, ScanSpec) for s in plan.steps)
    else:
        assert max(p.C for p in sums if not p.dense) == 3
    base = jaxpc.Options(fold_products=fold, impl=impl, kernel_shifts=False)
    # (plain LL: the batched pass's check below; tempered flows and pieces on XLA's forward only: the kernels
    # write the same shifts whatever the flow pass does with them)
    for kw in ({"propagation": "GeneralLL", "alpha": 2.5},
               {"eflow_temperature": 0.5, "precision": "tf32", "gather_chunk": 2 * 8 * 11})[:2 if impl == "xla" else 1]:
        got = c.flows(c.params, x, options=base.replace(kernel_shifts=True, **kw), return_ll=True)
        ref = c.flows(c.params, x, options=base.replace(**kw), return_ll=True)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)

    # the kept shifts themselves, block by block (the shift cancels from the flows up to rounding, so the flows
    # alone would not notice one at a wrong row)
    o = base.replace(kernel_shifts=True, gather_chunk=2 * 8 * 11)
    vals = jax.jit(lambda p, xb: engine_forward.input_values(c.layout, c.tables, p, xb, None, o))(c.params, x)
    tabs = c.tables["fold"] if fold else c.tables
    buf, shifts, _, _ = jax.jit(lambda p, v: stages.forward_buffer(plan, tabs, p, v, o, keep_shifts=True))(
        c.params["sum"], vals)

    @jax.jit  # one program (op by op, each operation would compile on its own)
    def kept_and_maxes(buf, shifts):
        pairs = []

        def check(carry, spec, tab, offset, name):
            row = offset + sum(p.num_rows for p in spec.prods)  # traced in a scanned step
            for part, t in zip(spec.sums, tab["sums"]):
                if routing._keeps_shift(part):
                    m = jnp.max(gather_children(buf, t["ch"], part.Kc, False), axis=1)
                    pairs.append((shifts[(row + np.arange(part.n) * part.Kp) // unit], m))
                row += part.num_rows
            return carry

        stages.run_stages(plan, tabs, None, check, scan=False)
        return [jnp.where(jnp.isfinite(a), a, 0.0) for pair in pairs for a in pair]

    checked = kept_and_maxes(buf, shifts)
    for got, m in zip(checked[::2], checked[1::2]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(m))
    assert sum(len(m) for m in checked[1::2]) >= 4

    def maxes(opts):
        step = lambda p, xb: em.flows_and_ll(c.layout, c.tables, p, xb, None, None, opts)  # noqa: E731
        return str(jax.make_jaxpr(step)(c.params, x)).count("reduce_max")

    assert maxes(base.replace(kernel_shifts=True)) < maxes(base)
    # the batched parameter-flow pass reads them too: keeping them spares more maxes than in the element flows alone
    batched, inline = base.replace(param_flow_pass="batched"), base.replace(param_flow_pass="inline")
    spared = [maxes(o) - maxes(o.replace(kernel_shifts=True)) for o in (inline, batched)]
    assert 0 < spared[0] < spared[1]
    got = c.flows(c.params, x, options=batched.replace(kernel_shifts=True), return_ll=True)
    ref = c.flows(c.params, x, options=inline, return_ll=True)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    # max-product keeps no shifts but its first maximizers: one variadic reduction where the max and the search were
    mpe = base.replace(propagation="MPE")
    assert maxes(mpe.replace(kernel_shifts=True)) == 0 < maxes(mpe)
    # no shift buffer where no XLA flow pass reads one (the Pallas backward recomputes its shifts)
    assert shifts is not None
    o = base.replace(impl="pallas", kernel_shifts=True)
    assert jax.eval_shape(lambda: stages.forward_buffer(plan, tabs, c.params["sum"], vals, o, keep_shifts=True))[1] \
        is None


def test_shift_unit():
    SumPart, StageSpec, Layout = (jaxpc.compiler.layout.SumPart, jaxpc.compiler.layout.StageSpec,
                                  jaxpc.compiler.layout.Layout)

    def layout(*stages):
        return Layout(num_rows=4096, kmax=16, input_layers=(), steps=stages, sum_groups=(), root_row=0, num_vars=1)

    big = SumPart(n=3, C=2, Kp=32, Kc=32, group="g", dense=False)
    root = SumPart(n=1, C=5, Kp=1, Kc=32, group="r", dense=False)
    dense = SumPart(n=2, C=2, Kp=4, Kc=4, group="d", dense=True)
    assert routing.shift_unit(layout(StageSpec((), (big,), 512), StageSpec((), (root,), 608))) == 32
    assert routing.shift_unit(layout(StageSpec((), (dense, big), 512))) == 8  # rows 520 on: gcd 8
    assert routing.shift_unit(layout(StageSpec((), (big,), 516))) == 0  # 4 rows: no shift buffer
    small = SumPart(n=3, C=2, Kp=4, Kc=4, group="s", dense=False)
    assert routing.shift_unit(layout(StageSpec((), (small,), 512))) == 0


def test_kept_shift_of_a_wrong_shape_is_refused():
    from jaxpc.ops.sum_layer import sum_layer_backward_reference

    values = np.zeros((40, 3), np.float32)
    ch, pid, logw = np.array([[8], [16]], np.int32), np.array([[0], [1]], np.int32), np.zeros((2, 4, 4), np.float32)
    kw = dict(Kp=4, Kc=4, dense=False)
    cf, _ = sum_layer_backward_reference(values, values, ch, pid, logw, 24, shift=np.zeros((2, 3), np.float32), **kw)
    assert cf.shape == (2, 4, 3)
    with pytest.raises(ValueError, match="shift must be"):
        sum_layer_backward_reference(values, values, ch, pid, logw, 24, shift=np.zeros((3, 2), np.float32), **kw)
    with pytest.raises(ValueError, match="shift must be"):  # a dense partition of several blocks keeps none
        sum_layer_backward_reference(values, values, ch, pid, logw, 24, shift=np.zeros((2, 3), np.float32),
                                     Kp=4, Kc=4, dense=True)
    # a dense partition of one block (a tree's top level) reads its shift as a blockwise one does
    values = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
    shift = values[8:12].max(axis=0, keepdims=True) + 0.5
    one, _ = sum_layer_backward_reference(values, values, ch[:1], pid[:1], logw, 24, shift=shift, **kw)
    dense, _ = sum_layer_backward_reference(values, values, ch[:1], pid[:1], logw, 24, shift=shift, Kp=4, Kc=4,
                                            dense=True)
    np.testing.assert_allclose(np.asarray(dense), np.asarray(one)[0], rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("seed,fold", [(0, True)], ids=["fold"])  # the leaf buffer is the same on both plans
@pytest.mark.full
def test_leaf_kernel_matches_exact_expected_counts(monkeypatch, seed, fold):
    """Where every input layer is a table of log-values (categorical, Bernoulli), the Pallas routes build the flow
    pass's node buffer in one kernel (``forward.leaf_values``; interpret mode here): flows with missing values and
    weights against the oracle, values NaN out of range, ``jax.grad`` of ``log_prob`` (the kernel's VJP) and an EM
    step equal to the XLA path's; which options route to it."""
    from jaxpc.ops import pallas_leaf

    gen, c = make(seed, kinds=("categorical", "bernoulli"))
    o = jaxpc.Options(impl="pallas_forward", fold_products=fold)
    route = routing.leaf_kernel
    assert route(c.layout, c.params, o) and route(c.layout, c.params, o.replace(impl="pallas"))
    assert route(c.layout, c.params, jaxpc.Options()) == (jax.default_backend() == "gpu")
    assert route(c.layout, c.params, o, batch=1)  # the batch rule is impl="auto"'s
    assert not route(c.layout, c.params, jaxpc.Options(), batch=jaxpc.Tuning().leaf_batch - 1)
    for other in (o.replace(impl="xla"), o.replace(backward="autodiff"), o.replace(leaf_kernel=False)):
        assert not route(c.layout, c.params, other)
    assert not route(c.layout, c.params, o, soft=jnp.zeros((1,)))
    assert not route(c.layout, jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), c.params), o)
    calls = []
    real = pallas_leaf.categorical_buffer
    monkeypatch.setattr(pallas_leaf, "categorical_buffer", lambda *a, **k: calls.append(1) or real(*a, **k))

    x, miss, w, _ = check_flows_and_ll(gen, c, options=o)  # traced afresh: this options key is new to the circuit
    assert calls
    ref = o.replace(impl="xla")
    xi = as_input(gen, x)
    bad = xi.copy()
    bad[3, 0] = 9  # out of range: NaN, not a clamped value
    lp = np.asarray(c.log_prob(c.params, bad, options=o, validate=False))
    assert np.isnan(lp[3]) and np.isfinite(np.delete(lp, 3)).all()

    buf = engine_forward.leaf_values(c.layout, c.tables, c.params, jnp.asarray(xi), None, o)
    assert isinstance(buf, jax.Array) and buf.shape == (routing.buffer_plan(c.layout, o, len(xi)).num_rows, len(xi))
    as_float = engine_forward.leaf_values(c.layout, c.tables, c.params, jnp.asarray(xi, jnp.float32), None, o)
    np.testing.assert_array_equal(np.asarray(as_float), np.asarray(buf))  # values given as floats: cast, as XLA's
    with pytest.raises(ValueError, match="flow pass"):  # a buffer reaches only the flow pass
        engine_forward.evaluate(c.layout, c.tables, c.params["sum"], buf, o.replace(backward="autodiff"))

    def loss(p, opts):
        return jnp.sum(c.log_prob(p, xi, miss, options=opts))

    g, g_ref = (jax.jit(jax.grad(lambda p, opts=opts: loss(p, opts)))(c.params) for opts in (o, ref))
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    p1, ll1 = c.em_step(c.params, xi, miss, options=o, return_ll=True)
    p2, ll2 = c.em_step(c.params, xi, miss, options=ref, return_ll=True)
    np.testing.assert_allclose(np.asarray(ll1), np.asarray(ll2), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_buffers_past_int32_offsets_run_on_xla(monkeypatch, pallas_forward_calls):
    """The Pallas kernels address the node buffer with int32 offsets. From 2^31 elements (lowered here to this
    circuit's buffer at the batch) ``impl="auto"`` runs every layer on XLA with the same answers, and an explicit
    Pallas ``impl`` is refused, naming the sizes; below it the kernels run. The limit counts the rows of the buffer
    the call runs on: the folded plan's for the flow pass, the layout's (products stored) for the plain forward."""
    data = np.random.default_rng(5).integers(0, 4, (200, 7))
    root = structures.HCLT(data, 4, input_dist=distributions.Categorical(num_cats=4))
    x = data[:B].astype(np.int32)
    c = jaxpc.compile(root, seed=2)
    ref = c.flows(c.params, x, options=jaxpc.Options(impl="xla"), return_ll=True)
    rows, full = c.layout.fold.num_rows, c.layout.num_rows
    assert rows < full
    monkeypatch.setattr(routing, "INT32_ELEMENTS", rows * B)
    got = c.flows(c.params, x, return_ll=True)
    assert not pallas_forward_calls
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    with pytest.raises(ValueError, match=f"node buffer of {rows:,} rows"):
        c.log_prob(c.params, x, options=jaxpc.Options(impl="pallas"))
    # between the two plans' sizes: the flow pass (folded) keeps its kernels, the full layout's forward refuses them
    monkeypatch.setattr(routing, "INT32_ELEMENTS", rows * B + 1)
    small = jaxpc.compile(root, seed=2)
    assert routing.within_int32(small.layout, jaxpc.Options(), B) == jaxpc.Options()
    assert routing.within_int32(small.layout, jaxpc.Options(backward="autodiff"), B).impl == "xla"
    assert routing.within_int32(small.layout, jaxpc.Options(logspace_flows=True), B).impl == "xla"
    with pytest.raises(ValueError, match=f"node buffer of {full:,} rows"):
        small.log_prob(small.params, x, options=jaxpc.Options(impl="pallas", backward="autodiff"))
    small.flows(small.params, x, return_ll=True)
    assert pallas_forward_calls


@pytest.mark.slow
@pytest.mark.parametrize("under_vmap", [False, True], ids=["one-set", "vmap"])
def test_fanin_partitions_run_the_atomic_backward_and_equal_xla(monkeypatch, under_vmap):
    """Where the forward kept the shifts of a partition whose child row blocks several parent blocks read (a PD's
    fan-ins), the flow pass runs it as one kernel (interpret mode here; on a GPU with the default impl) and gives
    XLA's flows, parameter flows and log-likelihoods (GeneralLL's exponent: the kernel's own test), or under
    ``vmap`` over parameter sets XLA's set by set; which options and batches route to it."""
    from types import SimpleNamespace

    c = jaxpc.compile(structures.PD((2, 4), 8, split_intervals=(1, 1), input_dist=distributions.Categorical(5)),
                      seed=3)
    x = np.random.default_rng(0).integers(0, 5, (13, 8)).astype(np.int32)
    plan = c.layout.fold
    fanin = [p for s in plan.stages() for p in s.sums if p.D > 1 and p.C > 1]
    assert fanin and all(not routing.exclusive(p) for p in fanin)
    part = max(fanin, key=lambda p: p.D)
    values = SimpleNamespace(shape=(0, 13), dtype=jnp.float32)
    o = jaxpc.Options(impl="pallas_forward", precision="tf32")
    assert routing.atomic_backward(o, part, values)
    for off in ({"precision": "fp32"}, {"impl": "xla"}, {"eflow_temperature": 0.5}, {"pflow_temperature": 0.5},
                {"propagation": "MPE"}, {"tuning": jaxpc.Tuning(fanin_kernel_batch=14)},
                {"tuning": jaxpc.Tuning(fanin_kernel_batch=0)}):
        assert not routing.atomic_backward(o.replace(**off), part, values), off
    assert routing.atomic_backward(jaxpc.Options(precision="tf32"), part, values) == (jax.default_backend() == "gpu")
    calls = []
    real = engine_flows._sum_flows_atomic
    monkeypatch.setattr(engine_flows, "_sum_flows_atomic", lambda *a, **k: calls.append(1) or real(*a, **k))
    if not under_vmap:
        got = c.flows(c.params, x, options=o, return_ll=True)
        assert len(calls) == len([p for p in fanin if not p.dense])
        ref = c.flows(c.params, x, options=o.replace(tuning=jaxpc.Tuning(fanin_kernel_batch=0)), return_ll=True)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6 * float(np.abs(b).max()))
        return
    # under vmap over parameter sets (Pallas batches the kernel, its atomic adds per set) as set by set on XLA
    sets = jax.tree_util.tree_map(lambda *v: jnp.stack(v), c.params, c.init_params(jax.random.key(1)))
    got = jax.jit(jax.vmap(lambda p: c.flows(p, x, options=o, return_ll=True)))(sets)
    assert calls
    for i in range(2):
        p_i = jax.tree_util.tree_map(lambda v, i=i: v[i], sets)
        ref = c.flows(p_i, x, options=o.replace(impl="xla"), return_ll=True)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
            np.testing.assert_allclose(np.asarray(a)[i], np.asarray(b), rtol=2e-5,
                                       atol=1e-6 * float(np.abs(b).max()))


@pytest.mark.slow
@pytest.mark.full  # an opt-in route's or tuning's variants
def test_fanin_kernel_orders_give_the_same_flows(monkeypatch):
    """The fan-in kernels' launch and load orders (``Tuning.fanin_order_batch``: the backward's edge blocks child by
    child, the partition's ``eorder``, from that batch on; ``Tuning.fanin_prefetch`` and
    ``Tuning.fanin_forward_prefetch_batch``: the next tile's loads issued before each tile's arithmetic;
    ``Tuning.fanin_group``: a parent block's children in one program; ``Tuning.fanin_forward_span``: several child
    blocks per step of the forward's loop; ``Tuning.fanin_forward_wide_tile``: the wide partitions' batch tile;
    ``Tuning.fanin_backward_stages``: the backward's pipeline stages; ``Options.kernels`` tiles of a fan-in
    partition: its one-kernel backward's tiles too, the batch tile below the batch, several tiles per program)
    reach the kernels and change no log-likelihood, flow or parameter flow beyond rounding."""
    from jaxpc.ops import pallas_sum

    c = jaxpc.compile(structures.PD((2, 4), 8, split_intervals=(1, 1), input_dist=distributions.Categorical(5)),
                      seed=3)
    x = np.random.default_rng(0).integers(0, 5, (13, 8)).astype(np.int32)
    o = jaxpc.Options(impl="pallas_forward", precision="tf32")
    seen, fwd_seen, configs = [], [], []
    bwd, fwd = pallas_sum.backward_atomic, pallas_sum.forward
    monkeypatch.setattr(pallas_sum, "backward_atomic", lambda *a, **k: seen.append(
        (k["order"] is not None, k["prefetch"], k["group"])) or configs.append(k["config"]) or bwd(*a, **k))
    monkeypatch.setattr(pallas_sum, "forward", lambda *a, **k: fwd_seen.append(k["config"].prefetch) or fwd(*a, **k))
    plain = o.replace(tuning=jaxpc.Tuning(fanin_prefetch=False))
    ref = c.flows(c.params, x, options=plain, return_ll=True)
    assert seen and set(seen) == {(False, False, 1)} and fwd_seen and not any(fwd_seen)
    seen.clear(), fwd_seen.clear()
    default = c.flows(c.params, x, options=o, return_ll=True)  # 13 rows (bucket 16): one child per program
    assert set(seen) == {(False, True, 1)} and not any(fwd_seen)
    assert configs and all(cfg == pallas_sum.KernelConfig(num_stages=jaxpc.Tuning().fanin_backward_stages)
                           for cfg in configs)  # the default tiles, here and in ref (the tuned ones: below)
    seen.clear()
    ordered = c.flows(c.params, x, options=o.replace(tuning=jaxpc.Tuning(fanin_order_batch=16,
                                                                         fanin_forward_prefetch_batch=16)),
                      return_ll=True)
    assert set(seen) == {(True, True, 1)} and any(fwd_seen)
    seen.clear()
    grouped = c.flows(c.params, x, options=o.replace(tuning=jaxpc.Tuning(fanin_group=8, fanin_group_batch=16)),
                      return_ll=True)
    assert max(g for *_, g in seen) > 1  # every child of a parent block in one program where the fan-in allows
    assert all(not prefetch for _, prefetch, g in seen if g > 1)
    spans = []
    monkeypatch.setattr(pallas_sum, "forward", lambda *a, **k: spans.append(
        (k["config"].span, k["config"].block_b)) or fwd(*a, **k))
    spanned = c.flows(c.params, x, options=o.replace(tuning=jaxpc.Tuning(fanin_forward_span=4)), return_ll=True)
    assert max(span for span, _ in spans) == 4
    spans.clear()
    wide = c.flows(c.params, x, options=o.replace(tuning=jaxpc.Tuning(fanin_group_blocks=1, fanin_forward_wide_tile=8,
                                                                      fanin_forward_span=4)), return_ll=True)
    assert (1, 8) in spans and all(span == 1 for span, block_b in spans if block_b == 8)  # 2 batch tiles of 8
    assert {cfg.num_stages for cfg in configs} == {jaxpc.Tuning().fanin_backward_stages}
    configs.clear()
    staged = c.flows(c.params, x, options=o.replace(tuning=jaxpc.Tuning(fanin_backward_stages=1)), return_ll=True)
    assert {cfg.num_stages for cfg in configs} == {1}
    keys = {routing.partition_key(p, 16) for s in c.layout.fold.stages() for p in s.sums if p.C > 1 and not p.dense}
    tuned_tiles = o.replace(kernels=tuple((k, ("pallas_forward", 8, 16, 4)) for k in sorted(keys)))
    configs.clear()
    tuned = c.flows(c.params, x, options=tuned_tiles, return_ll=True)
    assert configs and all(cfg.block_b == 8 and cfg.block_k == 16 for cfg in configs)
    for run in (default, ordered, grouped, spanned, wide, staged, tuned):
        for a, b in zip(jax.tree_util.tree_leaves(run), jax.tree_util.tree_leaves(ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6 * float(np.abs(b).max()))


@pytest.mark.slow
@pytest.mark.full
def test_shared_kernel_tables_pad_a_class_to_one_shape(monkeypatch):
    """The fan-in partitions of one kernel class (group, fold depth, block shape) run their Pallas kernels on tables
    of one shape, the class's largest block count and fan-in, with their own shape: the padding's programs write
    nothing, and the log-likelihoods, flows and parameter flows are the reference's."""
    from jaxpc.ops import pallas_sum

    c = jaxpc.compile(structures.PD((4, 6), 8, split_intervals=(1, 1), input_dist=distributions.Categorical(5)),
                      seed=2)
    members = [(p, t) for s, tab in zip(c.layout.fold.steps, c.tables["fold"]["steps"])
               for p, t in zip(s.sums, tab["sums"]) if p.C > 1 and p.Kp == 8]
    n, C = max(p.n for p, _ in members), max(p.C for p, _ in members)
    assert len(members) >= 4 and len({p.C for p, _ in members}) >= 3
    for p, t in members:
        ch, pid, eorder, extent = routing.kernel_tables(t, p, "pallas")
        assert ch.shape[:2] == pid.shape == (n, C) and extent == {"blocks": p.n, "fanin": p.C}
        np.testing.assert_array_equal(np.asarray(ch[:p.n, :p.C]), np.asarray(t["ch"]))
        np.testing.assert_array_equal(np.asarray(pid[:p.n, :p.C]), np.asarray(t["pid"]))
        e = np.asarray(t["eorder"])
        np.testing.assert_array_equal(np.asarray(eorder[:e.size]), (e // p.C) * C + e % p.C)
        assert sorted(np.asarray(eorder).tolist()) == list(range(n * C))
        assert routing.kernel_tables(t, p, "triton")[3] == {}
    seen = {"forward": [], "backward_atomic": []}
    for name in seen:
        real = getattr(pallas_sum, name)
        monkeypatch.setattr(pallas_sum, name, lambda *a, _real=real, _name=name, **k: seen[_name].append(
            ((a[1] if _name == "forward" else a[4]).shape[:2], k.get("blocks"), k.get("fanin"))) or _real(*a, **k))
    into = []
    atomic = pallas_sum.backward_atomic
    monkeypatch.setattr(pallas_sum, "backward_atomic", lambda *a, **k: into.append(
        (k.get("dparams") is not None, k.get("overwrite"))) or atomic(*a, **k))
    x = np.random.default_rng(1).integers(0, 5, (24, 24)).astype(np.int32)
    got = c.flows(c.params, x, options=jaxpc.Options(impl="pallas_forward", precision="tf32"), return_ll=True)
    want = {(p.n, p.C) for p, _ in members}
    for calls in seen.values():
        padded = [(shape, b, f) for shape, b, f in calls if b is not None]
        assert {shape for shape, *_ in padded} == {(n, C)} and {(b, f) for _, b, f in padded} == want
    # PD's edge blocks own their parameter blocks: the flows are stored in place, the accumulator starting unset
    # (NaN here: a block left unwritten would show below)
    assert into and all(a and b for a, b in into)
    ref = c.flows(c.params, x, options=jaxpc.Options(impl="xla", precision="fp32"), return_ll=True)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-5 * float(np.abs(b).max()))


def test_untied_groups():
    """``SumGroupSpec.untied``: no vector of the group tied to another (each parameter block one edge block's, so the
    flow pass may write its parameter flows instead of adding them); a PD with tied regions and a homogeneous HMM
    have tied groups."""
    cat = distributions.Categorical(5)
    untied = jaxpc.compile(structures.PD((2, 4), 8, split_intervals=(1, 1), input_dist=cat))
    assert untied.layout.sum_groups and all(g.untied for g in untied.layout.sum_groups)
    tied = jaxpc.compile(structures.PD((2, 4), 8, split_intervals=(1, 1), input_dist=cat,
                                       tie_homogeneous_params=True))
    assert not all(g.untied for g in tied.layout.sum_groups)
    hmm = jaxpc.compile(structures.HMM(6, 8, 5))
    assert not all(g.untied for g in hmm.layout.sum_groups)


def test_fanin_forward_tiles():
    """The fan-in forward's tiles: in partitions of ``Tuning.fanin_group_blocks`` edge blocks batch tiles of
    ``Tuning.fanin_forward_wide_tile`` samples and one child block per step, unless tuned or set to 0; elsewhere the
    given tiles with ``Tuning.fanin_forward_span`` blocks per step; dense partitions and single children as given."""
    from types import SimpleNamespace

    from jaxpc.ops.pallas_sum import KernelConfig

    o, cfg = jaxpc.Options(), KernelConfig()
    wide = SimpleNamespace(n=512, C=32, Kp=32, Kc=32, dense=False)
    narrow = SimpleNamespace(n=100, C=32, Kp=32, Kc=32, dense=False)
    got = routing.fanin_forward_config(o, wide, 512, "pallas_forward", cfg)
    assert (got.block_b, got.span, got.prefetch) == (64, 1, True)
    got = routing.fanin_forward_config(o, narrow, 512, "pallas_forward", cfg)
    assert (got.block_b, got.span) == (cfg.block_b, 2)
    assert routing.fanin_forward_config(o, wide, 512, "pallas_forward", cfg, tuned=True).block_b == cfg.block_b
    off = o.replace(tuning=jaxpc.Tuning(fanin_forward_wide_tile=0))
    assert routing.fanin_forward_config(off, wide, 512, "pallas_forward", cfg).span == 2
    for part in (SimpleNamespace(n=512, C=32, Kp=32, Kc=32, dense=True),
                 SimpleNamespace(n=20000, C=1, Kp=32, Kc=32, dense=False)):
        assert routing.fanin_forward_config(o, part, 512, "pallas_forward", cfg) == cfg
    with pytest.raises(ValueError, match="fanin_forward_wide_tile"):
        jaxpc.Tuning(fanin_forward_wide_tile=48)


def test_fanin_group_sizes():
    """Children per program of the atomic backward: ``Tuning.fanin_group`` from ``fanin_group_batch`` samples on or
    in partitions of ``fanin_group_blocks`` edge blocks, a power of two dividing the fan-in, its tiles within
    ``routing.GROUP_ELEMENTS``; one in child order or below."""
    from types import SimpleNamespace

    o = jaxpc.Options()
    part = SimpleNamespace(n=100, C=32, Kp=32, Kc=32)
    batch = lambda B: SimpleNamespace(shape=(0, B))  # noqa: E731
    assert routing.fanin_group(o, part, batch(1024)) == 4
    assert routing.fanin_group(o, part, batch(512)) == 1
    assert routing.fanin_group(o, SimpleNamespace(n=512, C=32, Kp=32, Kc=32), batch(512)) == 4  # 16,384 edge blocks
    assert routing.fanin_group(o, SimpleNamespace(n=100, C=6, Kp=32, Kc=32), batch(2048)) == 2
    assert routing.fanin_group(o, SimpleNamespace(n=100, C=32, Kp=16, Kc=16), batch(1024)) == 4
    assert routing.fanin_group(o, SimpleNamespace(n=100, C=32, Kp=64, Kc=64), batch(1024)) == 1  # 4 x 64 x 64
    assert routing.fanin_group(o, SimpleNamespace(n=100, C=32, Kp=32, Kc=64), batch(1024)) == 2
    for tuning in (jaxpc.Tuning(fanin_order_batch=1024), jaxpc.Tuning(fanin_group_batch=0),
                   jaxpc.Tuning(fanin_group=1)):
        assert routing.fanin_group(o.replace(tuning=tuning), part, batch(1024)) == 1
    wide = SimpleNamespace(n=512, C=32, Kp=32, Kc=32)
    assert routing.fanin_group(o.replace(tuning=jaxpc.Tuning(fanin_group_blocks=0)), wide, batch(512)) == 1
    assert routing.fanin_group(o.replace(tuning=jaxpc.Tuning(fanin_group_batch=8)), part, batch(16)) == 4


@pytest.mark.slow
def test_the_stage_barrier_ends_every_forward_stage_and_changes_no_answer():
    """``Tuning.stage_barrier_batch`` (128 by default): from that batch on, the forward's stages each end in an
    optimization barrier (none below it), and the log-likelihoods, flows and max-product flows are bit for bit
    those without."""
    rng = np.random.default_rng(4)
    data = rng.integers(0, 4, (200, 9)).astype(np.int32)
    c = jaxpc.compile(structures.HCLT(data, 8, input_dist=distributions.Categorical(4)), seed=1)
    x = data[:12]
    at, above = (jaxpc.Options(tuning=jaxpc.Tuning(stage_barrier_batch=b)) for b in (12, 13))
    unrolled = dataclasses.replace(at, scan_stages=False)

    def barriers(o):
        jaxpr = jax.make_jaxpr(lambda p, v: engine_forward.node_values(c.layout, c.tables, p, v, None, o))
        return str(jaxpr(c.params, jnp.asarray(x))).count("optimization_barrier")

    stages_run = sum(s.repeats * len(s.period) if isinstance(s, ScanSpec) else 1 for s in c.layout.steps)
    assert barriers(above) == barriers(jaxpc.Options()) and barriers(unrolled) - barriers(above) == stages_run
    big = jnp.asarray(rng.integers(0, 4, (128, 9)).astype(np.int32))  # the default's barriers start at B=128
    on = jax.make_jaxpr(lambda p, v: engine_forward.node_values(c.layout, c.tables, p, v, None, jaxpc.Options()))
    assert str(on(c.params, big)).count("optimization_barrier") == barriers(at) > barriers(above)
    for o in (at, unrolled, at.replace(propagation="MPE")):
        plain = o.replace(tuning=jaxpc.Tuning(stage_barrier_batch=0))
        want, got = (c.flows(c.params, x, options=p, return_ll=True) for p in (plain, o))
        for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
