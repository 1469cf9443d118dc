"""Kernel routes under ``jax_enable_x64``: a float32 circuit's kernels are traced with 32-bit default types, so that
turning on 64-bit types elsewhere in a program changes none of the kernels' results and none fails to lower."""

from __future__ import annotations

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions, structures
from jaxpc.engine import routing
from jaxpc.ops import pallas_chain, pallas_sum
from jaxpc.structures.hclt import hidden_tree_circuit

from .test_levels import chains_tree

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
PALLAS = jaxpc.Options(impl="pallas", precision="fp32")


def _pd():
    cat = distributions.Categorical(4)
    return jaxpc.compile(structures.PD((4, 4), 8, split_intervals=2, input_dist=cat, block_size=8), seed=0)


def _tree():
    children, root = chains_tree((2, 3, 4, 5, 5))
    root = hidden_tree_circuit(children, root, 64, list(range(len(children))), distributions.Categorical(3),
                               block_size=64)
    return jaxpc.compile(root, seed=2, scan_min_repeats=0)


def _hmm():
    return jaxpc.compile(structures.HMM(6, 8, 4, homogeneous=True), seed=0)


@contextlib.contextmanager
def on_gpu():
    """The GPU's routes, kernels lowered for CUDA (no GPU needed)."""
    with (mock.patch.object(pallas_sum, "interpret_mode", lambda: False),
          mock.patch.object(pallas_chain, "interpret_mode", lambda: False),
          mock.patch.object(routing, "on_gpu", lambda: True),
          jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=H200))):
        yield


@pytest.mark.parametrize("build,cats", [(_pd, 4), (_tree, 3), (_hmm, 4)], ids=["pd", "tree", "hmm"])
@pytest.mark.slow
@pytest.mark.full
def test_the_kernels_give_the_same_flows_under_x64(build, cats):
    """The Pallas route (the interpreter, the kernels' own code) with 64-bit types on equals the same circuit's call
    with them off, in float32 (the HMM's chain: its kernels with x64 off, the scans with it on, which the interpreter
    cannot run them under: ``engine.chain.persistent``)."""
    c = build()
    x = jnp.asarray(np.random.default_rng(0).integers(0, cats, (16, c.num_vars)).astype(np.int32))
    want, ll_want = c.flows(c.params, x, options=PALLAS, return_ll=True)
    with jax.enable_x64(True):
        c64 = build()  # its own executables, traced with 64-bit types on
        got, ll_got = c64.flows(c64.params, x, options=PALLAS, return_ll=True)
    assert ll_got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(ll_got), np.asarray(ll_want), rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * float(np.max(np.abs(b))))


def test_the_kernels_lower_for_cuda_under_x64():
    """The default call's kernels (Pallas's Triton lowering), the tree's cluster kernels (Mosaic, their steps'
    hand-offs fenced: ``mosaic_tree.FENCES``) and the HMM chain's kernels lower for an H200 with 64-bit types on."""
    with jax.enable_x64(True):
        pd, tree = _pd(), _tree()
        x = jnp.zeros((16, pd.num_vars), jnp.int32)
        xt = jnp.zeros((16, tree.num_vars), jnp.int32)
        clusters = jaxpc.Options(precision="tf32", tuning=jaxpc.Tuning(tree_clusters=True))
        A, Et = jnp.ones((256, 256), jnp.float32), jnp.ones((5, 256, 16), jnp.float32)
        with on_gpu():
            for fn, args, markers in (
                    (lambda p, x: pd.flows(p, x, options=PALLAS.replace(precision="tf32"), validate=False),
                     (pd.params, x), ["__gpu$xla.gpu.triton"]),
                    (lambda p, x: tree.flows(p, x, options=clusters, validate=False), (tree.params, xt),
                     ["mosaic_gpu_v2", "fence.acq_rel.cluster", "fence.proxy.async.global"]),
                    (lambda a, e: pallas_chain.forward_backward(a, e, a[0], "tf32"), (A, Et),
                     ["__gpu$xla.gpu.triton"])):
                text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
                assert all(m in text for m in markers), [m for m in markers if m not in text]


def test_a_float64_circuit_runs_its_sum_layers_on_xla_whatever_the_impl():
    """The kernels compute in float32: a float64 circuit's explicit or tuned kernel choice (which should change how,
    never what) runs its sum layers on XLA, equal to impl="xla" bit for bit."""
    with jax.enable_x64(True):
        cat = distributions.Categorical(4)
        c = jaxpc.compile(structures.PD((2, 2), 4, split_intervals=1, input_dist=cat, block_size=4), seed=0,
                          dtype=jnp.float64)
        x = np.random.default_rng(0).integers(0, 4, (8, 4)).astype(np.int32)
        ref = c.flows(c.params, x, options=jaxpc.Options(impl="xla"), return_ll=True)
        for impl in ("pallas", "pallas_forward"):
            got = c.flows(c.params, x, options=jaxpc.Options(impl=impl), return_ll=True)
            for u, v in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
                assert u.dtype == jnp.float64
                np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
