"""Autotuning outside jit.

:class:`Autotuner` picks one configuration among candidates for a *shape key*:

1. The heuristic configuration is the reference; every candidate (the heuristic included) runs once
   untimed (compilation, warm-up; ``workers`` candidates at a time in threads, so their compilations
   overlap) and then once timed, one after the other.
2. Candidates slower than ``drop_factor`` (2x) times the fastest first timing are dropped; the
   survivors and the heuristic get ``full_reps`` timed runs (median).
3. A candidate replaces the heuristic only when it is at least ``margin`` (10%) faster.

Results are cached in the process and, with ``cache_path``, in a JSON file, keyed by the
environment (GPU name, driver / platform version, jax and jaxlib versions), the shape key and the
configurations (the heuristic and the candidates, by their ``repr``).

:func:`tune_circuit` applies it to every sum partition of a compiled circuit (``impl="auto"``'s choice
against the XLA path and the Pallas kernels in a few configurations), then to the whole step (the default
options against the tuned ones), and returns :class:`~jaxpc.Options` whose ``kernels`` field routes each
partition to its winner; the choice is part of the executable key.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import statistics
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["Autotuner", "environment_key", "tune_circuit", "DEFAULT_CANDIDATES"]


def environment_key() -> str:
    """``device kind | platform version | jax | jaxlib`` of the default device."""
    dev = jax.devices()[0]
    try:
        platform_version = dev.client.platform_version
    except Exception:  # noqa: BLE001 - not every client reports it
        platform_version = dev.platform
    import jaxlib

    return f"{dev.device_kind}|{platform_version}|jax {jax.__version__}|jaxlib {jaxlib.__version__}"


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and not math.isnan(v)


def _wall_timer(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t


class Autotuner:
    """See the module docstring.

    Args:
        timer: ``timer(fn) -> seconds`` times one call of ``fn`` (injectable; default: wall-clock time of the call
            until its outputs are ready); not callable: a ``TypeError``.
        cache_path: optional JSON file (``~`` expanded) that keeps the choices across processes; default None: the
            process cache only.
        env_key: the environment part of every cache key (default None: :func:`environment_key`, the device kind,
            platform version and jax / jaxlib versions); a choice is reused only under the same ``env_key``, for the
            same shape key and configurations.
        margin: how much faster (a fraction) a candidate must be to replace the heuristic; a float in [0, 1)
            (default 0.10), else a ``ValueError``.
        drop_factor: candidates slower than ``drop_factor`` times the fastest first timing are dropped; a float
            >= 1 (default 2), else a ``ValueError``.
        full_reps: timed runs of each surviving candidate (median); an int >= 1 (default 10), else a
            ``ValueError``.
        workers: candidates warmed up (compiled) at a time in threads; a positive int (default None:
            ``min(8, os.cpu_count())``), else a ``ValueError``.
    """

    _process_cache: dict = {}
    _lock = threading.Lock()

    def __init__(self, timer: Callable[[Callable[[], Any]], float] | None = None, cache_path: str | None = None,
                 env_key: str | None = None, margin: float = 0.10, drop_factor: float = 2.0, full_reps: int = 10,
                 workers: int | None = None):
        if not _is_real(margin) or not 0 <= margin < 1:
            raise ValueError(f"margin must be a float in [0, 1), got {margin!r}")
        if not _is_real(drop_factor) or not drop_factor >= 1:
            raise ValueError(f"drop_factor must be a float >= 1, got {drop_factor!r}")
        if isinstance(full_reps, bool) or not isinstance(full_reps, numbers.Integral) or full_reps < 1:
            raise ValueError(f"full_reps must be an int >= 1, got {full_reps!r}")
        if timer is not None and not callable(timer):
            raise TypeError(f"timer must be a function timer(fn) -> seconds, got {type(timer).__name__}")
        workers = min(8, os.cpu_count() or 1) if workers is None else workers
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        self.workers = workers
        self.timer = timer or _wall_timer
        self.cache_path = None if cache_path is None else Path(os.path.expanduser(cache_path))
        self.env_key = env_key if env_key is not None else environment_key()
        self.margin, self.drop_factor, self.full_reps = float(margin), float(drop_factor), int(full_reps)
        self.last_timings: dict = {}

    # ---- caches -------------------------------------------------------------------------------
    def _key(self, shape_key: Hashable, configs: Sequence) -> str:
        """The cache key of a choice among ``configs`` (by their ``repr``): a choice is an index into them, reused
        only for the same configurations in the same order."""
        digest = hashlib.sha256(repr(tuple(configs)).encode()).hexdigest()[:16]
        return f"{self.env_key}||{shape_key!r}||{digest}"

    def _disk(self) -> dict:
        """The disk cache's choices; an unreadable or damaged file holds none."""
        if self.cache_path is None or not self.cache_path.is_file():
            return {}
        try:
            data = json.loads(self.cache_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return {}
        return data if isinstance(data, dict) else {}

    def _store(self, key: str, index: int) -> None:
        with self._lock:
            Autotuner._process_cache[key] = index
            if self.cache_path is not None:
                data = self._disk()
                data[key] = index
                self.cache_path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.cache_path.with_suffix(".tmp")
                tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
                tmp.replace(self.cache_path)

    def lookup(self, shape_key: Hashable, configs: Sequence) -> Any | None:
        """The configuration chosen earlier for ``shape_key`` among ``configs`` (the heuristic first, then the
        candidates, as :meth:`tune` lists them), from the process cache or the disk cache; None where there is
        none."""
        key = self._key(shape_key, configs)
        with self._lock:
            idx = Autotuner._process_cache.get(key)
        if idx is None:
            idx = self._disk().get(key)
            if not (isinstance(idx, int) and not isinstance(idx, bool) and 0 <= idx < len(configs)):
                return None
            with self._lock:
                Autotuner._process_cache[key] = idx
        return configs[idx]

    # ---- tuning -------------------------------------------------------------------------------
    def tune(self, shape_key: Hashable, heuristic: Any, candidates: Sequence, run: Callable[[Any], Callable[[], Any]]):
        """The chosen configuration for ``shape_key``. ``run(config)`` returns a zero-argument callable
        executing the operation once with that configuration."""
        configs = [heuristic]
        for c in candidates:
            if c not in configs:
                configs.append(c)
        cached = self.lookup(shape_key, configs)
        if cached is not None:
            return cached

        def warm(cfg):  # untimed: compile and warm up
            fn = run(cfg)
            jax.block_until_ready(fn())
            return fn

        with ThreadPoolExecutor(max_workers=min(self.workers, len(configs))) as pool:
            pending = [pool.submit(warm, cfg) for cfg in configs]
        fns, first = {}, {}
        for i, fut in enumerate(pending):
            try:
                fns[i] = fut.result()
                first[i] = self.timer(fns[i])
            except Exception:  # noqa: BLE001 - a candidate that fails to build or run is not a candidate
                if i == 0:
                    raise
        best = min(first.values())
        survivors = [i for i in first if i == 0 or first[i] <= self.drop_factor * best]
        full = {i: statistics.median(self.timer(fns[i]) for _ in range(self.full_reps)) for i in survivors}
        self.last_timings = {"first": first, "full": full}
        winner = 0
        challenger = min((i for i in full if i != 0), key=lambda i: full[i], default=None)
        if challenger is not None and full[challenger] <= (1.0 - self.margin) * full[0]:
            winner = challenger
        self._store(self._key(shape_key, configs), winner)
        return configs[winner]


# ---- circuits -----------------------------------------------------------------------------------

DEFAULT_CANDIDATES = tuple((impl, *cfg) for impl in ("pallas", "pallas_forward")
                           for cfg in ((16, 32, 4), (32, 64, 4), (64, 64, 8)))


def tune_circuit(circuit, params, x, *, precision: str = "default", candidates: Sequence | None = None,
                 tuner: Autotuner | None = None, fold_products: bool = True):
    """Options whose ``kernels`` route each sum partition of ``circuit`` (at the batch bucket of ``x``) to
    the fastest of ``impl="auto"``'s choice for it (the heuristic), the XLA reference and the kernel
    configurations ``candidates`` (tuples ``(impl, block_b, block_k, num_warps)``; ``impl`` ``"pallas"``:
    Pallas forward and backward, ``"pallas_forward"``: Pallas forward, XLA backward), timing forward +
    backward of the partition alone. The partitions are those of the plan the returned options run: the
    folded plan (``fold_products``, the default, for a circuit that has one) or the full layout.

    A partition timed alone is not the partition inside the whole step (on the H200, PD-128's partitions alone
    favoured XLA where the whole step is faster with the Pallas forward: tuned 13.6 against 12.6 ms), so the
    routes are then checked the same way on the whole forward + flows step: the tuned options are returned
    only when that step is ``tuner.margin`` faster than with the default options, which are returned
    otherwise (``Options(precision=precision, fold_products=fold_products)``). Both decisions are cached.
    ``precision``: the returned options' (default ``"default"``, the calls' own default: tuning changes routes,
    never the arithmetic). ``params``: the parameters the timed calls run on (a params pytree of ``circuit``,
    else a ``ValueError``); ``x``: a batch ``[B, V]`` (checked as :meth:`jaxpc.Circuit.log_prob` checks it),
    repeated to its bucket; ``tuner``: the :class:`Autotuner` (default None: a new one with its defaults).
    A ``circuit`` that is no :class:`jaxpc.Circuit` or a ``tuner`` that is no :class:`Autotuner` is a
    ``TypeError``, a malformed candidate a ``ValueError``, raised before anything is timed."""
    from . import checks
    from .circuit import Circuit
    from .options import Options

    if not isinstance(circuit, Circuit):
        raise TypeError(f"tune_circuit: circuit must be a jaxpc.Circuit, got {type(circuit).__name__}")
    if tuner is not None and not isinstance(tuner, Autotuner):
        raise TypeError(f"tune_circuit: tuner must be a jaxpc.autotune.Autotuner or None, got {type(tuner).__name__}")
    default = Options(precision=precision, fold_products=fold_products)  # (checks both)
    tuner = tuner or Autotuner()
    cands = DEFAULT_CANDIDATES if candidates is None else _checked_candidates(candidates)
    checks.check_params(circuit.runtime.params_spec, params)
    batch = circuit.runtime.prepare(x, None, True)
    xj = batch.x
    B = circuit.runtime.bucket(batch.n)
    xb = jnp.concatenate([xj] * (-(-B // xj.shape[0])))[:B]
    from .engine import routing

    fold = routing.buffer_plan(circuit.layout, default, B) is not circuit.layout
    choices, heuristics = _tune_partitions(circuit, params, xb, fold=fold, precision=precision, candidates=cands,
                                           tuner=tuner)
    kernels = tuple(sorted((sig, ch) for sig, ch in choices.items() if ch != heuristics[sig]))
    if not kernels:
        return default
    tuned = default.replace(kernels=kernels)

    def whole(opts):
        return lambda: circuit.flows(params, xb, options=opts, validate=False)

    # (the keys hold the precision the calls resolve to: "default" follows JAX's matmul setting)
    return tuner.tune(("plan", default.concrete_precision, fold, B, tuple(sorted(heuristics.items())), kernels),
                      default, [tuned], whole)


def _checked_candidates(candidates) -> tuple:
    """``tune_circuit``'s ``candidates`` as a tuple of routes ``(impl, block_b, block_k, num_warps)``, ``impl``
    ``"pallas"`` or ``"pallas_forward"`` and positive ints (or ``("xla",)``); else a ``ValueError`` naming the
    first bad one, before anything is timed."""
    if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Sequence):
        raise TypeError(f"tune_circuit: candidates must be a sequence of (impl, block_b, block_k, num_warps) "
                        f"tuples, got {type(candidates).__name__}")
    out = []
    for c in candidates:
        ok = isinstance(c, tuple) and (c == ("xla",) or (
            len(c) == 4 and isinstance(c[0], str) and c[0] in ("pallas", "pallas_forward")
            and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0 for v in c[1:])))
        if not ok:
            raise ValueError(f"tune_circuit: candidate {c!r} is not (impl, block_b, block_k, num_warps) with impl "
                             f"'pallas' or 'pallas_forward' and positive ints, nor ('xla',)")
        out.append(c[:1] + tuple(int(v) for v in c[1:]))
    return tuple(out)


def _sum_partitions(plan, tables):
    """Every sum partition of ``plan``'s steps in order: ``(part, tables, scanned)``; a scanned step's tables
    keep their leading scan axis."""
    from .compiler.layout import ScanSpec

    for step, tab in zip(plan.steps, tables["steps"]):
        scanned = isinstance(step, ScanSpec)
        for spec, t in (list(zip(step.period, tab)) if scanned else [(step, tab)]):
            for part, pt in zip(spec.sums, t["sums"]):
                yield part, pt, scanned


def _tune_partitions(circuit, params, xb, *, fold: bool, precision: str, candidates: tuple, tuner: Autotuner):
    """``(choices, heuristics)``: per partition signature (:func:`jaxpc.engine.routing.partition_key` at the batch
    of ``xb``) the tuned route and ``impl="auto"``'s route, each distinct partition of the plan (folded with
    ``fold``) timed alone on the buffer of an XLA forward of ``xb``."""
    from .engine import forward, routing, stages
    from .options import Options

    B = xb.shape[0]
    plan = circuit.layout.fold if fold else circuit.layout
    tables = circuit.tables["fold"] if fold else circuit.tables
    ref = Options(precision=precision, fold_products=fold, impl="xla")

    @jax.jit  # one executable, not one per operation
    def buffer(all_tables, plan_tables, params, xb):
        vals = forward.input_values(circuit.layout, all_tables, params, xb, None, ref)
        return stages.forward_buffer(plan, plan_tables, params["sum"], vals, ref)

    values = buffer(circuit.tables, tables, params, xb)
    flows = jnp.ones_like(values)
    choices: dict = {}
    heuristics: dict = {}
    for part, pt, scanned in _sum_partitions(plan, tables):
        sig = routing.partition_key(part, B)
        if sig in choices:
            continue
        pt = jax.tree_util.tree_map(lambda a: a[0] if scanned else a, pt)
        run = _partition_runner(part, pt, params["sum"][part.group], values, flows, precision=precision,
                                first_row=2 * plan.kmax)
        heuristic = _auto_choice(routing.auto_impl(part, values.dtype, B))
        heuristics[sig] = heuristic
        choices[sig] = tuner.tune(("sum", sig, ref.concrete_precision, heuristic), heuristic,
                                  (("xla",),) + candidates, run)
    return choices, heuristics


def _partition_runner(part, pt, logw, values, flows, *, precision: str, first_row: int):
    """``run(route)`` for :meth:`Autotuner.tune`: a zero-argument callable running the forward and backward of
    sum partition ``part`` (tables ``pt``, parameters ``logw``) on ``values`` and ``flows`` under ``route``
    (``("xla",)`` or ``(impl, block_b, block_k, num_warps)``)."""
    from .engine import flows as flow_pass
    from .ops import pallas_sum
    from .ops.sum_layer import sum_layer, sum_layer_backward_reference

    off = 0  # the parents' first row: timed alone, any rows of the buffer serve
    kw = dict(Kp=part.Kp, Kc=part.Kc, precision=precision)

    def run(cfg):
        kc = None if cfg == ("xla",) else pallas_sum.KernelConfig(*cfg[1:])

        def op(v, f):
            if kc is None:
                out = sum_layer(v, pt["ch"], pt["pid"], logw, dense=part.dense, **kw)
            else:
                out = pallas_sum.forward(v, pt["ch"], pt["pid"], logw, config=kc, **kw)
            if cfg[0] == "pallas":
                return (out, *flow_pass.pallas_sum_backward(v, f, off, pt, logw, part, alpha=1.0, config=kc,
                                                            precision=precision, first_row=first_row))
            cf, pf = sum_layer_backward_reference(v, f, pt["ch"], pt["pid"], logw, off, dense=part.dense, **kw)
            return out, flow_pass.scatter_child_flows(f, cf, pt["ch"], part, first_row), pf

        f = jax.jit(op)
        return lambda: f(values, flows)

    return run


def _auto_choice(impl: str) -> tuple:
    """A route of ``Options.kernels`` equal to what ``impl="auto"`` runs for a partition routed to ``impl``."""
    if impl == "xla":
        return ("xla",)
    from .ops.pallas_sum import KernelConfig

    cfg = KernelConfig()
    return (impl, cfg.block_b, cfg.block_k, cfg.num_warps)
