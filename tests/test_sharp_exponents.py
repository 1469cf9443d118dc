"""Sum-product exponents above 1 (GeneralLL's ``alpha``, flows tempered by ``T < 1``) against float64 brute force:
values, flows and EM at exponents up to 1000, where the factored products ``exp(a log w) @ exp(a (x - m))``
underflow in float32, and the routes that keep such exponents off the kernels."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions
from jaxpc.engine import routing
from jaxpc.ops.sum_layer import sum_layer_backward_reference, sum_layer_param_flows_reference, sum_layer_reference

from . import oracle
from .tiers import cases

sum_ops = importlib.import_module("jaxpc.ops.sum_layer")  # the module: ``jaxpc.ops`` exports its function

B = 6
ALPHAS = [0.5, 2.0, 100.0, 1000.0]
TEMPERATURES = [0.5, 0.01, 0.001]


@functools.cache
def two_level():
    """Four categorical variables, two levels of sums: blocks of 2, fan-ins of 2 and 4 child blocks."""
    def leaf(v):
        return jaxpc.inputs(v, num_node_blocks=2, block_size=2, dist=distributions.Categorical(3))

    left = jaxpc.summate(jaxpc.multiply(leaf(0), leaf(1)), num_node_blocks=2, block_size=2)
    right = jaxpc.summate(jaxpc.multiply(leaf(2), leaf(3)), jaxpc.multiply(leaf(2), leaf(3)), num_node_blocks=2,
                          block_size=2)
    root = jaxpc.summate(jaxpc.multiply(left, right), num_nodes=1)
    return jaxpc.compile(root, seed=3)


def data(seed=0, num_vars=4):
    return np.random.default_rng(seed).integers(0, 3, (B, num_vars)).astype(np.int32)


def exact_flows(c, x, alpha: float | None = None, tp: float = 1.0, te: float = 1.0):
    """float64 ``(root values [B], sum edge flows {id: [n, nch]}, input statistics {id: [n, cats]})``: the forward
    under ``GeneralLL(alpha)`` (LL where None), each sum's flow split over its children by ``(w p)^(a / T)``
    normalized (``a`` = ``alpha`` or 1; ``T`` = ``tp`` for the edge flows, ``te`` for the flows passed down)."""
    edges, node_flows, vals = oracle.flows(c, c.params, x, tp=tp, te=te, alpha=alpha)
    stats = {ns.id: oracle.input_stats(ns, c.get_node_params(c.params, ns), x, None, node_flows[ns.id])
             for ns in c.nodes if ns.is_input()}
    return vals[c.root.id][0], edges, stats


def check_flows(c, fl, edges, stats, rtol, atol):
    """``c.flows``' result ``fl`` against :func:`exact_flows`, and the root's edge flows summing to the batch."""
    for ns in c.nodes:
        if ns.is_prod():
            continue
        got = np.asarray(c.get_node_flows(fl, ns), np.float64)
        if ns.is_sum():
            np.testing.assert_allclose(got, edges[ns.id], rtol=rtol, atol=atol, err_msg=f"sum {ns.id}")
        else:
            np.testing.assert_allclose(got, stats[ns.id], rtol=rtol, atol=atol, err_msg=f"input {ns.id}")
    np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, c.root)).sum(), B, rtol=1e-5)


def tolerance(a: float) -> float:
    """Float32 terms carry about ``|t| * 6e-8`` of error, which an exponent ``a`` multiplies in the shares."""
    return max(1e-4, 2e-6 * a)


@pytest.mark.parametrize("alpha, impl", cases([(a, i) for a in ALPHAS for i in ("xla", "pallas")],
                                               fast=[(1000.0, "xla"), (100.0, "pallas")], unpack=True))
def test_general_ll_values_and_flows_are_exact(alpha, impl):
    """Alpha 0.5 runs on the kernels under ``"pallas"`` (interpret mode), larger ones on XLA's terms."""
    c = two_level()
    x = data()
    ref, edges, stats = exact_flows(c, x.astype(np.float64), alpha=alpha)
    opts = jaxpc.Options(impl=impl, propagation="GeneralLL", alpha=alpha, precision="fp32")
    fl, ll = c.flows(c.params, x, options=opts, return_ll=True)
    np.testing.assert_allclose(np.asarray(ll), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x, options=opts)), ref, rtol=1e-5, atol=1e-5)
    check_flows(c, fl, edges, stats, tolerance(alpha), tolerance(alpha))


@pytest.mark.parametrize("T, which", cases([(T, w) for T in TEMPERATURES for w in ("pflow_temperature",
                                                                                    "eflow_temperature")],
                                             fast=[(0.001, "pflow_temperature"), (0.01, "eflow_temperature")],
                                             unpack=True))
def test_tempered_flows_are_exact(T, which):
    """Each temperature on its own: the edge flows tempered, or the flows passed down (and the leaves' counts)."""
    c = two_level()
    x = data(1)
    _, edges, stats = exact_flows(c, x.astype(np.float64), **{"tp" if which == "pflow_temperature" else "te": T})
    fl = c.flows(c.params, x, options=jaxpc.Options(precision="fp32", **{which: T}))
    check_flows(c, fl, edges, stats, tolerance(1 / T), tolerance(1 / T))


def test_tempered_em_step_approaches_hard_em():
    """At T = 0.001 both flows are hard EM's: in a mixture of products the children's values are the same under
    LL and MPE, and every sample's best term leads by more than 0.05, so the others' shares are below e^-50. Every
    parameter moves."""
    peaks = np.array([[0, 0, 0], [1, 1, 1], [2, 2, 2], [0, 1, 2]])  # each component's likeliest values
    leaves = [jaxpc.inputs(v, num_nodes=4, dist=distributions.Categorical(3),
                           params=np.where(peaks[:, v:v + 1] == np.arange(3), 0.6, 0.2)) for v in range(3)]
    root = jaxpc.summate(jaxpc.multiply(*leaves), num_nodes=1, params=np.array([[0.35, 0.3, 0.2, 0.15]]))
    c = jaxpc.compile(root)
    x = np.stack(np.meshgrid(*[np.arange(3)] * 3, indexing="ij"), -1).reshape(-1, 3).astype(np.int32)  # all 27
    terms = np.log(np.asarray(c.get_node_params(c.params, root), np.float64))[0][:, None] + sum(
        np.log(np.asarray(c.get_node_params(c.params, leaf), np.float64))[:, x[:, v]] for v, leaf in enumerate(leaves))
    top = np.sort(terms, axis=0)
    assert (top[-1] - top[-2]).min() > 0.05 and len(set(terms.argmax(0))) == 4  # no ties; every component wins
    tempered = c.em_step(c.params, x, options=jaxpc.Options(pflow_temperature=1e-3, eflow_temperature=1e-3))
    hard = c.em_step(c.params, x, options=jaxpc.Options(propagation="MPE"))
    for ns in [root, *leaves]:
        got, want = (np.asarray(c.get_node_params(p, ns)) for p in (tempered, hard))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert not np.allclose(want, np.asarray(c.get_node_params(c.params, ns)), atol=1e-2)


@functools.cache
def fanin_part():
    """A sum partition of 8-node blocks over 2 child blocks each, every child block read by 2 parent blocks."""
    def leaf(v):
        return jaxpc.inputs(v, num_node_blocks=3, block_size=8, dist=distributions.Categorical(3))

    edges = np.array([[0, 0, 1, 1, 2, 2], [0, 1, 1, 2, 2, 0]])
    inner = jaxpc.summate(jaxpc.multiply(leaf(0), leaf(1)), num_node_blocks=3, block_size=8, edge_ids=edges)
    c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(inner, leaf(2)), num_nodes=1))
    return next(p for spec in c.layout.stages() for p in spec.sums if not p.dense)


def test_exponents_above_one_never_route_to_kernels(monkeypatch):
    """As on a GPU: GeneralLL's alpha 0.5 takes the kernels' routes (the in-place forward, the Pallas backward,
    the forward's shifts, the atomic backward and the batched parameter flows' kernel), alpha 2 none of them."""
    monkeypatch.setattr(routing, "on_gpu", lambda: True)
    part, buf = fanin_part(), jnp.zeros((4, 16), jnp.float32)
    assert part.Kp >= routing.SHIFT_MIN_UNIT and part.D > 1 and not part.dense
    for alpha, kernels in ((0.5, True), (2.0, False)):
        for impl in ("auto", "pallas_forward", "pallas"):
            opts = jaxpc.Options(impl=impl, propagation="GeneralLL", alpha=alpha, precision="tf32")
            choice = routing.kernel_choice(opts, part, 16)[0]
            assert routing.runs_inplace(choice, opts, buf) is kernels, (alpha, impl)
            assert routing.pflow_kernel(opts, jnp.float32) is kernels
            assert routing.atomic_backward(opts, part, buf) is (kernels and impl != "pallas")
            assert routing.runs_kernel_backward("pallas", opts) is kernels
            assert routing.runs_kernel_backward("triton", opts) is kernels
            assert routing.runs_kernel_backward(choice, opts) is (kernels and impl == "pallas")
            assert routing.writes_shift(opts, part, buf) is (kernels and impl != "pallas")
        tuned = ((routing.partition_key(part, 16), ("pallas", 32, 32, 4)),)
        assert routing.kernel_choice(jaxpc.Options(propagation="GeneralLL", alpha=alpha, kernels=tuned), part,
                                     16)[0] == ("pallas" if kernels else "xla")


def test_auto_on_a_gpu_computes_large_alpha_on_xla(pallas_forward_calls):
    """``impl="auto"`` as on a GPU: at alpha 100 no Pallas forward is traced, and the values are exact."""
    c = two_level()
    x = data(2)
    ref, _, _ = exact_flows(c, x.astype(np.float64), alpha=100.0)
    got = c.log_prob(c.params, x, options=jaxpc.Options(propagation="GeneralLL", alpha=100.0))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5)
    assert pallas_forward_calls == []


def random_layer(rng, n, C, Kp, Kc, dense):
    """A node buffer ``[R, B]`` (with ``-inf`` entries, a child block of ``-inf`` only and an impossible parent
    block) and a sum partition's
    tables over it: ``(buf, ch, pid, logw, out_offset)``, the parents' values at ``out_offset``."""
    R = 4 + C * Kc * (1 if dense else n)
    buf = rng.normal(0.0, 3.0, (R, B)).astype(np.float32)
    buf[rng.random(buf.shape) < 0.1] = -np.inf
    buf[4:4 + Kc] = -np.inf  # the first child block is impossible in every sample,
    buf[4:4 + C * Kc, 0] = -np.inf  # the first parent block in sample 0
    ch = 4 + Kc * (np.arange(C)[None, :] + (0 if dense else C * np.arange(n)[:, None]))
    ch = np.broadcast_to(ch, (n, C)).astype(np.int32)
    pid = np.arange(n * C, dtype=np.int32).reshape(n, C)
    logw = np.log(rng.dirichlet(np.full(C * Kc, 0.3), n * Kp)).reshape(n, Kp, C, Kc).transpose(0, 2, 1, 3)
    return buf, ch, pid, logw.reshape(n * C, Kp, Kc).astype(np.float32), R


# (propagation's exponent, element-flow temperature, parameter-flow temperature): GeneralLL, and tempered LL flows with
# both exponents above 1 (one pass, or two) or one of them at most 1 (its factored products beside the other's terms)
LAYER_CASES = [(1000.0, 1.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1e-3, 2.0), (1.0, 2.0, 1e-2), (1.0, 1e-2, 1e-3)]


def exact_layer(t, fp, alpha, te, tp, dense):
    """float64 ``(values [n * Kp, B], child flows, parameter flows [n, Kp, C*Kc])`` of the terms ``t [n, Kp, C*Kc,
    B]`` at exponent ``alpha``, the parents' flows ``fp [n, Kp, B]`` split by ``exp(alpha t / T)`` normalized."""
    def shares(a):
        top = t.max(2, keepdims=True)
        top = np.where(np.isfinite(top), top, 0.0)
        e = np.exp(a * (t - top))
        return e, top[:, :, 0]

    with np.errstate(divide="ignore", invalid="ignore"):
        e, top = shares(alpha)
        values = (np.log(e.sum(2)) / alpha + top).reshape(-1, t.shape[3])
        edges = {T: np.nan_to_num(fp[:, :, None] * shares(alpha / T)[0] / shares(alpha / T)[0].sum(2, keepdims=True))
                 for T in (te, tp)}  # (impossible parents: 0)
    return values, edges[te].sum((0, 1)) if dense else edges[te].sum(1), edges[tp].sum(3)


@pytest.mark.parametrize("dense", [False, True])
def test_layer_at_large_exponents_matches_float64(dense):
    """The layer ops (forward, child and parameter flows, the batched parameter flows, the dispatching layer on
    ``impl="pallas"``) at exponents up to 1000 against float64 terms, the two flows' exponents apart, at fp32 and
    tf32 (local sums from the stored values); impossible parents give ``-inf`` and pass nothing."""
    rng = np.random.default_rng(0)
    n, C, Kp, Kc = (1, 3, 2, 2) if dense else (3, 2, 2, 2)
    buf, ch, pid, logw, R = random_layer(rng, n, C, Kp, Kc, dense)
    t = np.stack([logw[pid[i]].astype(np.float64).transpose(1, 0, 2).reshape(Kp, C * Kc)[:, :, None]
                  + np.concatenate([buf[r:r + Kc] for r in ch[0 if dense else i]])[None] for i in range(n)])
    fp = rng.uniform(0.5, 2.0, (n, Kp, B))
    prow = R + Kp * np.arange(n)

    @jax.jit
    def run(buf, ch, pid, logw, fp, prow):
        out = []
        for alpha, te, tp in LAYER_CASES:
            kw = dict(Kp=Kp, Kc=Kc, propagation="LL" if alpha == 1.0 else "GeneralLL",
                      alpha=None if alpha == 1.0 else alpha)
            got = sum_layer_reference(buf, ch, pid, logw, dense=dense, **kw)
            by_pallas = sum_ops.sum_layer(buf, ch, pid, logw, dense=dense, impl="pallas", **kw) if alpha > 1 else got
            values = jnp.concatenate([buf, got])
            flows = jnp.zeros_like(values).at[R:].set(fp.reshape(-1, B))
            for precision in ("fp32", "tf32"):  # (tf32: untempered shares from the stored values)
                cf, pf = sum_layer_backward_reference(values, flows, ch, pid, logw, R, dense=dense, precision=precision,
                                                      eflow_temperature=te, pflow_temperature=tp, **kw)
                batched = None if dense else sum_layer_param_flows_reference(values, flows, ch, pid, logw, prow,
                                                                             temperature=tp, precision=precision, **kw)
                out.append((got, by_pallas, cf, pf, batched))
        return out

    cases_twice = [case for case in LAYER_CASES for _ in range(2)]
    for (alpha, te, tp), (got, by_pallas, cf, pf, batched) in zip(cases_twice, run(buf, ch, pid, logw, fp, prow)):
        want, cf_want, pf_want = exact_layer(t, fp, alpha, te, tp, dense)
        pf_want = pf_want.reshape(n, Kp, C, Kc).transpose(0, 2, 1, 3)
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
        ok = np.isfinite(want)
        assert not ok.all()
        np.testing.assert_allclose(np.asarray(got)[ok], want[ok], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(by_pallas), np.asarray(got))
        rtol = tolerance(alpha / min(te, tp))
        np.testing.assert_allclose(np.asarray(cf), cf_want, rtol=rtol, atol=1e-5, err_msg=f"{alpha, te, tp}")
        np.testing.assert_allclose(np.asarray(pf), pf_want, rtol=rtol, atol=1e-5, err_msg=f"{alpha, te, tp}")
        if batched is not None:
            np.testing.assert_allclose(np.asarray(batched), pf_want, rtol=rtol, atol=1e-5)
    with pytest.raises(ValueError, match="exponent 1000 .*underflow"):
        sum_ops.param_flow_factors(jnp.asarray(buf), jnp.asarray(buf), jnp.asarray(ch), jnp.asarray(pid),
                                   jnp.asarray(logw), jnp.asarray(prow), Kp=Kp, Kc=Kc, temperature=1e-3)
