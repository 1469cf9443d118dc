"""The autotuner's rules with fake timers: call counts, the 2x drop, the 10% margin, the caches; and every route it
may pick against the reference's values and flows."""

import collections

import jax
import numpy as np
import pytest

import jaxpc
from jaxpc import structures
from jaxpc.autotune import Autotuner, tune_circuit

from .tiers import cases

TIMES = {"H": 1.0, "A": 0.95, "B": 3.0, "C": 0.5}


class Op:
    def __init__(self, cfg, calls):
        self.cfg, self.calls = cfg, calls

    def __call__(self):
        self.calls[self.cfg] += 1
        return np.zeros(())


def fake_timer(fn):
    fn()
    return TIMES[fn.cfg]


def tuner(**kw):
    Autotuner._process_cache.clear()
    return Autotuner(timer=fake_timer, env_key=kw.pop("env_key", "test-gpu"), full_reps=5, **kw)


def test_call_counts_drop_rule_and_winner():
    calls = collections.Counter()
    t = tuner()
    best = t.tune("shape", "H", ["A", "B", "C"], lambda cfg: Op(cfg, calls))
    assert best == "C"
    # everyone: one untimed + one timed run; B (3x the fastest first timing) is dropped there;
    # the survivors (and always the heuristic) get full_reps more
    assert calls == {"H": 2 + 5, "A": 2 + 5, "B": 2, "C": 2 + 5}


def test_untimed_first_runs_overlap():
    """The untimed first runs (compilations) of the candidates run in threads at the same time: each blocks until
    all have started, which would time out if they ran one after the other."""
    import threading

    start = threading.Barrier(3, timeout=10)

    class Slow(Op):
        def __call__(self):
            if self.calls[self.cfg] == 0:
                start.wait()  # raises BrokenBarrierError after 10 s unless all three first runs are in flight
            return super().__call__()

    calls = collections.Counter()
    assert tuner(workers=3).tune("shape", "H", ["A", "C"], lambda cfg: Slow(cfg, calls)) == "C"
    assert calls == {"H": 2 + 5, "A": 2 + 5, "C": 2 + 5}
    with pytest.raises(ValueError, match="workers"):
        Autotuner(workers=0)


def test_margin_rule_keeps_the_heuristic():
    calls = collections.Counter()
    assert tuner().tune("shape", "H", ["A"], lambda cfg: Op(cfg, calls)) == "H"  # 5% faster is not enough
    calls.clear()
    assert tuner(margin=0.04).tune("shape", "H", ["A"], lambda cfg: Op(cfg, calls)) == "A"


def test_failing_candidate_is_skipped_but_failing_heuristic_raises():
    calls = collections.Counter()

    def run(cfg):
        if cfg == "C":
            raise RuntimeError("does not compile")
        return Op(cfg, calls)

    assert tuner().tune("s", "H", ["A", "C"], run) == "H"
    with pytest.raises(RuntimeError, match="does not compile"):
        tuner().tune("s", "C", ["A"], run)


def test_process_and_disk_caches(tmp_path):
    path = tmp_path / "tune.json"
    calls = collections.Counter()
    t = tuner(cache_path=str(path))
    assert t.tune("k", "H", ["A", "C"], lambda cfg: Op(cfg, calls)) == "C"
    n = sum(calls.values())
    assert t.tune("k", "H", ["A", "C"], lambda cfg: Op(cfg, calls)) == "C"  # process cache
    assert sum(calls.values()) == n
    t2 = tuner(cache_path=str(path))  # fresh process cache: read from disk
    assert t2.tune("k", "H", ["A", "C"], lambda cfg: Op(cfg, calls)) == "C"
    assert sum(calls.values()) == n
    t3 = tuner(cache_path=str(path), env_key="another-gpu|driver 2|jax x")  # other environment: tune again
    t3.tune("k", "H", ["A", "C"], lambda cfg: Op(cfg, calls))
    assert sum(calls.values()) > n


# slow: test_tune_circuit_starts_from_the_auto_choice tunes the same circuit's partitions by scripted timings, and the
# hclt-folded-16-one-route case of test_every_candidate_route_gives_the_reference checks a routed folded plan against
# the reference
@pytest.mark.parametrize("impl,fold", cases([("pallas", False), ("pallas", True), ("pallas_forward", True)],
                                             fast=[], unpack=True),
                         ids=["pallas-full-layout", "pallas-folded", "pallas_forward-folded"])
def test_tune_circuit_routes_partitions_and_stays_exact(impl, fold):
    """Every partition of the tuned plan (the folded plan's carry M in their key) routed to the faster
    candidate by fake timings, and the tuned options give the reference's values and flows."""
    from jaxpc.engine.routing import partition_key

    data = np.random.default_rng(0).integers(0, 3, (200, 5))
    c = jaxpc.compile(structures.HCLT(data, 4, input_dist=jaxpc.distributions.Categorical(3)), seed=1)
    x = data[:10].astype(np.int32)
    plan = c.layout.fold if fold else c.layout
    keys = {partition_key(p, 16) for st in plan.stages() for p in st.sums}
    Autotuner._process_cache.clear()

    class Timer:
        def __call__(self, fn):
            fn()
            return self.next.pop(0)

    # per partition: the heuristic (auto's choice: the reference on a CPU) is timed first (1.0), the candidate
    # after it (0.4), then 2 full reps each; then the whole step: default options, tuned ones, 2 reps each
    timer = Timer()
    timer.next = [1.0, 0.4, 1.0, 1.0, 0.4, 0.4] * (len(keys) + 1)
    t = Autotuner(timer=timer, env_key="fake", full_reps=2)
    opts = tune_circuit(c, c.params, x, candidates=[(impl, 16, 16, 4)], tuner=t, fold_products=fold)
    assert not timer.next and opts.fold_products == fold and opts.impl == "auto"
    assert {k for k, _ in opts.kernels} == keys and all(ch == (impl, 16, 16, 4) for _, ch in opts.kernels)
    assert any(len(k) == 8 for k in keys) == fold  # folded partitions with products of several terms
    ref = jaxpc.Options(precision="default", fold_products=fold)
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x, options=opts)),
                               np.asarray(c.log_prob(c.params, x, options=ref)), rtol=1e-5)
    f1, f2 = c.flows(c.params, x, options=opts), c.flows(c.params, x, options=ref)
    for a, b in zip(jax.tree_util.tree_leaves(f1), jax.tree_util.tree_leaves(f2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def _small_hclt():
    data = np.random.default_rng(0).integers(0, 3, (200, 5))
    return jaxpc.compile(structures.HCLT(data, 4, input_dist=jaxpc.distributions.Categorical(3)), seed=1), data[:10]


class ScriptedTimer:
    """Times by configuration: a partition's route (a tuple) or the whole step's options (``Options``)."""

    def __init__(self, route_s, plan_s):
        self.route_s, self.plan_s, self.seen = route_s, plan_s, []

    def __call__(self, fn):
        fn()
        self.seen.append(fn.cfg)
        return self.plan_s(fn.cfg) if isinstance(fn.cfg, jaxpc.Options) else self.route_s(fn.cfg)


def _tag(run):
    """``run`` whose callables carry the configuration they run (for :class:`ScriptedTimer`)."""
    def tagged(cfg):
        f = run(cfg)

        def g():
            return f()
        g.cfg = cfg
        return g
    return tagged


def _tune(c, x, timer, monkeypatch, candidates):
    tune = Autotuner.tune
    monkeypatch.setattr(Autotuner, "tune", lambda self, key, h, cands, run: tune(self, key, h, cands, _tag(run)))
    Autotuner._process_cache.clear()
    tuner = Autotuner(timer=timer, env_key="fake", full_reps=2)
    return tune_circuit(c, c.params, x, candidates=candidates, tuner=tuner)


@pytest.mark.slow
def test_tune_circuit_keeps_the_default_when_the_whole_step_is_not_faster(monkeypatch):
    """Partitions alone favour the candidate, the whole step does not: the default options come back."""
    c, x = _small_hclt()
    cand = ("pallas", 16, 16, 4)
    timer = ScriptedTimer(lambda r: 0.4 if r == cand else 1.0, lambda o: 1.0 if o.kernels else 0.95)
    opts = _tune(c, x, timer, monkeypatch, [cand])
    assert opts == jaxpc.Options(precision="default")
    assert any(isinstance(s, jaxpc.Options) and s.kernels for s in timer.seen)  # the tuned step was timed
    # a whole step 10% faster is kept
    timer = ScriptedTimer(lambda r: 0.4 if r == cand else 1.0, lambda o: 0.5 if o.kernels else 1.0)
    opts = _tune(c, x, timer, monkeypatch, [cand])
    assert opts.kernels and all(ch == cand for _, ch in opts.kernels)


@pytest.mark.slow
def test_tune_circuit_starts_from_the_auto_choice(monkeypatch):
    """With the GPU rule on, a partition's heuristic is the route impl="auto" takes (the Pallas forward with the
    default configuration at a small batch, run in interpret mode here): the XLA path has to beat it, and
    partitions left on it are not listed in the returned options."""
    from jaxpc.engine import routing
    from jaxpc.ops.pallas_sum import KernelConfig

    monkeypatch.setattr(routing, "on_gpu", lambda: True)
    c, x = _small_hclt()
    k = KernelConfig()
    auto = ("pallas_forward", k.block_b, k.block_k, k.num_warps)
    timer = ScriptedTimer(lambda r: 1.0, lambda o: 1.0)  # ties: every heuristic stays
    assert _tune(c, x, timer, monkeypatch, []) == jaxpc.Options(precision="default")
    assert auto in timer.seen and ("xla",) in timer.seen
    timer = ScriptedTimer(lambda r: 0.5 if r == ("xla",) else 1.0, lambda o: 0.5 if o.kernels else 1.0)
    opts = _tune(c, x, timer, monkeypatch, [])
    assert opts.impl == "auto" and opts.kernels and all(ch == ("xla",) for _, ch in opts.kernels)


def _routes():
    """Every route the tuner may put on a partition: the XLA path, ``impl="auto"``'s choice as a route (the
    heuristic every partition starts from) and every default candidate."""
    from jaxpc.autotune import DEFAULT_CANDIDATES
    from jaxpc.ops.pallas_sum import KernelConfig

    k = KernelConfig()
    auto = [(impl, k.block_b, k.block_k, k.num_warps) for impl in ("pallas", "pallas_forward")]
    return list(dict.fromkeys([("xla",)] + auto + list(DEFAULT_CANDIDATES)))


# (structure, folded plan, batch, routes): one route in the slow tier (the first case); in the full tier every route
# on one structure and plan, and each impl's default route on the other (the kernel configurations differ in their
# tiles only)
ACCURACY_CASES = [pytest.param("hclt", True, 16, ("pallas", 16, 32, 4), id="hclt-folded-16-one-route"),
                  pytest.param("hclt", False, 16, "every", id="hclt-full-16"),
                  pytest.param("pd", True, 16, "impls", id="pd-folded-16")]


@pytest.mark.parametrize("structure,fold,batch,routes", ACCURACY_CASES)
@pytest.mark.slow
def test_every_candidate_route_gives_the_reference(structure, fold, batch, routes, monkeypatch):
    """Whatever the tuner picks is exact: each route it may choose (:func:`_routes`), put on every sum partition of
    the plan it tunes (folded or not), gives the XLA reference's log-likelihoods and flows (the Pallas kernels in
    interpret mode: at batch 16 a tree level's backward as one kernel, at 128 the exclusive and the parent / child
    backward kernels; PD's partitions have several child blocks)."""
    from jaxpc.engine import routing
    from jaxpc.ops import pallas_sum

    assert routing.kernels_available()
    calls = []  # the Pallas forward kernel runs (a route that fell back to XLA would not)
    kernel = pallas_sum.forward
    monkeypatch.setattr(pallas_sum, "forward", lambda *a, **k: calls.append(k["config"]) or kernel(*a, **k))
    rng = np.random.default_rng(0)
    data = rng.integers(0, 3, (200, 4))
    cat = jaxpc.distributions.Categorical(3)
    root = (structures.HCLT(data, 4, input_dist=cat, block_size=2) if structure == "hclt" else
            structures.PD((2, 2), 4, split_intervals=1, input_dist=cat, block_size=2))
    c = jaxpc.compile(root, seed=1)
    x = data[rng.integers(0, 200, batch)].astype(np.int32)
    plan = c.layout.fold if fold else c.layout
    keys = sorted({routing.partition_key(p, batch) for st in plan.stages() for p in st.sums})
    ref = jaxpc.Options(precision="default", fold_products=fold, impl="xla")
    ll_ref, fl_ref = c.log_prob(c.params, x, options=ref), c.flows(c.params, x, options=ref)
    for i, route in enumerate({"every": _routes(), "impls": _routes()[:3]}.get(routes, [routes])):
        opts = ref.replace(impl="auto", kernels=tuple((k, route) for k in keys))
        before = len(calls)
        if i < 3:  # the forward-only entry once per impl (the other routes differ from these in their tiles only)
            np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x, options=opts)), np.asarray(ll_ref),
                                       rtol=1e-5, atol=1e-5, err_msg=str(route))
        fl, ll = c.flows(c.params, x, options=opts, return_ll=True)
        np.testing.assert_allclose(np.asarray(ll), np.asarray(ll_ref), rtol=1e-5, atol=1e-5, err_msg=str(route))
        for a, b in zip(jax.tree_util.tree_leaves(fl), jax.tree_util.tree_leaves(fl_ref), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5, err_msg=str(route))
        assert (len(calls) > before) == (route[0] != "xla"), route
