"""Hidden Chow-Liu trees (Liu & Van den Broeck, 2021).

1. Pairwise mutual information of soft-binned data (each value spread over ``num_bins`` bins
   by a Gaussian kernel of width ``sigma``): one matrix product per block of variables, with JAX on the
   default device at its default precision.
2. The Chow-Liu tree: a maximum spanning tree of the MI graph (``scipy.sparse.csgraph``),
   rooted at its center.
3. Every variable ``x_v`` gets a latent ``z_v`` with ``num_latents`` states; the circuit mirrors
   the tree ``z_parent -> z_v -> x_v``. Leaves of the tree merge their latent into the input
   vector, as PyJuice does, so the sizes match PyJuice's HCLT exactly.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from scipy.sparse import csgraph, csr_matrix

from .. import distributions
from ..nodes import CircuitNodes, inputs, multiply, summate
from ..nodes.nodes import check_dist
from ._util import check_bool, check_int, check_latents, check_leaf_values, check_numbers

__all__ = ["HCLT", "mutual_information", "chow_liu_tree"]


@functools.partial(jax.jit, static_argnames=("num_bins", "sigma", "num_vars"))
def _soft_bins(xs, *, num_bins: int, sigma: float, num_vars: int):
    """Each value of ``xs`` ``[B, n]`` spread over ``num_bins`` bins: ``(p, q)``, both ``[B, n * nb]``, ``p`` with
    no mass on the padding variables past ``num_vars`` and ``q`` normalized per value."""
    bins = jnp.linspace(0.0, 1.0, num_bins, dtype=xs.dtype)  # (float32 under jax_enable_x64 too: the same bins)
    p = jnp.exp(-0.5 * jnp.square(xs[:, :, None] - bins[None, None, :]) / (sigma * sigma))  # [B, n, nb]
    q = p / jnp.sum(p, axis=2, keepdims=True)
    p = p * (jnp.arange(xs.shape[1]) < num_vars)[None, :, None]
    return p.reshape(p.shape[0], -1), q.reshape(q.shape[0], -1)


# (one executable apart from _soft_bins: on the H200, XLA took 37 s to compile the two reductions in one)
@functools.partial(jax.jit, static_argnames=("num_bins",))
def _entropies(q, *, num_bins: int):
    """The entropies ``[n]`` of the variables' mean soft bins (``q`` from :func:`_soft_bins`)."""
    marg = jnp.mean(q, axis=0).reshape(-1, num_bins)
    return -jnp.sum(marg * jnp.log(marg + 1e-4), axis=1)


def _row_entropy(p, start, *, num_bins: int, rows: int, cols: int):
    """Entropy of the soft joint histogram of each of the ``rows`` variables from ``start`` with each of the ``cols``
    variables from ``start`` on, wrapping around past the last variable of ``p`` ``[B, V * nb]``: ``[rows, cols]``.
    One matrix product at JAX's default precision (the start is traced, so one compile serves every block)."""
    B, width = p.shape
    pa = jax.lax.dynamic_slice_in_dim(p, start * num_bins, rows * num_bins, axis=1)
    pb = jnp.take(p, (start * num_bins + jnp.arange(cols * num_bins)) % width, axis=1)
    joint = jnp.dot(pa.T, pb) / B
    joint = joint.reshape(rows, num_bins, cols, num_bins)
    total = jnp.sum(joint, axis=(1, 3), keepdims=True)
    joint = joint / jnp.where(total > 0, total, 1.0)  # (padding variables: all zero)
    return -jnp.sum(joint * jnp.log(joint + 1e-4), axis=(1, 3))


# XLA's Triton GEMM fusions of this one product and their autotuning took 42 s to compile on the H200 (the
# product runs a few times per tree): compiled without them it takes about a second
_ROW_ENTROPY_XLA = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}


@functools.lru_cache(maxsize=8)
def _row_entropy_exe(shape: tuple, num_bins: int, rows: int, cols: int, backend: str, precision):
    """:func:`_row_entropy` compiled for ``p`` of ``shape`` (float32) on ``backend`` under JAX's matmul
    ``precision`` setting."""
    lowered = jax.jit(functools.partial(_row_entropy, num_bins=num_bins, rows=rows, cols=cols)).lower(
        jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
    return lowered.compile(compiler_options=_ROW_ENTROPY_XLA if backend == "gpu" else None)


def mutual_information(x, num_bins: int = 32, sigma: float = 0.5 / 32, chunk_size: int = 64) -> np.ndarray:
    """Soft-binned pairwise mutual information ``[V, V]`` of data ``x`` ``[N, V]`` (values are scaled to
    ``[0, 1]`` by the global min and max first), computed with JAX on the default device. ``x`` must hold numbers
    (else a ``TypeError``), finite (else a ``ValueError`` naming the entry), in two axes.

    ``num_bins``: soft bins evenly spaced over ``[0, 1]`` (default 32; an int >= 2, else a ``ValueError``).
    ``sigma``: the width of each value's Gaussian spread over the bins, in the scaled units (default ``0.5 / 32``;
    a positive finite float, else a ``ValueError``). ``chunk_size``: variables per block of the pairwise pass (default
    64, at most ``V`` used; a positive int, else a ``ValueError``): it trades memory for fewer calls."""
    x = np.asarray(x)
    check_numbers("mutual_information", "x", x)
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"mutual_information: x must be [num_samples >= 1, num_vars >= 1], got shape {x.shape}")
    x = x.astype(np.float64) if x.dtype.kind in "biu" or x.dtype.itemsize > 4 else x.astype(np.float32)
    if not np.isfinite(x).all():
        r, c = np.argwhere(~np.isfinite(x))[0]
        raise ValueError(f"mutual_information: x must be finite; x[{r}, {c}] is {x[r, c]}")
    num_bins = check_int("mutual_information", "num_bins", num_bins, 2)
    chunk_size = check_int("mutual_information", "chunk_size", chunk_size)
    if isinstance(sigma, (bool, np.bool_)) or not (isinstance(sigma, (int, float, np.integer, np.floating)) and
                                                   np.isfinite(sigma) and sigma > 0):
        raise ValueError(f"mutual_information: sigma must be a positive float, got {sigma!r}")
    lo, hi = float(x.min()), float(x.max())
    V, nb = x.shape[1], int(num_bins)
    c = max(1, min(int(chunk_size), V))
    n = -(-V // c) * c
    xs = np.zeros((x.shape[0], n), np.float32)
    xs[:, :V] = (x - lo) / (hi - lo + 1e-8)  # (scaled in the data's precision, then rounded to float32)
    p, q = _soft_bins(jnp.asarray(xs), num_bins=nb, sigma=float(sigma), num_vars=V)
    h1 = _entropies(q, num_bins=nb)
    del q
    # Block b of c variables pairs with blocks b, b + 1, ... b + m // 2 (mod m) of the m blocks: every pair of
    # blocks meets once (twice where m is even: then from the lower block), at about half the full product's work.
    m = n // c
    span = m // 2 + 1
    exe = _row_entropy_exe(tuple(p.shape), nb, c, span * c, jax.default_backend(),
                           jax.config.jax_default_matmul_precision)
    rows = [exe(p, np.int32(b * c)) for b in range(m)]
    upper = np.zeros((n, n), np.float32)  # block (i, j), i <= j: block i's rows against block j's variables
    for b, row in enumerate(rows):
        row = np.asarray(row)
        for k in range(span):
            j = (b + k) % m
            if 2 * k == m and b > j:
                continue
            block = row[:, k * c:(k + 1) * c]
            first, second = min(b, j), max(b, j)
            upper[first * c:(first + 1) * c, second * c:(second + 1) * c] = block if b <= j else block.T
    h12 = np.where(np.triu(np.ones((V, V), bool)), upper[:V, :V], upper[:V, :V].T)  # each pair from i <= j
    h1 = np.asarray(h1)[:V]
    return h1[:, None] + h1[None, :] - h12.astype(np.float64)


def chow_liu_tree(mi: np.ndarray) -> tuple[list[list[int]], int]:
    """Maximum spanning tree of the pairwise scores ``mi`` rooted at its center. Returns (children lists, root).

    Args:
        mi: ``[V, V]`` (``V >= 1``) finite scores of the pairs of variables, such as :func:`mutual_information`
            returns; the tree reads the upper triangle (``mi[i, j]``, ``i < j``), so ``mi`` is meant symmetric. Other
            shapes, non-numbers and NaN or infinite scores raise a ``TypeError`` or ``ValueError``.

    Returns:
        ``(children, root)``: ``children[v]`` the child variables of ``v`` (ids ``0 .. V - 1``), ``root`` the
        variable at the middle of a longest path.
    """
    mi = np.asarray(mi)
    check_numbers("chow_liu_tree", "mi", mi)
    mi = mi.astype(np.float64)
    if mi.ndim != 2 or mi.shape[0] != mi.shape[1] or mi.shape[0] < 1:
        raise ValueError(f"chow_liu_tree: mi must be a square [V, V] matrix of pairwise scores (V >= 1), such as "
                         f"mutual_information(x) returns, got shape {mi.shape}")
    if not np.isfinite(mi).all():
        r, c = np.argwhere(~np.isfinite(mi))[0]
        raise ValueError(f"chow_liu_tree: mi must be finite; mi[{r}, {c}] is {mi[r, c]}")
    V = mi.shape[0]
    if V == 1:
        return [[]], 0
    # minimum spanning tree of (max - mi): all weights positive, so no edge is mistaken for "absent"
    w = np.triu(mi.max() - mi + 1.0, k=1)
    mst = csgraph.minimum_spanning_tree(csr_matrix(w))
    adj = (mst + mst.T).tocsr()
    root = _tree_center(adj)
    order, preds = csgraph.breadth_first_order(adj, root, directed=False, return_predecessors=True)
    children: list[list[int]] = [[] for _ in range(V)]
    for v in order[1:]:
        children[preds[v]].append(int(v))
    return children, int(root)


def _tree_center(adj) -> int:
    """The middle of a longest path (two breadth-first searches)."""
    def farthest(src):
        dist = csgraph.shortest_path(adj, unweighted=True, indices=src, directed=False)
        return int(np.argmax(dist)), dist

    a, _ = farthest(0)
    b, _ = farthest(a)
    _, preds = csgraph.breadth_first_order(adj, a, directed=False, return_predecessors=True)
    path = [b]
    while path[-1] != a:
        path.append(int(preds[path[-1]]))
    return path[len(path) // 2]


def HCLT(x, num_latents: int, num_bins: int = 32, sigma: float = 0.5 / 32, chunk_size: int = 64,
         num_root_ns: int = 1, block_size: int | None = None, input_dist: distributions.Distribution | None = None,
         tie_input_params: bool = False, variables=None) -> CircuitNodes:
    """A hidden Chow-Liu tree learned from data ``x`` ``[N, V]``.

    Args:
        x: data used to learn the tree (a few thousand rows suffice): numbers (ints or floats; else a
            ``TypeError``), finite.
        num_latents: latent states per variable.
        num_bins, sigma, chunk_size: the soft-binned mutual information estimator.
        num_root_ns: nodes of the root sum (1 for a distribution; more when the HCLT is a region
            inside a larger circuit).
        block_size: default: largest power of two dividing ``num_latents``, at most 1024.
        input_dist: leaf distribution (default ``Categorical(num_cats=256)``); where it is discrete, every entry of
            ``x`` must be one of its values (else a ``ValueError`` names the first that is not).
        tie_input_params: share one set of leaf parameters across all variables (a bool, else a ``TypeError``).
        variables: variable id of each column of ``x`` (default ``0 .. V-1``): distinct ints >= 0, one per column
            (else a ``ValueError``).
    """
    x = np.asarray(x)
    check_numbers("HCLT", "x", x)
    if x.ndim != 2 or x.shape[0] < 2 or x.shape[1] < 1:
        raise ValueError(f"HCLT: x must be [num_samples >= 2, num_vars >= 1], got shape {x.shape}")
    input_dist = check_dist("HCLT", "input_dist", input_dist, distributions.Categorical(num_cats=256))
    tie_input_params = check_bool("HCLT", "tie_input_params", tie_input_params)
    variables = _check_variables(variables, x.shape[1])
    bs, _ = check_latents("HCLT", num_latents, block_size, 1024)  # (before the tree is learned)
    _check_root_ns(num_root_ns, bs)
    check_leaf_values("HCLT", x, input_dist)
    mi = mutual_information(x, num_bins=num_bins, sigma=sigma, chunk_size=chunk_size)
    children, root = chow_liu_tree(mi)
    return hidden_tree_circuit(children, root, num_latents, variables, input_dist, num_root_ns=num_root_ns,
                               block_size=block_size, tie_input_params=tie_input_params)


def _check_variables(variables, num_cols: int) -> list[int]:
    """HCLT's ``variables``: ``num_cols`` distinct variable ids (ints >= 0, not bools); None: ``0 .. num_cols - 1``."""
    if variables is None:
        return list(range(num_cols))
    vs = np.asarray(variables)
    if vs.ndim != 1 or len(vs) != num_cols:
        raise ValueError(f"HCLT: variables must hold one variable id per column of x ({num_cols}), got "
                         f"{variables!r}")
    for v in variables:
        if not isinstance(v, numbers.Integral) or isinstance(v, (bool, np.bool_)) or v < 0:
            raise ValueError(f"HCLT: variables must be ints >= 0, got {v!r} in {variables!r}")
    if len(set(int(v) for v in variables)) != num_cols:
        dup = next(int(v) for i, v in enumerate(variables) if int(v) in [int(w) for w in variables[:i]])
        raise ValueError(f"HCLT: variables must be distinct, but {dup} is given twice")
    return [int(v) for v in variables]


def _check_root_ns(num_root_ns, bs: int) -> int:
    """HCLT's ``num_root_ns``: 1 or a positive multiple of the block size ``bs``."""
    num_root_ns = check_int("HCLT", "num_root_ns", num_root_ns)
    if num_root_ns != 1 and num_root_ns % bs:
        raise ValueError(f"HCLT: num_root_ns={num_root_ns} must be 1 or a multiple of block_size={bs}")
    return num_root_ns


def hidden_tree_circuit(children: list[list[int]], root: int, num_latents: int, variables: list[int],
                        input_dist: distributions.Distribution, num_root_ns: int = 1, block_size: int | None = None,
                        tie_input_params: bool = False) -> CircuitNodes:
    """The circuit of a tree-shaped latent model (see the module docstring)."""
    bs, nb = check_latents("HCLT", num_latents, block_size, 1024)
    num_root_ns = _check_root_ns(num_root_ns, bs)
    template = None

    def leaf(i):
        nonlocal template
        v = variables[i]
        if tie_input_params and template is not None:
            return template.duplicate(v, tie_params=True)
        ns = inputs(v, num_node_blocks=nb, block_size=bs, dist=input_dist)
        template = template or ns
        return ns

    # post-order without recursion (trees over thousands of variables are deep)
    order, stack = [], [root]
    while stack:
        v = stack.pop()
        order.append(v)
        stack.extend(children[v])
    region: dict[int, CircuitNodes] = {}
    for v in reversed(order):
        if not children[v]:
            region[v] = leaf(v)
            continue
        prod = multiply(*[region[c] for c in children[v]], leaf(v))
        if v == root:
            if num_root_ns == 1:
                region[v] = summate(prod, num_node_blocks=1, block_size=1)
            else:
                region[v] = summate(prod, num_node_blocks=num_root_ns // bs, block_size=bs)
        else:
            region[v] = summate(prod, num_node_blocks=nb, block_size=bs)
    out = region[root]
    if out.is_input():  # a single variable
        out = summate(out, num_node_blocks=1, block_size=1) if num_root_ns == 1 else \
            summate(out, num_node_blocks=num_root_ns // bs, block_size=bs)
    return out
