"""Input checks.

Shapes and dtypes are checked in Python on every call (also for tracers, inside a user's ``jit``).
Values are checked where they live: numpy data on the host before anything runs, device arrays
inside the executable that does the work (:class:`DeviceCheck`), which replaces every bad entry by
an admissible value, reports its rows as bad (NaN log-likelihoods, zero weight in flows and EM) and
returns a flag that :mod:`jaxpc.runtime` reads without stalling the device.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .distributions import Distribution


def _check_one_range(v: int, dists: list[Distribution]) -> None:
    """Refuse a variable whose leaves take different values: discrete leaves of different ranges (queries would
    decode, sample and check only the values they share), or discrete and real leaves together (masses mixed with
    densities). Leaves of unbounded integer values (such as :class:`~jaxpc.distributions.External`, which reads no
    value) take those of the others."""
    kinds = {}
    for d in dists:
        r = d.value_range()
        if r is None or r[1] is not None:
            kinds.setdefault(r, d)
    ranges = set(kinds)
    if len(ranges) < 2:
        return
    said = "; ".join(f"{d!r} takes {d.describe_values()}" for d in kinds.values())
    fix = ("give them one range (a categorical leaf may put zero mass on values it does not take)"
           if None not in ranges else "a variable is either discrete or real")
    raise ValueError(f"variable {v} is read by leaves that take different values: {said}; {fix}")


@dataclasses.dataclass(frozen=True)
class VarInfo:
    num_vars: int
    discrete: np.ndarray  # bool[V]: some leaf treats the variable as discrete
    continuous: np.ndarray  # bool[V]
    lo: np.ndarray  # int64[V] smallest admissible discrete value
    hi: np.ndarray  # float64[V] exclusive upper bound (inf when unbounded)
    names: tuple[str, ...]  # description of the leaves of each variable
    card: np.ndarray  # int64[V]: number of values of a discrete variable (0 for reals)

    @classmethod
    def from_var_dists(cls, num_vars: int, var_dists: dict[int, list[Distribution]]) -> VarInfo:
        discrete = np.zeros(num_vars, bool)
        continuous = np.zeros(num_vars, bool)
        lo = np.zeros(num_vars, np.int64)
        hi = np.full(num_vars, np.inf)
        names = [""] * num_vars
        card = np.zeros(num_vars, np.int64)
        for v, dists in var_dists.items():
            names[v] = ", ".join(repr(d) for d in dists)
            _check_one_range(v, dists)
            counts = [d.num_values() for d in dists if d.num_values() is not None]
            if counts:
                bounded = [d.value_range()[1] for d in dists if d.value_range() and d.value_range()[1] is not None]
                card[v] = min(bounded) if bounded else max(counts)
            for d in dists:
                r = d.value_range()
                if r is None:
                    continuous[v] = True
                else:
                    discrete[v] = True
                    lo[v] = max(lo[v], r[0])
                    if r[1] is not None:
                        hi[v] = min(hi[v], r[1])
        return cls(num_vars, discrete, continuous, lo, hi, tuple(names), card)

    @functools.cached_property
    def all_discrete(self) -> bool:  # (cached: read on every call, in a small step's host time)
        return not self.continuous.any()

    @functools.cached_property
    def _int_limits(self) -> dict:
        return {}

    @functools.cached_property
    def _unsigned_tops(self) -> dict:
        return {}

    def int_limits(self, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray] | None:
        """``[V]`` inclusive bounds of each variable's admissible values in integer ``dtype`` (the type's whole range
        for a variable that no leaf reads), made once per dtype; None where a variable admits no value of the
        type."""
        if dtype not in self._int_limits:
            t, low, top = np.iinfo(dtype), [], []  # Python integers: exact for every integer type
            for d, lo, hi in zip(self.discrete.tolist(), self.lo.tolist(), self.hi.tolist()):
                low.append(max(lo, t.min) if d else t.min)
                top.append(min(int(hi) - 1, t.max) if d and not math.isinf(hi) else t.max)
                if d and (lo > t.max or top[-1] < low[-1]):
                    self._int_limits[dtype] = None
                    break
            else:
                self._int_limits[dtype] = np.array(low, dtype), np.array(top, dtype)
        return self._int_limits[dtype]

    def unsigned_tops(self, dtype: np.dtype) -> np.ndarray | int | None:
        """Where every variable's smallest admissible value is 0 in integer ``dtype``: the largest ones as the unsigned
        type of ``dtype``'s width (one number when they are all equal), so that a batch viewed as that type is
        in range exactly where its maximum is at most them (a negative value views as one above every top).
        None otherwise."""
        if dtype not in self._unsigned_tops:
            limits = self.int_limits(dtype)
            tops = None
            if limits is not None and not limits[0].any():
                tops = limits[1].astype(np.dtype(f"u{dtype.itemsize}"))
                if tops.size and (tops == tops[0]).all():
                    tops = int(tops[0])
            self._unsigned_tops[dtype] = tops
        return self._unsigned_tops[dtype]

    def describe(self, v: int) -> str:
        if self.discrete[v]:
            upper = "" if np.isinf(self.hi[v]) else f", {int(self.hi[v]) - 1}]"
            rng = f"integers in [{self.lo[v]}{upper}" if upper else f"integers >= {self.lo[v]}"
        else:
            rng = "finite real values"
        return f"variable {v} ({self.names[v]}) accepts {rng}"


@dataclasses.dataclass(frozen=True)
class ParamsSpec:
    """The parameter pytree a circuit takes: its structure, each leaf's shape and the circuit's float dtype."""

    tree: jax.tree_util.PyTreeDef
    paths: tuple[str, ...]  # each leaf's path, as ``['sum']['4x4']``
    shapes: tuple[tuple[int, ...], ...]
    dtype: np.dtype | None = None  # None: any floating dtype

    @classmethod
    def of(cls, params, dtype=None) -> ParamsSpec:
        leaves, tree = jax.tree_util.tree_flatten_with_path(params)
        return cls(tree, tuple(jax.tree_util.keystr(k) for k, _ in leaves), tuple(np.shape(v) for _, v in leaves),
                   None if dtype is None else np.dtype(dtype))


def _first(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (" ..." if len(names) > n else "")


def check_params(spec: ParamsSpec, params, what: str = "params") -> None:
    """Check that ``params`` has ``spec``'s pytree structure, shapes and dtype (the circuit's, as JAX would store
    it: float64 numpy leaves pass where 64-bit JAX is off): a ``ValueError`` naming the leaves that are missing,
    unexpected or of another shape (``params`` of another circuit), a ``TypeError`` naming a leaf of another dtype.
    Nothing else names them: a missing group surfaces as a ``KeyError`` deep in the trace, integer parameters as
    wrong numbers, float16 ones as float16 outputs and an EM step that returns float32."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    paths = [jax.tree_util.keystr(k) for k, _ in leaves]
    if tree != spec.tree:
        have, want = set(paths), set(spec.paths)
        missing = [what + p for p in spec.paths if p not in have]
        extra = [what + p for p in paths if p not in want]
        detail = "; ".join(([f"missing {_first(missing)}"] if missing else [])
                           + ([f"unexpected {_first(extra)}"] if extra else [])) or f"got {type(params).__name__}"
        hint = ("pass circuit.params, circuit.init_params(key) or what an update of them returned"
                if what == "params" else "pass what this circuit's calls returned")
        raise ValueError(f"{what} does not have the structure of this circuit's params ({detail}): {hint}")
    for path, want, (_, v) in zip(paths, spec.shapes, leaves):
        shape = tuple(np.shape(v))
        if shape != want:
            raise ValueError(f"{what}{path} has shape {shape}, this circuit's has {want} (another circuit's params?)")
        dt = np.dtype(v.dtype) if hasattr(v, "dtype") else np.asarray(v).dtype
        if not jnp.issubdtype(dt, jnp.floating):
            raise TypeError(f"{what}{path} has dtype {dt}; parameters are floating point")
        if spec.dtype is not None and jax.dtypes.canonicalize_dtype(dt) != spec.dtype:
            raise TypeError(f"{what}{path} has dtype {dt}, but this circuit computes in {spec.dtype} "
                            f"(jaxpc.compile(root, dtype=...) sets it): cast them, e.g. "
                            f"jax.tree.map(lambda a: a.astype('{spec.dtype}'), {what.split('[')[0]})")


def any_bad_params(params):
    """Whether some entry of ``params`` is NaN or +inf (a boolean scalar; traceable)."""
    flags = [jnp.any(jnp.isnan(v) | (v == jnp.inf)) for v in jax.tree_util.tree_leaves(params)]
    return jnp.any(jnp.stack(flags)) if flags else jnp.asarray(False)


def bad_params_entry(params, what: str = "params") -> str | None:
    """The first NaN or +inf entry of ``params`` (read on the host), named with its leaf and index, how many more its
    leaf holds and how many leaves hold any; None where there is none."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    bad = []
    with jax.transfer_guard_device_to_host("allow"):  # (an error path: the parameters are read once)
        for path, v in leaves:
            a = np.asarray(v)
            m = np.isnan(a) | (a == np.inf)
            if m.any():
                bad.append((jax.tree_util.keystr(path), a, m))
    if not bad:
        return None
    path, a, m = bad[0]
    idx = tuple(int(i) for i in np.argwhere(m)[0])
    more = int(m.sum()) - 1
    detail = (f" and {more} more entr{'ies' if more > 1 else 'y'} of that leaf" if more else "") + (
        f"; {len(bad)} of {len(leaves)} leaves hold NaN or +inf" if len(bad) > 1 else "")
    return f"{what}{path}[{', '.join(map(str, idx))}] is {a[idx]}{detail}"


def raise_bad_params(params, what: str = "params", where: str = "") -> None:
    """Raise a ``ValueError`` naming the first NaN or +inf entry of ``params`` (:func:`bad_params_entry`); return
    where there is none. Parameters are log-weights and distribution parameters: finite, or -inf for a zero
    weight."""
    entry = bad_params_entry(params, what)
    if entry is not None:
        raise ValueError(f"{entry}{where}: parameters must be finite (a log-weight may be -inf, a zero weight); NaN "
                         "comes from a diverged optimizer step, an edit or a checkpoint")


def _is_tracer(a) -> bool:
    return isinstance(a, jax.core.Tracer)


def is_device_array(a) -> bool:
    """Whether ``a`` is a concrete device array (a ``jax.Array``, not numpy, not a tracer): its values are checked on
    the device, and its sharding places the call."""
    return isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)


def check_bool(where: str, name: str, value) -> bool:
    """``value`` as a Python bool where it is one (a NumPy bool too), else a ``TypeError`` naming ``where`` and
    ``name``: a switch given as a string (``"False"``), a number or None is not read by its truth value."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: {name} must be a bool, got {value!r}")
    return bool(value)


def check_key(key, who: str = "") -> None:
    """Raise a ``TypeError`` where ``key`` is not one PRNG key: a typed key of shape ``()`` or a raw ``uint32``
    key of shape ``[2]`` or ``[4]`` (tracers too: their shapes and dtypes are known); ``who`` prefixes the message
    (``"init_params: "``)."""
    want = f"{who}key must be a PRNG key such as jax.random.key(0)"
    if not isinstance(key, (jax.Array, np.ndarray)):
        raise TypeError(f"{want}, got {type(key).__name__}")
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise TypeError(f"{want}, got an array of keys of shape {tuple(key.shape)} (jax.vmap over them to draw "
                            "with each)")
    elif key.dtype != np.uint32 or key.shape not in ((2,), (4,)):
        raise TypeError(f"{want}, got an array of dtype {key.dtype} and shape {tuple(key.shape)}")


def check_batch(info: VarInfo, x, missing, *, check_values: bool, float_dtype, what: str = "x"):
    """Check ``x`` ``[B, V]`` and ``missing`` (``bool[V]`` or ``bool[B, V]``): shapes and dtypes always, values of
    host data with ``check_values``. Returns ``(x, missing, on_device)`` as jnp arrays; ``on_device``: ``x`` was a
    concrete device array, whose values only the executable's :class:`DeviceCheck` sees."""
    traced = _is_tracer(x)
    on_device = is_device_array(x)
    if not on_device and not traced and not isinstance(x, np.ndarray):
        try:
            x = np.asarray(x)
        except Exception as e:  # noqa: BLE001 - re-raised with context
            raise TypeError(f"{what} must be an array of shape [batch, {info.num_vars}], got {type(x).__name__}") from e
    shape = x.shape
    if len(shape) != 2:
        hint = f"; for one sample use {what}[None]" if len(shape) == 1 else ""
        raise ValueError(f"{what} must have shape [batch, num_vars] = [B, {info.num_vars}], got shape {shape}{hint}")
    if shape[1] != info.num_vars:
        raise ValueError(f"{what} has {shape[1]} variables (shape {shape}), but the circuit has {info.num_vars} "
                         f"(variable ids 0..{info.num_vars - 1})")
    if shape[0] == 0:
        raise ValueError(f"{what} has an empty batch (shape {shape})")
    dt = np.dtype(x.dtype)
    is_int = dt.kind in "iub"  # signed, unsigned, bool
    is_float = dt.kind == "f"
    if not (is_int or is_float):
        raise TypeError(f"{what} has dtype {dt}; expected integers (category ids) or floats")
    if info.all_discrete and not is_int:
        raise TypeError(f"{what} has dtype {dt}, but every variable of this circuit is discrete: pass integer "
                        f"category ids (e.g. {what}.astype(np.int32)) and mark unknown values with missing=")

    m = None
    if missing is not None:
        if not isinstance(missing, (np.ndarray, jax.Array)) and not _is_tracer(missing):
            missing = np.asarray(missing)
        mshape = tuple(missing.shape)
        if np.dtype(missing.dtype) != np.bool_:
            raise TypeError(f"missing must be a boolean mask, got dtype {missing.dtype}")
        if mshape not in ((info.num_vars,), shape):
            raise ValueError(f"missing must have shape [{info.num_vars}] or {list(shape)} (like {what}), "
                             f"got {mshape}")
        m = missing

    target = jnp.int32 if info.all_discrete else float_dtype
    if check_values and not on_device and not traced and not _is_tracer(m):
        check_host_values(info, x, m, what, target)  # host data: checked before anything runs

    # a device array of the right dtype is used as it is (jnp.asarray costs ~0.1 ms of host time per call)
    xj = x if (on_device or traced) and dt == target else jnp.asarray(x, dtype=target)
    mj = None if m is None else (m if isinstance(m, jax.Array) and m.dtype == jnp.bool_ else jnp.asarray(m, dtype=bool))
    return xj, mj, on_device


def bad_entries(xp, x, discrete: np.ndarray, lo: np.ndarray, hi: np.ndarray, limits=None):
    """``bool[B, V]``: the entries of ``x`` that no leaf of their variable admits (out of a discrete variable's
    range ``[lo, hi)``, fractional for a discrete variable, or not finite). ``xp``: numpy for host data, jax.numpy
    inside a trace; integer ``x`` is compared in its own type, so no value is rounded. ``limits``: :func:`bounds`
    of ``x``'s dtype, when the caller keeps them."""
    low, top = limits if limits is not None else bounds(np.dtype(x.dtype), lo, hi)
    if xp.issubdtype(x.dtype, xp.integer):
        return ((x < low) | (x > top)) & discrete
    frac = (x != xp.round(x)) & discrete
    oor = ((x < low) | (x >= top)) & discrete
    return ~xp.isfinite(x) | frac | oor


def bounds(dtype: np.dtype, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``lo`` and ``hi`` in ``dtype``: for integers the inclusive range ``[lo, hi - 1]`` clipped to the type's,
    for floats ``lo`` and the exclusive ``hi``."""
    if np.issubdtype(dtype, np.integer):
        dt = np.iinfo(dtype)
        low = np.clip(lo, dt.min, dt.max).astype(dtype)
        top = np.full(hi.shape, dt.max, dtype)
        bounded = ~np.isinf(hi) & (hi - 1 < dt.max)
        top[bounded] = (hi[bounded] - 1).astype(dtype)
        return low, top
    return lo.astype(dtype), hi.astype(dtype)


def check_host_values(info: VarInfo, x, m, what: str, target=None) -> None:
    """Raise a ``ValueError`` naming the first entry of host data ``x`` (observed where ``m`` is not True) that no
    leaf of its variable admits (:func:`bad_entries`), or that overflows the float ``target`` dtype that ``x`` is
    converted to (float64 data into a float32 circuit), with the number of such entries."""
    xh = np.asarray(x)
    integers = xh.dtype.kind in "iu" and info.all_discrete
    tops = info.unsigned_tops(xh.dtype) if integers and xh.size and xh.dtype.isnative else None
    if tops is not None:  # ids from 0: one comparison per entry, on the batch viewed as unsigned
        xu = xh.view(np.dtype(f"u{xh.dtype.itemsize}"))
        if m is None:
            if isinstance(tops, int):
                if xu.max() <= tops:  # (one reduction over the batch: its largest entry)
                    return
            elif not (xu.max(axis=0) > tops).any():
                return
        elif not ((xu > tops) & ~np.asarray(m)).any():
            return
    limits = info.int_limits(xh.dtype) if integers and tops is None else None
    if limits is not None:  # integer ids: compared in their own type, without copies
        low, top = limits
        if m is None:  # each variable's smallest and largest value (no [B, V] temporaries)
            if xh.size and not ((xh.min(axis=0) < low).any() or (xh.max(axis=0) > top).any()):
                return
        elif not (((xh < low) | (xh > top)) & ~np.asarray(m)).any():
            return
    mh = None if m is None else np.broadcast_to(np.asarray(m), xh.shape)
    observed = np.ones(xh.shape, bool) if mh is None else ~mh
    xc = xh.astype(np.int64) if xh.dtype.kind in "iub" else xh  # booleans and small integers compared as int64
    with np.errstate(invalid="ignore"):
        bad = bad_entries(np, xc, info.discrete, info.lo, info.hi) & observed
        narrow = target is not None and xh.dtype.kind == "f" and np.dtype(target).kind == "f" and \
            np.finfo(target).max < np.finfo(xh.dtype).max
        over = None
        if narrow and xh.size:  # two reductions (NaN skipped); the mask only where some value is that large
            ft = np.finfo(target)
            limit = float(ft.max) + 2.0 ** (ft.maxexp - ft.nmant - 2)  # (from here on, the conversion gives inf)
            if np.fmax.reduce(xh, axis=None) >= limit or np.fmin.reduce(xh, axis=None) <= -limit:
                over = (np.abs(xh) >= limit) & np.isfinite(xh) & observed
    if over is not None:
        bad = bad | over
    if bad.any():
        b, v = (int(i) for i in np.argwhere(bad)[0])
        val = xh[b, v]
        n_bad = int(bad.sum())
        more = f" ({n_bad} bad entries in all)" if n_bad > 1 else ""
        if over is not None and over[b, v]:
            raise ValueError(f"{what}[{b}, {v}] = {val} overflows the circuit's {np.dtype(target).name}: "
                             f"{info.describe(v)}{more}")
        if np.issubdtype(xh.dtype, np.floating) and not np.isfinite(val):
            raise ValueError(f"{what}[{b}, {v}] = {val}: {info.describe(v)}; mark unknown values with "
                             f"missing= instead of {'NaN' if np.isnan(val) else val}{more}")
        raise ValueError(f"{what}[{b}, {v}] = {val} is out of range: {info.describe(v)}{more}")


def raise_bad_values(info: VarInfo, x, m, what: str, where: str) -> None:
    """Raise the host check's error for a batch that the device check found bad (``where`` names the call)."""
    try:
        check_host_values(info, np.asarray(x), None if m is None else np.asarray(m), what)
    except ValueError as e:
        raise ValueError(f"{e} (in {where})") from None
    raise ValueError(f"{what} held a value that the device check rejected (in {where}); the host check found none")


class DeviceCheck:
    """The value check of a batch inside a traced function (hashable: a static part of the executable key).

    ``apply(x, missing) -> (x_clean, bad_rows)``: every entry that is not admissible (:func:`bad_entries`, the
    rule the host check applies too) is replaced by an admissible value
    (the variable's smallest value; 0 for a real variable), and ``bad_rows`` ``bool[B]`` marks the rows
    with such an entry among their observed (not missing) variables.
    """

    def __init__(self, info: VarInfo):
        self.__setstate__({"discrete": info.discrete, "lo": info.lo, "hi": info.hi})

    def __setstate__(self, state: dict) -> None:
        self.discrete = np.asarray(state["discrete"], bool)
        self.lo = np.asarray(state["lo"], np.int64)
        hi = np.asarray(state["hi"], np.float64)
        self.hi = hi
        self.safe = np.where(self.discrete, self.lo, 0).astype(np.float64)
        self._consts: dict = {}
        self._key = (self.discrete.tobytes(), self.lo.tobytes(), hi.tobytes())
        self._hash = hash(self._key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, DeviceCheck) and self._key == other._key)

    def __repr__(self) -> str:
        return f"DeviceCheck({self.discrete.size} variables)"

    def __getstate__(self) -> dict:
        """What defines the check (its pickled form and its digest in stored executables' fingerprints)."""
        return {"discrete": self.discrete, "lo": self.lo, "hi": self.hi}

    def _constants(self, dtype: np.dtype) -> tuple:
        """``(bounds, safe values)`` in ``dtype``, made once per dtype and kept: the traced program's numpy
        constants stay the same objects for every trace (JAX's lowering keys constants by ``id``, and a
        temporary's ``id`` can come back for another array while a trace on another thread runs)."""
        hit = self._consts.get(dtype)
        if hit is None:
            hit = self._consts.setdefault(dtype, (bounds(dtype, self.lo, self.hi), self.safe.astype(dtype)))
        return hit

    def apply(self, x, missing):
        limits, safe = self._constants(np.dtype(x.dtype))
        bad = bad_entries(jnp, x, self.discrete, self.lo, self.hi, limits)
        clean = jnp.where(bad, safe, x)
        if missing is not None:
            bad = bad & ~missing
        return clean, jnp.any(bad, axis=1)


# ---- soft evidence ------------------------------------------------------------------------------

def check_soft_evidence(var_info, soft, where: str):
    """Soft evidence's shape and dtype, the rules of every entry point that takes it: ``[B, V, K]`` float weights,
    ``B >= 1``, ``K`` at least the most values a variable takes, every variable discrete (``var_info``: the
    circuit's :class:`VarInfo`). Returns it as an array of its own kind (numpy stays numpy, tracers stay tracers); a
    ``ValueError`` (``TypeError`` for a dtype) naming ``where`` otherwise. Its values are checked apart
    (:func:`raise_bad_soft` on the host, :func:`any_bad_soft` on the device)."""
    if not var_info.all_discrete:
        raise ValueError(f"{where}: soft_evidence needs every variable to be discrete; this circuit has continuous "
                         f"variables {np.nonzero(var_info.continuous)[0][:6].tolist()}")
    if not isinstance(soft, (jax.Array, np.ndarray)):  # (tracers are jax.Arrays)
        soft = np.asarray(soft)
    V = len(var_info.card)
    if soft.ndim != 3 or soft.shape[1] != V:
        raise ValueError(f"{where}: soft_evidence must have shape [batch, {V}, num_values], got {tuple(soft.shape)}")
    if soft.shape[0] == 0:
        raise ValueError(f"{where}: soft_evidence has an empty batch (shape {tuple(soft.shape)})")
    K = int(var_info.card.max())
    if soft.shape[2] < K:
        raise ValueError(f"{where}: soft_evidence has {soft.shape[2]} values per variable, but variable "
                         f"{int(np.argmax(var_info.card))} takes {K}")
    if not jnp.issubdtype(soft.dtype, jnp.floating):
        raise TypeError(f"{where}: soft_evidence must hold float weights, got dtype {soft.dtype}")
    return soft


def bad_soft_rows(q):
    """``bool[B]``: the rows of soft evidence ``q`` ``[B, V, K]`` with a weight that is negative or not finite."""
    return jnp.any(~jnp.isfinite(q) | (q < 0), axis=(1, 2))


def any_bad_soft(q):
    """Whether soft evidence ``q`` holds a negative or non-finite weight (a device check's flag)."""
    return jnp.any(bad_soft_rows(q))


def raise_bad_soft(q, where: str, how: str) -> None:
    """Raise a ``ValueError`` naming the first negative or non-finite weight of soft evidence ``q`` ``[B, V, K]`` (a
    host array, or a device array read back after its device check failed) and their number, ``(in where, how)``;
    nothing where there is none."""
    with jax.transfer_guard_device_to_host("allow"):  # (an error's message, not the call's data path)
        a = np.asarray(q)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(a) | (a < 0)
    if bad.any():
        b, v, k = (int(i) for i in np.argwhere(bad)[0])
        more = f" ({int(bad.sum())} such weights in all)" if bad.sum() > 1 else ""
        raise ValueError(f"soft_evidence[{b}, {v}, {k}] = {a[b, v, k]}: soft evidence must be finite and "
                         f"non-negative{more} (in {where}, {how})")


def explain_bad_soft(q, where: str) -> None:
    """The error of soft evidence ``q`` whose device check failed (:func:`raise_bad_soft` on its values)."""
    raise_bad_soft(q, where, "checked on the device; its rows gave NaN")
    raise ValueError(f"soft_evidence held a weight that the device check rejected (in {where}); the host check "
                     "found none")


# ---- per-call evidence --------------------------------------------------------------------------
# The value rules of ``Circuit.check_evidence``: host (numpy) arrays are checked on the host before anything runs;
# concrete device arrays by :class:`EvidenceCheck`, the flag of a call path executable (``Runtime.record_check``),
# and read back for the error (:func:`explain_bad_evidence`) only where that flag is set.

EVIDENCE_RULES = {"log": "log-values must not be NaN or +inf (-inf is a zero)",
                  "nonnegative": "values must be finite and non-negative"}


def raise_bad_evidence(name: str, host: np.ndarray, rule: str, where: str = "") -> None:
    """Raise a ``ValueError`` naming the first entry of the host array ``evidence[name]`` that breaks ``rule``
    (``"log"``: NaN or +inf; ``"nonnegative"``: negative or not finite), its value and their number; nothing where
    there is none or the array does not hold floats. ``where`` ends the message."""
    if host.dtype.kind not in "fc":
        return
    with np.errstate(invalid="ignore"):
        bad = (np.isnan(host) | (host == np.inf)) if rule == "log" else ~(np.isfinite(host) & (host >= 0))
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        more = f" ({int(bad.sum())} such entries in all)" if bad.sum() > 1 else ""
        raise ValueError(f"evidence['{name}']{list(i)} = {host[i]}: {EVIDENCE_RULES[rule]}{more}{where}")


def raise_bad_topk_ids(ids: np.ndarray, mask, num_cats: int | None, where: str = "") -> None:
    """Raise a ``ValueError`` where the host top-k ``ids`` ``[B, V, k]`` hold, among the entries that ``mask`` keeps
    (all without one), an id outside ``[0, num_cats)`` (the soft evidence leaves' values; without ``num_cats`` any id
    >= 0), named with its index, value and their number, or an id more than once in a row ``[b, v]``."""
    host = np.asarray(ids, np.int64)
    live = np.ones(host.shape, bool) if mask is None else np.asarray(mask, bool)
    out = live & ((host < 0) | (host >= (num_cats if num_cats is not None else np.iinfo(np.int64).max)))
    if out.any():
        i = tuple(int(j) for j in np.argwhere(out)[0])
        more = f" ({int(out.sum())} such entries in all)" if out.sum() > 1 else ""
        values = f"integers in [0, {num_cats - 1}]" if num_cats is not None else "integers >= 0"
        raise ValueError(f"evidence['categorical_topk']['ids']{list(i)} = {host[i]} is not a value of the soft "
                         f"evidence leaves ({values}){more}{where}")
    keyed = np.where(live, host, -1 - np.arange(host.shape[2]))  # (masked entries never collide)
    srt = np.sort(keyed, axis=2)
    dup = np.argwhere((srt[:, :, 1:] == srt[:, :, :-1]).any(axis=2))
    if len(dup):
        b, v = (int(j) for j in dup[0])
        vals, counts = np.unique(keyed[b, v], return_counts=True)
        more = f" ({len(dup)} such rows in all)" if len(dup) > 1 else ""
        raise ValueError(f"evidence['categorical_topk']['ids'][{b}, {v}] holds the id {int(vals[counts > 1][0])} "
                         f"more than once: a row's ids must be distinct (mask the extra entries){more}{where}")


def _bad_log(a):
    return jnp.any(jnp.isnan(a) | (a == jnp.inf))


def _bad_nonnegative(a):
    return jnp.any(~(jnp.isfinite(a) & (a >= 0)))


def _bad_topk_ids(ids, mask, num_cats: int | None):
    """Whether top-k ``ids`` ``[B, V, k]`` (in their own integer type) hold, where ``mask`` keeps them, an id outside
    ``[0, num_cats)`` or one id twice in a row (:func:`raise_bad_topk_ids`' rule)."""
    live = jnp.ones(ids.shape, bool) if mask is None else mask.astype(bool)
    out = jnp.zeros(ids.shape, bool)
    if jnp.issubdtype(ids.dtype, jnp.signedinteger):
        out = ids < 0
    if num_cats is not None and num_cats <= jnp.iinfo(ids.dtype).max:
        out = out | (ids >= num_cats)
    # a row's live ids sorted after its live flag (live first): a repeated one lies next to itself
    dead, srt = jax.lax.sort((jnp.where(live, 0, 1).astype(jnp.int32), ids), dimension=2, num_keys=2)
    both = (dead[:, :, 1:] == 0) & (dead[:, :, :-1] == 0)
    return jnp.any(out & live) | jnp.any(both & (srt[:, :, 1:] == srt[:, :, :-1]))


@dataclasses.dataclass(frozen=True)
class EvidenceCheck:
    """The value check of a call's device evidence arrays: ``check(arrays)``, a boolean scalar, is True where one
    breaks its rule. ``rules``: one per group of ``arrays``: ``"log"`` or ``"nonnegative"`` (one array), ``"ids"``
    (top-k ids, then their mask or None) bounded by ``num_cats``. Hashable by value: the static part of the flag's
    executable, so one is compiled per rules and shapes."""

    rules: tuple[str, ...]
    num_cats: int | None = None

    def __call__(self, arrays):
        flags = []
        for rule, group in zip(self.rules, arrays):
            if rule == "ids":
                flags.append(_bad_topk_ids(group[0], group[1], self.num_cats))
            else:
                flags.append((_bad_log if rule == "log" else _bad_nonnegative)(group[0]))
        return jnp.any(jnp.stack(flags)) if flags else jnp.asarray(False)


def _host_values(a) -> np.ndarray:
    """A device evidence array read on the host (floats numpy does not know, such as bfloat16, as float32)."""
    h = np.asarray(a)
    return h if h.dtype.kind in "fciub" else h.astype(np.float32)


def explain_bad_evidence(items, num_cats: int | None, where: str) -> None:
    """The error of device evidence whose check (:class:`EvidenceCheck`) failed: the host check's ``ValueError`` (key,
    first bad index and value, their number) on the arrays read back, ``(in where, ...)``. ``items``: ``(name,
    rule, arrays)`` per group, in the order of the check's rules."""
    how = f" (in {where}, checked on the device: that call's outputs are not valid)"
    with jax.transfer_guard_device_to_host("allow"):  # (an error's message, not the call's data path)
        for name, rule, arrays in items:
            host = [None if a is None else _host_values(a) for a in arrays]
            if rule == "ids":
                raise_bad_topk_ids(host[0], host[1], num_cats, how)
            else:
                raise_bad_evidence(name, host[0], rule, how)
    raise ValueError(f"evidence held a value that the device check rejected (in {where}); the host check found none")
