"""The executable cache is sound by construction: every option and plan is part of the key, batches
are bucketed and padded rows never leak, the cache is bounded, thread-safe and sync-free.

Its tests compile each key once, as off a GPU (``_one_compile_per_key``): on a GPU a key's first call would run a
quick compile and a background thread would swap in an optimized one, an ulp apart and at a moment of its own, under
the tests that compare calls bit for bit and count a key's compiles. The quick and optimized pair's own tests turn
it on (``quick_store``: as on a GPU, for real on one)."""

import dataclasses
import functools
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import executables, structures
from jaxpc.executables import BucketPolicy

from .conftest import assert_same_result
from .tiers import cases


@pytest.fixture(autouse=True)
def _one_compile_per_key(single_compile):
    """Every test here on one compile per key (tests/conftest.py's ``single_compile``; nothing changes on the CPU)."""


def _hmm(**kw):
    return jaxpc.compile(structures.HMM(6, 4, 5, block_size=2), seed=1, **kw)


def _data(B, seed=0, T=6, V=5):
    return np.random.default_rng(seed).integers(0, V, (B, T)).astype(np.int32)


_same = assert_same_result  # bit for bit on the CPU, within a GPU's run-to-run spread there


def _differs(a, b):
    return any(not np.array_equal(np.asarray(u), np.asarray(v))
               for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


# every field of Options: (entry point, base options, changed options); a new field fails this test until listed
OPTION_CHANGES = {
    "propagation": ("log_prob", {}, {"propagation": "MPE"}),
    "alpha": ("log_prob", {"propagation": "GeneralLL", "alpha": 1.5}, {"propagation": "GeneralLL", "alpha": 2.5}),
    "backward": ("flows", {"propagation": "MPE"}, {"propagation": "MPE", "backward": "autodiff"}),
    "precision": ("log_prob", {}, {"precision": "bf16"}),
    "compute_param_flows": ("flows", {}, {"compute_param_flows": False}),
    "negate_flows": ("flows", {}, {"negate_flows": True}),
    "logspace_flows": ("flows", {}, {"logspace_flows": True}),
    "node_flows": ("flows", {}, {"node_flows": True}),
    "impl": ("flows", {"chain_scan": False}, {"chain_scan": False, "impl": "pallas"}),
    "pflow_temperature": ("flows", {}, {"pflow_temperature": 0.5}),
    "eflow_temperature": ("flows", {}, {"eflow_temperature": 0.5}),
    # a tuned per-partition route (signature of the HMM's scanned 2x2 partition at bucket 16)
    "kernels": ("flows", {"chain_scan": False},
                {"chain_scan": False, "kernels": (((2, 2, 2, 2, 2, 2, 16), ("pallas", 16, 16, 4)),)}),
    "chain_scan": ("flows", {}, {"chain_scan": False}),
    "fold_products": ("flows", {"chain_scan": False}, {"chain_scan": False, "fold_products": False}),
    "scan_stages": ("flows", {"chain_scan": False}, {"chain_scan": False, "scan_stages": False}),
    "gather_chunk": ("flows", {"chain_scan": False}, {"chain_scan": False, "gather_chunk": 1}),
    "kernel_shifts": ("flows", {"chain_scan": False, "impl": "pallas_forward"},
                      {"chain_scan": False, "impl": "pallas_forward", "kernel_shifts": False}),
    "param_flow_pass": ("flows", {"chain_scan": False}, {"chain_scan": False, "param_flow_pass": "inline"}),
    "leaf_kernel": ("flows", {"chain_scan": False, "impl": "pallas_forward"},
                    {"chain_scan": False, "impl": "pallas_forward", "leaf_kernel": False}),
    "tuning": ("flows", {}, {"tuning": jaxpc.Tuning(chain_unroll=2, chain_unroll_batch=0)}),
}
SINGLE_VALUED: dict = {}  # fields with one allowed value (none today)
# every field of Tuning, changed; each change is a new executable (the knobs are part of the key through Options)
TUNING_CHANGES = {"leaf_batch": 1, "counts_batch": 1, "small_batch": 1, "pflow_batch": 1, "pflow_sum_batch": 0,
                  "chain_unroll": 2, "chain_unroll_batch": 0,
                  "chain_kernel_batch": 0, "chain_side_by_side": False,
                  "product_kernel_batch": 0, "full_layout_reads": 0,
                  "chain_stack_limit": 0, "unset_rows": False, "min_unset": 1, "onehot_chunk": 1 << 20,
                  "quick_first_compile": False, "unroll_optimized": False, "max_product_kernels": True,
                  "compiler_options": (("xla_cpu_enable_fast_math", False),), "concurrent_batch": 0,
                  "fanin_kernel_batch": 0,
                  "tree_kernel_batch": 16, "tree_clusters": True, "tree_log_weights": True,
                  "tree_forward_tile": 64, "tree_backward_tile": 64,
                  "fanin_order_batch": 1,
                  "fanin_forward_prefetch_batch": 0,
                  "fanin_forward_span": 1, "fanin_group_blocks": 0, "fanin_forward_wide_tile": 0,
                  "fanin_backward_stages": 2, "fanin_prefetch": False, "fanin_group": 2, "fanin_group_batch": 1,
                  "stage_barrier_batch": 1}


def test_every_tuning_field_is_listed():
    assert set(TUNING_CHANGES) == {f.name for f in dataclasses.fields(jaxpc.Tuning)}, "list the new Tuning field"


def test_small_batches_order_command_buffers_by_data_dependencies_on_a_gpu():
    """``Tuning.concurrent_batch``: XLA's CONCURRENT command-buffer order for batches up to it, on a GPU only, and
    never over the caller's own setting of that option."""
    from unittest import mock

    mode = executables.CONCURRENT_XLA[0]
    x16, x64 = {"x": jnp.zeros((16, 3), jnp.int32)}, {"x": jnp.zeros((64, 3), jnp.int32)}
    opts = jaxpc.Options()
    with mock.patch.object(executables, "_on_gpu", lambda: False):
        assert executables.batch_xla(opts, {}, x16) == {}  # off a GPU
    with mock.patch.object(executables, "_on_gpu", lambda: True):
        assert executables.batch_xla(opts, {}, x16) == {mode: "CONCURRENT"}
        assert executables.batch_xla(opts, {"a": 1}, x64) == {"a": 1}
        assert executables.batch_xla(opts, {mode: "LHS"}, x16) == {mode: "LHS"}
        assert executables.batch_xla(opts.replace(tuning=jaxpc.Tuning(concurrent_batch=0)), {}, x16) == {}
        assert executables.batch_xla(opts, {}, {"params": jnp.zeros(3)}) == {}  # no batch


@pytest.mark.slow
@pytest.mark.full
def test_every_tuning_field_is_in_the_key():
    x = _data(10)
    c = _hmm()
    c.flows(c.params, x)
    for name, value in TUNING_CHANGES.items():
        misses = c.cache_info().misses
        c.flows(c.params, x, options=jaxpc.Options(tuning=jaxpc.Tuning(**{name: value})))
        assert c.cache_info().misses == misses + 1, f"Tuning.{name} must be part of the executable's key"


def test_every_option_field_is_covered():
    fields = {f.name for f in dataclasses.fields(jaxpc.Options)}
    assert fields == set(OPTION_CHANGES) | set(SINGLE_VALUED), "list the new option field in OPTION_CHANGES"
    for name, allowed in SINGLE_VALUED.items():
        assert len(allowed) == 1, f"{name} now has several values: move it to OPTION_CHANGES"


@functools.cache
def _shared_hmm():
    """One circuit per process for the test below: most fields' first options are the same ({} or chain_scan off)
    and compile once on it, while each field's changed options are new to it."""
    return _hmm()


@pytest.mark.parametrize("field", cases(sorted(OPTION_CHANGES), fast=["precision", "propagation"]))
def test_changing_an_option_never_replays_the_cached_executable(field):
    entry, base, changed = OPTION_CHANGES[field]
    x = _data(10)
    c = _hmm() if field == "chain_scan" else _shared_hmm()  # chain_scan's changed options: the others' first ones
    run = {"log_prob": lambda circ, o: circ.log_prob(circ.params, x, options=o),
           "flows": lambda circ, o: circ.flows(circ.params, x, options=o)}[entry]
    o1, o2 = jaxpc.Options(**base), jaxpc.Options(**changed)
    first = run(c, o1)
    misses = c.cache_info().misses
    second = run(c, o2)
    assert c.cache_info().misses == misses + 1, "the changed option must compile a new executable"
    _same(second, run(_hmm(), o2))  # equal to a fresh circuit with that option
    _same(run(c, o1), first)  # and switching back replays the first one
    if field not in ("backward", "impl", "kernels", "chain_scan", "fold_products", "scan_stages", "gather_chunk",
                     "kernel_shifts", "param_flow_pass", "leaf_kernel", "tuning"):  # these agree up to rounding
        assert _differs(first, second)


# ---- the five silent-correctness bugs of a graph replayed under an incomplete key --------------------

def test_mpe_after_ll_gives_mpe():
    c, x = _hmm(), _data(8)
    ll = c.log_prob(c.params, x)
    mp = c.log_prob(c.params, x, propagation="MPE")
    _same(mp, _hmm().log_prob(c.params, x, propagation="MPE"))
    assert np.all(np.asarray(mp) < np.asarray(ll))


@pytest.mark.slow
def test_compute_param_flows_false_after_a_training_step():
    c, x = _hmm(), _data(16)
    params = c.em_step(c.params, x, step_size=0.5)
    fl = c.flows(params, x, options=jaxpc.Options(compute_param_flows=False))
    assert all(float(jnp.abs(v).max()) == 0.0 for v in fl["sum"].values())
    assert float(fl["input"]["categorical"]["counts"].sum()) == pytest.approx(16 * 6, rel=1e-5)
    new = c.em_step(params, x, step_size=0.5, options=jaxpc.Options(compute_param_flows=False))
    _same(new["sum"], params["sum"])  # sum parameters untouched
    assert _differs(new["input"], params["input"])  # the leaves still train
    # and a normal step afterwards is a normal step
    _same(c.em_step(params, x, step_size=0.5), _hmm().em_step(params, x, step_size=0.5))


def test_partial_evaluation_on_off_and_off_on():
    c, x = _hmm(), _data(12)
    x2 = x.copy()
    x2[:, 4] = (x2[:, 4] + 1) % 5
    plan = c.partial([4])
    full = c.log_prob(c.params, x2)  # off
    values = c.node_values(c.params, x)
    on, buf = plan.log_prob(c.params, x2, values)  # on
    again_off = c.log_prob(c.params, x2)  # off again
    _same(again_off, full)
    fresh = _hmm()
    _same(on, fresh.partial([4]).log_prob(fresh.params, x2, fresh.node_values(fresh.params, x))[0])
    np.testing.assert_allclose(np.asarray(on), np.asarray(full), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(buf), np.asarray(c.node_values(c.params, x2)), rtol=1e-6)
    # and on again after off
    _same(plan.log_prob(c.params, x2, values)[0], on)
    # a buffer of another dtype, or no array, and a variable that is no int are named
    with pytest.raises(TypeError, match="values must be the node buffer of dtype float32 .* got dtype int32"):
        plan.log_prob(c.params, x2, values.astype(jnp.int32))
    with pytest.raises(TypeError, match="values must be the node buffer that circuit.node_values returns, got list"):
        plan.log_prob(c.params, x2, np.asarray(values).tolist())
    with pytest.raises(TypeError, match="partial evaluation: variables must be ints, got 0.5"):
        c.partial([0.5])


def _gated_hmm():
    """``_hmm()`` with gate columns on every sum vector (one gate per parent node and edge block)."""
    root = structures.HMM(6, 4, 5, block_size=2)
    for ns in jaxpc.nodes.topological_order(root):
        if ns.is_sum():
            ns.set_gates(1)
    return jaxpc.compile(root, seed=1)


def _sum_evidence(c, B, seed):
    """Random gate columns and LowRank factors for ``B`` samples."""
    rng = np.random.default_rng(seed)
    return {"sum_gates": rng.normal(size=(B, c.num_gates)).astype(np.float32),
            "sum_lowrank": {g.key: {"u": rng.random((B, g.num_blocks, g.Kp, 2)).astype(np.float32),
                                    "v": rng.random((B, g.num_blocks, 2, g.Kc)).astype(np.float32)}
                            for g in c.layout.sum_groups}}


@pytest.mark.parametrize("evidence", [False, True])
@pytest.mark.parametrize("sizes", cases([(32, 16), (30, 13)], fast=[(32, 16)]))
@pytest.mark.slow
def test_batch_32_16_32_flows_equal_fresh(evidence, sizes):
    """Batches of 32, 16 and 32 rows (and 30, 13, 30: padded to those buckets) through one circuit's cache (with
    gate and LowRank evidence or none): the third call's flows and LL equal a fresh circuit's, bit for bit."""
    make = _gated_hmm if evidence else _hmm
    c = make()
    (na, nb) = sizes
    xa, xb = _data(na, 1), _data(nb, 2)
    ea, eb = (_sum_evidence(c, na, 1), _sum_evidence(c, nb, 2)) if evidence else (None, None)
    c.flows(c.params, xa, evidence=ea)
    c.flows(c.params, xb, evidence=eb)
    _same(c.flows(c.params, xa, evidence=ea, return_ll=True),
          make().flows(c.params, xa, evidence=ea, return_ll=True))


def test_first_step_flows_equal_second(single_compile):
    """The first call (compile, pad 20 rows to the bucket of 32) and the second (replay) both give the flows of
    an independent reference: scaled forward-backward in float64 numpy."""
    from .test_hmm import _nodes, forward_backward

    c, x = _hmm(), _data(20)
    trans, emit = _nodes(c, "trans"), _nodes(c, "emit")
    alphas = [np.asarray(c.get_node_params(c.params, trans[t]), np.float64) for t in range(5)]
    betas = [np.asarray(c.get_node_params(c.params, emit[t]), np.float64) for t in range(6)]
    gamma = np.asarray(c.get_node_params(c.params, c.root), np.float64)[0]
    _, init_ref, xi_ref, emit_ref = forward_backward(alphas, betas, gamma, x)
    first = c.flows(c.params, x)
    second = c.flows(c.params, x)
    for fl in (first, second):
        np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, c.root))[0], init_ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, trans[0])), xi_ref.sum(0), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, emit[0])), emit_ref.sum(0), rtol=1e-4, atol=1e-4)
    _same(first, second)
    assert c.cache_info().hits == 1 and c.cache_info().misses == 1


# ---- buckets ----------------------------------------------------------------------------------------

def test_bucket_policy():
    assert [BucketPolicy()(n) for n in (1, 8, 9, 16, 17, 600)] == [8, 8, 16, 16, 32, 1024]
    assert BucketPolicy("exact")(13) == 13
    assert [BucketPolicy([10, 20])(n) for n in (3, 10, 11, 45)] == [10, 10, 20, 60]
    with pytest.raises(ValueError, match="buckets must be"):
        BucketPolicy("log")


@pytest.mark.slow
@pytest.mark.full
def test_varying_batches_equal_unpadded_and_share_executables():
    c = _hmm()
    exact = _hmm(buckets="exact")
    for B in (12, 5, 9, 12, 5):
        x = _data(B, B)
        w = np.linspace(0.5, 1.5, B)
        np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x)), np.asarray(exact.log_prob(c.params, x)),
                                   rtol=1e-6)
        f1, f2 = c.flows(c.params, x, ll_weights=w), exact.flows(c.params, x, ll_weights=w)
        for u, v in zip(jax.tree_util.tree_leaves(f1), jax.tree_util.tree_leaves(f2)):
            np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)
        n1, n2 = c.em_step(c.params, x, step_size=0.3), exact.em_step(c.params, x, step_size=0.3)
        for u, v in zip(jax.tree_util.tree_leaves(n1), jax.tree_util.tree_leaves(n2)):
            np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)
    # buckets touched: 16 and 8, for each of log_prob, flows and em_step
    assert c.cache_info().misses == 6
    assert exact.cache_info().misses == 9


@pytest.mark.slow
def test_codd_like_batches_use_at_most_three_executables():
    c = _hmm()
    rng = np.random.default_rng(0)
    for _ in range(30):
        c.flows(c.params, _data(int(rng.integers(10, 27)), int(rng.integers(1000))), validate=False)
    assert c.cache_info().misses <= 3


# ---- bounds and warnings -----------------------------------------------------------------------------

def test_lru_bound():
    c = _hmm(max_executables=2)
    for B in (3, 12, 20):  # buckets 8, 16, 32
        c.log_prob(c.params, _data(B))
    assert c.cache_info().live == 2
    misses = c.cache_info().misses
    c.log_prob(c.params, _data(3))  # bucket 8 was dropped first
    assert c.cache_info().misses == misses + 1
    c.log_prob(c.params, _data(20))  # bucket 32 is still live
    assert c.cache_info().misses == misses + 1


@pytest.mark.slow
def test_warns_once_naming_the_changing_option():
    c = _hmm(max_layouts_per_entry=3)
    x = _data(4)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for a in (1.1, 1.2, 1.3, 1.4, 1.5, 1.6):
            c.log_prob(c.params, x, propagation="GeneralLL", alpha=a)
    warned = [w for w in rec if issubclass(w.category, RuntimeWarning)]
    assert len(warned) == 1
    assert "'log_prob'" in str(warned[0].message) and "option 'alpha' keeps changing" in str(warned[0].message)
    assert warned[0].filename == __file__, "the warning points at the user's call, not into jaxpc"


def test_warning_names_a_changing_argument():
    c = _hmm(max_layouts_per_entry=2, buckets="exact")
    with pytest.warns(RuntimeWarning, match="argument 'x' keeps changing"):
        for B in (3, 4, 5):
            c.log_prob(c.params, _data(B))


@pytest.mark.slow
def test_evicted_executables_compiled_again_warn_to_raise_the_cache_and_bookkeeping_stays_small():
    """Executables compiled again after their eviction are not new layouts: the warning says to raise
    ``max_executables``; the per-entry layouts and the sightings of keys stay bounded however many keys come."""
    c = _hmm(max_executables=2, max_layouts_per_entry=3)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            for B in (3, 12, 20):  # three buckets through a cache of two: each is evicted before it comes back
                c.log_prob(c.params, _data(B))
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) <= 1 and not any("keeps changing" in m for m in msgs)
    for _ in range(2):
        for B in (3, 12, 20):
            c.log_prob(c.params, _data(B))
    cache = c.runtime.cache
    assert len(cache._layouts["log_prob"]) <= 4 and not cache._sightings
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        d = _hmm(max_executables=2, max_layouts_per_entry=3)
        for _ in range(3):
            for B in (3, 12, 20):
                d.log_prob(d.params, _data(B))
    assert any("raise it (jaxpc.compile(root, max_executables=...))" in str(w.message) for w in rec)


def test_compile_after_two_reuses_a_larger_bucket_first():
    c = _hmm(compile_after=2)
    big = _data(30)
    c.log_prob(c.params, big)  # compiles bucket 32 (no larger bucket exists)
    assert c.cache_info().misses == 1
    small = _data(5)
    ref = _hmm(buckets="exact").log_prob(c.params, small)
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, small)), np.asarray(ref), rtol=1e-6)
    assert c.cache_info().misses == 1  # first sighting of bucket 8 ran on bucket 32
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, small)), np.asarray(ref), rtol=1e-6)
    assert c.cache_info().misses == 2  # the second sighting compiles its own


# ---- threads and transfers ---------------------------------------------------------------------------

@pytest.mark.slow
def test_threads_share_the_cache_safely():
    c = _hmm()
    data = _data(64, 7)
    ref = np.asarray(_hmm(buckets="exact").log_prob(c.params, data))
    errors = []
    device = {(lo, n): jnp.asarray(data[lo:lo + n]) for lo, n in ((0, 16), (5, 16), (3, 11), (9, 11), (30, 5))}

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for i in range(50):
                lo = int(rng.integers(0, 40))
                n = int(rng.integers(1, 24))
                got = np.asarray(c.log_prob(c.params, data[lo:lo + n], validate=False))
                np.testing.assert_allclose(got, ref[lo:lo + n], rtol=1e-6)
                (lo, n), x = list(device.items())[i % len(device)]  # device batches: replayed calls
                np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x, validate=False)), ref[lo:lo + n],
                                           rtol=1e-6)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert c.cache_info().live == c.cache_info().misses <= 3  # buckets 8, 16, 32: each compiled exactly once


@pytest.mark.slow
def test_training_step_makes_no_host_transfer():
    c = _hmm()
    xs = [jnp.asarray(_data(12, s)) for s in range(3)]
    params = c.em_step(c.params, xs[0], step_size=0.1, pseudocount=0.1)  # warm up
    c.log_prob(params, xs[0])
    with jax.transfer_guard("disallow"):  # the default call: its input check reads one flag, nothing else moves
        for x in xs:
            params, ll = c.em_step(params, x, step_size=0.1, pseudocount=0.1, return_ll=True)
            c.log_prob(params, x)
        for x in xs:
            params, ll = c.em_step(params, x, step_size=0.1, pseudocount=0.1, validate=False, return_ll=True)
            c.log_prob(params, x, validate=False)
    assert np.all(np.isfinite(np.asarray(ll)))


# ---- partial evaluation ------------------------------------------------------------------------------

@pytest.mark.slow
def test_partial_evaluation_matches_full_on_random_circuits():
    from .random_circuits import Generator
    for seed in (2, 6):
        gen = Generator(seed, 4, kinds=("categorical", "bernoulli", "gaussian"))
        c = jaxpc.compile(gen.circuit())
        x = gen.sample_data(9)
        x2 = gen.sample_data(9)
        x2[:, :2] = x[:, :2]  # variables 2 and 3 change

        def xin(a):
            return a if "gaussian" in gen.kinds else a.astype(np.int32)

        values = c.node_values(c.params, xin(x))
        ll, buf = c.partial([2, 3]).log_prob(c.params, xin(x2), values)
        np.testing.assert_allclose(np.asarray(ll), np.asarray(c.log_prob(c.params, xin(x2))), rtol=1e-5, atol=1e-5)


def test_partial_plan_of_a_long_hmm_still_scans():
    c = jaxpc.compile(structures.HMM(200, 4, 5))
    plan = c.partial([150])
    assert len(plan.plan.steps) <= 4
    x = _data(3, 0, T=200)
    values = c.node_values(c.params, x)
    x2 = x.copy()
    x2[:, 150] = (x2[:, 150] + 1) % 5
    ll, _ = plan.log_prob(c.params, x2, values)
    np.testing.assert_allclose(np.asarray(ll), np.asarray(c.log_prob(c.params, x2)), rtol=1e-5)
    with pytest.raises(ValueError, match="variable 500 is not in the circuit"):
        c.partial([500])


# ---- persistent compilation cache ----------------------------------------------------------------------

def test_jax_default_layout_pickles_as_itself():
    """JAX's ``AutoLayout`` comes back from a pickle as the same object (a stored executable's avals hold it)."""
    import pickle

    from jax._src.layout import AutoLayout

    assert pickle.loads(pickle.dumps(AutoLayout)) is AutoLayout


@pytest.mark.slow
@pytest.mark.full
def test_gradients_flow_through_parameters_that_a_stored_executable_made(tmp_path):
    """A second process loads ``em_step`` from the store; ``jax.grad`` of ``log_prob`` (the flow pass's custom VJP)
    at the parameters it returns works and equals the first process's (on jax 0.12 it failed with "the layouts do
    not match" where the store's executables came back with a copy of JAX's default layout)."""
    script = textwrap.dedent(f"""
        import json, numpy as np, jax, jax.numpy as jnp, jaxpc
        from jaxpc import structures
        jaxpc.enable_persistent_cache({str(tmp_path)!r})
        c = jaxpc.compile(structures.HMM(8, 4, 5, block_size=2), seed=3)
        x = np.random.default_rng(0).integers(0, 5, (16, 8)).astype(np.int32)
        p = c.em_step(c.params, x, step_size=1.0, pseudocount=0.1)
        g = jax.grad(lambda q: c.log_prob(q, jnp.asarray(x)).sum())(p)
        mpe = c.flows(p, x, options=jaxpc.Options(propagation="MPE"))
        print(json.dumps(dict(loaded=c.cache_info().loaded,
                              grad=[np.asarray(a).tolist() for a in jax.tree_util.tree_leaves(g)],
                              mpe=float(sum(np.asarray(a).sum() for a in jax.tree_util.tree_leaves(mpe))))))
    """)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), JAXPC_PERSISTENT_CACHE="1")

    def run():
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.splitlines()[-1])

    first, second = run(), run()
    assert first["loaded"] == 0 and second["loaded"] >= 1
    assert second["grad"] == first["grad"] and second["mpe"] == first["mpe"]


@pytest.mark.slow
@pytest.mark.parametrize("store", ["kept", "lost"])
def test_persistent_cache_serves_a_second_process(tmp_path, store):
    """A second process loads the stored executable: it traces, lowers and compiles nothing for the call, and
    its flows equal the first process's. A changed option is a new fingerprint and compiles. Where the store lost
    its files (``lost``), JAX's own cache serves the next process."""
    script = textwrap.dedent(f"""
        import collections, json, sys, numpy as np, jax, jaxpc
        from jaxpc import structures
        events = collections.Counter()
        jax.monitoring.register_event_duration_secs_listener(lambda name, secs, **kw: events.update([name]))
        jaxpc.enable_persistent_cache({str(tmp_path)!r})
        c = jaxpc.compile(structures.HMM(12, 8, 6), seed=3)
        x = np.random.default_rng(0).integers(0, 6, (16, 12)).astype(np.int32)
        opts = jaxpc.Options(precision=sys.argv[1])
        events.clear()
        flows = c.flows(c.params, x, options=opts)
        ll = c.log_prob(c.params, x, options=opts)
        jax.block_until_ready((flows, ll))
        info = c.cache_info()
        print(json.dumps(dict(loaded=info.loaded, misses=info.misses, compile_s=info.compile_seconds,
                              traces=events["/jax/core/compile/jaxpr_trace_duration"],
                              compiles=events["/jax/core/compile/backend_compile_duration"],
                              ll=np.asarray(ll).tolist(),
                              flow=float(sum(np.asarray(a).sum() for a in jax.tree_util.tree_leaves(flows))))))
    """)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), JAXPC_PERSISTENT_CACHE="1")

    def run(precision):
        r = subprocess.run([sys.executable, "-c", script, precision], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.splitlines()[-1])

    first = run("fp32")
    assert first["loaded"] == 0 and first["compiles"] >= 1
    assert any((tmp_path / "executables").rglob("*.jaxpc-exe")), "no executable was stored"
    if store == "lost":
        _served_by_jax_after_the_store_lost_its_files(tmp_path, run, first)
        return
    second = run("fp32")
    assert second["loaded"] == second["misses"] == 2 and second["compile_s"] == 0.0
    assert second["traces"] == 0 and second["compiles"] == 0, f"the second process compiled: {second}"
    assert second["ll"] == first["ll"] and second["flow"] == first["flow"]
    other = run("bf16")
    assert other["loaded"] == 0 and other["compiles"] >= 1, "a changed option must not load the stored executable"


def _served_by_jax_after_the_store_lost_its_files(tmp_path, run, first):
    """JAX's own cache serves a process whose store lost its files (another jaxpc version, a cleaned directory):
    what JAX deserialized is not stored again (on the CPU such a copy fails at its first call), and the process
    after it still runs and agrees."""
    shutil.rmtree(tmp_path / "executables")
    served = run("fp32")
    assert served["loaded"] == 0 and served["ll"] == first["ll"]
    assert not any((tmp_path / "executables").rglob("*.jaxpc-exe")), "an executable JAX loaded was stored again"
    after = run("fp32")
    assert after["ll"] == first["ll"] and after["flow"] == first["flow"]


def test_table_signature_is_computed_once_per_tables_object():
    """The key's table component comes from an identity memo; equal tables in another object (a copy, or a
    recompiled circuit) still give an equal key, and tables of another shape a different one."""
    from jaxpc.executables import ExecutableCache

    c = _hmm()
    cache = ExecutableCache()
    sigs = cache._table_sigs
    first = sigs.get(c.tables)
    assert sigs.get(c.tables) is first
    copy = jax.tree_util.tree_map(jnp.array, c.tables)
    assert sigs.get(copy) is not first and sigs.get(copy) == first
    other = jaxpc.compile(structures.HMM(5, 4, 3)).tables
    assert sigs.get(other) != first
    k1 = cache.describe("flows", {}, {"tables": c.tables})
    k2 = ExecutableCache().describe("flows", {}, {"tables": copy})
    assert hash(tuple(k1.items())) == hash(tuple(k2.items())) and k1 == k2


def test_options_hash_is_computed_once_and_stays_in_its_process():
    """Options and Tuning keep their fields' hash after the first call's key (it hashes them on every call); equal
    options hash equally, and a pickled or copied one carries no hash (string hashes differ between processes)."""
    import copy
    import pickle

    o = jaxpc.Options(precision="tf32", tuning=jaxpc.Tuning(concurrent_batch=8))
    h = hash(o)
    assert o.__dict__["_hash"] == h and "_hash" in o.tuning.__dict__
    assert h == hash(tuple(getattr(o, f.name) for f in dataclasses.fields(o)))
    object.__setattr__(o, "_hash", h + 1)  # the stored value is what hash() returns
    assert hash(o) == h + 1
    object.__setattr__(o, "_hash", h)
    for twin in (pickle.loads(pickle.dumps(o)), copy.deepcopy(o), copy.copy(o)):
        assert "_hash" not in twin.__dict__ and twin == o and hash(twin) == h
    assert hash(jaxpc.Options(precision="tf32", tuning=jaxpc.Tuning(concurrent_batch=8))) == h
    assert o.replace(precision="bf16") != o and "_hash" not in o.replace(precision="bf16").__dict__


def test_call_key_is_by_value_and_inlines_tracers():
    """The per-call key (``ExecutableCache.key``): equal options in another object and another params pytree of
    the same shapes replay the executable; a new batch bucket compiles; tracer arguments (a call inside the
    user's jit) run the function inline and leave the cache alone."""
    from jaxpc.executables import ExecutableCache

    c, x = _hmm(), _data(8)
    first = c.log_prob(c.params, x, options=jaxpc.Options(precision="tf32"))
    info = c.cache_info()
    params2 = jax.tree_util.tree_map(lambda a: a + 0, c.params)
    _same(c.log_prob(params2, x, options=jaxpc.Options(precision="tf32")), first)
    assert (c.cache_info().misses, c.cache_info().hits) == (info.misses, info.hits + 1)
    c.log_prob(c.params, _data(20), options=jaxpc.Options(precision="tf32"))  # bucket 32
    assert c.cache_info().misses == info.misses + 1
    info = c.cache_info()
    traced = jax.jit(lambda p: c.log_prob(p, x, options=jaxpc.Options(precision="tf32"), validate=False))(c.params)
    assert c.cache_info() == info
    np.testing.assert_allclose(np.asarray(traced), np.asarray(first), rtol=1e-6)
    key = ExecutableCache().key
    assert key("e", {"n": 1}, {"x": jnp.zeros(3)}) == key("e", {"n": 1}, {"x": jnp.ones(3)})
    assert key("e", {"n": 1}, {"x": jnp.zeros(3)}) != key("e", {"n": 1}, {"x": jnp.zeros(3, jnp.int32)})
    assert key("e", {"n": 1}, {"x": jnp.zeros(3)}) != key("e", {"n": 2}, {"x": jnp.zeros(3)})
    assert key("e", {}, {"p": {"a": jnp.zeros(2)}}) != key("e", {}, {"p": {"b": jnp.zeros(2)}})
    seen = []
    jax.jit(lambda v: seen.append(key("e", {}, {"p": {"a": v}})) or v)(jnp.zeros(2))
    assert seen == [None]


def test_a_call_tries_its_last_executable_and_falls_back_to_the_key():
    """``ExecutableCache.run`` first tries the executable that the last call with the same entry, static values and
    top-level shapes ran: arguments of another dtype or pytree are refused by that executable and compiled under
    their own key (and replayed from then on), an evicted executable is never tried, and tracers run inline."""
    from jaxpc.executables import ExecutableCache

    cache = ExecutableCache(max_executables=2)
    fn = lambda p, x: sum(jnp.sum(v).astype(jnp.float32) for v in jax.tree_util.tree_leaves(p)) * x  # noqa: E731

    def run(p, n=3):
        return np.asarray(cache.run("f", fn, {}, {"p": p, "x": jnp.ones(n)}))

    def counts():
        return cache.info().misses, cache.info().hits

    f32, i32, other = {"a": jnp.ones(2)}, {"a": jnp.full(2, 2, jnp.int32)}, {"b": jnp.full(2, 3.0)}
    np.testing.assert_array_equal(run(f32), [2.0] * 3)
    np.testing.assert_array_equal(run(f32), [2.0] * 3)
    assert counts() == (1, 1)
    np.testing.assert_array_equal(run(i32), [4.0] * 3)  # same shapes, another dtype
    np.testing.assert_array_equal(run(i32), [4.0] * 3)
    assert counts() == (2, 2)
    np.testing.assert_array_equal(run(other), [6.0] * 3)  # same shapes, another pytree
    assert counts() == (3, 2) and cache.info().live == 2  # f32's executable was dropped
    np.testing.assert_array_equal(run(f32), [2.0] * 3)
    assert counts() == (4, 2)
    traced = jax.jit(lambda p: cache.run("f", fn, {}, {"p": p, "x": jnp.ones(3)}))(f32)
    np.testing.assert_array_equal(np.asarray(traced), [2.0] * 3)
    assert counts() == (4, 2)
    np.testing.assert_array_equal(run(f32, 4), [2.0] * 4)  # x of 4: tried first by the next call with x of 4
    np.testing.assert_array_equal(run(f32, 4), [2.0] * 4)
    assert counts() == (5, 3)
    run(f32, 5), run(f32, 6)  # the executable for x of 4 is dropped: the next such call compiles again
    np.testing.assert_array_equal(run(f32, 4), [2.0] * 4)
    assert counts() == (8, 3)


@pytest.mark.slow
def test_a_repeated_call_replays_its_executable_and_stays_exact():
    """A call that repeats the last one's options on a device batch filling its bucket runs that call's executable
    again without its checks and key (``Runtime.replay``): the same outputs as the full call, the input check's
    flag still raised, and the full call wherever anything else changed (host data, another shape, tracers, JAX's
    matmul setting, a cleared cache)."""
    c, fresh = _hmm(), _hmm()
    full = []
    prepare = c.runtime.prepare
    c.runtime.prepare = lambda *a, **k: full.append(1) or prepare(*a, **k)

    def calls():
        n = len(full)
        return lambda: len(full) - n

    xs = [jnp.asarray(_data(16, s)) for s in range(3)]
    for fn in (lambda cc, p, x, **k: cc.flows(p, x, return_ll=True, **k),
               lambda cc, p, x, **k: cc.log_prob(p, x, **k),
               lambda cc, p, x, **k: cc.em_step(p, x, step_size=0.3, pseudocount=0.1, return_ll=True, **k)):
        for batch in (xs, [x[:11] for x in xs]):  # a full bucket, and one padded to it and cut back
            fn(c, c.params, batch[0])
            count, hits = calls(), c.cache_info().hits
            for x in batch:
                _same(fn(c, c.params, x), fn(fresh, fresh.params, x, validate=False))
            assert count() == 0 and c.cache_info().hits == hits + 3
        hosts = [np.asarray(x) for x in xs]
        fn(c, c.params, hosts[0])  # numpy: its own replay, beside the device batch's
        fn(c, c.params, hosts[0][:11])
        count = calls()
        class Rows(np.ndarray):  # a subclass, as a memmap's slices are
            pass

        for x in (*hosts, np.asfortranarray(hosts[2]), hosts[1][::-1], hosts[1][:11], hosts[2][:11],
                  hosts[0].view(Rows)):
            _same(fn(c, c.params, x), fn(fresh, fresh.params, x, validate=False))
        _same(fn(c, c.params, xs[1]), fn(fresh, fresh.params, xs[1], validate=False))
        assert count() == 0
        seen, call = [], jax.stages.Compiled.__call__  # the executable never holds the caller's buffer (a CPU
        with mock.patch.object(jax.stages.Compiled, "__call__",  # executable reads it in place after the call)
                               lambda self, *a, **k: seen.extend(a) or call(self, *a, **k)):
            buf = hosts[2].copy()
            out = fn(c, c.params, buf)
            buf[:] = hosts[0]
            _same(out, fn(fresh, fresh.params, hosts[2], validate=False))
        assert count() == 0 and any(isinstance(v, np.ndarray) for v in seen)
        assert not any(isinstance(v, np.ndarray) and np.shares_memory(v, buf) for v in seen)
        bad = hosts[1].copy()
        bad[5, 3] = 77
        with pytest.raises(ValueError, match=r"x\[5, 3\] = 77 is out of range"):  # checked on the host, at once
            fn(c, c.params, bad)
        fn(c, c.params, hosts[1].astype(np.int64))  # another dtype: the full call
        assert count() == 1
    # EM's step size and pseudocount are taken anew (a schedule replays too)
    count = calls()
    for step, pc in ((0.7, 0.1), (0.7, 0.0), (1.0, 0.5)):
        _same(c.em_step(c.params, xs[1], step_size=step, pseudocount=pc),
              fresh.em_step(fresh.params, xs[1], step_size=step, pseudocount=pc))
    assert count() == 0
    with pytest.raises(ValueError, match="step_size"):
        c.em_step(c.params, xs[1], step_size=1.5)

    bad = xs[0].at[3, 2].set(99)  # out of range: the device check's flag, read by the next call
    count = calls()
    ll = c.log_prob(c.params, bad)
    assert np.isnan(np.asarray(ll)[3]) and np.all(np.isfinite(np.delete(np.asarray(ll), 3)))
    with pytest.raises(ValueError, match="99"):
        c.log_prob(c.params, xs[0])
    c.log_prob(c.params, xs[0], validate="sync")
    with pytest.raises(ValueError, match="99"):
        c.log_prob(c.params, bad, validate="sync")  # replayed, and raised at once
    ll = c.log_prob(c.params, bad[:11])  # padded
    assert np.isnan(np.asarray(ll)[3]) and ll.shape == (11,)
    with pytest.raises(ValueError, match="99"):
        c.log_prob(c.params, xs[0][:11])
    assert count() == 1  # the first call with validate="sync"

    count = calls()
    jitted = jax.jit(lambda p: c.log_prob(p, xs[2]))(c.params)  # tracers: the full call, inline
    _same(jitted, fresh.log_prob(fresh.params, xs[2]))
    assert count() == 1
    c.log_prob(c.params, xs[0][:8])  # another shape
    assert count() == 2
    misses = c.cache_info().misses
    with jax.default_matmul_precision("float32"):  # JAX's setting is part of the key
        c.log_prob(c.params, xs[0])
    assert count() == 3 and c.cache_info().misses == misses + 1
    c.runtime.cache.clear()
    own = jax.tree_util.tree_map(lambda a: a + 0, c.params)  # the remembered call keeps neither its params nor x
    x = xs[1] + 0
    c.log_prob(own, x)
    assert count() == 4
    refs = [weakref.ref(jax.tree_util.tree_leaves(own)[0]), weakref.ref(x)]
    del own, x
    c.log_prob(c.params, xs[0])  # replayed (and settles the flag that held x)
    assert count() == 4
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.slow
def test_a_call_under_the_callers_grad_leaves_the_remembered_call_alone(single_compile):
    """A call whose parameters are the caller's tracers (``jax.grad`` with concrete data) runs inline and is not
    remembered for replay, and a remembered call keeps the helpers of its own outputs: here a padded ``log_prob``, a
    padded ``conditional`` (whose outputs a helper of the same statics cuts back), then ``jax.grad`` of
    ``log_prob``; the next ``log_prob`` calls replay with the right helpers and stay exact (they once ran the
    ``conditional``'s and raised a ``TypeError``)."""
    c, fresh = _hmm(), _hmm()
    full = []
    prepare = c.runtime.prepare
    c.runtime.prepare = lambda *a, **k: full.append(1) or prepare(*a, **k)
    xs = [jnp.asarray(_data(11, s)) for s in range(3)]  # padded to the bucket of 16, then cut back
    c.log_prob(c.params, xs[0])
    miss = np.zeros(6, bool)
    miss[2] = True
    _same(c.conditional(c.params, np.asarray(xs[0]), miss), fresh.conditional(fresh.params, np.asarray(xs[0]), miss))
    grad = jax.grad(lambda p: c.log_prob(p, xs[1]).sum())(c.params)
    _same(grad, jax.grad(lambda p: fresh.log_prob(p, xs[1]).sum())(fresh.params))
    n = len(full)
    for x in xs:
        _same(c.log_prob(c.params, x), fresh.log_prob(fresh.params, x, validate=False))
    assert len(full) == n  # replayed: the traced call did not replace the remembered one


@pytest.mark.parametrize("structure", ["hclt", "hmm", "pd"])
@pytest.mark.slow
@pytest.mark.full
def test_a_random_sequence_of_calls_stays_exact(structure):
    """Two hundred calls drawn at random (entry point, a batch short of or filling its bucket, numpy or device, no
    mask, a ``[V]`` or ``[B, V]`` mask, two parameter sets, calls under the caller's ``jax.jit``, ``jax.grad`` and
    ``jax.vmap``) on one circuit, each equal to the same call on a fresh circuit of the same structure without
    checks: whatever the caches, replays and helpers remembered from the calls before does not change an answer.
    (On the HCLT it met the replay that took another entry's helper, fixed since, at its 42nd call.) The slow tier
    runs the HCLT, the full tier the HMM and a PD too."""
    from jaxpc.distributions import Categorical

    data = np.random.default_rng(0).integers(0, 5, (64, 6)).astype(np.int32)
    cat = Categorical(num_cats=5)
    root = {"hclt": lambda: structures.HCLT(data, num_latents=4, input_dist=cat),
            "hmm": lambda: structures.HMM(6, 4, 5, block_size=2),
            "pd": lambda: structures.PD(data_shape=(2, 3), num_latents=4, split_intervals=(1, 1), input_dist=cat)}[
        structure]()
    c, ref = jaxpc.compile(root, seed=1), jaxpc.compile(root, seed=1)
    rng = np.random.default_rng(7)
    params = [c.params, c.init_params(jax.random.key(3))]
    both = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), *params)

    def close(a, b, what):
        for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
            np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=2e-5, atol=1e-5, err_msg=what)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the many layouts' advice)
        for i in range(200):
            B = int(rng.choice([11, 16]))  # (few kinds of call, so that they meet each other's remembered state)
            x = data[rng.integers(0, 64, B)]
            kind = str(rng.choice(["numpy", "device"]))
            xx = x if kind == "numpy" else jnp.asarray(x)
            mask = [None, rng.random(6) < 0.3, rng.random((B, 6)) < 0.3, "device"][int(rng.integers(0, 4))]
            if isinstance(mask, str):
                mask = jnp.asarray(rng.random((B, 6)) < 0.3)
            m = None if mask is None else np.asarray(mask)
            query = m if m is not None else rng.random(6) < 0.5  # the queries' unobserved variables
            p = params[int(rng.integers(0, 2))]
            entry = str(rng.choice(["log_prob", "sync", "flows", "em_step", "conditional", "mpe", "sample", "marginal",
                                    "grad", "jit", "vmap"]))
            what = f"call {i}: {entry}, B={B}, {kind} batch, mask {None if m is None else m.shape}"
            key = jax.random.key(int(rng.integers(0, 3)))
            xd = jnp.asarray(x)
            got, want = {
                "log_prob": lambda: (c.log_prob(p, xx, mask), ref.log_prob(p, x, m, validate=False)),
                "sync": lambda: (c.log_prob(p, xx, mask, validate="sync"), ref.log_prob(p, x, m, validate=False)),
                "flows": lambda: (c.flows(p, xx, mask, return_ll=True),
                                  ref.flows(p, x, m, return_ll=True, validate=False)),
                "em_step": lambda: (c.em_step(p, xx, mask, step_size=0.5, pseudocount=0.1),
                                    ref.em_step(p, x, m, step_size=0.5, pseudocount=0.1, validate=False)),
                "conditional": lambda: (c.conditional(p, xx, query), ref.conditional(p, x, query, validate=False)),
                "mpe": lambda: (c.mpe(p, xx, query), ref.mpe(p, x, query, validate=False)),
                "sample": lambda: (c.sample(p, key, x=xx, missing=query),
                                   ref.sample(p, key, x=x, missing=query, validate=False)),
                "marginal": lambda: (c.marginal(p, soft_evidence=np.eye(5, dtype=np.float32)[x]),
                                     ref.marginal(p, soft_evidence=np.eye(5, dtype=np.float32)[x], validate=False)),
                "grad": lambda: (jax.grad(lambda q: c.log_prob(q, xd, mask).sum())(p),
                                 jax.grad(lambda q: ref.log_prob(q, xd, m, validate=False).sum())(p)),
                "jit": lambda: (jax.jit(lambda q, y: c.log_prob(q, y, mask))(p, xd),
                                ref.log_prob(p, x, m, validate=False)),
                "vmap": lambda: (jax.vmap(lambda q: c.log_prob(q, xd, mask))(both),
                                 np.stack([ref.log_prob(q, x, m, validate=False) for q in params])),
            }[entry]()
            close(got, want, what)
    c.raise_pending()


@pytest.mark.parametrize("entry", cases(["flows", "log_prob", "em_step"], fast=["em_step"]))
@pytest.mark.slow
def test_a_repeated_call_with_a_mask_replays_and_stays_exact(entry):
    """Calls with ``missing`` replay too, per kind and shape of the mask (``[V]`` or ``[B, V]``, numpy or device): the
    same outputs as the full call, the mask padded with a batch short of its bucket, a host batch's values checked
    only where they are observed, and a device batch's flag still raised by the next call."""
    c, fresh = _hmm(), _hmm()
    full = []
    prepare = c.runtime.prepare
    c.runtime.prepare = lambda *a, **k: full.append(1) or prepare(*a, **k)
    rng = np.random.default_rng(5)
    xs = [_data(16, s) for s in range(3)]
    masks = [rng.random((16, 6)) < 0.3 for _ in range(3)]
    fn = {"flows": lambda cc, p, x, m, **k: cc.flows(p, x, m, return_ll=True, **k),
          "log_prob": lambda cc, p, x, m, **k: cc.log_prob(p, x, m, **k),
          "em_step": lambda cc, p, x, m, **k: cc.em_step(p, x, m, step_size=0.3, pseudocount=0.1, return_ll=True,
                                                         **k)}[entry]
    for rows in (16, 11):
        for put in (np.asarray, jnp.asarray):
            for per_row in (True, False):
                def mask(i):
                    return put(masks[i][:rows] if per_row else masks[i][0])
                fn(c, c.params, put(xs[0][:rows]), mask(0))
                n = len(full)
                for i in range(3):
                    _same(fn(c, c.params, put(xs[i][:rows]), mask(i)),
                          fn(fresh, fresh.params, xs[i][:rows], np.asarray(mask(i)), validate=False))
                assert len(full) == n, (rows, put, per_row)
    bad = xs[1].copy()
    bad[2, 3] = 9
    hidden = masks[1].copy()
    hidden[2, 3] = True
    c.log_prob(c.params, xs[0], masks[0])
    c.log_prob(c.params, jnp.asarray(xs[0]), jnp.asarray(masks[0]))
    n = len(full)
    c.log_prob(c.params, bad, hidden)  # a bad value that is missing is not checked
    with pytest.raises(ValueError, match=r"x\[2, 3\] = 9"):
        c.log_prob(c.params, bad, masks[1] & ~hidden)
    ll = c.log_prob(c.params, jnp.asarray(bad), jnp.asarray(masks[1] & ~hidden))  # device: NaN, then the next call
    assert np.isnan(np.asarray(ll)[2])
    with pytest.raises(ValueError, match="9"):
        c.log_prob(c.params, jnp.asarray(xs[0]), jnp.asarray(masks[0]))
    assert len(full) == n  # every one of them replayed


def test_packed_tables_round_trip_and_serve_equal_tables():
    """Executables take the tables packed (one array per dtype): unpacking gives every table back, scalars and
    mixed dtypes included; the executable compiled for one tables object runs a copy (and a larger bucket's
    executable, found by ``find``, takes the same arguments)."""
    from jaxpc.executables import ExecutableCache, PackedTables

    tables = {"a": jnp.arange(6, dtype=jnp.int32).reshape(2, 3), "s": jnp.asarray(7, jnp.int32),
              "f": [jnp.linspace(0, 1, 4, dtype=jnp.float32)], "b": jnp.asarray([True, False])}
    pack = PackedTables(tables)
    assert len(pack.arrays) == 3  # int32, float32, bool
    back = jax.jit(pack.unpack)(pack.arrays)
    packed = back.pop("packed")  # the packed arrays themselves ride along, for the kernels (jaxpc.ops.tables)
    for u, v in zip(packed, pack.arrays):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tables)
    for u, v in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(tables)):
        assert u.shape == v.shape and u.dtype == v.dtype
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))

    cache = ExecutableCache()
    fn = lambda tables, x: x * tables["s"] + tables["a"].sum() + tables["f"][0][1]  # noqa: E731
    x = jnp.ones(3)
    want = np.asarray(fn(tables, x))
    np.testing.assert_allclose(np.asarray(cache.run("f", fn, {}, {"tables": tables, "x": x})), want, rtol=1e-6)
    copy = jax.tree_util.tree_map(jnp.array, tables)
    np.testing.assert_allclose(np.asarray(cache.run("f", fn, {}, {"tables": copy, "x": x})), want, rtol=1e-6)
    assert cache.info().misses == 1
    exe = cache.find("f", {}, {"tables": copy, "x": x})
    np.testing.assert_allclose(np.asarray(exe(copy, x)), want, rtol=1e-6)


def test_compiled_returns_the_most_recently_used_executable():
    c, x = _hmm(), _data(10)
    assert c.compiled("flows") is None and c.compiled("log_prob") is None
    c.flows(c.params, x)
    first = c.compiled("flows")
    mem = first.memory_analysis()
    assert mem.argument_size_in_bytes > 0 and mem.output_size_in_bytes > 0
    assert c.compiled("em_step") is None
    c.flows(c.params, x, options=jaxpc.Options(chain_scan=False))
    other = c.compiled("flows")
    assert other is not first
    c.flows(c.params, x)  # a cache hit makes the first one the most recent again
    assert c.compiled("flows") is first


def test_compiler_options_reach_the_executable():
    """``Options(tuning=Tuning(compiler_options=...))`` reaches XLA (an option XLA does not know fails the compile, a
    known one compiles the same answer) and is part of the key (a new executable, not a replay)."""
    x = _data(10)
    c = _hmm()
    want = c.log_prob(c.params, x)

    def opts(**xla):
        return jaxpc.Options(tuning=jaxpc.Tuning(compiler_options=tuple(xla.items())))

    with pytest.raises(Exception, match="not_an_xla_option"):
        c.log_prob(c.params, x, options=opts(not_an_xla_option=1))
    misses = c.cache_info().misses
    np.testing.assert_array_equal(np.asarray(c.log_prob(c.params, x, options=opts(xla_gpu_graph_min_graph_size=1))),
                                  np.asarray(want))
    assert c.cache_info().misses == misses + 1


def test_fingerprint_is_by_value_and_refuses_code_it_cannot_version(tmp_path):
    """A stored executable's name: equal for equal keys, different when an option, a shape or the XLA options
    change, and None (compile, never load) for a local function or an object of code outside jaxpc."""
    from jaxpc.checks import bad_entries
    from jaxpc.executables import ExecutableStore

    store = ExecutableStore(str(tmp_path))
    x = np.zeros((4, 3), np.int32)

    def fp(fn=bad_entries, static=None, arg=x, xla=None):
        return store.fingerprint(fn, static or {"options": jaxpc.Options()}, {"x": arg}, xla or {})

    assert fp() is not None and fp() == fp(static={"options": jaxpc.Options()})
    assert fp(static={"options": jaxpc.Options(precision="fp32")}) != fp()
    assert fp(arg=np.zeros((8, 3), np.int32)) != fp() and fp(arg=np.zeros((4, 3), np.int64)) != fp()
    assert fp(xla={"xla_gpu_autotune_level": 0}) != fp()
    assert fp(fn=lambda x: x) is None

    class Mine:
        pass

    assert fp(static={"options": jaxpc.Options(), "mine": Mine()}) is None
    one, other = (jax.device_put(jnp.zeros((4, 3), jnp.int32), d) for d in (jax.devices()[0], jax.devices()[-1]))

    def gone(name):  # JAX's deprecated names, as once they are removed
        raise AttributeError(f"module 'jax.sharding' has no attribute {name!r}")

    with pytest.MonkeyPatch.context() as mp:  # a committed argument's device, without jax.sharding.SingleDeviceSharding
        mp.setattr(jax.sharding, "__getattr__", gone, raising=False)
        assert fp(arg=one) is not None and (len(jax.devices()) < 2 or fp(arg=other) != fp(arg=one))
    with pytest.MonkeyPatch.context() as mp:  # and without is_single_device_sharding (JAX 0.11 has none)
        mp.delattr(jax.sharding, "is_single_device_sharding", raising=False)
        mp.setattr(jax.sharding, "__getattr__", gone, raising=False)
        assert fp(arg=one) is not None and (len(jax.devices()) < 2 or fp(arg=other) != fp(arg=one))


def test_a_new_circuit_loads_its_earlier_executables_ahead(tmp_path, monkeypatch, single_compile):
    """A circuit of a structure that ran before (here: in this process, with its own cache, as a second process
    would) starts loading the stored executables of that run when it is compiled; its first call takes them
    from that load and gives the same flows."""
    from jaxpc import executables

    store = executables.ExecutableStore(str(tmp_path))
    monkeypatch.setattr(executables, "_STORE", store)
    x = jnp.asarray(np.random.default_rng(0).integers(0, 6, (16, 12)).astype(np.int32))
    first = jaxpc.compile(structures.HMM(12, 8, 6), seed=3)
    assert first.runtime.cache.wait_loaded_ahead(60)
    want = first.flows(first.params, x)
    first.raise_pending()
    owner = first.runtime.cache._owner
    assert owner is not None and len(store.recent(owner)) == 1
    second = jaxpc.compile(structures.HMM(12, 8, 6), seed=3)
    assert second.runtime.cache._owner == owner
    assert second.runtime.cache.wait_loaded_ahead(60)
    got = second.flows(second.params, x)
    assert second.cache_info().loaded == 1 and second.cache_info().compile_seconds == 0.0
    assert store.loaded_ahead >= 1
    _same(got, want)
    other = jaxpc.compile(structures.HMM(12, 8, 5), seed=3)  # another structure: another index, nothing loaded
    assert other.runtime.cache.wait_loaded_ahead(60) and other.runtime.cache._owner != owner


def test_a_load_ahead_and_a_call_load_an_executable_once(tmp_path, monkeypatch):
    """A call asking for an executable that is being loaded ahead waits for that load; at exit no further load
    starts; the index keeps the most recent executables first, at most ``RECENT_EXECUTABLES``."""
    from jaxpc import executables

    store = executables.ExecutableStore(str(tmp_path))
    loads, gate = [], threading.Event()

    def slow_load(fp):
        loads.append(fp)
        gate.wait(10)
        return f"executable {fp}"

    monkeypatch.setattr(store, "_load", slow_load)
    ahead = threading.Thread(target=store.load_ahead, args=(["a", "b"],))
    ahead.start()
    while not loads:
        time.sleep(0.01)
    got = []
    caller = threading.Thread(target=lambda: got.append(store.load("a")))
    caller.start()
    time.sleep(0.05)
    assert not got  # waiting for the load ahead
    gate.set()
    ahead.join(10)
    caller.join(10)
    assert got == ["executable a"] and loads == ["a", "b"] and store.loaded_ahead == 1
    assert store.load("b") == "executable b" and store.load("b") == "executable b" and loads == ["a", "b", "b"]
    monkeypatch.setattr(executables, "_EXITING", threading.Event())
    executables._EXITING.set()  # at exit a load ahead stops before its next executable
    store.load_ahead(["c", "d"])
    assert loads == ["a", "b", "b"] and not store._slots
    store.note("c1", ["x", "y"])
    store.note("c1", ["z", None, "x"])
    assert store.recent("c1") == ["z", "x", "y"] and store.recent("c2") == []
    store.note("c1", [f"f{i}" for i in range(20)])
    assert store.recent("c1") == [f"f{i}" for i in range(executables.RECENT_EXECUTABLES)]


def _copy_chain(n: int, seed: int) -> np.ndarray:
    """``n`` rows of 12 ternary variables, each a copy of the one before 80% of the time: a chain of copies, whose
    HCLT is a path-shaped tree with its levels scanned."""
    rng = np.random.default_rng(seed)
    data = np.zeros((n, 12), np.int32)
    data[:, 0] = rng.integers(0, 3, n)
    for i in range(1, 12):
        data[:, i] = np.where(rng.random(n) < 0.8, data[:, i - 1], rng.integers(0, 3, n))
    return data


@pytest.fixture
def quick_store(tmp_path, monkeypatch):
    """A persistent store in ``tmp_path`` and quick first compiles as on a GPU (the quick compile's GPU options
    mean nothing to the CPU compiler: both executables compute the same)."""
    from jaxpc import executables

    monkeypatch.setattr(executables, "_on_gpu", lambda: True)
    monkeypatch.setattr(executables, "_STORE", executables.ExecutableStore(str(tmp_path)))
    # JAX's own cache off (the suite's, tests/conftest.py): XLA's CPU client does not load back an executable that it
    # compiled with the quick compile's GPU options and cached (a "function ... not found" error at its first run)
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    executables._reset_jax_cache()
    yield tmp_path
    jax.config.update("jax_enable_compilation_cache", was)
    executables._reset_jax_cache()


def test_quick_first_compile_is_replaced_by_the_optimized_one(quick_store):
    """A new key runs its quick compile at once; a background thread compiles it again with the options' XLA
    settings, stores both and swaps the optimized one in; a later cache compiles nothing: it loads the quick one
    and the optimized one behind it."""
    from jaxpc import executables

    x = _data(10)
    with pytest.MonkeyPatch.context() as mp:  # without the quick compile, in a store of its own
        mp.setattr(executables, "_STORE", executables.ExecutableStore(str(quick_store / "once")))
        once = _hmm()
        ref = once.log_prob(once.params, x, options=jaxpc.Options(tuning=jaxpc.Tuning(quick_first_compile=False)))
        assert once.cache_info().upgrading == 0
    stored_once = len(list((quick_store / "once").rglob("*.jaxpc-exe")))
    c = _hmm()
    first = c.log_prob(c.params, x)
    quick = c.compiled("log_prob")
    assert c.wait_compiled(timeout=120)
    assert c.cache_info().upgrading == 0
    assert c.compiled("log_prob") is not quick
    _same(first, ref)
    _same(c.log_prob(c.params, x), ref)
    # the call path's own executables, the quick and the optimized one: one more than without the quick compile
    assert len(list(quick_store.rglob("*.jaxpc-exe"))) - stored_once == stored_once + 1
    again = _hmm()
    _same(again.log_prob(again.params, x), ref)
    assert again.cache_info().loaded >= 1 and again.wait_compiled(timeout=120)
    assert again.cache_info().compile_seconds == 0 and again.cache_info().upgrading == 0
    _same(again.log_prob(again.params, x), ref)


@pytest.mark.slow
def test_the_optimized_compile_runs_the_scanned_stages_unrolled(quick_store):
    """The quick compile keeps the stages that ``jaxpc.compile`` grouped into scans (XLA while loops); the
    optimized one that replaces it traces them unrolled (``Tuning.unroll_optimized``) at the key's next call (or
    in ``wait_compiled``), on the caller's thread, computes the same, and is what the store serves a later
    process (behind the quick one, which it loads first: it loads faster); ``unroll_optimized=False`` keeps the
    loops. The unrolled compile runs without XLA's Triton GEMM fusions but with its autotuning."""
    from jaxpc import distributions, executables

    data = _copy_chain(300, seed=0)
    root = structures.HCLT(data, 4, input_dist=distributions.Categorical(3))
    x = data[:9]

    def loops(c):
        return c.compiled("flows").as_text().count(" while(")

    c = jaxpc.compile(root)
    ref = c.flows(c.params, x, options=jaxpc.Options(tuning=jaxpc.Tuning(quick_first_compile=False)),
                  return_ll=True)
    seen, traced = [], []  # the XLA options of every compile from here on, the Options of every trace
    compile_, lower_ = executables._compile, executables._lower

    def spy(lowered, xla, **kw):
        seen.append(dict(xla))
        return compile_(lowered, xla, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(executables, "_compile", spy)
        mp.setattr(executables, "_lower", lambda fn, static, *a: traced.append(static["options"])
                   or lower_(fn, static, *a))
        got = c.flows(c.params, x, return_ll=True)
        assert loops(c) > 0 and c.cache_info().upgrading == 1  # its unrolled trace waits for the next call
        c.flows(c.params, x)  # traces it; the compile runs in the background
        assert c.wait_compiled(timeout=120)
    assert loops(c) == 0 and c.cache_info().upgrading == 0
    small = dict([executables.CONCURRENT_XLA])  # a batch of 9 (bucket 16): Tuning.concurrent_batch's order
    assert seen == [{**dict(executables.QUICK_XLA), **small}, {**dict(executables.UNROLLED_XLA), **small}]
    # the quick trace leaves the leaf kernels out (their Triton compiles lengthen a first call); the optimized
    # trace keeps them
    assert [(o.scan_stages, o.leaf_kernel) for o in traced] == [(True, False), (False, True)]
    for a, b in zip(jax.tree_util.tree_leaves((got, c.flows(c.params, x, return_ll=True))),
                    jax.tree_util.tree_leaves((ref, ref))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    again = jaxpc.compile(root)
    with pytest.MonkeyPatch.context() as mp:  # the optimized executable's load held back until the first call ran
        from jaxpc import executables

        gate = threading.Event()
        load = executables.ExecutableStore.load

        def held(self, fp):
            if threading.current_thread().name == "jaxpc-upgrade":
                gate.wait(60)
            return load(self, fp)

        mp.setattr(executables.ExecutableStore, "load", held)
        got = again.flows(again.params, x, return_ll=True)
        assert loops(again) > 0 and again.cache_info().upgrading == 1
        gate.set()
        assert again.wait_compiled(timeout=120)
    assert again.cache_info().loaded >= 1 and again.cache_info().compile_seconds == 0 and loops(again) == 0
    for a, b in zip(jax.tree_util.tree_leaves((got, again.flows(again.params, x, return_ll=True))),
                    jax.tree_util.tree_leaves((ref, ref))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    kept = jaxpc.Options(tuning=jaxpc.Tuning(unroll_optimized=False))
    c.flows(c.params, x, options=kept)
    assert c.wait_compiled(timeout=120)
    assert c.compiled("flows").as_text().count(" while(") > 0
    # a circuit without scanned stages: its optimized compile is not traced a second time
    pd = jaxpc.compile(structures.PD((2, 4), 4, split_intervals=(1, 1), input_dist=distributions.Categorical(3)))
    assert c.runtime.cache.scans and not pd.runtime.cache.scans


@pytest.mark.slow
@pytest.mark.full
def test_queries_compile_quick_first_then_optimized(quick_store):
    """``mpe``, ``sample`` and ``conditional`` take the circuit's compile path: a quick first compile that keeps the
    scanned stages (forward and top-down selection), then the optimized one, which gives the same answers:
    ``conditional``'s with the stages unrolled, ``mpe``'s and ``sample``'s with them still scanned (their unrolled
    selection is slower); without the quick compile (``Tuning(quick_first_compile=False)``) they compile once."""
    from jaxpc import distributions

    data = _copy_chain(200, seed=1)
    c = jaxpc.compile(structures.HCLT(data, 4, input_dist=distributions.Categorical(3)))
    x, miss = data[:9], np.arange(12) % 3 == 0
    once = jaxpc.Options(tuning=jaxpc.Tuning(quick_first_compile=False))

    def scans(name):  # the stages' loops (on a CPU, jax.random's threefry runs loops of its own)
        return len(re.findall(r' while\(.*op_name="[^"]*jaxpc/scan\d+\)*/while"', c.compiled(name).as_text()))
    calls = {"mpe": lambda **kw: c.mpe(c.params, x, miss, **kw),
             "sample": lambda **kw: c.sample(c.params, jax.random.key(3), x=x, missing=miss, **kw),
             "conditional": lambda **kw: c.conditional(c.params, x, miss, **kw)}
    for name, call in calls.items():
        ref = call(options=once)
        assert c.wait_compiled(timeout=0)
        quick = c.compiled(name).as_text()
        assert scans(name) > 0
        first = call()
        assert scans(name) > 0 and c.cache_info().upgrading == 1, name
        _same(first, ref)
        assert c.wait_compiled(timeout=120)
        assert c.compiled(name).as_text() != quick, f"{name}'s optimized executable did not replace the quick one"
        if name == "conditional":
            assert scans(name) == 0, f"{name}'s optimized executable keeps the scans"
        else:
            assert scans(name) > 0, f"{name}'s optimized executable runs the scans unrolled"
        for a, b in zip(jax.tree_util.tree_leaves(call()), jax.tree_util.tree_leaves(ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_no_quick_compile_where_the_options_say_so(quick_store):
    """Off with ``Tuning(quick_first_compile=False)`` or when the caller sets one of the quick compile's XLA
    options; a failed optimized compile warns and leaves the quick executable running."""
    from jaxpc import executables

    x = _data(10)
    for tuning in (jaxpc.Tuning(quick_first_compile=False),
                   jaxpc.Tuning(compiler_options=(("xla_gpu_autotune_level", 4),))):
        c = _hmm()
        c.log_prob(c.params, x, options=jaxpc.Options(tuning=tuning))
        assert c.cache_info().upgrading == 0 and c.wait_compiled(timeout=0)
        assert executables.quick_options(jaxpc.Options(tuning=tuning), dict(tuning.compiler_options)) is None
    c = _hmm()
    bad = jaxpc.Options(tuning=jaxpc.Tuning(compiler_options=(("not_an_xla_option", 1),)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(executables, "quick_options", lambda options, xla: {})
        with pytest.warns(RuntimeWarning, match="optimized compile of an executable failed"):
            got = c.log_prob(c.params, x, options=bad)
            assert c.wait_compiled(timeout=120)
    _same(got, _hmm().log_prob(_hmm().params, x))


@pytest.mark.slow
@pytest.mark.parametrize("structure", ["hmm", "hclt"])
def test_a_process_that_ends_during_the_optimized_compile_waits_and_stores_it(tmp_path, structure):
    """A script that ends right after its first call (the optimized compile still running on its thread, made
    slow here; for an HCLT with scanned levels, not traced yet) exits cleanly after that compile, which it
    stores: the next process compiles nothing (it loads the quick executable, and the optimized one behind it)."""
    make = {"hmm": "structures.HMM(12, 8, 3)",  # or an HCLT of a chain of copies: its levels are scanned
            "hclt": "structures.HCLT(np.cumsum(np.random.default_rng(1).random((300, 12)) < 0.1, axis=1) % 3, 4, "
                    "input_dist=jaxpc.distributions.Categorical(3))"}[structure]
    script = textwrap.dedent(f"""
        import json, sys, time, numpy as np, jax, jaxpc
        from jaxpc import executables, structures
        executables._on_gpu = lambda: True  # quick first compiles as on a GPU
        compile_ = jax.stages.Lowered.compile
        def slow(self, compiler_options=None):
            if not compiler_options or "xla_gpu_autotune_level" not in compiler_options:
                time.sleep(2.0)  # the optimized compile
            return compile_(self, compiler_options=compiler_options)
        jax.stages.Lowered.compile = slow
        jaxpc.enable_persistent_cache({str(tmp_path)!r})
        c = jaxpc.compile({make}, seed=3)
        x = np.random.default_rng(0).integers(0, 3, (16, 12)).astype(np.int32)
        ll = c.log_prob(c.params, x)
        info = c.cache_info()
        print(json.dumps(dict(loaded=info.loaded, upgrading=info.upgrading, compiled=info.compile_seconds,
                              ll=np.asarray(ll).tolist())), flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), JAXPC_PERSISTENT_CACHE="1")

    def run():
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.splitlines()[-1]), r.stderr

    first, err = run()
    assert first["loaded"] == 0 and first["upgrading"] == 1
    says = {"hmm": "waiting for 1 optimized executable still compiling",  # (made to take 2 s: > EXIT_NOTICE_S)
            "hclt": "compiling 1 optimized executable for the persistent cache"}[structure]
    assert f"jaxpc: before exit, {says}" in err, err[-3000:]  # the wait at exit is not silent
    second, err = run()
    assert second["loaded"] >= 1 and second["compiled"] == 0, second
    assert "for the persistent cache" not in err, err[-3000:]  # nothing left to trace and compile
    np.testing.assert_allclose(second["ll"], first["ll"], rtol=1e-6)


@pytest.mark.slow
def test_a_process_without_a_store_drops_the_untraced_optimized_compiles_at_exit():
    """Without a disk store (``JAXPC_PERSISTENT_CACHE=0``), a script that ends with an HCLT's optimized compile not
    yet traced (its levels scanned in the quick compile) neither traces nor compiles it at exit: nothing would run
    it. Its own first call runs the quick executable and the process exits cleanly."""
    script = textwrap.dedent("""
        import atexit, json, numpy as np, jax
        compiles = []
        compile_ = jax.stages.Lowered.compile
        def counted(self, compiler_options=None):
            compiles.append("quick" if compiler_options and "xla_gpu_autotune_level" in compiler_options
                            else "optimized")
            return compile_(self, compiler_options=compiler_options)
        jax.stages.Lowered.compile = counted
        # registered before jaxpc's exit hook, so it runs after it
        atexit.register(lambda: print(json.dumps(dict(compiles=compiles)), flush=True))
        import jaxpc
        from jaxpc import executables, structures
        executables._on_gpu = lambda: True  # quick first compiles as on a GPU
        c = jaxpc.compile(structures.HCLT(np.cumsum(np.random.default_rng(1).random((300, 12)) < 0.1, axis=1) % 3,
                                          4, input_dist=jaxpc.distributions.Categorical(3)), seed=3)
        x = np.random.default_rng(0).integers(0, 3, (16, 12)).astype(np.int32)
        ll = c.log_prob(c.params, x)
        assert np.isfinite(np.asarray(ll)).all()
        print(json.dumps(dict(upgrading=c.cache_info().upgrading, before_exit=list(compiles))), flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), JAXPC_PERSISTENT_CACHE="0")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    first, last = (json.loads(line) for line in r.stdout.splitlines()[-2:])
    assert first["upgrading"] == 1 and "quick" in first["before_exit"], first  # the optimized trace was waiting
    assert last["compiles"] == first["before_exit"], last  # nothing traced or compiled at exit
    assert "jaxpc: before exit" not in r.stderr, r.stderr[-3000:]  # nor any wait to explain


def test_a_kept_copy_lives_as_long_as_its_array():
    """``Runtime.kept`` makes a copy once per live array: the same array reads it again; another array (of the same
    values) makes it anew, and a collected array's copy goes with it."""
    rt = jaxpc.runtime.Runtime(jaxpc.checks.VarInfo.from_var_dists(0, {}), jnp.float32)
    made = []

    def make(a):
        made.append(a.shape)
        return a * 2

    a = jnp.arange(4.0)
    first = rt.kept("k", a, make)
    assert rt.kept("k", a, make) is first and len(made) == 1
    b = jnp.arange(4.0)
    assert rt.kept("k", b, make) is not first and len(made) == 2
    np.testing.assert_array_equal(np.asarray(rt.kept("k", b, make)), [0, 2, 4, 6])
    assert len(made) == 2
    del b
    gc.collect()
    assert "k" not in rt._kept
    rt.kept("k", a, make)
    assert len(made) == 3 and "k" in rt._kept


@pytest.mark.slow
def test_jax_settings_are_part_of_the_key():
    """Changing a JAX setting that changes what a traced function computes (here the PRNG's partitionable bits)
    compiles anew, as ``jax.jit`` does: a circuit's ``sample`` and ``init_params`` then draw what a fresh circuit
    draws, not the executable cached (or the call replayed) under the old setting."""
    c = jaxpc.compile(structures.HMM(4, 3, 5))
    k = jax.random.key(0)
    before = np.asarray(c.sample(c.params, k, 6)), np.asarray(c.init_params(k)["sum"][next(iter(c.params["sum"]))])
    c.sample(c.params, k, 6)  # (remembered for replay)
    old = jax.config.jax_threefry_partitionable
    try:
        jax.config.update("jax_threefry_partitionable", not old)
        after = np.asarray(c.sample(c.params, k, 6)), np.asarray(c.init_params(k)["sum"][next(iter(c.params["sum"]))])
        fresh = jaxpc.compile(structures.HMM(4, 3, 5))
        np.testing.assert_array_equal(after[0], np.asarray(fresh.sample(fresh.params, k, 6)))
    finally:
        jax.config.update("jax_threefry_partitionable", old)
    assert not np.array_equal(before[0], after[0]) and not np.array_equal(before[1], after[1])
    np.testing.assert_array_equal(before[0], np.asarray(c.sample(c.params, k, 6)))  # and back


def _packing(make, made: list, tables):
    made.append(tables)
    return make(tables)


def test_a_dropped_circuit_releases_its_tables():
    """The memos of the tables' signature and packed form (each circuit's cache has its own) hold a circuit's tables,
    and their copies placed on another device, only while the circuit lives; while it lives, each tables object is
    packed once, whatever the calls."""
    c, x = _hmm(), _data(8)
    cache = c.runtime.cache
    made = []
    cache._packed.make = functools.partial(_packing, cache._packed.make, made)
    for _ in range(2):
        c.log_prob(c.params, x)
    placed = len(jax.devices()) > 1
    if placed:  # committed to another device: the call runs there, on a copy of the tables placed there once
        for _ in range(2):
            c.log_prob(c.params, jax.device_put(x, jax.devices()[1]))
    assert len(made) == 1 + placed and made[0] is c.tables
    packed = [a for _, p in cache._packed._memo.values() for a in p.arrays]
    refs = [weakref.ref(a) for a in [*jax.tree_util.tree_leaves(made), *packed]] + [weakref.ref(c)]
    del c, cache, made, packed
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs), "a dropped circuit's tables stay alive"


@pytest.mark.slow
def test_a_stored_executable_that_fails_to_load_is_stored_again(tmp_path, monkeypatch):
    """A stored executable that fails to load (a damaged file) is compiled again and written back to the store, also
    where JAX's own persistent cache (the suite's, tests/conftest.py) serves that compile: a later circuit loads it
    and compiles nothing."""
    from jaxpc import executables

    store = executables.ExecutableStore(str(tmp_path))
    monkeypatch.setattr(executables, "_STORE", store)
    x = _data(8)
    first = _hmm()
    want = first.log_prob(first.params, x)
    fps = store.recent(first.runtime.cache.owner(60))
    assert fps, "the call's executable is not in the circuit's index"
    for fp in fps:  # (whether or not it was stored: JAX's cache may have served this first compile already)
        os.makedirs(os.path.dirname(store._path(fp)), exist_ok=True)
        with open(store._path(fp), "wb") as f:
            f.write(b"damaged")
    second = _hmm()
    _same(second.log_prob(second.params, x), want)
    assert second.cache_info().loaded == 0 and second.cache_info().misses == 1
    assert second.runtime.cache.wait_upgrades(60)
    for fp in fps:
        with open(store._path(fp), "rb") as f:
            assert f.read() != b"damaged", "the executable that failed to load was not stored again"
    third = _hmm()
    _same(third.log_prob(third.params, x), want)
    assert third.cache_info().loaded == 1 and third.cache_info().compile_seconds == 0.0
