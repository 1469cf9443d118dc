"""jaxpc: probabilistic circuits as pure JAX functions.

Build node vectors with :func:`inputs`, :func:`multiply` and :func:`summate` (PyJuice's names
and block semantics), :func:`compile` them once, then evaluate, differentiate and train the
resulting :class:`Circuit` over a pytree of parameters.
"""

import importlib
import inspect
import warnings

from . import distributions, edit, io, optim, parallel, queries, structures, visualize
from .circuit import Circuit, compile
from .executables import CacheInfo, default_persistent_cache, enable_persistent_cache
from .nodes import CircuitNodes, InputNodes, ProdNodes, SumNodes, duplicate, inputs, multiply, summate
from .options import Options, Tuning

default_persistent_cache()  # a per-user compilation cache, unless JAX's own is set (see jaxpc.executables)

__version__ = "0.1.0"

__all__ = [
    "inputs", "multiply", "summate", "duplicate", "compile", "Circuit", "Options", "Tuning", "distributions",
    "CircuitNodes", "InputNodes", "ProdNodes", "SumNodes", "structures", "queries", "CacheInfo",
    "enable_persistent_cache",
    "edit", "visualize", "optim", "parallel", "io",
]


def __getattr__(name: str):
    """Deprecated names, kept for one release: ``jaxpc.dists`` (now ``jaxpc.distributions``) and
    ``jaxpc.transforms`` (now ``jaxpc.edit``; the module warns when first imported)."""
    if name == "dists":
        # ``from jaxpc import dists`` probes the name with hasattr (importlib's _handle_fromlist) before
        # reading it: warn on the read only, once per use.
        if inspect.currentframe().f_back.f_code.co_name != "_handle_fromlist":
            warnings.warn("jaxpc.dists is deprecated and will be removed in the next release; use "
                          "jaxpc.distributions", DeprecationWarning, stacklevel=2)
        return distributions
    if name == "transforms":
        return importlib.import_module(".transforms", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
