"""Hidden Markov models as circuits (PyJuice's construction and conventions).

``alpha[i, j] = P(z_{t+1} = j | z_t = i)``, ``beta[i, v] = P(x_t = v | z_t = i)``,
``gamma[i] = P(z_0 = i)``. The circuit is built backwards: the sum vector of step ``t``
holds ``P(x_{t+1:} | z_t)``, so its ``i``-th node mixes the step-``t+1`` products with the
``i``-th row of ``alpha``. Every step has the same shapes, so the compiled circuit runs all
steps under one ``lax.scan`` (tied or not): compile time does not grow with the length.
"""

from __future__ import annotations

import numpy as np

from .. import distributions
from ..nodes import SumNodes, inputs, multiply, summate
from ..nodes.nodes import check_dist
from ._util import check_bool, check_int, check_latents, check_weights


def HMM(seq_length: int, num_latents: int, num_emits: int, homogeneous: bool = True, block_size: int | None = None,
        alpha=None, beta=None, gamma=None) -> SumNodes:
    """A hidden Markov model with categorical emissions.

    Args:
        seq_length: number of steps (variables ``0 .. seq_length - 1``).
        num_latents: hidden states.
        num_emits: vocabulary size.
        homogeneous: tie transitions and emissions across steps (else each step has its own,
            initialized to the same values); a bool (else a ``TypeError``).
        block_size: node block size (default: the largest power of two dividing ``num_latents``,
            at most 1024).
        alpha, beta, gamma: optional ``[L, L]`` transition, ``[L, V]`` emission and ``[L]`` initial
            probabilities (``L = num_latents``, ``V = num_emits``): ``alpha[i, j] = P(z_{t+1} = j | z_t = i)`` (row
            ``i`` is the distribution of the next state from state ``i``), ``beta[i, v] = P(x_t = v | z_t = i)``,
            ``gamma[i] = P(z_0 = i)``. They become ``circuit.params`` after :func:`jaxpc.compile`. Entries must be
            finite and non-negative real numbers (not booleans: a ``TypeError``); each row of ``alpha`` and ``beta``,
            and ``gamma``, is renormalized to sum to 1 (so unnormalized weights such as counts are taken as their
            proportions), and a row summing to zero raises a ``ValueError``. Omitted ones are drawn by
            :func:`jaxpc.compile` (its ``seed``).
    """
    num_latents = check_int("HMM", "num_latents", num_latents)
    num_emits = check_int("HMM", "num_emits", num_emits)
    if beta is not None:
        beta = check_weights("HMM", "beta", beta)
        if beta.shape != (num_latents, num_emits):
            raise ValueError(f"HMM: beta must have shape [num_latents, num_emits] = [{num_latents}, {num_emits}], "
                             f"got {beta.shape}")
        if np.any(beta.sum(axis=1) <= 0):
            raise ValueError(f"HMM: beta row {int(np.argmin(beta.sum(axis=1)))} sums to zero (row i holds "
                             f"P(x_t | z_t = i))")
    return GeneralizedHMM(seq_length, num_latents, distributions.Categorical(num_emits), homogeneous=homogeneous,
                          block_size=block_size, alpha=alpha, beta=beta, gamma=gamma)


def GeneralizedHMM(seq_length: int, num_latents: int, input_dist: distributions.Distribution, homogeneous: bool = True,
                   block_size: int | None = None, alpha=None, beta=None, gamma=None) -> SumNodes:
    """An HMM whose emissions are any distribution of :mod:`jaxpc.distributions` (``beta``: its natural
    parameters for ``num_latents`` nodes, e.g. ``{"mu": [L], "sigma": [L]}`` for a Gaussian).

    Args:
        seq_length: number of steps (variables ``0 .. seq_length - 1``), a positive int (else a ``ValueError``).
        num_latents: hidden states ``L``, a positive int.
        input_dist: the emission distribution of every step (a :class:`jaxpc.distributions.Distribution`, else a
            ``TypeError``).
        homogeneous: as for :func:`HMM`: tie transitions and emissions across steps (default ``True``).
        block_size: as for :func:`HMM` (default: the largest power of two dividing ``num_latents``, at most
            1024); it must divide ``num_latents`` (else a ``ValueError``).
        alpha: as for :func:`HMM`: optional ``[L, L]`` transition probabilities (rows renormalized; another shape
            is a ``ValueError``).
        beta: optional natural parameters of ``input_dist`` for ``L`` nodes (checked by the distribution).
        gamma: as for :func:`HMM`: optional ``[L]`` initial probabilities (renormalized; another shape is a
            ``ValueError``).
    """
    seq_length = check_int("HMM", "seq_length", seq_length)
    bs, nb = check_latents("HMM", num_latents, block_size, 1024)
    input_dist = check_dist("HMM", "input_dist", input_dist)
    homogeneous = check_bool("HMM", "homogeneous", homogeneous)
    L = num_latents = int(num_latents)
    if alpha is not None:
        alpha = check_weights("HMM", "alpha", alpha)
        if alpha.shape != (L, L):
            raise ValueError(f"HMM: alpha must have shape [num_latents, num_latents] = [{L}, {L}], got {alpha.shape}")
        if np.any(alpha.sum(axis=1) <= 0):
            raise ValueError(f"HMM: alpha row {int(np.argmin(alpha.sum(axis=1)))} sums to zero (row i holds "
                             f"P(z_t+1 | z_t = i))")
    if gamma is not None:
        gamma = check_weights("HMM", "gamma", gamma)
        if gamma.shape != (L,):
            raise ValueError(f"HMM: gamma must have shape [num_latents] = [{L}], got {gamma.shape}")
        if gamma.sum() <= 0:
            raise ValueError("HMM: gamma sums to zero")

    emit = inputs(seq_length - 1, num_node_blocks=nb, block_size=bs, dist=input_dist, params=beta,
                  name=f"emit{seq_length - 1}")
    z = emit
    trans = None
    for t in range(seq_length - 2, -1, -1):
        x_t = emit.duplicate(t, tie_params=homogeneous, name=f"emit{t}")
        if trans is None:
            trans = summate(z, num_node_blocks=nb, block_size=bs, params=alpha, name=f"trans{t}")
            s = trans
        else:
            s = trans.duplicate(z, tie_params=homogeneous, name=f"trans{t}")
        z = multiply(x_t, s, name=f"z{t}")
    return summate(z, num_node_blocks=1, block_size=1, params=None if gamma is None else gamma[None, :],
                   name="init")
