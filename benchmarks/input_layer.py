"""Formulations of the categorical leaves' values written into the node buffer, timed at HCLT-256's shape.

    python benchmarks/input_layer.py [--vars 784] [--latents 256] [--cats 256] [--rows 348673]
                                     [--batches 16,128,512] [--reps 20]

The first stage of every forward pass: ``V * J`` leaves (``J`` latents per variable, each with its own row
of ``K`` log-probabilities) read ``x[b, v]`` and write ``[V * J, B]`` values right after the buffer's
padding rows, zeros above (``jaxpc.engine.stages.input_buffer``). Variants (ms per call, calls dispatched
back to back, synchronized once every ``--reps`` calls; median of 9 such loops), each checked equal to
``flat``:

* ``flat``: the library's gather, one flat index ``row * K + x`` per (leaf, sample), fused into the
  buffer's concatenation;
* ``flat-values``: the same gather alone (no buffer), and ``zeros``: the buffer alone (its write cost);
* ``zeros-bcast``: a zero buffer alone (a broadcast, no concatenation);
* ``flat-xt`` (``xt-values`` without the buffer): ``x`` transposed to ``[V, B]`` first (materialized), so
  consecutive samples read consecutive indices; ``take``: the same as a ``take_along_axis`` over
  ``[V, J, K]``;
* ``dus`` / ``dus-xt``: a broadcast zero buffer with the padding and the values written into it in place
  (``dynamic_update_slice``) instead of one concatenation;
* ``rows-t``: the parameters transposed per variable to ``[V, K, J]`` (every step), whole 1 KiB rows
  ``[V, B, J]`` gathered by ``x``, transposed back to ``[V, J, B]`` inside the concatenation;
* ``rows-t-stored``: the same with the transposed parameters given (what storing them so would cost).

"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def flat_values(lp, x, V, J, K):
    rows = jnp.arange(V * J, dtype=jnp.int32)
    xi = x.T[jnp.repeat(jnp.arange(V), J)]  # [N, B]
    return lp.reshape(-1)[rows[:, None] * K + xi]


def flat_values_xt(lp, x, V, J, K):
    rows = jnp.arange(V * J, dtype=jnp.int32)
    xt = jax.lax.optimization_barrier(x.T)  # [V, B] materialized: consecutive samples read consecutive ints
    return lp.reshape(-1)[rows[:, None] * K + xt[jnp.repeat(jnp.arange(V), J)]]


def take_values(lp, x, V, J, K):
    xt = jax.lax.optimization_barrier(x.T)
    idx = jnp.broadcast_to(xt[:, None, :], (V, J, x.shape[0]))
    return jnp.take_along_axis(lp.reshape(V, J, K), idx, axis=2).reshape(V * J, -1)


def rows_t_values(lpt, x, V, J, K):
    g = jnp.take_along_axis(lpt, x.T[:, :, None], axis=1)  # [V, K, J] -> [V, B, J]
    return jnp.transpose(g, (0, 2, 1)).reshape(V * J, -1)


def buffer(vals, R, B, pad):
    return jnp.concatenate([jnp.zeros((pad, B)), jnp.full((pad, B), -jnp.inf), vals,
                            jnp.zeros((R - 2 * pad - vals.shape[0], B))])


def dus_buffer(vals, R, B, pad):
    buf = jnp.zeros((R, B))
    buf = jax.lax.dynamic_update_slice(buf, jnp.full((pad, B), -jnp.inf), (pad, 0))
    return jax.lax.dynamic_update_slice(buf, vals, (2 * pad, 0))


def timed(fn, args, reps):
    out = fn(*args)
    jax.block_until_ready(out)
    loops = []
    for _ in range(9):
        t = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        loops.append((time.perf_counter() - t) * 1e3 / reps)
    return float(np.median(loops)), out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vars", type=int, default=784)
    p.add_argument("--latents", type=int, default=256)
    p.add_argument("--cats", type=int, default=256)
    p.add_argument("--rows", type=int, default=348673)
    p.add_argument("--batches", default="16,128,512")
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args(argv)
    V, J, K, R, pad = a.vars, a.latents, a.cats, a.rows, a.latents
    rng = np.random.default_rng(0)
    lp = jnp.asarray(np.log(rng.dirichlet(np.ones(K), size=V * J)).astype(np.float32))
    lpt = jnp.transpose(lp.reshape(V, J, K), (0, 2, 1))
    variants = {
        "flat": jax.jit(lambda lp, lpt, x: buffer(flat_values(lp, x, V, J, K), R, x.shape[0], pad)),
        "flat-values": jax.jit(lambda lp, lpt, x: flat_values(lp, x, V, J, K)),
        "zeros": jax.jit(lambda lp, lpt, x: buffer(jnp.zeros((V * J, x.shape[0])), R, x.shape[0], pad)),
        "zeros-bcast": jax.jit(lambda lp, lpt, x: jnp.zeros((R, x.shape[0]))),
        "flat-xt": jax.jit(lambda lp, lpt, x: buffer(flat_values_xt(lp, x, V, J, K), R, x.shape[0], pad)),
        "xt-values": jax.jit(lambda lp, lpt, x: flat_values_xt(lp, x, V, J, K)),
        "take": jax.jit(lambda lp, lpt, x: buffer(take_values(lp, x, V, J, K), R, x.shape[0], pad)),
        "dus": jax.jit(lambda lp, lpt, x: dus_buffer(flat_values(lp, x, V, J, K), R, x.shape[0], pad)),
        "dus-xt": jax.jit(lambda lp, lpt, x: dus_buffer(flat_values_xt(lp, x, V, J, K), R, x.shape[0], pad)),
        "rows-t": jax.jit(lambda lp, lpt, x: buffer(
            rows_t_values(jnp.transpose(lp.reshape(V, J, K), (0, 2, 1)), x, V, J, K), R, x.shape[0], pad)),
        "rows-t-stored": jax.jit(lambda lp, lpt, x: buffer(rows_t_values(lpt, x, V, J, K), R, x.shape[0], pad)),
    }
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; V={V} J={J} K={K} R={R}", flush=True)
    for B in (int(b) for b in a.batches.split(",")):
        x = jnp.asarray(rng.integers(0, K, (B, V)).astype(np.int32))
        ref = None
        line = []
        for name, fn in variants.items():
            ms, out = timed(fn, (lp, lpt, x), a.reps)
            if name == "flat":
                ref = np.asarray(out)
            err = "" if name in ("zeros", "flat-values", "zeros-bcast", "xt-values") else (
                " ok" if np.array_equal(np.asarray(out), ref) else " DIFFERS")
            line.append(f"{name} {ms:.3f}{err}")
        print(f"B={B:4d}: " + " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
