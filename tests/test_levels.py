"""Evened tree levels (:mod:`jaxpc.compiler.levels`): runs of similar tree levels of the folded plan are padded to one
shape and run under one scan body. The padding blocks must change no number: log-likelihoods, flows, EM steps and
log-space flows against the float64 oracle and the unpadded plan, on the XLA route and the Pallas kernels."""

import jax
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions
from jaxpc.compiler import ScanSpec
from jaxpc.compiler.levels import is_padding
from jaxpc.structures.hclt import hidden_tree_circuit

from . import oracle
from .tiers import cases, slow

CAT = 3
FOLD = jaxpc.Options(fold_products=True)


def chains_tree(lengths, extra_leaves=(0, 2)):
    """A tree over variables: chains of the given lengths hang from the root (so level ``h`` holds the chains longer
    than ``h``: block counts that shrink slowly), and ``extra_leaves`` leaves hang from some chain nodes (products
    of different arity in one level). Returns ``(children, root)``."""
    children, v = [[]], 1
    for i, L in enumerate(lengths):
        prev = 0
        for j in range(L):
            children.append([])
            children[prev].append(v)
            if j == 1 and i < len(extra_leaves):
                for _ in range(extra_leaves[i]):
                    children.append([])
                    children[v].append(v + 1 + _)
                node, v = v, v + 1 + extra_leaves[i]
                prev = node
                continue
            prev, v = v, v + 1
    return children, 0


def tree_circuit(lengths=(2, 3, 4, 4, 5, 5), latents=4, block_size=4, scan_min_repeats=3, seed=1):
    children, root = chains_tree(lengths)
    V = len(children)
    circuit = hidden_tree_circuit(children, root, latents, list(range(V)), distributions.Categorical(CAT),
                                  block_size=block_size)
    return jaxpc.compile(circuit, seed=seed, scan_min_repeats=scan_min_repeats), V, circuit


def padding_blocks(c) -> int:
    """Padding blocks in the folded plan's tables (scanned tables unstacked)."""
    n = 0
    for step, tab in zip(c.layout.fold.steps, c.tables["fold"]["steps"]):
        scanned = isinstance(step, ScanSpec)
        for t in tab if scanned else [tab]:
            for st in t["sums"]:
                ch = np.asarray(st["ch"])
                n += int(is_padding(ch.reshape((-1,) + ch.shape[2:]) if scanned else ch).sum())
    return n


@pytest.fixture(scope="module")
def evened():
    c, V, _ = tree_circuit()
    data = np.random.default_rng(3).integers(0, CAT, (24, V)).astype(np.int32)
    return c, data


def test_the_folded_levels_are_padded_into_scans(evened):
    c, _ = evened
    plain, _, root = tree_circuit(scan_min_repeats=0)
    assert padding_blocks(c) > 0
    assert padding_blocks(plain) == 0
    scans = [s for s in c.layout.fold.steps if isinstance(s, ScanSpec)]
    assert scans and len(c.layout.fold.steps) < len(plain.layout.fold.steps)
    # the unfolded layout and the parameters are untouched
    assert c.layout.steps == plain.layout.steps
    for a, b in zip(jax.tree_util.tree_leaves(c.params), jax.tree_util.tree_leaves(plain.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("impl", cases(["auto", "pallas", "xla"], fast=["auto"]))
@pytest.mark.parametrize("batch", cases([8, 70], fast=[8]))
def test_flows_and_ll_match_the_oracle(evened, impl, batch):
    """With missing values and per-sample weights; ``impl="pallas"`` runs the in-place forward and the tree-level
    backward kernels (one kernel per level up to 64 samples, three above) over the padding blocks (interpret mode
    off a GPU)."""
    c, data = evened
    rng = np.random.default_rng(batch)
    x = np.resize(data, (batch, data.shape[1]))
    miss = rng.random(x.shape) < 0.2
    w = rng.uniform(0.5, 2.0, batch)
    fl, ll = c.flows(c.params, x, missing=miss, ll_weights=w, options=FOLD.replace(impl=impl), return_ll=True)
    totals, in_totals, _ = oracle.flow_totals(c, c.params, x, miss, weights=w)
    assert oracle.check_flows(c, fl, totals, in_totals) > 0
    _, ref = oracle.forward(c, c.params, x, miss)
    np.testing.assert_allclose(np.asarray(ll), ref, rtol=1e-5, atol=1e-5)


# slow: in the fast tier test_flows_and_ll_match_the_oracle[8-auto] runs the batched pass (auto's choice for the
# levels' fan-in 1 at that batch) over the padded plan against the oracle
@pytest.mark.parametrize("mode", cases(["batched", "inline"], fast=[]))
def test_parameter_flow_passes_equal_the_unpadded_plan(evened, mode):
    """The batched parameter-flow pass leaves the padding blocks out; the inline one adds their zero flows."""
    c, data = evened
    plain, _, root = tree_circuit(scan_min_repeats=0)
    opts = FOLD.replace(param_flow_pass=mode)
    got = c.flows(c.params, data, options=opts, return_ll=True)
    ref = plain.flows(plain.params, data, options=opts, return_ll=True)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


@slow
@pytest.mark.parametrize("call", ["em_step", "logspace_flows", "node_flows"])
def test_em_step_log_flows_and_node_flows_equal_the_unpadded_plan(evened, call):
    c, data = evened
    plain, _, root = tree_circuit(scan_min_repeats=0)
    # (the default flows: test_flows_and_ll_match_the_oracle)
    if call == "em_step":
        got = c.em_step(c.params, data, pseudocount=0.1)
        ref = plain.em_step(plain.params, data, pseudocount=0.1)
    else:
        o = FOLD.replace(**{call: True})
        got, ref = c.flows(c.params, data, options=o), plain.flows(plain.params, data, options=o)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
