"""Raw Triton kernels called from JAX through jax-triton: the launch record, the route's availability, and the
kernels' CPU check in Triton's interpreter.

A kernel module (:mod:`jaxpc.ops.triton_sum`, :mod:`jaxpc.ops.triton_leaf`) describes each call as a
:class:`Launch`: the ``triton.jit`` function, a one-axis grid, the array arguments (inputs, then the outputs the
kernel writes through its last pointers), which inputs alias which outputs, and the compile-time constants.
:func:`run` calls it with ``jax_triton.triton_call`` (one custom call in the executable); :func:`interpret` runs
the same launch in Triton's interpreter on numpy copies, which is how the kernels' code is tested on a machine
without a GPU, alone or (through a host callback in :func:`run`) inside whole circuits.

The route is used only where it works (:func:`status`): Triton and jax-triton import, JAX runs on a GPU, and a
probe kernel called through ``triton_call`` inside ``jax.jit`` returns the right values. The first check is made
once per process; a failure leaves a one-line reason that the caller's fallback warning quotes.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .x32 import x32


def load_triton():
    """``(triton, triton.language)``, or ``(None, None)`` where Triton is not installed. Imported when a kernel
    module or the route's check first needs it, not with jaxpc."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None, None
    return triton, tl

Array = jax.Array

PRECISION_CODES = {"fp32": 0, "tf32": 1, "bf16": 2}  # the kernels' PREC constant: exact, TF32, bfloat16 operands


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel call: ``kernel[grid](*inputs, *outputs, **meta)``. ``aliases`` maps an input's position to the
    output it is updated into in place (the output's pointer then addresses the input's buffer)."""

    kernel: Any
    grid: int
    inputs: tuple
    out_shapes: tuple  # of jax.ShapeDtypeStruct
    aliases: dict
    meta: dict
    name: str
    num_warps: int = 4
    num_stages: int = 2


@x32
def run(launch: Launch):
    """The outputs of ``launch`` (a tuple) through ``jax_triton.triton_call``; where Triton runs in its interpreter
    (:func:`interpreting`: the CPU tests), through a host callback into :func:`interpret` instead."""
    if interpreting():
        return tuple(jax.pure_callback(lambda *arrays: interpret(dataclasses.replace(launch, inputs=arrays)),
                                       launch.out_shapes, *launch.inputs))
    import jax_triton

    outs = jax_triton.triton_call(*launch.inputs, kernel=launch.kernel, out_shape=launch.out_shapes,
                                  grid=(launch.grid,), input_output_aliases=dict(launch.aliases),
                                  num_warps=launch.num_warps, num_stages=launch.num_stages, name=launch.name,
                                  **launch.meta)
    return tuple(outs)


# ---- the interpreter ----------------------------------------------------------------------------------

_TRITON_TYPES = {np.dtype(np.float32): "fp32", np.dtype(np.int32): "i32", np.dtype(np.float64): "fp64",
                 np.dtype(np.int64): "i64"}


class _Storage:
    def __init__(self, tensor: _HostTensor):
        self.tensor = tensor

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def cpu(self) -> _Storage:
        return self

    def copy_(self, other) -> None:  # the interpreter ran on this very memory
        del other


class _HostTensor:
    """A numpy array as the interpreter takes a tensor: its address, its Triton type, its storage (itself)."""

    def __init__(self, a: np.ndarray):
        self.a = np.ascontiguousarray(a)
        self.dtype = _TRITON_TYPES[self.a.dtype]

    def data_ptr(self) -> int:
        return self.a.ctypes.data

    def untyped_storage(self) -> _Storage:
        return _Storage(self)

    def new_empty(self, *args, **kwargs) -> _HostTensor:
        del args, kwargs
        return self

    def set_(self, *args) -> None:
        del args

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple:
        return self.a.shape

    def stride(self) -> tuple:
        return tuple(s // self.a.itemsize for s in self.a.strides)


def interpreting() -> bool:
    """Whether Triton's kernels run in its interpreter in this process (``TRITON_INTERPRET=1`` when it was
    imported: ``triton.jit`` then makes interpreted functions, its library's too)."""
    triton, tl = load_triton()
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


def interpret(launch: Launch) -> tuple:
    """The outputs of ``launch`` (numpy arrays) from Triton's interpreter on the host: inputs copied to numpy,
    aliased outputs starting as their inputs, other outputs filled with NaN (or -1), so that an element the
    kernel should write and does not shows. Needs Triton (no GPU) imported with ``TRITON_INTERPRET=1``
    (:func:`interpreting`)."""
    if not interpreting():
        raise RuntimeError("triton_base.interpret runs Triton's interpreter: set TRITON_INTERPRET=1 before triton "
                           "is imported")
    ins = [_HostTensor(np.array(jax.device_get(a))) for a in launch.inputs]
    outs = []
    for j, s in enumerate(launch.out_shapes):
        src = [i for i, o in launch.aliases.items() if o == j]
        if src:
            outs.append(ins[src[0]])
        else:
            fill = np.nan if jnp.issubdtype(s.dtype, jnp.floating) else -1
            outs.append(_HostTensor(np.full(s.shape, fill, np.dtype(s.dtype))))
    launch.kernel[(launch.grid,)](*ins, *outs, **launch.meta)
    return tuple(o.a for o in outs)


# ---- availability ---------------------------------------------------------------------------------------

_STATUS: list = []
_LOCK = threading.Lock()


def _probe_kernel():
    triton, tl = load_triton()

    @triton.jit
    def probe(x_ptr, y_ptr, N: tl.constexpr):
        r = tl.arange(0, N)
        tl.store(y_ptr + r, tl.load(x_ptr + r) * 2.0 + 1.0)

    return probe


def _check() -> tuple[bool, str]:
    triton, _ = load_triton()
    if triton is None:
        return False, "triton is not installed"
    if jax.default_backend() != "gpu":
        return False, f"JAX runs on {jax.default_backend()!r}, and jax-triton runs on GPUs only"
    try:
        import jax_triton
    except Exception as e:  # an ImportError, or a jax-triton that does not match this jax
        return False, f"jax-triton does not import ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    version = getattr(jax_triton, "__version__", "?")
    probe = _probe_kernel()
    x = np.arange(16, dtype=np.float32)
    got: list = []

    def call():  # on a thread of its own: outside any trace of the caller's (JAX's trace state is per thread)
        try:
            f = jax.jit(lambda v: run(Launch(probe, 1, (v,), (jax.ShapeDtypeStruct((16,), jnp.float32),), {},
                                             {"N": 16}, "jaxpc_triton_probe"))[0])
            got.append(np.asarray(jax.device_get(f(jnp.asarray(x)))))
        except Exception as e:  # a jax-triton that does not match this jax or triton fails here
            got.append(e)

    thread = threading.Thread(target=call, name="jaxpc-triton-probe")
    thread.start()
    thread.join()
    if isinstance(got[0], Exception):
        e = got[0]
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return False, (f"jax-triton {version} fails with jax {jax.__version__} and triton {triton.__version__} "
                       f"({type(e).__name__}: {first[:160]})")
    y = got[0]
    if not np.array_equal(y, x * 2 + 1):
        return False, f"jax-triton {version}'s probe kernel returned wrong values"
    return True, f"jax-triton {version}, triton {triton.__version__}"


def status() -> tuple[bool, str]:
    """``(usable, reason)``: whether the jax-triton route runs here (checked once per process), and why not (or
    the versions that run it)."""
    with _LOCK:
        if not _STATUS:
            _STATUS.append(_check())
        return _STATUS[0]


def available() -> bool:
    return status()[0]


def reset_status() -> None:
    """Forget :func:`status`'s answer (tests that install or remove a route)."""
    with _LOCK:
        _STATUS.clear()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of positive ints: programs over ``a`` elements in tiles of ``b``."""
    return -(-a // b)


def out_shapes(shapes: Sequence[tuple], dtype=jnp.float32) -> tuple:
    return tuple(jax.ShapeDtypeStruct(tuple(s), dtype) for s in shapes)



# ---- the route's gate ---------------------------------------------------------------------------------------

_WARNED: list = []


def triton_route(options) -> bool:
    """Whether ``options`` (:class:`jaxpc.Options`) ask for the jax-triton route (``impl="triton"``, or a tuned
    partition on it) and it runs here (:func:`status`). Where it does not, jaxpc warns once with the reason and
    those partitions take ``impl="auto"``'s routes (Pallas or XLA)."""
    if options.impl != "triton" and not any(choice[0] == "triton" for _, choice in options.kernels):
        return False
    ok, reason = status()
    if not ok and not _WARNED:
        _WARNED.append(True)
        warnings.warn(f"jaxpc: impl='triton' is not available here: {reason}; its sum layers and leaves take "
                      f"impl='auto''s routes (Pallas or XLA)", RuntimeWarning, stacklevel=2)
    return ok


def route_impl(options) -> str:
    """``options.impl`` as the routes read it: ``"auto"`` for ``"triton"`` where the jax-triton route does not run
    (:func:`triton_route`)."""
    return "auto" if options.impl == "triton" and not triton_route(options) else options.impl
