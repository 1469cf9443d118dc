"""Kernels traced with 32-bit default types, whatever ``jax_enable_x64`` says.

Kernels take float32 buffers and int32 tables. Under ``jax_enable_x64`` a Python integer, an ``arange`` or a loop
counter inside a kernel would be int64, which Triton, Mosaic and ``lax``'s binary operations do not mix with the
int32 tables. Every kernel call goes through :func:`x32`, which traces it with x64 off; its inputs and outputs are
32-bit either way, so the switch changes nothing else.
"""

from __future__ import annotations

import functools

import jax


def x32(fn):
    """``fn`` (a kernel call) traced with ``jax_enable_x64`` off."""

    @functools.wraps(fn)
    def wrapped(*args, **kw):
        with jax.enable_x64(False):
            return fn(*args, **kw)

    return wrapped
