"""The raw Triton kernels of ``impl="triton"`` (:mod:`jaxpc.ops.triton_sum`, :mod:`jaxpc.ops.triton_leaf`) against
the plain-jnp reference, run by Triton's interpreter on the CPU (the kernel code itself runs: the launches that
jax-triton would make on a GPU, with the same arguments), and the route's gating: without a working jax-triton,
``impl="triton"`` warns once with the reason and gives the reference's answers. The same kernels run for real on
the GPU in ``benchmarks/kernels_check.py --triton``."""

import math
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc.ops import triton_base
from jaxpc.ops.sum_layer import child_rows, sum_layer_backward_reference, sum_layer_reference

from .test_kernels import EXCLUSIVE, SHAPES, make_leaf_case, make_partition, make_tree_level
from .tiers import cases

needs_interpreter = pytest.mark.skipif(not triton_base.interpreting(),
                                       reason="Triton's interpreter (triton installed, TRITON_INTERPRET=1)")


def _run(launch):
    return [jnp.asarray(o) for o in triton_base.interpret(launch)]


@needs_interpreter
@pytest.mark.parametrize("shape,alpha", cases([(s, a) for s in SHAPES for a in (1.0, 2.0)
                                               if s[4] <= 40 and s[3] <= 8 and (a == 1.0 or s == SHAPES[1])],
                                              fast=[(SHAPES[1], 1.0), (SHAPES[3], 1.0), (SHAPES[1], 2.0)],
                                              unpack=True),
                         ids=lambda v: "Kp{}-Kc{}-n{}-C{}-B{}".format(*v[:5]) if isinstance(v, tuple) else str(v))
@pytest.mark.slow
def test_triton_sum_kernels_match_reference(shape, alpha):
    """Forward, parent-side and child-side backward on padded blocks, -inf children, tied parameters, chunked
    fan-ins and several batch tiles (tensor-core products where every side is 16 or more). Fan-ins up to 8 child
    blocks: the interpreter takes 16 s for the 64 of ``SHAPES``' widest (``kernels_check.py --triton`` runs it on
    the GPU)."""
    from jaxpc.ops import triton_sum

    Kp, Kc, n, C, B = shape[:5]
    buf, t, logw, R = make_partition(*shape)
    prop = "LL" if alpha == 1.0 else "GeneralLL"
    kw = dict(Kp=Kp, Kc=Kc, dense=False, propagation=prop, alpha=None if alpha == 1.0 else alpha)
    ref = sum_layer_reference(buf, t["ch"], t["pid"], logw, **kw)
    cfg = triton_sum.KernelConfig(block_b=16, block_k=16) if B > 16 else triton_sum.KernelConfig()
    out, _ = _run(triton_sum.forward_launch(buf, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc, alpha=alpha, config=cfg))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)

    full = jnp.concatenate([buf, ref])
    noise = np.random.default_rng(1).random((n * Kp, B)).astype(np.float32)
    flows = jnp.zeros_like(full).at[R:].set(jnp.where(jnp.isfinite(ref), noise, 0.0))
    cf_ref, pf_ref = sum_layer_backward_reference(full, flows, t["ch"], t["pid"], logw, R, **kw)
    want = jnp.zeros_like(full).at[child_rows(t["ch"], Kc, False)].add(cf_ref)
    scale, pflow = triton_sum.parents_launches(full, flows, R, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc, alpha=alpha,
                                               config=cfg)
    a, m = _run(scale)
    (pf,) = _run(pflow(a, m))
    (got,) = _run(triton_sum.children_launch(full, a, m, t["uch"], t["par"], t["ppid"], logw, Kp=Kp, Kc=Kc,
                                             alpha=alpha, config=cfg, flows=jnp.zeros_like(full)))
    keep = np.ones(got.shape[0], bool)
    keep[max(Kp, Kc):2 * max(Kp, Kc)] = False  # the -inf padding rows collect nothing meaningful
    np.testing.assert_allclose(np.asarray(got)[keep], np.asarray(want)[keep], rtol=2e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pf), np.asarray(pf_ref), rtol=2e-4, atol=1e-5)
    (cf,) = _run(triton_sum.children_launch(full, a, m, t["uch"], t["par"], t["ppid"], logw, Kp=Kp, Kc=Kc,
                                            alpha=alpha, config=cfg))  # not in place: [U * Kc, B]
    got2 = jnp.zeros_like(full).at[(t["uch"][:, None] + jnp.arange(Kc)).reshape(-1)].add(cf)
    np.testing.assert_allclose(np.asarray(got2)[keep], np.asarray(want)[keep], rtol=2e-4, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("M", [1, 3])
def test_triton_in_place_forward_and_folded_backward(M):
    """A tree level on the folded plan (``ch [n, 1, M]``, zero-row padding): the in-place forward writes only the
    parents' rows and keeps each block's shift at row first parent row / unit (the rows between untouched); the
    child flows are added into every row block of the folded child in place."""
    from jaxpc.ops import triton_sum

    Kp, Kc, n, B = 16, 32, 3, 19
    out, flows0, t, logw, off, base, want, pf_ref = make_tree_level(Kp, Kc, n, M, B)
    from jaxpc.compiler.compile import inverse_tables

    inv = {k: jnp.asarray(v, jnp.int32) for k, v in inverse_tables(np.asarray(t["ch"]), np.asarray(t["pid"])).items()}
    buf = out.at[off:].set(7.0)  # the parents' rows, to be written
    unit = math.gcd(off, Kp)
    shifts = jnp.full((-(-out.shape[0] // unit), B), 5.0, jnp.float32)
    got, kept = _run(triton_sum.forward_launch(buf, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc, out_offset=off,
                                               shifts=shifts, unit=unit))
    np.testing.assert_allclose(np.asarray(got), np.asarray(out), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(got)[:off], np.asarray(buf)[:off])
    scale, pflow = triton_sum.parents_launches(out, flows0, off, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc)
    a, m = _run(scale)
    rows = (off + Kp * np.arange(n)) // unit
    np.testing.assert_array_equal(np.asarray(kept)[rows], np.asarray(m))
    np.testing.assert_array_equal(np.delete(np.asarray(kept), rows, axis=0), 5.0)
    (pf,) = _run(pflow(a, m))
    np.testing.assert_allclose(np.asarray(pf), np.asarray(pf_ref), rtol=2e-4, atol=1e-5)
    (fl,) = _run(triton_sum.children_launch(out, a, m, inv["uch"], inv["par"], inv["ppid"], logw, Kp=Kp, Kc=Kc,
                                            ch=t["ch"], pcol=inv.get("pcol"), flows=flows0))
    keep = np.r_[base:off]  # zero and -inf padding rows collect nothing meaningful
    np.testing.assert_allclose(np.asarray(fl)[keep], np.asarray(want)[keep], rtol=2e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(fl)[off:], np.asarray(flows0)[off:])


@needs_interpreter
@pytest.mark.parametrize("shape", cases(EXCLUSIVE, fast=EXCLUSIVE[1:2]),
                         ids=lambda s: "Kp{}-Kc{}-n{}-M{}-B{}".format(*s[:5]))
@pytest.mark.parametrize("alpha,precision", cases([(1.0, "fp32"), (0.5, "tf32")], fast=[(1.0, "fp32")], unpack=True))
def test_triton_tree_level_backwards_match_reference(shape, alpha, precision):
    """Tree levels (one child block per parent, folded children of M row blocks, zero-row padding): the exclusive
    backward (parent-side kernels, then W^T a once per parent added into every row block) and the one-kernel level
    backward (parameter flows as an array, or added into a parameter-flow buffer in place; local sums recomputed
    at fp32, from the stored values at tf32)."""
    from jaxpc.ops import triton_sum

    Kp, Kc, n, M, B = shape[:5]
    out, flows0, t, logw, off, base, want, pf_ref = make_tree_level(Kp, Kc, n, M, B, alpha)
    kw = dict(Kp=Kp, Kc=Kc, alpha=alpha, precision=precision)
    scale, pflow = triton_sum.parents_launches(out, flows0, off, t["ch"], t["pid"], logw, **kw)
    a, m = _run(scale)
    (pf,) = _run(pflow(a, m))
    (got,) = _run(triton_sum.exclusive_launch(out, a, m, flows0, t["ch"], t["pid"], logw, first_row=base, **kw))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-5)  # padding rows untouched
    np.testing.assert_allclose(np.asarray(pf), np.asarray(pf_ref), rtol=2e-4, atol=1e-5)
    if B > triton_sum.LEVEL_BATCH:
        return
    got, pf = _run(triton_sum.level_launch(out, flows0, off, t["ch"], t["pid"], logw, first_row=base, **kw))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pf).reshape(pf_ref.shape), np.asarray(pf_ref), rtol=2e-4, atol=1e-5)
    dp0 = jnp.asarray(np.random.default_rng(1).random((n + 2, Kp, Kc)), jnp.float32)
    got2, dp = _run(triton_sum.level_launch(out, flows0, off, t["ch"], t["pid"], logw, first_row=base, dparams=dp0,
                                            **kw))
    np.testing.assert_allclose(np.asarray(got2), np.asarray(got), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(dp), np.asarray(dp0.at[t["pid"]].add(pf_ref)), rtol=2e-4, atol=1e-5)
    with pytest.raises(ValueError, match="one child block"):
        triton_sum.level_launch(out, flows0, off, jnp.concatenate([t["ch"], t["ch"]], axis=1), t["pid"], logw,
                                first_row=base, **kw)


@needs_interpreter
@pytest.mark.parametrize("missing", [False, True])
@pytest.mark.parametrize("zero_above", [True, False])
def test_triton_categorical_buffer_matches_reference(missing, zero_above):
    """Two layers, out-of-range values (NaN), missing values (the marginal), padding and gaps: the reference's
    buffer; with ``zero_above=False`` nothing is written above the last layer."""
    from jaxpc.ops import pallas_leaf, triton_leaf

    xt, layers, tabs, miss = make_leaf_case(37, missing=missing)
    cfg = triton_leaf.LeafConfig(block_b=16, block_e=64)
    buf = None
    for launch in triton_leaf.buffer_launches(xt, layers, tabs, num_rows=47, kmax=4, missing=miss, config=cfg,
                                              zero_above=zero_above):
        (buf,) = _run(launch(buf))
    ref = np.asarray(pallas_leaf.categorical_buffer_reference(xt, layers, tabs, num_rows=47, kmax=4, missing=miss))
    top = 47 if zero_above else 41
    np.testing.assert_array_equal(np.asarray(buf)[:top], ref[:top])
    assert np.isnan(np.asarray(buf)[top:]).all()
    with pytest.raises(ValueError, match="at least one input layer"):
        triton_leaf.buffer_launches(xt, [], [], num_rows=47, kmax=4)


@pytest.fixture
def without_jax_triton(monkeypatch):
    """jax-triton as if it were not installed (it is on the GPU image): ``import jax_triton`` fails, and the route's
    check (``triton_base.status``, made once per process) is made anew, while the test runs. Off a GPU the check
    stops before it looks for jax-triton."""
    monkeypatch.setitem(sys.modules, "jax_triton", None)  # (None there: the import raises ModuleNotFoundError)
    monkeypatch.setattr(triton_base, "_STATUS", [])


def test_triton_route_reports_why_it_is_unavailable(without_jax_triton):
    """Off a GPU (or without jax-triton) the route is unusable, with a one-line reason."""
    ok, reason = triton_base.status()
    assert not ok and reason and "\n" not in reason
    looked = jax.default_backend() == "gpu" and triton_base.load_triton()[0] is not None  # (for jax-triton)
    assert ("jax-triton does not import" in reason) == looked, reason


def test_impl_triton_falls_back_with_one_warning_and_stays_exact(monkeypatch, without_jax_triton):
    """``impl="triton"`` where jax-triton cannot run: one warning naming the reason, then every call on the
    fallback route, with the reference's log-likelihoods and flows."""
    monkeypatch.setattr(triton_base, "_WARNED", [])
    c = jaxpc.compile(jaxpc.structures.HCLT(np.random.default_rng(0).integers(0, 3, (200, 6)), num_latents=4,
                                            input_dist=jaxpc.distributions.Categorical(num_cats=3)))
    p = c.init_params(jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(1).integers(0, 3, (9, 6)), jnp.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ll = c.log_prob(p, x, options=jaxpc.Options(impl="triton"))
        fl = c.flows(p, x, options=jaxpc.Options(impl="triton"))
        c.log_prob(p, x[:5], options=jaxpc.Options(impl="triton"))
    mine = [w for w in caught if "impl='triton'" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert triton_base.status()[1] in str(mine[0].message)
    ref = jaxpc.Options(impl="xla")
    np.testing.assert_allclose(np.asarray(ll), np.asarray(c.log_prob(p, x, options=ref)), rtol=1e-6, atol=1e-6)
    want = c.flows(p, x, options=ref)
    for g, w in zip(jax.tree_util.tree_leaves(fl), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


@needs_interpreter
@pytest.mark.parametrize("structure", cases(["hclt", "pd"], fast=["pd"]))
@pytest.mark.slow
def test_circuits_on_the_triton_route_equal_the_reference(structure, monkeypatch):
    """Whole circuits with ``impl="triton"``, the kernels in Triton's interpreter: an HCLT (tree levels, folded
    products) and a PD (blocks of several child blocks); log-likelihoods and flows equal the XLA route's, and the
    executable holds the jax-triton kernels (host callbacks into the interpreter here)."""
    monkeypatch.setattr(triton_base, "status", lambda: (True, "Triton's interpreter"))
    rng = np.random.default_rng(0)
    if structure == "hclt":
        ns = jaxpc.structures.HCLT(rng.integers(0, 3, (200, 6)), num_latents=16,
                                   input_dist=jaxpc.distributions.Categorical(num_cats=3))
        x = rng.integers(0, 3, (20, 6))
    else:
        ns = jaxpc.structures.PD(data_shape=(4, 4), num_latents=16, split_intervals=(2, 2),
                                 input_dist=jaxpc.distributions.Categorical(num_cats=4))
        x = rng.integers(0, 4, (20, 16))
    c = jaxpc.compile(ns)
    p = c.init_params(jax.random.key(0))
    x = jnp.asarray(x, jnp.int32)
    tri, ref = jaxpc.Options(impl="triton", precision="fp32"), jaxpc.Options(impl="xla", precision="fp32")
    text = jax.jit(lambda p, x: c.flows(p, x, options=tri, validate=False)).lower(p, x).as_text()
    assert "callback" in text
    np.testing.assert_allclose(np.asarray(c.log_prob(p, x, options=tri)), np.asarray(c.log_prob(p, x, options=ref)),
                               rtol=1e-5, atol=1e-5)
    for g, w in zip(jax.tree_util.tree_leaves(c.flows(p, x, options=tri)),
                    jax.tree_util.tree_leaves(c.flows(p, x, options=ref))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
