"""Test configuration. The suite checks correctness, not speed: compile XLA's CPU code at a low
optimization level (about 2x faster compiles), expose fake CPU devices for shard_map tests, keep jaxpc's executable
store off (it skips the tracing that tests watch; tests of the store turn it on) but share JAX's compilation cache
among the run's workers, and run raw Triton kernels in Triton's interpreter."""

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
os.environ.setdefault("TRITON_INTERPRET", "1")  # the raw Triton kernels run in Triton's interpreter (no GPU here)

import pytest  # noqa: E402


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
# of each test function, the cases the fast tier runs, or, where it runs none, the first case; this is what CI runs
# (.ci/run). ``pytest --full`` (alias ``--all``) runs every case of every test: the cases past the first of the slow
# tier's parametrizations, and the tests marked ``full``, form the full tier (``-m full`` alone). A parametrization
# marked ``every_case`` keeps all its cases in the slow tier (the notebooks). ``-m slow`` runs the slow tier's tests
# including the full tier's cases (``-m "slow and not full"``: the slow tier alone). Slow tests are deselected here
# rather than by ``-m "not slow"`` in addopts, which a command-line ``-m`` would not combine with: any ``-m``
# expression that names ``slow`` or ``full`` takes over the selection.


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", dest="run_slow",
                     help="run the slow tier too (what CI runs: every test function, one case of each)")
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
