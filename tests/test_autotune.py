"""The autotuner's rules with fake timers: call counts, the 2x drop, the 10% margin, the caches; and every route it
may pick against the reference's values and flows."""

import collections
import json

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
@pytest.mark.full
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
@pytest.mark.full
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


def test_a_choice_is_reused_only_for_the_same_candidates(tmp_path):
    """The caches kept an index into the configurations, keyed without them: tuned among ["A", "B", "C"] (C won,
    index 3), the same shape key among ["C", "A", "B"] returned "B", index 3 of that list and the slowest."""
    path = tmp_path / "tune.json"
    calls = collections.Counter()
    t = tuner(cache_path=str(path))
    assert t.tune("k", "H", ["A", "B", "C"], lambda cfg: Op(cfg, calls)) == "C"
    assert t.tune("k", "H", ["C", "A", "B"], lambda cfg: Op(cfg, calls)) == "C"
    assert t.tune("k", "H", ["A", "B"], lambda cfg: Op(cfg, calls)) == "H"  # A is not 10% faster
    assert calls["H"] == 3 * (2 + 5)
    n = sum(calls.values())
    for fresh in (False, True):  # the process cache, then the disk cache
        t2 = tuner(cache_path=str(path)) if fresh else t
        assert t2.tune("k", "H", ["A", "B", "C"], lambda cfg: Op(cfg, calls)) == "C"
        assert t2.tune("k", "H", ["C", "A", "B"], lambda cfg: Op(cfg, calls)) == "C"
        assert t2.tune("k", "H", ["A", "A", "B", "H"], lambda cfg: Op(cfg, calls)) == "H"  # duplicates: once
        assert sum(calls.values()) == n


def test_damaged_disk_cache_is_empty(tmp_path):
    """A cache file holding JSON that is no object (or an index that is no int) raised ``AttributeError: 'list'
    object has no attribute 'get'``; like an unreadable file it holds no choice."""
    path = tmp_path / "tune.json"
    calls = collections.Counter()
    for text in ("[1, 2]", '{"x": 1}', "not json"):
        path.write_text(text)
        assert tuner(cache_path=str(path)).tune("k", "H", ["C"], lambda cfg: Op(cfg, calls)) == "C"
    t = tuner(cache_path=str(path))
    key = next(iter(json.loads(path.read_text())))
    path.write_text(json.dumps({key: "1"}))
    assert t.lookup("k", ["H", "C"]) is None


@pytest.mark.parametrize("kw, msg", [({"margin": "0.1"}, "margin must be a float in"),
                                     ({"margin": float("nan")}, "margin must be a float in"),
                                     ({"drop_factor": float("nan")}, "drop_factor must be a float >= 1"),
                                     ({"drop_factor": 0.5}, "drop_factor must be a float >= 1"),
                                     ({"full_reps": 2.5}, "full_reps must be an int >= 1"),
                                     ({"full_reps": True}, "full_reps must be an int >= 1"),
                                     ({"timer": 3}, "timer must be a function")])
def test_autotuner_arguments_are_checked(kw, msg):
    """A NaN drop factor dropped every candidate but the heuristic, a float ``full_reps`` failed in the middle of
    tuning and a string margin raised a comparison's ``TypeError``."""
    with pytest.raises((TypeError, ValueError), match=msg):
        Autotuner(env_key="fake", **kw)


def test_tune_circuit_checks_its_arguments_before_timing():
    """A malformed candidate was timed (or skipped as failing) and then refused by Options with a message about
    ``kernels``, or silently never chosen; a tuner or circuit of another type and params of another circuit raised
    ``AttributeError`` / ``KeyError``. Nothing is timed before these checks."""
    c, x = _small_hclt()

    def never(fn):
        raise AssertionError("timed")

    t = Autotuner(timer=never, env_key="fake")
    for cand in [(16, 32, 4)], [("cuda", 16, 32, 4)], [("pallas", 16, 0, 4)], [("triton", 16, 16, 4)]:
        with pytest.raises(ValueError, match=r"tune_circuit: candidate .* is not \(impl, block_b"):
            tune_circuit(c, c.params, x, candidates=cand, tuner=t)
    with pytest.raises(TypeError, match="candidates must be a sequence"):
        tune_circuit(c, c.params, x, candidates="pallas", tuner=t)
    with pytest.raises(TypeError, match="tune_circuit: tuner must be a jaxpc.autotune.Autotuner or None, got str"):
        tune_circuit(c, c.params, x, tuner="fast")
    with pytest.raises(TypeError, match="tune_circuit: circuit must be a jaxpc.Circuit, got dict"):
        tune_circuit(c.params, c.params, x, tuner=t)
    with pytest.raises(ValueError, match="params does not have the structure of this circuit's params"):
        tune_circuit(c, {"sum": {}, "input": {}}, x, tuner=t)
    with pytest.raises(ValueError, match="precision must be one of"):
        tune_circuit(c, c.params, x, precision="fp16", tuner=t)


@pytest.mark.slow
@pytest.mark.full  # (in CI: test_tune_circuit_starts_from_the_auto_choice)
def test_tune_circuit_is_deterministic_and_exact(monkeypatch):
    """Under the same timings two tunings give equal options (the second from the cache, untimed), valid options
    (the key of one executable), whose log-likelihoods and flows are the default options' to rounding."""
    c, x = _small_hclt()
    cand = ("pallas_forward", 16, 16, 4)

    def timer():
        return ScriptedTimer(lambda r: 0.4 if r == cand else 1.0, lambda o: 0.5 if o.kernels else 1.0)

    first = _tune(c, x, timer(), monkeypatch, [cand])
    again = _tune(c, x, timer(), monkeypatch, [cand])
    assert first == again and hash(first) == hash(again) and first.kernels
    assert first == jaxpc.Options(**{f: getattr(first, f) for f in ("kernels", "precision", "fold_products")})
    seen = ScriptedTimer(lambda r: 1.0, lambda o: 1.0)
    tuner = Autotuner(timer=seen, env_key="fake", full_reps=2)  # the process cache answers: nothing timed
    assert tune_circuit(c, c.params, x, candidates=[cand], tuner=tuner) == first and not seen.seen
    ref = jaxpc.Options()
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x, options=first)),
                               np.asarray(c.log_prob(c.params, x, options=ref)), rtol=1e-5, atol=1e-6)
    f1, f2 = c.flows(c.params, x, options=first), c.flows(c.params, x, options=ref)
    for a, b in zip(jax.tree_util.tree_leaves(f1), jax.tree_util.tree_leaves(f2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_tuned_choices_are_keyed_by_the_resolved_precision(monkeypatch):
    """``precision="default"`` follows JAX's matmul setting (TF32 on a GPU, float32 under ``"highest"``): a choice
    timed under one was reused under the other, its key holding ``"default"`` alone."""
    import jax

    from jaxpc import options

    c, x = _small_hclt()
    keys = []
    monkeypatch.setattr(Autotuner, "tune", lambda self, key, h, cands, run: keys.append(key) or h)
    monkeypatch.setattr(options, "_platform", lambda: "gpu")  # "default" resolves to "tf32" outside "highest"
    with jax.default_matmul_precision(None):  # JAX's own default (the GPU's test processes set "highest")
        assert tune_circuit(c, c.params, x) == jaxpc.Options()
    with jax.default_matmul_precision("highest"):
        assert tune_circuit(c, c.params, x) == jaxpc.Options()
    tf32, fp32 = keys[:len(keys) // 2], keys[len(keys) // 2:]
    assert tf32 and {k[2] for k in tf32} == {"tf32"} and {k[2] for k in fp32} == {"fp32"}
    assert [k[:2] + k[3:] for k in tf32] == [k[:2] + k[3:] for k in fp32]
