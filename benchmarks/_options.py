"""Command-line spellings of jaxpc's options, shared by the benchmark scripts."""

from __future__ import annotations

import dataclasses

import jaxpc


def tuning(spec: str) -> jaxpc.Tuning:
    """A :class:`jaxpc.Tuning` from ``field=value`` pairs joined by ``+``; ``xla.<option>=<value>`` pairs go into
    ``Tuning.compiler_options`` (``true`` / ``false`` / an int / a string)."""
    fields = dict(kv.split("=", 1) for kv in spec.split("+"))
    xla = tuple((k[4:], xla_value(v)) for k, v in fields.items() if k.startswith("xla."))
    kw = int_fields(jaxpc.Tuning, {k: v for k, v in fields.items() if not k.startswith("xla.")})
    return jaxpc.Tuning(**kw, **({"compiler_options": xla} if xla else {}))


def options(spec: str) -> jaxpc.Options:
    """A :class:`jaxpc.Options` from ``field=value`` pairs joined by ``+`` (bool and int fields; ``tuning.<field>``
    pairs go into its :class:`jaxpc.Tuning`, as :func:`tuning` spells them)."""
    fields = dict(kv.split("=", 1) for kv in spec.split("+"))
    tun = "+".join(f"{k[7:]}={v}" for k, v in fields.items() if k.startswith("tuning."))
    kw = int_fields(jaxpc.Options, {k: v for k, v in fields.items() if not k.startswith("tuning.")})
    return jaxpc.Options(**kw, **({"tuning": tuning(tun)} if tun else {}))


def int_fields(cls, fields: dict) -> dict:
    """``fields`` (names to spellings) of dataclass ``cls`` as values: ``0`` / ``1`` for its bool fields (also
    ``none`` for those that take None), ints for the rest."""
    kinds = {f.name: str(f.type) for f in dataclasses.fields(cls)}

    def value(k, v):
        if kinds[k].startswith("bool"):
            return None if v.lower() == "none" and "None" in kinds[k] else bool(int(v))
        return int(v)
    return {k: value(k, v) for k, v in fields.items()}


def xla_value(v: str):
    """An XLA option's value from its spelling on the command line."""
    if v in ("true", "false"):
        return v == "true"
    try:
        return int(v)
    except ValueError:
        return v


def query_calls(c, put, **kw) -> dict:
    """The benchmarks' calls of circuit ``c``'s queries, each a function of the batch ``x``: ``conditional`` and
    ``mpe`` with a third of the variables unobserved, ``sample`` with that evidence under ``jax.random.key(0)``. The
    mask is ``put`` (``jnp.asarray``, or a numpy conversion for host batches); ``kw`` goes to every call."""
    import jax
    import numpy as np

    miss = put(np.arange(c.num_vars) % 3 == 0)
    key = jax.random.key(0)
    return {"conditional": lambda x: c.conditional(c.params, x, miss, **kw),
            "mpe": lambda x: c.mpe(c.params, x, miss, **kw),
            "sample": lambda x: c.sample(c.params, key, x=x, missing=miss, **kw)}
