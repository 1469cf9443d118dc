"""The Pallas sum-layer kernels against the plain-jnp reference (interpret mode on CPU: the kernel code
itself runs), over a product of shapes: block sizes 1-128, fan-ins 1-64 with padding, ragged batches,
children at -inf, tied parameters. The same kernels run for real on the GPU in
``benchmarks/kernels_check.py``."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc.compiler.compile import child_order, inverse_tables
from jaxpc.ops import pallas_chain, pallas_leaf, pallas_product, pallas_sum
from jaxpc.ops.sum_layer import child_rows, sum_layer_backward_reference, sum_layer_reference

from .conftest import tf32_unit
from .tiers import cases


def whole(f):
    """``f`` compiled as one program (array arguments traced; the others and keyword arguments fixed). Called
    eagerly, its operations would each compile on their own: most of the time these tests take."""
    def call(*args, **kw):
        pos = [i for i, a in enumerate(args) if isinstance(a, (jax.Array, np.ndarray))]

        def g(*arrays):
            full = list(args)
            for i, a in zip(pos, arrays):
                full[i] = a
            return f(*full, **kw)

        return jax.jit(g)(*(args[i] for i in pos))
    return call


# (Kp, Kc, n, C, B, pad_frac, ninf_frac)
SHAPES = [
    (1, 1, 5, 1, 1, 0.0, 0.0),
    (3, 5, 4, 3, 19, 0.3, 0.2),
    (2, 16, 3, 7, 33, 0.2, 0.1),
    (16, 16, 2, 4, 40, 0.0, 0.3),
    (32, 8, 3, 2, 17, 0.5, 0.0),
    (128, 4, 1, 2, 9, 0.0, 0.0),
    (4, 128, 2, 1, 5, 0.0, 0.2),
    (256, 256, 2, 1, 4, 0.0, 0.0),
    (1, 2, 6, 64, 3, 0.4, 0.1),
    (8, 8, 2, 5, 600, 0.2, 0.1),
]


def make_partition(Kp, Kc, n, C, B, pad_frac, ninf_frac, seed=0, num_param_blocks=None):
    rng = np.random.default_rng(seed)
    kmax = max(Kp, Kc)
    R = 2 * kmax + C * n * Kc + 64
    buf = rng.normal(size=(R, B)).astype(np.float32) * 3
    buf[:kmax] = 0.0
    buf[kmax:2 * kmax] = -np.inf
    ninf = rng.random((R, B)) < ninf_frac
    ninf[:2 * kmax] = False
    buf[ninf] = -np.inf
    ch = rng.integers(2 * kmax, R - Kc, (n, C))
    P = num_param_blocks or max(2, n * C // 2)  # fewer blocks than edges: tied parameters
    pid = rng.integers(0, P, (n, C))
    pad = rng.random((n, C)) < pad_frac
    pad[:, 0] = False
    ch = np.where(pad, -2, ch)  # -2 marks padding, as the compiler does
    inv = inverse_tables(ch, pid)
    ch = np.where(ch == -2, kmax, ch)  # padding reads the -inf rows
    logw = np.log(rng.random((P, Kp, Kc)).astype(np.float32) + 1e-3)
    tab = {k: jnp.asarray(v, jnp.int32) for k, v in {"ch": ch, "pid": pid, **inv}.items()}
    return jnp.asarray(buf), tab, jnp.asarray(logw), R


# GeneralLL's exponent on the shapes with padding, -inf children, chunked fan-ins, several batch tiles or large tiles
GENERAL_LL = [SHAPES[i] for i in (0, 1, 2, 7, 8, 9)]


@pytest.mark.parametrize("shape,alpha", cases([(s, a) for a in (1.0, 2.0) for s in SHAPES
                                               if a == 1.0 or s in GENERAL_LL],
                                              fast=[(SHAPES[0], 1.0), (SHAPES[0], 2.0)], unpack=True),
                         ids=lambda v: "Kp{}-Kc{}-n{}-C{}-B{}".format(*v[:5]) if isinstance(v, tuple) else str(v))
def test_kernels_match_reference(shape, alpha):
    Kp, Kc, n, C, B = shape[:5]
    buf, t, logw, R = make_partition(*shape)
    prop = "LL" if alpha == 1.0 else "GeneralLL"
    kw = dict(Kp=Kp, Kc=Kc, dense=False, propagation=prop, alpha=None if alpha == 1.0 else alpha)
    noise = np.random.default_rng(1).random((n * Kp, B)).astype(np.float32)

    @jax.jit  # the kernels and the reference as one program (op by op, each operation would compile on its own)
    def run(buf, t, logw, noise):
        ref = sum_layer_reference(buf, t["ch"], t["pid"], logw, **kw)
        out = pallas_sum.forward(buf, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc, alpha=alpha)
        # backward: parents write their values into the buffer, flows arrive on them
        full = jnp.concatenate([buf, ref])
        flows = jnp.zeros_like(full).at[R:].set(jnp.where(jnp.isfinite(ref), noise, 0.0))
        cf_ref, pf_ref = sum_layer_backward_reference(full, flows, t["ch"], t["pid"], logw, R, **kw)
        want = jnp.zeros_like(full).at[child_rows(t["ch"], Kc, False)].add(cf_ref)
        a, m, pf = pallas_sum.backward_parents(full, flows, R, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc, alpha=alpha)
        cf = pallas_sum.backward_children(full, a, m, t["uch"], t["par"], t["ppid"], logw, Kp=Kp, Kc=Kc, alpha=alpha)
        got = jnp.zeros_like(full).at[(t["uch"][:, None] + jnp.arange(Kc)).reshape(-1)].add(cf)
        return out, ref, got, want, pf, pf_ref

    out, ref, got, want, pf, pf_ref = (np.asarray(a) for a in run(buf, t, logw, noise))
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    keep = np.ones(got.shape[0], bool)
    keep[max(Kp, Kc):2 * max(Kp, Kc)] = False  # the -inf padding rows collect nothing meaningful
    np.testing.assert_allclose(got[keep], want[keep], rtol=2e-4, atol=1e-5)
    np.testing.assert_allclose(pf, pf_ref, rtol=2e-4, atol=1e-5)


def test_inverse_tables():
    ch = np.array([[10, 20, -2], [20, 30, 10]])
    pid = np.array([[0, 1, 9], [2, 3, 4]])
    inv = inverse_tables(ch, pid)
    np.testing.assert_array_equal(inv["uch"], [10, 20, 30])
    got = {int(u): sorted(zip(p[p >= 0].tolist(), e[e >= 0].tolist()))
           for u, p, e in zip(inv["uch"], inv["par"], inv["ppid"])}
    assert got == {10: [(0, 0), (1, 4)], 20: [(0, 1), (1, 2)], 30: [(1, 3)]}
    # the edge blocks i * C + c by child (rows 10, 10, 20, 20, 30), then parent; the padding slot (0, 2) last
    np.testing.assert_array_equal(inv["eorder"], [0, 5, 1, 3, 4, 2])


@pytest.mark.slow
@pytest.mark.parametrize("prop", ["LL"])  # GeneralLL kernels: test_kernels_match_reference[2.0-*]
def test_circuit_with_pallas_kernels_equals_reference(prop):
    """The full layout (products as their own layers) on the kernels; the folded plan's in-place kernels are
    checked against the exact oracle in test_fold."""
    from .random_circuits import Generator
    gen = Generator(1, 3, kinds=("categorical", "bernoulli"))  # six sum partitions (fan-ins 1 to 4), three products
    c = jaxpc.compile(gen.circuit())
    x = gen.sample_data(13).astype(np.int32)
    miss = np.random.default_rng(0).random(x.shape) < 0.3
    kw = dict(propagation=prop, alpha=1.5 if prop == "GeneralLL" else None, fold_products=False)
    ref = jaxpc.Options(**kw)
    pal = jaxpc.Options(impl="pallas", **kw)
    (f1, ll1), (f2, ll2) = (c.flows(c.params, x, miss, options=o, return_ll=True) for o in (pal, ref))
    np.testing.assert_allclose(np.asarray(ll1), np.asarray(ll2), rtol=1e-5, atol=1e-5)
    for u, v in zip(jax.tree_util.tree_leaves(f1), jax.tree_util.tree_leaves(f2)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=2e-4, atol=1e-5)


@pytest.mark.slow
def test_kernels_lower_for_cuda_without_a_gpu():
    """The Triton lowering of every kernel (caught here, on CPU, before a GPU run)."""
    buf, t, logw, R = make_partition(16, 32, 3, 4, 40, 0.2, 0.1)
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)

    def fwd(b, ch, pid, lw, prefetch=False, propagation="LL"):
        return pallas_sum.forward(b, ch, pid, lw, Kp=16, Kc=32, config=pallas_sum.KernelConfig(prefetch=prefetch),
                                  propagation=propagation)

    def padded(b, ch, pid, lw, prefetch=False, span=1, propagation="LL"):  # a kernel class's tables: the fan-in
        return pallas_sum.forward(b, ch, pid, lw, Kp=16, Kc=32, out_offset=0, blocks=2, fanin=3,  # read at run time
                                  config=pallas_sum.KernelConfig(prefetch=prefetch, span=span), propagation=propagation)

    def firsts(b, ch, pid, lw):  # the max-plus forward with its first maximizers, folded children, in place
        ch3 = jnp.stack([ch, jnp.zeros_like(ch)], axis=2)
        return pallas_sum.forward(b, ch3, pid, lw, Kp=16, Kc=32, out_offset=0, propagation="MPE",
                                  firsts=jnp.zeros(b.shape, jnp.int32))

    def packed(b, ch, pid, lw, span=1):  # the tables read in a packed table array, several child blocks per step
        ch3 = jnp.stack([ch, ch], axis=2)
        flat = jnp.concatenate([ch3.ravel(), pid.ravel()]).astype(jnp.int32)
        return pallas_sum.forward(b, ch3, pid, lw, Kp=16, Kc=32, out_offset=0, source=(flat, (0, ch3.size)),
                                  config=pallas_sum.KernelConfig(span=span, prefetch=True))

    def bwd(b, ch, pid, lw, uch, par, ppid):
        a, m, pf = pallas_sum.backward_parents(b, b, 0, ch, pid, lw, Kp=16, Kc=32)
        return pallas_sum.backward_children(b, a, m, uch, par, ppid, lw, Kp=16, Kc=32), pf

    def in_place(b, ch, pid, lw, uch, par, ppid):  # the folded plan's kernels: M = 2 terms, buffers aliased
        ch3 = jnp.stack([ch, jnp.zeros_like(ch)], axis=2)
        b = pallas_sum.forward(b, ch3, pid, lw, Kp=16, Kc=32, out_offset=0)
        a, m, pf = pallas_sum.backward_parents(b, b, 0, ch3, pid, lw, Kp=16, Kc=32)
        return pallas_sum.backward_children(b, a, m, uch, par, jnp.zeros_like(par), lw, Kp=16, Kc=32, ch=ch3,
                                            pcol=par, flows=b), pf

    def level(b, ch, pid, lw, uch, par, ppid, precision):  # a tree level in one kernel, dparams in place
        ch3 = jnp.stack([ch[:, :1], jnp.zeros_like(ch[:, :1])], axis=2)
        return pallas_sum.backward_level(b, b, 0, ch3, pid[:, :1], lw, Kp=16, Kc=32, first_row=64, dparams=lw,
                                         precision=precision)

    def after(b, ch, pid, lw, uch, par, ppid, precision):  # the batched parameter-flow pass
        n = ch.shape[0]
        return pallas_sum.param_flows_after(b, b, b[::8], jnp.arange(n) - 1, jnp.zeros(n, jnp.int32) + 64, ch, pid,
                                            lw, Kp=16, Kc=32, precision=precision)

    def leaves(b, ch, pid, lw, uch, par, ppid):  # the node buffer's leaves (missing values marginalized)
        xt = (ch[:1, :1] + jnp.arange(5 * 24).reshape(5, 24)) % 4
        tab = (lw.reshape(-1, 4), jnp.arange(7), jnp.arange(7) % 5, jnp.zeros(7))
        return pallas_leaf.categorical_buffer(xt, [pallas_leaf.LeafLayer(64, 7, 4)], [tab], num_rows=90, kmax=32,
                                              missing=xt == 0)

    from unittest import mock
    tabs = (buf, t["ch"], t["pid"], logw, t["uch"], t["par"], t["ppid"])
    with mock.patch.object(pallas_sum, "interpret_mode", lambda: False), \
            jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        for f, args in ((fwd, tabs[:4]), (functools.partial(fwd, prefetch=True), tabs[:4]), (padded, tabs[:4]),
                        (functools.partial(padded, prefetch=True), tabs[:4]), (bwd, tabs),
                        (functools.partial(padded, span=2), tabs[:4]), (functools.partial(packed, span=4), tabs[:4]),
                        (in_place, tabs),
                        (functools.partial(level, precision="fp32"), tabs),
                        (functools.partial(level, precision="tf32"), tabs),
                        (functools.partial(after, precision="tf32"), tabs),
                        (functools.partial(after, precision="bf16"), tabs), (leaves, tabs),
                        (functools.partial(fwd, propagation="MPE"), tabs[:4]),
                        (functools.partial(padded, propagation="MPE"), tabs[:4]), (firsts, tabs[:4])):
            text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert "__gpu$xla.gpu.triton" in text
    A, Et = jnp.ones((256, 256)), jnp.ones((5, 256, 16))  # the chain kernels, 64 programs, products in 2 blocks
    with mock.patch.object(pallas_chain, "interpret_mode", lambda: False), \
            mock.patch.object(pallas_sum, "interpret_mode", lambda: False), \
            jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        for f in (lambda a, e: pallas_chain.forward(a, e, "tf32"),
                  lambda a, e: pallas_chain.backward(a, e, e[0], "fp32"),
                  lambda a, e: pallas_chain.forward_backward(a, e, a[0], "tf32")):
            text = jax.jit(f).trace(A, Et).lower(lowering_platforms=("cuda",)).as_text()
            assert "__gpu$xla.gpu.triton" in text
    buf, pch = jnp.zeros((256, 512)), jnp.asarray([[64, 96], [96, 128]], jnp.int32)  # the product kernels
    with mock.patch.object(pallas_sum, "interpret_mode", lambda: False), \
            jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        for f in (lambda b, r: pallas_product.forward(b, pch, r, K=32),
                  lambda b, r: pallas_product.backward(b, pch, r, K=32, first_row=64)):
            text = jax.jit(f).trace(buf, jnp.int32(160)).lower(lowering_platforms=("cuda",)).as_text()
            assert "__gpu$xla.gpu.triton" in text


@pytest.mark.slow
def test_a_kernel_lowering_repeats_no_failed_dialect_import():
    """``pallas_sum.cache_missing_dialect_modules`` (run by ``call_kernel`` outside interpret mode): lowering a
    Pallas kernel for CUDA then searches the import path for no Python module of the Triton dialect (MLIR's
    bindings look one up per operation and prefix, and without it each lookup walked the path again)."""
    import importlib.machinery
    import sys
    from unittest import mock

    buf, t, logw, _ = make_partition(16, 32, 3, 4, 40, 0.2, 0.1)
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    searched, real = [], importlib.machinery.PathFinder.find_spec

    def spy(name, path=None, target=None):
        if name.endswith(".tt"):
            searched.append(name)
        return real(name, path, target)

    def lower():
        searched.clear()
        pallas_sum._KERNELS.clear()  # call_kernel makes the kernel's jitted function anew
        with mock.patch.object(pallas_sum, "interpret_mode", lambda: False), \
                mock.patch.object(importlib.machinery.PathFinder, "find_spec", staticmethod(spy)), \
                jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
            f = jax.jit(lambda b, ch, pid, lw: pallas_sum.forward(b, ch, pid, lw, Kp=16, Kc=32))
            text = f.trace(buf, t["ch"], t["pid"], logw).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text
        return len(searched)

    for n in [n for n in sys.modules if n.endswith(".tt") and sys.modules[n] is None]:
        del sys.modules[n]  # as in a process before its first call
    with mock.patch.object(pallas_sum, "cache_missing_dialect_modules", lambda *a, **k: None):
        assert lower() > 0  # without the record, every operation searched every prefix
    pallas_sum.cache_missing_dialect_modules()  # (its own lookups: once per prefix)
    assert lower() == 0
    assert [n for n in sys.modules if n.endswith(".tt") and sys.modules[n] is None]


def test_atomic_adds_are_relaxed_in_the_fanin_kernel_only():
    """Cross-lowered for CUDA: the fan-in backward's atomic adds get relaxed memory order
    (``pallas_sum.relaxed_atomics``), the chain kernels' grid-barrier atomics keep Pallas's acquire-release order."""
    from unittest import mock

    from jax._src.pallas.triton import lowering as tl
    from jax._src.pallas.triton import primitives as tp

    assert pallas_sum.relaxed_atomics()
    seen = []
    rule = tl.triton_lowering_rules[tp.atomic_rmw_p]

    def spy(ctx, *args, **kw):
        out = rule(ctx, *args, **kw)
        seen.append((ctx.context.name, str(out.owner.attributes["sem"])))
        return out

    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    b, ch, pid = jnp.zeros((256, 40)), jnp.full((3, 2, 2), 64, jnp.int32), jnp.zeros((3, 2), jnp.int32)

    def fanin(b, ch, pid, lw, **variant):  # B=40: two batch tiles, so that the prefetching loop is lowered too
        return pallas_sum.backward_atomic(b, b, b[::16], 128, ch, pid, lw, Kp=16, Kc=32, unit=16, first_row=64,
                                          **variant)

    A, Et = jnp.ones((256, 256)), jnp.ones((5, 256, 16))
    with mock.patch.dict(tl.triton_lowering_rules, {tp.atomic_rmw_p: spy}), \
            mock.patch.object(pallas_sum, "interpret_mode", lambda: False), \
            mock.patch.object(pallas_chain, "interpret_mode", lambda: False), \
            jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        for variant in ({}, {"order": jnp.arange(6), "prefetch": True}, {"group": 2}, {"prefetch": True},
                        {"blocks": 2, "fanin": 1, "dparams": jnp.zeros((6, 16, 32))}):  # padded tables, in place
            jax.jit(functools.partial(fanin, **variant)).trace(b, ch, pid, jnp.zeros((6, 16, 32))).lower(
                lowering_platforms=("cuda",))
        jax.jit(lambda a, e: pallas_chain.forward(a, e, "tf32")).trace(A, Et).lower(lowering_platforms=("cuda",))
    ours = [sem for name, sem in seen if name.startswith("jaxpc_sum_backward_atomic")]
    others = [sem for name, sem in seen if not name.startswith("jaxpc_sum_backward_atomic")]
    relaxed = f"{int(tl.tt_dialect.MemSemantic.RELAXED)} : i32"
    assert ours and all(sem == relaxed for sem in ours), seen
    assert others and not any(sem == relaxed for sem in others), seen


# (Kp, Kc, n, C, M, B): folded partitions (each child block the sum of M row blocks)
FOLDED = [(4, 4, 3, 2, 3, 7), (16, 32, 2, 1, 4, 19), (2, 8, 5, 3, 2, 40)]


@pytest.mark.slow
@pytest.mark.parametrize("shape", FOLDED, ids=lambda s: "Kp{}-Kc{}-n{}-C{}-M{}-B{}".format(*s))
def test_folded_kernels_in_place_match_reference(shape):
    """Folded tables (``ch [n, C, M]``: zero-row and -inf padding, row blocks shared between parents) through the
    in-place kernels: the parents' rows written into the buffer, the child flows added into the flow buffer."""
    Kp, Kc, n, C, M, B = shape
    rng = np.random.default_rng(7)
    kmax = max(Kp, Kc)
    nblk = 6
    base = 2 * kmax
    R = base + nblk * Kc + n * Kp
    off = base + nblk * Kc
    buf = np.zeros((R, B), np.float32)
    buf[kmax:2 * kmax] = -np.inf
    buf[base:off] = rng.normal(size=(nblk * Kc, B)) * 2
    buf[base:off][rng.random((nblk * Kc, B)) < 0.1] = -np.inf
    ch = base + Kc * rng.integers(0, nblk, (n, C, M))
    ch[rng.random((n, C, M)) < 0.3] = 0  # zero rows: a shorter product
    pad = rng.random((n, C)) < 0.2
    pad[:, 0] = False
    ch[pad, 0] = -2  # an empty slot: the -inf row plus zero rows
    ch[pad, 1:] = 0
    P = n * C
    pid = rng.permutation(P).reshape(n, C)
    inv = inverse_tables(ch, pid)
    assert set(inv) == {"uch", "par", "ppid", "pcol", "eorder"}
    ch = np.where(ch == -2, kmax, ch)
    t = {k: jnp.asarray(v, jnp.int32) for k, v in {"ch": ch, "pid": pid, **inv}.items()}
    logw = jnp.asarray(np.log(rng.random((P, Kp, Kc)) + 1e-3), jnp.float32)
    buf = jnp.asarray(buf)

    ref = whole(sum_layer_reference)(buf, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc, dense=False)
    out = whole(pallas_sum.forward)(buf, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc, out_offset=off)
    np.testing.assert_allclose(np.asarray(out[off:]), np.asarray(ref), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(out[:off]), np.asarray(buf[:off]))  # nothing else written

    flows0 = jnp.asarray(rng.random((R, B)), jnp.float32)  # flows already on the children: added to
    flows0 = flows0.at[off:].set(jnp.where(jnp.isfinite(ref), flows0[off:], 0.0))
    cf_ref, pf_ref = whole(sum_layer_backward_reference)(out, flows0, t["ch"], t["pid"], logw, off, Kp=Kp, Kc=Kc,
                                                  dense=False)
    want = flows0
    for m in range(M):
        want = want.at[child_rows(t["ch"][:, :, m], Kc, False)].add(cf_ref)
    a, mx, pf = whole(pallas_sum.backward_parents)(out, flows0, off, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc)
    # the forward keeping its shifts (Options.kernel_shifts): the same values, and each block's children max
    # (the parent-side kernel's recomputed one, -inf where every child is) at row first parent row / unit
    unit = math.gcd(off, Kp)
    untouched = jnp.full((-(-R // unit), B), 7.0, jnp.float32)
    out2, kept = whole(pallas_sum.forward)(buf, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc, out_offset=off, shifts=untouched,
                                    unit=unit)
    np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
    rows = (off + Kp * np.arange(n)) // unit
    np.testing.assert_array_equal(np.asarray(kept)[rows], np.asarray(mx))
    np.testing.assert_array_equal(np.delete(np.asarray(kept), rows, axis=0), 7.0)
    with pytest.raises(ValueError, match="unit"):
        pallas_sum.forward(buf, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc, out_offset=off, shifts=untouched, unit=3 * Kp)
    got = whole(pallas_sum.backward_children)(out, a, mx, t["uch"], t["par"], t["ppid"], logw, Kp=Kp, Kc=Kc, ch=t["ch"],
                                       pcol=t["pcol"], flows=flows0)
    keep = np.r_[base:off]  # the padding rows (zero and -inf) collect nothing meaningful
    np.testing.assert_allclose(np.asarray(got)[keep], np.asarray(want)[keep], rtol=2e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[off:], np.asarray(flows0)[off:])
    np.testing.assert_allclose(np.asarray(pf), np.asarray(pf_ref), rtol=2e-4, atol=1e-5)
    with pytest.raises(ValueError, match="pcol"):
        pallas_sum.backward_children(out, a, mx, t["uch"], t["par"], t["ppid"], logw, Kp=Kp, Kc=Kc, ch=t["ch"])


# (Kp, Kc, n, M, B, block_b): tree levels (one child block per parent block, one parent per row block)
EXCLUSIVE = [(4, 4, 3, 3, 7, 32), (16, 32, 2, 4, 19, 32), (8, 8, 5, 2, 40, 16), (3, 5, 4, 1, 1, 32)]


def make_tree_level(Kp, Kc, n, M, B, alpha=1.0, seed=11):
    """A tree level on the folded plan: ``n`` parent blocks, each reading one child made of ``M`` row blocks
    (some zero-row padding), every row block read once. Returns ``(values, flows, tables, logw, parent
    offset, first row above the padding, expected flows, expected parameter flows)``."""
    rng = np.random.default_rng(seed)
    kmax = max(Kp, Kc)
    base = 2 * kmax
    nblk = n * M
    off = base + nblk * Kc
    R = off + n * Kp
    buf = np.zeros((R, B), np.float32)
    buf[kmax:2 * kmax] = -np.inf
    buf[base:off] = rng.normal(size=(nblk * Kc, B)) * 2
    buf[base:off][rng.random((nblk * Kc, B)) < 0.1] = -np.inf
    ch = (base + Kc * rng.permutation(nblk)).reshape(n, 1, M)  # every row block read once
    if M > 1:
        short = rng.random((n, 1, M)) < 0.3
        short[:, :, 0] = False
        ch[short] = 0  # zero rows: a shorter product
    pid = rng.permutation(n).reshape(n, 1)
    assert inverse_tables(ch, pid)["par"].shape[1] == 1
    t = {k: jnp.asarray(v, jnp.int32) for k, v in {"ch": ch, "pid": pid}.items()}
    logw = jnp.asarray(np.log(rng.random((n, Kp, Kc)) + 1e-3), jnp.float32)
    prop = dict(propagation="LL") if alpha == 1.0 else dict(propagation="GeneralLL", alpha=alpha)

    @jax.jit  # one program (op by op, each operation would compile on its own)
    def reference(out, flows0, t, logw):
        vals = sum_layer_reference(out, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc, dense=False, **prop)
        out = out.at[off:].set(vals)
        flows0 = flows0.at[off:].set(jnp.where(jnp.isfinite(vals), flows0[off:], 0.0))
        flows0 = flows0.at[off:off + Kp, :2].set(0.0)  # parents without flow
        cf_ref, pf_ref = sum_layer_backward_reference(out, flows0, t["ch"], t["pid"], logw, off, Kp=Kp, Kc=Kc,
                                                      dense=False, **prop)
        want = flows0
        for m in range(M):
            rows = child_rows(t["ch"][:, :, m], Kc, False)
            want = want.at[rows].add(jnp.where(rows[:, :, None] >= base, cf_ref, 0.0))
        return out, flows0, want, pf_ref

    out, flows0, want, pf_ref = reference(jnp.asarray(buf), jnp.asarray(rng.random((R, B)), jnp.float32), t, logw)
    return out, flows0, t, logw, off, base, want, pf_ref


# each shape once, LL (alpha 1) and GeneralLL (alpha 0.5) in turn: one batch tile or several, 1 to 4 row blocks
@pytest.mark.parametrize("shape,alpha", cases(list(zip(EXCLUSIVE, [0.5, 1.0, 0.5, 1.0])), fast=[],
                                              unpack=True),
                         ids=lambda v: "Kp{}-Kc{}-n{}-M{}-B{}-bb{}".format(*v) if isinstance(v, tuple) else str(v))
def test_exclusive_backward_matches_reference(shape, alpha):
    """Tree levels: child flows computed once per parent and added into every row block of its folded child
    (zero-row padding untouched), over one batch tile or several, LL and GeneralLL."""
    Kp, Kc, n, M, B, bb = shape
    out, flows0, t, logw, off, base, want, pf_ref = make_tree_level(Kp, Kc, n, M, B, alpha)
    cfg = pallas_sum.KernelConfig(block_b=bb)
    got, pf = whole(pallas_sum.backward_exclusive)(out, flows0, off, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc,
                                                   first_row=base, alpha=alpha, config=cfg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-5)  # padding rows untouched
    np.testing.assert_allclose(np.asarray(pf), np.asarray(pf_ref), rtol=2e-4, atol=1e-5)
    got2, none = whole(pallas_sum.backward_exclusive)(out, flows0, off, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc,
                                               first_row=base, alpha=alpha, config=cfg, param_flows=False)
    assert none is None
    np.testing.assert_allclose(np.asarray(got2), np.asarray(want), rtol=2e-4, atol=1e-5)


def test_exclusive_backward_rejects_bad_input():
    b = jnp.zeros((40, 4), jnp.float32)
    ch, pid, lw = jnp.full((2, 2), 8, jnp.int32), jnp.zeros((2, 2), jnp.int32), jnp.zeros((4, 4, 4))
    with pytest.raises(ValueError, match="one child block"):
        pallas_sum.backward_exclusive(b, b, 24, ch, pid, lw, Kp=4, Kc=4, first_row=8)
    with pytest.raises(TypeError, match="float32"):
        pallas_sum.backward_exclusive(b, b.astype(jnp.float16), 24, ch[:, :1], pid[:, :1], lw, Kp=4, Kc=4, first_row=8)


@pytest.mark.parametrize("shape", cases(EXCLUSIVE, fast=EXCLUSIVE[:1]),
                         ids=lambda s: "Kp{}-Kc{}-n{}-M{}-B{}".format(*s[:5]))
@pytest.mark.parametrize("alpha,precision", cases([(1.0, "fp32"), (0.5, "tf32")], fast=[(1.0, "fp32")], unpack=True))
def test_level_backward_matches_reference(shape, alpha, precision):
    """A tree level in one kernel (the batch whole in each program): child flows into every row block of the
    folded child, parameter flows as an array or added into a parameter-flow buffer in place; local sums
    recomputed at fp32, from the stored values at tf32 (as the reference does; on a CPU both are exact)."""
    Kp, Kc, n, M, B = shape[:5]
    out, flows0, t, logw, off, base, want, pf_ref = make_tree_level(Kp, Kc, n, M, B, alpha)
    kw = dict(Kp=Kp, Kc=Kc, first_row=base, alpha=alpha, precision=precision)
    got, pf = whole(pallas_sum.backward_level)(out, flows0, off, t["ch"], t["pid"], logw, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-5)  # padding rows untouched
    np.testing.assert_allclose(np.asarray(pf), np.asarray(pf_ref), rtol=2e-4, atol=1e-5)
    dp0 = jnp.asarray(np.random.default_rng(1).random((n + 2, Kp, Kc)), jnp.float32)
    got2, dp = whole(pallas_sum.backward_level)(out, flows0, off, t["ch"], t["pid"], logw, dparams=dp0, **kw)
    np.testing.assert_allclose(np.asarray(got2), np.asarray(got), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(dp), np.asarray(dp0.at[t["pid"]].add(pf_ref)), rtol=2e-4, atol=1e-5)


def test_level_backward_rejects_bad_input():
    b = jnp.zeros((40, 4), jnp.float32)
    ch, pid, lw = jnp.full((2, 1), 8, jnp.int32), jnp.zeros((2, 1), jnp.int32), jnp.zeros((4, 4, 4))
    kw = dict(Kp=4, Kc=4, first_row=8)
    with pytest.raises(ValueError, match="one child block"):
        pallas_sum.backward_level(b, b, 24, jnp.full((2, 2), 8, jnp.int32), pid, lw, **kw)
    with pytest.raises(ValueError, match="at most 64 samples"):
        big = jnp.zeros((40, 65), jnp.float32)
        pallas_sum.backward_level(big, big, 24, ch, pid, lw, **kw)
    with pytest.raises(TypeError, match="float32"):
        pallas_sum.backward_level(b, b, 24, ch, pid, lw, dparams=jnp.zeros((4, 4, 4), jnp.float16), **kw)
    with pytest.raises(ValueError, match=r"dparams must be \[P, 4, 4\]"):
        pallas_sum.backward_level(b, b, 24, ch, pid, lw, dparams=jnp.zeros((4, 4, 5)), **kw)


def make_after_case(Kp, Kc, n, C, M, B, seed=0, unkept=3):
    """Final node values and flows ``[R, B]`` (some values ``-inf``, some flows zero), the batched parameter-flow
    tables of ``n`` blocks (parents at rows ``prow``; children ``ch [n, C, M]``, ``[n, C]`` for ``M = 1``,
    anywhere above the padding, block 0's all ``-inf``; distinct weight blocks ``pid`` out of ``n * C + 2``) and
    the shifts the forward kept: each block's max over its children per sample at row ``srow`` of ``shifts``
    (other rows random), ``srow = -1`` (none kept) for every ``unkept``-th block (0: none)."""
    rng = np.random.default_rng(seed)
    R = 2 * max(Kp, Kc) + n * C * M * Kc + n * Kp + 64
    vals = (rng.normal(size=(R, B)) * 3).astype(np.float32)
    vals[:Kc], vals[Kc:2 * Kc] = 0.0, -np.inf
    vals[rng.random((R, B)) < 0.05] = -np.inf
    fl = np.abs(rng.normal(size=(R, B))).astype(np.float32)
    fl[rng.random((R, B)) < 0.2] = 0.0
    ch = rng.integers(2 * Kc, R - Kc, (n, C, M)).astype(np.int32)
    ch[0, :, 0] = Kc  # block 0: every child -inf (its shift too)
    ch[0, :, 1:] = 0
    prow = rng.integers(2 * Kc, R - Kp, n).astype(np.int32)
    shifts = rng.normal(size=(n + 3, B)).astype(np.float32)
    srow = rng.permutation(n + 3)[:n].astype(np.int32)
    if unkept:
        srow[np.arange(n) % unkept == unkept - 1] = -1
    for i in np.flatnonzero(srow >= 0):
        x = sum(vals[ch[i, :, m][:, None] + np.arange(Kc)] for m in range(M))  # [C, Kc, B]
        shifts[srow[i]] = x.max(axis=(0, 1))
    P = n * C + 2
    pid = rng.permutation(P)[:n * C].reshape(n, C).astype(np.int32)
    logw = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(P, Kp, Kc)), jnp.float32), axis=-1)
    return (jnp.asarray(vals), jnp.asarray(fl), jnp.asarray(shifts), jnp.asarray(srow), jnp.asarray(prow),
            jnp.asarray(ch if M > 1 else ch[:, :, 0]), jnp.asarray(pid), logw)


# (Kp, Kc, n, C, M, B): the batched parameter-flow pass's blocks (fan-in C, folded children of M row blocks)
AFTER = [(8, 4, 3, 2, 3, 7), (16, 32, 2, 1, 4, 19), (8, 8, 5, 3, 1, 40), (64, 64, 3, 1, 1, 16), (32, 16, 2, 1, 2, 70)]


@pytest.mark.parametrize("shape", cases(AFTER, fast=AFTER[:1]), ids=lambda s: "Kp{}-Kc{}-n{}-C{}-M{}-B{}".format(*s))
@pytest.mark.parametrize("propagation", ["LL", "GeneralLL"])
def test_param_flows_after_match_reference(shape, propagation):
    """The batched parameter-flow kernel (local sums from the stored values; shifts kept, or recomputed where
    not) against the XLA reference at tf32 (exact on a CPU; on a GPU each sums products of two TF32-rounded
    positive operands, within ``2u`` relative of the exact sum, so the two lie within ``4u`` of each other, ``u``
    tests/conftest.py's ``tf32_unit``), GeneralLL's exponent, a block whose children are all -inf; bad input."""
    from jaxpc.ops.sum_layer import sum_layer_param_flows_reference

    Kp, Kc = shape[:2]
    vals, fl, shifts, srow, prow, ch, pid, logw = make_after_case(*shape)
    alpha = 2.5 if propagation == "GeneralLL" else None
    want = whole(sum_layer_param_flows_reference)(vals, fl, ch, pid, logw, prow, Kp=Kp, Kc=Kc, propagation=propagation,
                                           alpha=alpha, precision="tf32")
    kw = dict(Kp=Kp, Kc=Kc, alpha=alpha or 1.0)
    got = whole(pallas_sum.param_flows_after)(vals, fl, shifts, srow, prow, ch, pid, logw, **kw)
    assert got.shape == want.shape and bool(jnp.all(jnp.isfinite(got)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5 + 4 * tf32_unit(),
                               atol=1e-6 * float(jnp.abs(want).max()))
    with pytest.raises(TypeError, match="float32"):
        pallas_sum.param_flows_after(vals.astype(jnp.bfloat16), fl, shifts, srow, prow, ch, pid, logw, **kw)
    with pytest.raises(ValueError, match="precision below fp32"):
        pallas_sum.param_flows_after(vals, fl, shifts, srow, prow, ch, pid, logw, precision="fp32", **kw)
    with pytest.raises(ValueError, match="srow"):
        pallas_sum.param_flows_after(vals, fl, shifts, srow[1:], prow, ch, pid, logw, **kw)


# (Kp, Kc, n, C, M, B): fan-in partitions whose child row blocks several parent blocks share
ATOMIC = [(16, 16, 6, 3, 2, 20), (8, 32, 5, 4, 1, 70), (32, 8, 3, 2, 3, 9)]


# both propagations on the first shape, one each on the others
@pytest.mark.parametrize("shape,propagation", cases([(ATOMIC[0], "LL"), (ATOMIC[0], "GeneralLL"),
                                                     (ATOMIC[1], "GeneralLL"), (ATOMIC[2], "LL")],
                                                    fast=[(ATOMIC[0], "LL")], unpack=True),
                         ids=lambda v: "Kp{}-Kc{}-n{}-C{}-M{}-B{}".format(*v) if isinstance(v, tuple) else str(v))
@pytest.mark.slow
def test_fanin_backward_atomic_matches_reference(shape, propagation):
    """The one-kernel backward of a fan-in partition (the kept shifts read, local sums from the stored values, the
    child flows added to rows that several parent blocks share) against the XLA reference at tf32 (exact on a CPU):
    parameter flows, and the flow buffer with the child flows added to every row block of each folded child, the
    padding rows (zero rows of shorter products, the -inf rows) untouched; -inf values, zero flows; bad input."""
    from types import SimpleNamespace

    from jaxpc.engine.flows import scatter_child_flows

    Kp, Kc, n, C, M, B = shape
    rng = np.random.default_rng(1)
    kmax = max(Kp, Kc)
    first, U = 2 * kmax, 4  # the padding rows, then U child row blocks that the n * C edge blocks share
    off = -(-(first + U * Kc) // Kp) * Kp
    R = off + n * Kp
    vals = (rng.normal(size=(R, B)) * 3).astype(np.float32)
    vals[:kmax], vals[kmax:first] = 0.0, -np.inf
    vals[rng.random((R, B)) < 0.05] = -np.inf
    ch = (first + Kc * rng.integers(0, U, (n, C, M))).astype(np.int32)
    ch[0, 0, 0] = kmax  # a padding child: the -inf rows
    if M > 1:
        ch[1, :, M - 1] = 0  # a shorter product: the zero rows
    pid = rng.integers(0, n * C, (n, C)).astype(np.int32)
    logw = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(n * C, Kp, Kc)), jnp.float32), axis=-1)
    alpha = 2.5 if propagation == "GeneralLL" else None
    tab = jnp.asarray(ch if M > 1 else ch[:, :, 0])
    out, m = whole(sum_layer_reference)(jnp.asarray(vals), tab, jnp.asarray(pid), logw, Kp=Kp, Kc=Kc, dense=False,
                                        propagation=propagation, alpha=alpha, precision="tf32", with_shift=True)
    vals = jnp.asarray(vals).at[off:].set(out)
    shifts = jnp.asarray(rng.normal(size=(R // Kp, B)), jnp.float32).at[off // Kp + jnp.arange(n)].set(m)
    fl = np.abs(rng.normal(size=(R, B))).astype(np.float32)
    fl[rng.random((R, B)) < 0.2] = 0.0
    fl = jnp.asarray(fl)
    cf, pf = whole(sum_layer_backward_reference)(vals, fl, tab, jnp.asarray(pid), logw, off, Kp=Kp, Kc=Kc,
                                                  dense=False, propagation=propagation, alpha=alpha, precision="tf32",
                                                  shift=m)
    want = scatter_child_flows(fl, cf, tab, SimpleNamespace(Kc=Kc, dense=False, D=2), first)[first:]  # (and padding)
    kw = dict(Kp=Kp, Kc=Kc, unit=Kp, first_row=first, alpha=alpha or 1.0, precision="tf32")
    # child by child, each program's batch loop starting at its own tile; with the next tile's loads issued first;
    # a parent block's children in one program
    order = child_order(ch)
    assert sorted(order.tolist()) == list(range(n * C))
    variants = [dict(order=None), dict(order=jnp.asarray(order)), dict(order=jnp.asarray(order), prefetch=True),
                dict(group=C), dict(group=C, prefetch=True)]  # all children of a parent block in one program
    for variant in variants:
        got, gpf = whole(pallas_sum.backward_atomic)(vals, fl, shifts, off, tab, jnp.asarray(pid), logw, **kw,
                                                     **variant)
        assert bool(jnp.all(jnp.isfinite(got))) and bool(jnp.all(got[:first] == fl[:first]))
        np.testing.assert_allclose(np.asarray(got[first:]), np.asarray(want), rtol=2e-5,
                                   atol=1e-6 * float(jnp.abs(want).max()))
        np.testing.assert_allclose(np.asarray(gpf), np.asarray(pf), rtol=2e-5, atol=1e-6 * float(jnp.abs(pf).max()))
    with pytest.raises(ValueError, match="group must divide"):
        pallas_sum.backward_atomic(vals, fl, shifts, off, tab, jnp.asarray(pid), logw, **kw, group=C + 1)
    with pytest.raises(ValueError, match="order must list"):
        pallas_sum.backward_atomic(vals, fl, shifts, off, tab, jnp.asarray(pid), logw, **kw,
                                   order=jnp.asarray(order[1:]))
    with pytest.raises(TypeError, match="float32"):
        pallas_sum.backward_atomic(vals.astype(jnp.bfloat16), fl, shifts, off, tab, jnp.asarray(pid), logw, **kw)
    with pytest.raises(ValueError, match="precision below fp32"):
        pallas_sum.backward_atomic(vals, fl, shifts, off, tab, jnp.asarray(pid), logw, **{**kw, "precision": "fp32"})
    with pytest.raises(ValueError, match="at most 64"):
        pallas_sum.backward_atomic(vals, fl, shifts, off, tab, jnp.asarray(pid), logw, **{**kw, "Kp": 128})


@pytest.mark.slow
@pytest.mark.full
def test_padded_tables_run_the_real_blocks_only():
    """Tables padded to a kernel class's shape (:func:`jaxpc.compiler.compile.shared_kernel_tables`: more parent blocks
    and children) with the partition's own ``blocks`` and ``fanin``: the in-place forward writes the real blocks' rows
    and shifts and nothing above, the atomic backward adds the real edge blocks' child flows and returns their
    parameter flows, both as on the unpadded tables; an extent out of range is refused."""
    Kp, Kc, n, C, B, extra, wide = 8, 8, 3, 2, 11, 2, 4
    rng = np.random.default_rng(5)
    first, U = 2 * Kp, 3
    off = first + U * Kc
    R = off + (n + extra) * Kp  # the rows above the partition: where padding blocks would write
    vals = (rng.normal(size=(R, B)) * 2).astype(np.float32)
    vals[:Kp], vals[Kp:first] = 0.0, -np.inf
    ch = (first + Kc * rng.integers(0, U, (n, C))).astype(np.int32)
    pid = rng.permutation(n * C).reshape(n, C).astype(np.int32)
    logw = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(n * C, Kp, Kc)), jnp.float32), axis=-1)
    kch = jnp.asarray(np.pad(ch, ((0, extra), (0, wide - C)), mode="edge"))
    kpid = jnp.asarray(np.pad(pid, ((0, extra), (0, wide - C)), mode="edge"))
    order = child_order(ch[:, :, None])
    real = (order // C) * wide + order % C
    korder = jnp.asarray(np.concatenate([real, np.setdiff1d(np.arange((n + extra) * wide), real)]), jnp.int32)
    vals, ch, pid = jnp.asarray(vals), jnp.asarray(ch), jnp.asarray(pid)
    shifts = jnp.full((R // Kp, B), 7.0, jnp.float32)
    ext = dict(blocks=n, fanin=C)
    kw = dict(Kp=Kp, Kc=Kc, out_offset=off, shifts=shifts, unit=Kp, precision="tf32")
    want, want_m = whole(pallas_sum.forward)(vals, ch, pid, logw, **kw)
    # (the fan-in read at run time in the prefetching loop; the plain loop runs in the fold tests)
    got, got_m = whole(pallas_sum.forward)(vals, kch, kpid, logw, **kw, **ext,
                                           config=pallas_sum.KernelConfig(prefetch=True))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got_m), np.asarray(want_m))
    np.testing.assert_array_equal(np.asarray(got[off + n * Kp:]), np.asarray(vals[off + n * Kp:]))  # untouched
    np.testing.assert_array_equal(np.asarray(got_m[off // Kp + n:]), 7.0)
    # several child blocks per step of the forward's loop (KernelConfig.span; the fan-in static or read at run
    # time, children past it masked), the tables read in place from a packed array
    packed = jnp.concatenate([jnp.full((5,), 99, jnp.int32), kch.ravel(), kpid.ravel()])
    spans = [(dict(), 2), (ext, 2), (ext, 4), (dict(ext, source=(packed, (5, 5 + kch.size))), 4)]
    for extent, span in spans:
        tabs = (kch, kpid) if extent else (ch, pid)
        for prefetch in (False, True):
            cfg = pallas_sum.KernelConfig(span=span, prefetch=prefetch)
            got, got_m = whole(pallas_sum.forward)(vals, *tabs, logw, **kw, **extent, config=cfg)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(np.asarray(got_m), np.asarray(want_m))
    with pytest.raises(ValueError, match="span must be a power of two"):
        pallas_sum.forward(vals, ch, pid, logw, **kw, config=pallas_sum.KernelConfig(span=3))
    span = lambda s, C, Kc: pallas_sum.forward_span(pallas_sum.KernelConfig(span=s), C, Kc)  # noqa: E731
    # up to the fan-in and to SPAN_NODES (64) child nodes a step, whole blocks of a power-of-two size only
    assert (span(4, 8, 32), span(4, 8, 16), span(4, 3, 8), span(2, 1, 32), span(2, 8, 64), span(2, 8, 24)) == \
        (2, 4, 4, 1, 1, 1)
    fl = jnp.asarray(np.abs(rng.normal(size=(R, B))), jnp.float32)
    bkw = dict(Kp=Kp, Kc=Kc, unit=Kp, first_row=first, precision="tf32")
    want_f, want_pf = whole(pallas_sum.backward_atomic)(want, fl, want_m, off, ch, pid, logw, **bkw)
    got_f, got_pf = whole(pallas_sum.backward_atomic)(want, fl, want_m, off, kch, kpid, logw, **bkw, **ext)
    assert got_pf.shape == (n, C, Kp, Kc)
    np.testing.assert_allclose(np.asarray(got_f), np.asarray(want_f), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_pf), np.asarray(want_pf), rtol=1e-5, atol=1e-6)
    # the parameter flows added in place into a group's [P, Kp, Kc] accumulator at the blocks pid; the edge blocks
    # one program each with the next tile prefetched, a parent block's children in one program, in child order
    dp0 = jnp.asarray(rng.random((n * C + 3, Kp, Kc)), jnp.float32)
    for variant in (dict(prefetch=True, dparams=dp0), dict(group=C, dparams=dp0), dict(order=korder),
                    dict(group=C)):
        got_f, got = whole(pallas_sum.backward_atomic)(want, fl, want_m, off, kch, kpid, logw, **bkw, **variant, **ext)
        np.testing.assert_allclose(np.asarray(got_f), np.asarray(want_f), rtol=1e-5, atol=1e-6)
        if "dparams" in variant:
            np.testing.assert_allclose(np.asarray(got), np.asarray(dp0.at[pid].add(want_pf)), rtol=1e-5, atol=1e-6)
        elif "group" in variant:
            np.testing.assert_allclose(np.asarray(got), np.asarray(want_pf), rtol=1e-5, atol=1e-6)
    for bad in (dict(blocks=0), dict(blocks=n + extra + 1), dict(fanin=wide + 1)):
        with pytest.raises(ValueError, match="blocks and fanin must be in"):
            pallas_sum.forward(vals, kch, kpid, logw, **kw, **bad)
    with pytest.raises(ValueError, match="below it in place only"):
        pallas_sum.forward(vals, kch, kpid, logw, Kp=Kp, Kc=Kc, **ext)
    with pytest.raises(ValueError, match="group must divide"):
        pallas_sum.backward_atomic(want, fl, want_m, off, kch, kpid, logw, **bkw, group=4, **ext)
    with pytest.raises(TypeError, match="dparams must be float32"):
        pallas_sum.backward_atomic(want, fl, want_m, off, ch, pid, logw, **bkw, dparams=jnp.zeros((6, Kp, Kc + 1)))


# ---- the node buffer's leaves (pallas_leaf) ----------------------------------------------------------

def make_leaf_case(B: int, seed: int = 0, missing: bool = False):
    """Two categorical layers (3 and 5 categories, tied parameter rows) with a gap between them, values out of
    range in a few places."""
    rng = np.random.default_rng(seed)
    V = 6
    x = rng.integers(0, 5, (V, B))
    x[rng.random((V, B)) < 0.05] = -1
    x[rng.random((V, B)) < 0.05] = 7
    layers = [pallas_leaf.LeafLayer(30, 11, 5), pallas_leaf.LeafLayer(8, 13, 3)]
    tabs = []
    for spec, P in zip(layers, (4, 13)):
        lp = np.log(rng.dirichlet(np.ones(spec.num_cats), P)).astype(np.float32)
        lp[0, 1] = -np.inf  # a zero probability
        tabs.append((jnp.asarray(lp), jnp.asarray(rng.integers(0, P, spec.num_nodes), jnp.int32),
                     jnp.asarray(rng.integers(0, V, spec.num_nodes), jnp.int32),
                     jnp.asarray(rng.normal(size=spec.num_nodes), jnp.float32)))
    miss = jnp.asarray(rng.random((V, B)) < 0.3) if missing else None
    return jnp.asarray(x, jnp.int32), layers, tabs, miss


@pytest.mark.parametrize("B", cases([1, 37, 130], fast=[37]))
@pytest.mark.parametrize("missing", cases([False, True], fast=[True]))
@pytest.mark.parametrize("config", [pallas_leaf.LeafConfig(), pallas_leaf.LeafConfig(block_b=16, block_e=64)],
                         ids=["default", "small"])
def test_categorical_buffer_matches_reference(B, missing, config):
    """The leaf kernel writes every row: padding (zeros, then -inf), the leaves (NaN out of range, the marginal
    where missing), zeros in the gap between the layers and above them; exactly the reference's buffer."""
    xt, layers, tabs, miss = make_leaf_case(B, missing=missing)
    got = whole(pallas_leaf.categorical_buffer)(xt, layers, tabs, num_rows=47, kmax=4, missing=miss, config=config)
    ref = whole(pallas_leaf.categorical_buffer_reference)(xt, layers, tabs, num_rows=47, kmax=4, missing=miss)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    g = np.asarray(got)
    assert (g[:4] == 0).all() and (g[4:8] == -np.inf).all() and (g[21:30] == 0).all() and (g[41:] == 0).all()
    lp, rows, vars_, marg = (np.asarray(a) for a in tabs[0])
    xv = np.asarray(xt)[vars_]
    want = np.where((xv < 0) | (xv > 4), np.nan, lp[rows[:, None], np.clip(xv, 0, 4)])
    if missing:
        want = np.where(np.asarray(miss)[vars_], marg[:, None], want)
    np.testing.assert_array_equal(g[30:41], want)


@pytest.mark.parametrize("missing", [False, True])
def test_categorical_buffer_can_leave_the_rows_above_the_leaves_unwritten(missing, monkeypatch):
    """``zero_above=False`` (the flow pass's buffer, whose stages write those rows): the rows up to the last layer
    are the reference's; the kernel writes none above (interpret mode shows them as NaN: on a GPU too, where the
    compiled kernel's unwritten rows would hold whatever the memory held)."""
    monkeypatch.setattr(pallas_sum, "interpret_mode", lambda: True)
    xt, layers, tabs, miss = make_leaf_case(37, missing=missing)
    got = np.asarray(whole(pallas_leaf.categorical_buffer)(xt, layers, tabs, num_rows=47, kmax=4, missing=miss,
                                                    zero_above=False))
    ref = np.asarray(whole(pallas_leaf.categorical_buffer_reference)(xt, layers, tabs, num_rows=47, kmax=4,
                                                                     missing=miss))
    np.testing.assert_array_equal(got[:41], ref[:41])
    assert got.shape == ref.shape and np.isnan(got[41:]).all()


def test_categorical_buffer_refuses_bad_input():
    xt, layers, tabs, miss = make_leaf_case(9, missing=True)
    kw = dict(num_rows=47, kmax=4)
    with pytest.raises(TypeError, match="integers"):
        pallas_leaf.categorical_buffer(xt.astype(jnp.float32), layers, tabs, **kw)
    with pytest.raises(TypeError, match="float32"):
        pallas_leaf.categorical_buffer(xt, layers, [(tabs[0][0].astype(jnp.float16),) + tabs[0][1:], tabs[1]], **kw)
    with pytest.raises(ValueError, match="padding"):
        pallas_leaf.categorical_buffer(xt, [pallas_leaf.LeafLayer(6, 11, 5), layers[1]], tabs, **kw)
    with pytest.raises(ValueError, match="padding"):
        pallas_leaf.categorical_buffer(xt, layers, tabs, num_rows=40, kmax=4)
    with pytest.raises(ValueError, match="marginals"):
        pallas_leaf.categorical_buffer(xt, layers, [tabs[0][:3] + (None,), tabs[1]], missing=miss, **kw)
    with pytest.raises(ValueError, match="missing mask"):
        pallas_leaf.categorical_buffer(xt, layers, tabs, missing=miss[:, :3], **kw)


def test_forward_kernel_keeps_nan_children():
    """A NaN child value (a leaf out of range with validation off) makes its parents NaN, as on XLA, never -inf;
    an empty sum (all children -inf) stays -inf."""
    buf, t, logw, R = make_partition(4, 8, 3, 2, 5, 0.0, 0.0)
    row = int(t["ch"][1, 0]) + 2
    buf = buf.at[row, 3].set(jnp.nan).at[int(t["ch"][2, 0]):int(t["ch"][2, 0]) + 8].set(-jnp.inf)
    buf = buf.at[int(t["ch"][2, 1]):int(t["ch"][2, 1]) + 8].set(-jnp.inf)
    ref = np.asarray(whole(sum_layer_reference)(buf, t["ch"], t["pid"], logw, Kp=4, Kc=8, dense=False))
    out = np.asarray(whole(pallas_sum.forward)(buf, t["ch"], t["pid"], logw, Kp=4, Kc=8))
    assert np.isnan(ref).any() and np.isneginf(ref).any()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isneginf(out), np.isneginf(ref))
    np.testing.assert_allclose(out[np.isfinite(ref)], ref[np.isfinite(ref)], rtol=1e-5)


def test_forward_config_for_small_grids():
    """The forward's default tiles: smaller parent tiles only where the batch is one tile and the grid has fewer
    programs than FILL_PROGRAMS; a tuned config is kept."""
    fc, K = pallas_sum.forward_config, pallas_sum.KernelConfig
    assert fc(2, 256, 16) == K(block_k=16, block_c=256)  # 2 x 16 programs
    assert fc(20, 256, 16) == K(block_k=32, block_c=64)  # 160 programs
    assert fc(40, 256, 16) == K() and fc(2, 256, 512) == K() and fc(1, 256, 33) == K() and fc(3, 16, 8) == K()
    tuned = K(16, 128, 8)
    assert fc(2, 256, 16, tuned) is tuned


@pytest.mark.parametrize("n,M", [(2, 3), (20, 1)])
def test_forward_on_small_grid_tiles_matches_reference(n, M):
    """The forward kernel on forward_config's small-grid tiles (a tree level's 256-node blocks at batch 16, folded
    children of M row blocks) equals the reference."""
    Kp = Kc = 256
    buf, t, logw, R = make_partition(Kp, Kc, n * M, 1, 16, 0.0, 0.1)
    ch3 = t["ch"].reshape(n, 1, M)
    pid = t["pid"][:n]
    summed = sum(buf[(ch3[:, :, m][:, :, None] + jnp.arange(Kc)).reshape(n, -1)] for m in range(M))  # [n, Kc, B]
    cfg = pallas_sum.forward_config(n, Kp, 16)
    assert cfg != pallas_sum.KernelConfig()
    out = whole(pallas_sum.forward)(buf, ch3, pid, logw, Kp=Kp, Kc=Kc, config=cfg, precision="fp32")
    w = jnp.exp(logw[pid[:, 0]])  # [n, Kp, Kc]
    m = jnp.max(summed, axis=1, keepdims=True)
    ref = jnp.log(jnp.einsum("npk,nkb->npb", w, jnp.exp(summed - m), precision="highest")) + m
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref.reshape(n * Kp, 16)), rtol=2e-5, atol=2e-5)


def test_table_gathers_leave_out_the_negative_index_wrap():
    """``jaxpc.ops.rows``: the same values as ``x[idx]`` and ``x.at[idx]`` for the tables' indices (never
    negative), with no compare-and-select of a wrap in the trace; out-of-range scatter rows are dropped."""
    from jaxpc.ops.rows import add_rows, put_rows, take_rows

    x = jnp.arange(40.0).reshape(10, 4)
    idx = jnp.array([[3, 0], [9, 3]], jnp.int32)
    v = jnp.ones((2, 2, 4))
    np.testing.assert_array_equal(take_rows(x, idx), x[idx])
    np.testing.assert_array_equal(add_rows(x, idx, v), x.at[idx].add(v))
    np.testing.assert_array_equal(put_rows(x, idx[:1], v[:1], unique_indices=True), x.at[idx[:1]].set(v[:1]))
    np.testing.assert_array_equal(add_rows(x, jnp.array([10]), jnp.ones((1, 4))), x)  # past the end: dropped
    np.testing.assert_array_equal(take_rows(np.asarray(x), np.array([2])), np.asarray(x)[[2]])
    for f in (lambda x, i: take_rows(x, i), lambda x, i: add_rows(x, i, v)):
        prims = {e.primitive.name for e in jax.make_jaxpr(f)(x, idx).jaxpr.eqns}
        assert not prims & {"lt", "select_n"}, prims
    assert "select_n" in {e.primitive.name for e in jax.make_jaxpr(lambda x, i: x[i])(x, idx).jaxpr.eqns}


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_in_place_forward_reads_its_tables_from_the_packed_array(monkeypatch, scan):
    """An executable's in-place forward kernels read ``ch`` and ``pid`` in the packed table array (a copy of each
    would be a device copy per call) wherever the tables lie whole in it: in unscanned stages and in unrolled
    repetitions of a scan (``jaxpc.ops.tables``), not inside a scan. The flows equal XLA's either way."""
    from jaxpc import distributions, structures
    from jaxpc.compiler.layout import ScanSpec
    from jaxpc.ops import tables

    data = np.random.default_rng(0).integers(0, 3, (300, 30))
    c = jaxpc.compile(structures.HCLT(data, 4, input_dist=distributions.Categorical(3)))
    assert any(isinstance(s, ScanSpec) for s in c.layout.fold.steps)
    seen = []
    forward = pallas_sum.forward

    def spy(*a, **k):  # (wrong offsets would read other tables: the flows below would differ)
        seen.append(k.get("source") is not None)
        return forward(*a, **k)

    monkeypatch.setattr(pallas_sum, "forward", spy)
    x = data[:8].astype(np.int32)
    g_ref, ll_ref = c.flows(c.params, x, options=jaxpc.Options(impl="xla", precision="fp32"), return_ll=True)
    seen.clear()
    g, ll = c.flows(c.params, x, options=jaxpc.Options(impl="pallas", precision="fp32", scan_stages=scan),
                    return_ll=True)
    np.testing.assert_allclose(np.asarray(ll), np.asarray(ll_ref), rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert all(seen) if not scan else (any(seen) and not all(seen)), (scan, seen)
    t = tables.TableAt(0, 10, (3, 2, 4))
    assert t.take(2) == tables.TableAt(0, 26, (2, 4))


@pytest.mark.parametrize("shape", cases(SHAPES, fast=[SHAPES[1], SHAPES[7]]),
                         ids=lambda v: "Kp{}-Kc{}-n{}-C{}-B{}".format(*v[:5]))
def test_max_product_forward_equals_the_reference_exactly(shape):
    """The max-plus forward (``propagation="MPE"``) writes the reference's max-product values bit for bit: each
    term is the same float32 sum, and a max does not round; given a buffer of first maximizers, it writes each
    parent's first maximizing child there as XLA's reduction finds it (``with_first``). Over padded fan-ins,
    children at -inf, several batch tiles and chunks."""
    Kp, Kc, n, C, B = shape[:5]
    buf, t, logw, R = make_partition(*shape)
    kw = dict(Kp=Kp, Kc=Kc, propagation="MPE")

    @jax.jit
    def run(buf, t, logw):
        ref = sum_layer_reference(buf, t["ch"], t["pid"], logw, dense=False, with_first=True, **kw)
        full = jnp.concatenate([buf, jnp.full((n * Kp, B), 7.0)])
        firsts = jnp.full(full.shape, -5, jnp.int32)
        return (*ref, pallas_sum.forward(buf, t["ch"], t["pid"], logw, **kw),
                pallas_sum.forward(full, t["ch"], t["pid"], logw, out_offset=R, **kw),
                *pallas_sum.forward(full, t["ch"], t["pid"], logw, out_offset=R, firsts=firsts, **kw))

    ref, ref_first, out, inplace, kept, first = (np.asarray(a) for a in run(buf, t, logw))
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(inplace[R:], ref)
    np.testing.assert_array_equal(inplace[:R], np.asarray(buf))
    np.testing.assert_array_equal(kept, inplace)
    np.testing.assert_array_equal(first[R:], ref_first)
    np.testing.assert_array_equal(first[:R], -5)
    assert (ref_first == C * Kc).any() == (~np.isfinite(ref)).any()


@pytest.mark.slow
def test_max_product_forward_on_folded_and_padded_tables():
    """Folded children (the sum of ``M`` row blocks, added in the reference's order) and tables padded to a class's
    shape (``blocks``, ``fanin`` read at run time) give the reference's values exactly; shifts are refused."""
    Kp, Kc, n, M = 16, 32, 3, 3
    buf, t, logw, R = make_partition(Kp, Kc, n * M * 2, 1, 20, 0.0, 0.1)
    ch3 = t["ch"].reshape(n, 2, M)
    pid = t["pid"].reshape(n, 2, M)[:, :, 0]
    kw = dict(Kp=Kp, Kc=Kc, propagation="MPE")
    # (the reference's values and its first maximizers, in one program)
    ref, ref_first = whole(sum_layer_reference)(buf, ch3, pid, logw, dense=False, with_first=True, **kw)
    full = jnp.concatenate([buf, jnp.zeros((n * Kp, 20))])
    got = whole(pallas_sum.forward)(full, ch3, pid, logw, out_offset=R, **kw)
    np.testing.assert_array_equal(np.asarray(got)[R:], np.asarray(ref))
    # the first two blocks and their first child of tables padded to 4 blocks of 3 children
    pch = jnp.full((4, 3, M), int(ch3[0, 0, 0]), jnp.int32).at[:2, :1].set(ch3[:2, :1])
    ppid = jnp.zeros((4, 3), jnp.int32).at[:2, :1].set(pid[:2, :1])
    ref2 = whole(sum_layer_reference)(buf, ch3[:2, :1], pid[:2, :1], logw, dense=False, **kw)
    got2 = whole(pallas_sum.forward)(full, pch, ppid, logw, out_offset=R, blocks=2, fanin=1, **kw)
    np.testing.assert_array_equal(np.asarray(got2)[R:R + 2 * Kp], np.asarray(ref2))
    np.testing.assert_array_equal(np.asarray(got2)[R + 2 * Kp:], 0.0)
    with pytest.raises(ValueError, match="propagation=MPE"):
        pallas_sum.forward(full, ch3, pid, logw, out_offset=R, shifts=jnp.zeros((R // Kp + n, 20)), unit=Kp, **kw)
    with pytest.raises(ValueError, match="firsts are kept"):
        pallas_sum.forward(full, ch3, pid, logw, out_offset=R, firsts=jnp.zeros(full.shape, jnp.float32), **kw)
    firsts = jnp.zeros(full.shape, jnp.int32)
    got3, first = whole(pallas_sum.forward)(full, ch3, pid, logw, out_offset=R, firsts=firsts, **kw)
    np.testing.assert_array_equal(np.asarray(got3), np.asarray(got))
    np.testing.assert_array_equal(np.asarray(first)[R:], np.asarray(ref_first))
    # 128 parent rows a program where the grid keeps two programs per SM, 64 below; unrolled steps within Kc
    assert pallas_sum.max_tiles(64, 256, 512, 512) == (64, 128, 4)
    assert pallas_sum.max_tiles(1, 1024, 1024, 512) == (64, 64, 8) and pallas_sum.max_tiles(3, 16, 2, 20) == (32, 16, 2)
