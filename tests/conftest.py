"""Test configuration. The suite checks correctness, not speed: compile XLA's CPU code at a low
optimization level (about 2x faster compiles), expose fake CPU devices for shard_map tests, keep jaxpc's executable
store off (it skips the tracing that tests watch; tests of the store turn it on) but share JAX's compilation cache
among the run's workers, and run raw Triton kernels in Triton's interpreter.

The suite is written for the CPU and runs on a GPU as it is. Each process that runs tests (not pytest-xdist's
controller, which runs none and would hold GPU memory for nothing) looks at JAX's backend once, at configure time,
after the environment above is set (``on_gpu``). On a GPU it then:

- sets JAX's default matmul precision to ``"highest"`` (``jax.config.update("jax_default_matmul_precision",
  "highest")``, and ``JAX_DEFAULT_MATMUL_PRECISION`` for the processes that tests start; not where that variable
  is set): ``precision="default"`` resolves to exact float32 there as on the CPU, so that the checks against exact
  oracles hold at the CPU's tolerances. Calls that ask for ``precision="tf32"`` still get TF32 (an explicit
  precision is not JAX's default); the tests that make them hold them to TF32's rounding where it is real
  (``tf32_unit``). ``tests/test_checks.py`` checks JAX's own default (TF32 on a GPU) inside
  ``jax.default_matmul_precision(None)``;
- sets ``TRITON_INTERPRET=0`` (not where it is set; ``1`` elsewhere): the raw Triton kernels of ``impl="triton"``
  compile for the GPU through jax-triton, and the tests that run them in Triton's interpreter skip.

Tests of behaviour that is the CPU's by design pin it by monkeypatching the library's own switch rather than skip
on a GPU: NaN-filled unset buffers (``jaxpc.ops.buffers._on_gpu``), Pallas' interpret mode
(``jaxpc.ops.pallas_sum.interpret_mode``), the routes ``impl="auto"`` takes off a GPU (``routing.on_gpu``),
jax-triton's absence (``sys.modules["jax_triton"] = None``), and one compile per executable key (the
``single_compile`` fixture: on a GPU a key's first call runs a quick compile and an optimized one replaces it in the
background, an ulp apart)."""

import functools
import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=4"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAXPC_PERSISTENT_CACHE", "0")
if "PYTEST_XDIST_WORKER" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # JAX's compilation cache (not jaxpc's executable store, which skips the tracing that tests watch), fresh for
    # each run and shared by its workers: tests that build the same circuits compile each executable once
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="jaxpc-tests-xla-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import pytest  # noqa: E402


@functools.cache
def on_gpu() -> bool:
    """Whether JAX runs on a GPU (its backend is initialized here, with the environment above already set)."""
    import jax

    return jax.default_backend() == "gpu"


TF32_UNIT = 2.0**-10  # a TF32 operand keeps 10 of float32's 23 mantissa bits; the tensor cores may truncate the rest


def tf32_unit() -> float:
    """The largest relative error of one operand of a ``precision="tf32"`` product: ``TF32_UNIT`` on a GPU, where
    TF32 is real (XLA's products and the Pallas and Triton kernels' alike, compiled or in interpret mode), 0 on the
    CPU, where those products are exact float32."""
    return TF32_UNIT if on_gpu() else 0.0


RUN_TO_RUN_ULPS = 16  # the spread of two runs of one executable on a GPU, in units of the dtype's epsilon


def assert_same_result(a, b) -> None:
    """Two calls that run one computation give the same pytree: bit for bit on the CPU; on a GPU, integer leaves
    bit for bit and floating ones within ``RUN_TO_RUN_ULPS`` epsilons of the larger magnitude, since the flows'
    atomic adds (the Pallas backward kernels', XLA's scatters) add in an order that changes from run to run."""
    import jax
    import numpy as np

    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb), (len(la), len(lb))
    for u, v in zip(la, lb):
        u, v = np.asarray(u), np.asarray(v)
        if not on_gpu() or not np.issubdtype(v.dtype, np.floating) or v.size == 0:
            np.testing.assert_array_equal(u, v)
            continue
        tol = RUN_TO_RUN_ULPS * float(np.finfo(v.dtype).eps)
        scale = max(1.0, float(np.nanmax(np.abs(np.where(np.isinf(v), 0, v)), initial=0.0)))
        np.testing.assert_allclose(u, v, rtol=tol, atol=tol * scale)


def _runs_tests(config) -> bool:
    """Whether this process collects and runs tests: a pytest-xdist worker, or a run without workers (pytest-xdist's
    controller hands the tests to its workers, which set themselves up; with ``--collect-only`` it collects)."""
    if hasattr(config, "workerinput"):
        return True
    distributing = getattr(config.option, "dist", "no") != "no" and bool(getattr(config.option, "tx", None))
    return not distributing or bool(config.getoption("collectonly"))


def pytest_configure(config):
    if not _runs_tests(config):
        return
    # the raw Triton kernels run in Triton's interpreter, except on a GPU (set before a test module imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "0" if on_gpu() else "1")
    if on_gpu() and "JAX_DEFAULT_MATMUL_PRECISION" not in os.environ:
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")  # "default": exact float32, as on the CPU
        os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"  # (and in the processes that tests start)


@pytest.fixture
def single_compile(monkeypatch):
    """Each executable key compiled once, as off a GPU (a no-op on the CPU). On a GPU a key's first call runs a
    quick compile and a background thread swaps in an optimized one (``jaxpc.executables.quick_options``), whose
    results may differ from the quick one's by an ulp, at a moment of its own: tests that compare calls bit for bit
    or count a key's executables pin the one path (the quick path's own tests turn it on)."""
    from jaxpc import executables

    monkeypatch.setattr(executables, "_on_gpu", lambda: False)


@pytest.fixture
def pallas_forward_calls(monkeypatch):
    """``impl="auto"`` as on a GPU (the Pallas kernels run in interpret mode): the ``out_offset`` of every Pallas
    forward kernel traced while the test runs, appended to the returned list."""
    from jaxpc.engine import routing
    from jaxpc.ops import pallas_sum

    calls = []
    kernel = pallas_sum.forward
    monkeypatch.setattr(pallas_sum, "forward", lambda *a, **k: calls.append(k["out_offset"]) or kernel(*a, **k))
    monkeypatch.setattr(routing, "on_gpu", lambda: True)
    return calls


# Tiers. A plain ``pytest`` runs the fast tier: every test not marked ``slow``. ``pytest --slow`` adds the slow tier:
# of each test function not marked ``full``, the cases the fast tier runs, or, where it runs none, the first case;
# this is what CI runs (.ci/run). ``pytest --full`` (alias ``--all``) runs every case of every test: the cases past
# the first of the slow tier's parametrizations, and the tests marked ``full``, form the full tier (``-m full``
# alone). A parametrization marked ``every_case`` keeps all its cases in the slow tier (the notebooks). ``-m slow``
# runs the slow tier's tests including the full tier's cases (``-m "slow and not full"``: the slow tier alone). Slow
# tests are deselected here rather than by ``-m "not slow"`` in addopts, which a command-line ``-m`` would not
# combine with: any ``-m`` expression that names ``slow`` or ``full`` takes over the selection.


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", dest="run_slow",
                     help="run the slow tier too (what CI runs: one case of each test function not marked full)")
    parser.addoption("--full", "--all", action="store_true", dest="run_full",
                     help="run every test and every case (the fast, slow and full tiers)")


# The longest tests (the notebooks, each in a kernel of its own) run first: with two workers, one of them left
# for the end would keep a worker busy while the other has nothing left to run.
FIRST = ("tests/test_notebooks.py::test_notebook_runs",)


def _mark_full(items) -> None:
    """Mark ``full`` the slow cases of a test function that the fast tier runs a case of, and those past its first
    slow case where it runs none (not those of an ``every_case`` parametrization)."""
    fast = {item.nodeid.split("[")[0] for item in items if item.get_closest_marker("slow") is None}
    seen = set()
    for item in items:
        if item.get_closest_marker("slow") is None or item.get_closest_marker("every_case") is not None:
            continue
        function = item.nodeid.split("[")[0]
        if "[" in item.nodeid and (function in fast or function in seen):
            item.add_marker(pytest.mark.full)
        seen.add(function)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    _mark_full(items)
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))  # (stable: the rest keep their order)
    expr = config.getoption("markexpr") or ""
    if config.getoption("run_full") or "slow" in expr or "full" in expr:
        return
    tiers = ("full",) if config.getoption("run_slow") else ("slow", "full")
    dropped = [item for item in items if any(item.get_closest_marker(t) for t in tiers)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = set(map(id, dropped))
        items[:] = [item for item in items if id(item) not in gone]
