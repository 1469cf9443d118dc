"""Random small circuits for brute-force tests: random region splits, block sizes 1-4,
block-sparse sum and product edges, tied sums and inputs, explicit and random parameters,
sums over sums, and every distribution."""

from __future__ import annotations

import itertools

import numpy as np

import jaxpc
from jaxpc import distributions

KINDS = ("categorical", "bernoulli", "masked", "indicator", "literal", "gaussian", "logistic")
CARD = {"categorical": 3, "bernoulli": 2, "masked": 3, "indicator": 2, "literal": 2, "logistic": 3}


def random_sum(rng, children, nb: int, K: int, registry: dict, tie_prob: float, sparse: float,
               explicit: bool | None = None, sparse_needs_two: bool = False):
    """A random sum vector of ``nb`` blocks of ``K`` nodes over ``children``: at times (``tie_prob``) a tied copy
    of an earlier one of the same shape in ``registry``, else block-sparse edges with probability ``sparse`` (only
    over two child blocks or more with ``sparse_needs_two``) and explicit random weights half the time (or as
    ``explicit`` says); new vectors are recorded in ``registry``."""
    key = (nb, K, tuple((c.num_node_blocks, c.block_size) for c in children))
    if key in registry and rng.random() < tie_prob:
        return registry[key].duplicate(*children, tie_params=True)
    T = sum(c.num_node_blocks for c in children)
    edge_ids = None
    if rng.random() < sparse and (T > 1 or not sparse_needs_two):
        mask = rng.random((nb, T)) < 0.5
        mask[np.arange(nb), rng.integers(0, T, nb)] = True
        edge_ids = np.stack(np.nonzero(mask))
    ns = jaxpc.summate(*children, num_node_blocks=nb, block_size=K, edge_ids=edge_ids)
    if rng.random() < 0.5 if explicit is None else explicit:
        Kc = children[0].block_size
        dense = np.zeros((ns.num_nodes, ns.num_ch_nodes))
        for p, c in ns.edge_ids.T:
            dense[p * K:(p + 1) * K, c * Kc:(c + 1) * Kc] = rng.random((K, Kc)) + 0.05
        ns.set_params(dense)
    registry.setdefault(key, ns)
    return ns


class Generator:
    def __init__(self, seed: int, num_vars: int, kinds=None, tie_prob: float = 0.4, max_blocks: int = 3,
                 block_sizes=(1, 2, 3, 4)):
        self.rng = np.random.default_rng(seed)
        rng = self.rng
        pool = KINDS if kinds is None else kinds
        self.kinds = [pool[i] for i in rng.integers(0, len(pool), num_vars)]
        self.num_vars = num_vars
        self.tie_prob = tie_prob
        self.max_blocks = max_blocks
        self.block_sizes = block_sizes
        self.sum_registry: dict = {}
        self.leaf_registry: dict = {}
        self.leaf_sums: list = []

    def _bs(self):
        return int(self.rng.choice(self.block_sizes))

    def _probs(self, n, k):
        p = self.rng.random((n, k)) + 0.05
        return p / p.sum(1, keepdims=True)

    def leaf(self, v: int, nb: int, K: int):
        rng = self.rng
        kind = self.kinds[v]
        key = (kind, nb, K)
        if key in self.leaf_registry and rng.random() < self.tie_prob and kind not in ("literal",):
            return self.leaf_registry[key].duplicate(v, tie_params=True)
        n = nb * K
        explicit = rng.random() < 0.5
        if kind == "categorical":
            ns = jaxpc.inputs(v, nb, K, distributions.Categorical(3), params=self._probs(n, 3) if explicit else None)
        elif kind == "bernoulli":
            params = rng.uniform(0.1, 0.9, n) if explicit else None
            ns = jaxpc.inputs(v, nb, K, distributions.Bernoulli(), params=params)
        elif kind == "masked":
            lo = rng.integers(0, 2, n)
            hi = np.minimum(lo + 1 + rng.integers(0, 3, n), 3)
            mask = np.stack([lo, hi], 1)
            params = {"mask": mask}
            if explicit:
                ar = np.arange(3)[None, :]
                p = self._probs(n, 3) * ((ar >= lo[:, None]) & (ar < hi[:, None]))
                params["probs"] = p / p.sum(1, keepdims=True)
            ns = jaxpc.inputs(v, nb, K, distributions.MaskedCategorical(3, "range"), params=params)
        elif kind == "indicator":
            ns = jaxpc.inputs(v, nb, K, distributions.Indicator(2))
        elif kind == "literal":
            Kc = self._bs()
            l0 = jaxpc.inputs(v, 1, Kc, distributions.Literal(0))
            l1 = jaxpc.inputs(v, 1, Kc, distributions.Literal(1))
            return jaxpc.summate(l0, l1, num_node_blocks=nb, block_size=K)
        elif kind == "gaussian":
            params = {"mu": rng.normal(0, 1, n), "sigma": rng.uniform(0.5, 1.5, n)} if explicit else None
            ns = jaxpc.inputs(v, nb, K, distributions.Gaussian(min_sigma=0.05), params=params)
        elif kind == "logistic":
            params = {"mu": rng.uniform(0, 1, n), "s": rng.uniform(0.1, 0.5, n)} if explicit else None
            ns = jaxpc.inputs(v, nb, K, distributions.DiscreteLogistic((0.0, 1.0), 3), params=params)
        else:
            raise AssertionError(kind)
        self.leaf_registry.setdefault(key, ns)
        return ns

    def _sum(self, children, nb: int, K: int):
        return random_sum(self.rng, children, nb, K, self.sum_registry, self.tie_prob, sparse=0.6)

    def region(self, vars_: list[int], nb: int, K: int):
        rng = self.rng
        if len(vars_) == 1:
            v = vars_[0]
            same_k = [t for t in self.leaf_sums if t.block_size == K]
            if same_k and rng.random() < self.tie_prob:  # tie to an earlier sum over leaves of another variable
                src = same_k[int(rng.integers(len(same_k)))]
                leaves = [self.leaf(v, c.num_node_blocks, c.block_size) for c in src.children]
                return src.duplicate(*leaves, tie_params=True)
            if rng.random() < 0.4:  # a sum over leaf vectors
                Kc = self._bs()
                leaves = [self.leaf(v, int(rng.integers(1, self.max_blocks + 1)), Kc)
                          for _ in range(int(rng.integers(1, 3)))]
                out = self._sum(leaves, nb, K)
                self.leaf_sums.append(out)
                return out
            return self.leaf(v, nb, K)
        if rng.random() < 0.1:  # a sum over a sum
            inner = self.region(vars_, int(rng.integers(1, self.max_blocks + 1)), self._bs())
            return self._sum([inner], nb, K)
        Kc = self._bs()
        prods = []
        for _ in range(1 if len(vars_) <= 2 else int(rng.integers(1, 3))):
            perm = list(rng.permutation(vars_))
            nparts = 2 if len(perm) < 3 or rng.random() < 0.7 else 3
            cuts = sorted(rng.choice(np.arange(1, len(perm)), nparts - 1, replace=False))
            parts = [sorted(int(v) for v in p) for p in np.split(np.asarray(perm), cuts)]
            children = [self.region(p, int(rng.integers(1, self.max_blocks + 1)), Kc) for p in parts]
            nbs = [ch.num_node_blocks for ch in children]
            npb = int(rng.integers(1, self.max_blocks + 1))
            edge_ids = np.stack([rng.integers(0, b, npb) for b in nbs], axis=1)
            prods.append(jaxpc.multiply(*children, edge_ids=edge_ids))
        return self._sum(prods, nb, K)

    def circuit(self):
        root = self.region(list(range(self.num_vars)), 1, 1)
        return root

    def discrete_vars(self):
        return [v for v in range(self.num_vars) if self.kinds[v] != "gaussian"]

    def all_assignments(self):
        """``[M, V]`` float64 array enumerating all discrete values (Gaussian columns 0) and the
        missing mask marking the Gaussian columns."""
        cols = [range(CARD[k]) if k != "gaussian" else [0] for k in self.kinds]
        x = np.asarray(list(itertools.product(*cols)), dtype=np.float64)
        miss = np.asarray([k == "gaussian" for k in self.kinds])
        return x, miss

    def sample_data(self, n: int):
        """Random valid data (Gaussian columns real)."""
        rng = self.rng
        cols = []
        for k in self.kinds:
            if k == "gaussian":
                cols.append(rng.normal(0, 1.2, n))
            else:
                cols.append(rng.integers(0, CARD[k], n).astype(np.float64))
        return np.stack(cols, 1)
