"""Fuzzing the compiler and engine against the float64 oracle on circuit shapes that tests/random_circuits.py does not
build: heavy node sharing (one product read by sums at several depths and by a product at the top), deep narrow
chains of single-child sums and products, sums of fan-in 200, sums and products with a single child, a root that is
a leaf or a product, block sizes 1, 3 and 7 in one circuit, sums tied across layers (to their own child, too), one
child vector listed twice, several leaf types over one variable, zero weights and impossible samples, hand-built
HMMs that the compiler runs as chains, and batches of 1, 3 and 257. Each case checks ``log_prob`` (LL, MPE,
GeneralLL, with missing values), ``flows`` (with missing values and sample weights; GeneralLL's and MPE's flows
too) and ``em_step`` against the oracle."""

import numpy as np
import pytest

import jaxpc
from jaxpc import distributions as D
from jaxpc.nodes import topological_order

from . import oracle
from .random_circuits import random_sum
from .tiers import cases

CARDS = {"cat2": 2, "cat3": 3, "cat5": 5, "bern": 2, "masked": 4, "lit": 2, "gauss": None}


class Fuzz:
    """Random circuits over ``num_vars`` variables of random ``kinds``: node vectors are shared across parents with
    probability ``share`` and tied with probability ``tie``; ``deep`` wraps vectors in chains of up to that many
    single-child sums and products; ``wide`` gives products of up to that many blocks."""

    def __init__(self, seed, num_vars, kinds=("cat2", "cat3", "cat5", "bern"), block_sizes=(1, 3, 7), share=0.5,
                 tie=0.4, deep=0, wide=0, max_blocks=3):
        self.rng = rng = np.random.default_rng(seed)
        self.kinds = [kinds[i] for i in rng.integers(0, len(kinds), num_vars)]
        self.nv, self.bs, self.share, self.tie, self.deep, self.wide, self.mb = (
            num_vars, block_sizes, share, tie, deep, wide, max_blocks)
        self.pool, self.sums, self.leaves = {}, {}, {}

    def K(self):
        return int(self.rng.choice(self.bs))

    def nb(self):
        return int(self.rng.integers(1, self.mb + 1))

    def probs(self, n, k):
        p = self.rng.random((n, k)) + 0.05
        return p / p.sum(1, keepdims=True)

    def leaf(self, v, nb, K):
        rng, kind = self.rng, self.kinds[v]
        key = (kind, nb, K)
        if key in self.leaves and rng.random() < self.tie:
            return self.leaves[key].duplicate(v, tie_params=True)
        n, explicit = nb * K, rng.random() < 0.5
        if kind.startswith("cat"):
            k = CARDS[kind]
            ns = jaxpc.inputs(v, nb, K, D.Categorical(k), params=self.probs(n, k) if explicit else None)
        elif kind == "bern":
            ns = jaxpc.inputs(v, nb, K, D.Bernoulli(), params=rng.uniform(0.1, 0.9, n) if explicit else None)
        elif kind == "gauss":
            p = {"mu": rng.normal(0, 1, n), "sigma": rng.uniform(0.5, 1.5, n)} if explicit else None
            ns = jaxpc.inputs(v, nb, K, D.Gaussian(min_sigma=0.05), params=p)
        elif kind == "masked":
            lo = rng.integers(0, 2, n)
            mask = np.stack([lo, np.minimum(lo + 1 + rng.integers(0, 3, n), 4)], 1)
            ns = jaxpc.inputs(v, nb, K, D.MaskedCategorical(4, "range"), params={"mask": mask})
        else:  # "lit": a sum over the two literals
            lits = [jaxpc.inputs(v, 1, K, D.Literal(i)) for i in (0, 1)]
            return self.sum(lits, nb, K)
        self.leaves.setdefault(key, ns)
        return ns

    def sum(self, children, nb, K, explicit=None):
        return random_sum(self.rng, children, nb, K, self.sums, self.tie, sparse=0.5, explicit=explicit,
                          sparse_needs_two=True)

    def node(self, scope, K):
        """A node vector over ``scope`` (most often of block size ``K``), shared with earlier parents at times."""
        rng = self.rng
        key = (tuple(scope), K)
        if key in self.pool and rng.random() < self.share:
            return self.pool[key][int(rng.integers(len(self.pool[key])))]
        out = self._node(scope, K)
        if self.deep and rng.random() < 0.3:
            for _ in range(int(rng.integers(1, self.deep + 1))):
                if rng.random() < 0.5:
                    out = jaxpc.multiply(out, edge_ids=rng.integers(0, out.num_node_blocks, (self.nb(), 1)))
                else:
                    out = self.sum([out], self.nb(), out.block_size)
        self.pool.setdefault((tuple(scope), out.block_size), []).append(out)
        return out

    def _node(self, scope, K):
        rng = self.rng
        if len(scope) == 1:
            if rng.random() < 0.4:
                return self.leaf(scope[0], self.nb(), K)
            Kc = self.K()
            ch = [self.node(scope, Kc) if rng.random() < 0.3 else self.leaf(scope[0], self.nb(), Kc)
                  for _ in range(int(rng.integers(1, 4)))]
            return self.sum([c for c in ch if c.block_size == ch[0].block_size], self.nb(), K)
        Kc = self.K()
        ch = []
        for _ in range(int(rng.integers(1, 4))):
            if rng.random() < 0.15:  # a sum over a vector of the same scope
                got = self.node(scope, Kc)
                if got.block_size == Kc:
                    ch.append(got)
                    continue
            perm = list(rng.permutation(scope))
            parts = 2 if len(perm) < 3 or rng.random() < 0.7 else 3
            cuts = sorted(rng.choice(np.arange(1, len(perm)), parts - 1, replace=False))
            kids = [self.node(sorted(int(v) for v in p), Kc) for p in np.split(np.asarray(perm), cuts)]
            if any(k.block_size != Kc for k in kids):
                kids = [k if k.block_size == Kc else self.sum([k], self.nb(), Kc) for k in kids]
            wide = self.wide and rng.random() < 0.3
            npb = int(rng.integers(self.wide // 2, self.wide + 1)) if wide else self.nb()
            prod = jaxpc.multiply(*kids, edge_ids=np.stack([rng.integers(0, k.num_node_blocks, npb) for k in kids], 1))
            if rng.random() < 0.1:
                prod = jaxpc.multiply(prod)
            ch.append(prod)
            self.pool.setdefault((tuple(scope), Kc), []).append(prod)
        return self.sum(ch, self.nb(), K)

    def circuit(self):
        inner = self.node(list(range(self.nv)), self.K())
        return self.sum([inner], 1, 1)

    def data(self, n):
        cols = [self.rng.normal(0, 1.2, n) if k == "gauss" else self.rng.integers(0, CARDS[k], n).astype(np.float64)
                for k in self.kinds]
        return np.stack(cols, 1)

    def all_assignments(self):
        """Every assignment of the discrete variables (Gaussian columns 0) and the mask of the Gaussian ones."""
        import itertools
        cols = [[0] if k == "gauss" else range(CARDS[k]) for k in self.kinds]
        x = np.asarray(list(itertools.product(*cols)), np.float64)
        return x, np.asarray([k == "gauss" for k in self.kinds])


def fixed(seed, kinds):
    """A :class:`Fuzz` whose variables have the given kinds, in order."""
    g = Fuzz(seed, len(kinds), kinds=tuple(kinds))
    g.kinds = list(kinds)
    return g


# ---- named shapes ------------------------------------------------------------------------------------------------

def shared_product(seed):
    """One product read by sums at five depths and by a product at the top, a sum tied to one a layer below it."""
    g = fixed(seed, ("cat3", "bern", "cat5"))
    K = 3
    a, b, c = g.leaf(0, 2, K), g.leaf(1, 3, K), g.leaf(2, 2, K)
    P = jaxpc.multiply(a, b, edge_ids=np.array([[0, 0], [1, 2], [0, 1], [1, 1]]))
    S1 = g.sum([P], 2, K)
    S2 = g.sum([S1, P], 3, K)
    S3 = jaxpc.summate(S2, P, S1, num_node_blocks=2, block_size=K,
                       edge_ids=np.array([[0, 0, 1, 1, 1], [0, 4, 2, 5, 8]]))
    S4 = S1.duplicate(P, tie_params=True)
    S5 = g.sum([S3, S4, P], 2, K)
    Q = jaxpc.multiply(S5, c, edge_ids=np.array([[0, 0], [1, 1], [1, 0]]))
    Q2 = jaxpc.multiply(S1, c, edge_ids=np.array([[1, 1]]))
    Q3 = jaxpc.multiply(P, c, edge_ids=np.array([[3, 0], [2, 1]]))
    return g, g.sum([g.sum([Q, Q2, Q3], 2, 7)], 1, 1)


def deep_chain(seed, depth=45):
    """A narrow chain of 45 single-child sums and products, block sizes 1, 3 and 7 changing along it."""
    g = fixed(seed, ("cat3", "bern"))
    rng = g.rng
    x = jaxpc.multiply(g.leaf(0, 2, 3), g.leaf(1, 2, 3), edge_ids=np.array([[0, 1], [1, 0]]))
    for i in range(depth):
        if i % 2:
            x = jaxpc.multiply(x, edge_ids=rng.integers(0, x.num_node_blocks, (int(rng.integers(1, 3)), 1)))
        else:
            x = g.sum([x], int(rng.integers(1, 3)), int(rng.choice([1, 3, 7])))
    return g, g.sum([x], 1, 1)


def wide(seed):
    """A dense sum over a product of 200 blocks, and a sum over 41 child vectors."""
    g = fixed(seed, ("cat3", "bern"))
    a, b = g.leaf(0, 20, 1), g.leaf(1, 10, 1)
    P = jaxpc.multiply(a, b, edge_ids=np.stack([np.arange(200) % 20, np.arange(200) // 20], 1))
    S = g.sum([P], 2, 1, explicit=True)
    many = [jaxpc.multiply(g.leaf(0, 1, 1), g.leaf(1, 1, 1)) for _ in range(40)]
    return g, jaxpc.summate(*many, S, num_node_blocks=1, block_size=1)


def mixed_leaves(seed):
    """Categoricals of 5 categories, literals and indicators under one sum; a Gaussian; a Bernoulli beside literals."""
    g = fixed(seed, ("cat5", "gauss", "bern"))
    s0 = jaxpc.summate(jaxpc.inputs(0, 1, 3, D.Categorical(5), params=g.probs(3, 5)),
                       jaxpc.inputs(0, 2, 3, D.Categorical(5)), jaxpc.inputs(0, 1, 3, D.Literal(1)),
                       jaxpc.inputs(0, 1, 3, D.Indicator(5)), num_node_blocks=2, block_size=3)
    s1 = g.sum([g.leaf(1, 2, 3), g.leaf(1, 1, 3)], 2, 3)
    s2 = g.sum([g.leaf(2, 1, 3), jaxpc.inputs(2, 1, 3, D.Literal(1)), jaxpc.inputs(2, 1, 3, D.Literal(0))], 2, 3)
    p = jaxpc.multiply(s0, s1, s2, edge_ids=np.array([[0, 0, 0], [1, 1, 1], [0, 1, 1]]))
    return g, g.sum([p], 1, 1)


def repeated_child(seed):
    """A sum listing one child vector twice, sums tied to their own child, a sum over one leaf vector twice."""
    g = fixed(seed, ("cat3", "bern"))
    K = 3
    a, b = g.leaf(0, 2, K), g.leaf(1, 2, K)
    P = jaxpc.multiply(a, b)
    S1 = g.sum([P, P], 2, K)
    T1 = g.sum([S1], 2, K)
    T3 = T1.duplicate(T1.duplicate(T1, tie_params=True), tie_params=True)
    Q = jaxpc.multiply(g.sum([a, a], 2, K), b, edge_ids=np.array([[0, 1], [1, 0]]))
    return g, jaxpc.summate(T3, Q, T1, S1, num_node_blocks=1, block_size=1)


def zeros(seed):
    """Zero weights inside edges, zero-probability categories: samples of probability zero."""
    g = fixed(seed, ("cat3", "cat3", "cat3"))
    K = 3
    p0 = g.probs(2 * K, 3)
    p0[:, 2] = 0  # value 2 of variable 0 is impossible
    p1 = g.probs(2 * K, 3)
    p1[::2, 0] = 0
    a = jaxpc.inputs(0, 2, K, D.Categorical(3), params=p0 / p0.sum(1, keepdims=True))
    b = jaxpc.inputs(1, 2, K, D.Categorical(3), params=p1 / p1.sum(1, keepdims=True))
    S = jaxpc.summate(jaxpc.multiply(a, b, edge_ids=np.array([[0, 0], [1, 1], [0, 1]])), num_node_blocks=2,
                      block_size=K)
    W = g.rng.random((2 * K, 3 * K)) + 0.05
    W[0, :] = 0
    W[0, 4] = 1.0  # a node with a single nonzero weight
    W[:, 1] = 0  # a child no parent reads
    S.set_params(W)
    return g, jaxpc.summate(jaxpc.multiply(S, g.leaf(2, 2, K)), num_node_blocks=1, block_size=1)


def chain(seed, n=6, nb=2, K=3, tie=True, permute=False, swap=False, tied_leaves=False):
    """A hand-built HMM (the compiler runs it as a chain): ``S_0`` over ``e_0``, then ``S_r x e_{r+1}``."""
    g = fixed(seed, ("cat3",) * n)
    order = [int(v) for v in g.rng.permutation(n)] if permute else list(range(n - 1, -1, -1))
    leaves = []

    def leaf(v):
        if tied_leaves and leaves:
            return leaves[0].duplicate(v, tie_params=True)
        leaves.append(jaxpc.inputs(v, nb, K, D.Categorical(3), params=g.probs(nb * K, 3)))
        return leaves[-1]

    x, first = leaf(order[0]), None
    for i, v in enumerate(order[1:]):
        if tie and first is not None:
            s = first.duplicate(x, tie_params=True)
        else:
            s = g.sum([x], nb, K, explicit=True)
            first = first or s
        e = leaf(v)
        x = jaxpc.multiply(e, s) if swap and i % 2 else jaxpc.multiply(s, e)
    return g, jaxpc.summate(x, num_node_blocks=1, block_size=1)


def tree(seed, n=13, K=4):
    """An HCLT-like latent tree over two chains of variables joined at the root: each variable's sum (one block of
    ``K``) over the product of its leaf and its children's sums; its six levels of two sums form a run of tree
    levels (``layout.fold.tree``)."""
    g = fixed(seed, ("bern",) * n)
    g.tie = 0.0  # (a level of tied sums is no tree level)
    kids = {v: [u for u in range(2, n) if u - 2 == v] + ([1] if v == 0 else []) for v in range(n)}

    def node(v):
        return g.sum([jaxpc.multiply(g.leaf(v, 1, K), *[node(u) for u in kids[v]])], 1, K)

    return g, g.sum([node(0)], 1, 1)


def root_leaf(seed):
    g = fixed(seed, ("cat5",))
    return g, jaxpc.inputs(0, 1, 1, D.Categorical(5), params=g.probs(1, 5))


def root_product(seed):
    g = fixed(seed, ("cat3", "bern", "cat2"))
    kids = [g.node([v], 1) for v in range(3)]
    return g, jaxpc.multiply(*kids, edge_ids=np.array([[k.num_node_blocks - 1 for k in kids]]))


SHAPES = {
    "shared_product": shared_product, "deep_chain": deep_chain, "wide": wide, "mixed_leaves": mixed_leaves,
    "repeated_child": repeated_child, "zeros": zeros, "root_leaf": root_leaf, "root_product": root_product,
    "chain_untied": lambda s: chain(s, tie=False, permute=True, swap=True),
    "chain_tied_leaves": lambda s: chain(s, n=5, nb=1, K=7, tied_leaves=True, swap=True), "tree": tree,
}


# ---- checks ------------------------------------------------------------------------------------------------------

def as_input(g, x):
    return x if "gauss" in g.kinds else x.astype(np.int32)


def tied(c, edge):
    return oracle.tied_edge_flows(c, edge)


def hard_edge_flows(c, params, x, miss, w):
    """MPE's flows by source vector: each sum node's flow goes to its first maximizing child."""
    vals, _ = oracle.forward(c, params, x, miss, mode="MPE")
    order = topological_order(c.root)
    F = {ns.id: np.zeros((ns.num_nodes, len(x))) for ns in order}
    F[c.root.id][0] = w
    edge = {}
    for ns in reversed(order):
        if ns.is_sum():
            with np.errstate(divide="ignore"):
                t = np.log(np.asarray(c.get_node_params(params, ns), np.float64))[:, :, None] + np.concatenate(
                    [vals[ch.id] for ch in ns.children])[None]
            ef = np.zeros(t.shape)
            n, b = np.meshgrid(np.arange(t.shape[0]), np.arange(t.shape[2]), indexing="ij")
            ef[n, np.argmax(t, axis=1), b] = np.where(np.isfinite(t.max(1)), F[ns.id], 0.0)
            edge[ns.id] = ef.sum(2)
            start = 0
            for ch in ns.children:
                F[ch.id] += ef.sum(0)[start:start + ch.num_nodes]
                start += ch.num_nodes
        elif ns.is_prod():
            for j, ch in enumerate(ns.children):
                rows = (ns.edge_ids[:, j][:, None] * ns.block_size + np.arange(ns.block_size)).reshape(-1)
                np.add.at(F[ch.id], rows, F[ns.id])
    return tied(c, edge)


def check_sum_flows(c, fl, ref, what, tol):
    for ns in c.nodes:
        if ns.is_sum() and ns.source is ns:
            np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, ns)), ref[ns.id], rtol=3 * tol, atol=tol,
                                       err_msg=f"{what} {ns.name}")


def check(g, c, B, options=None, *, seed=0, tol=1e-4, propagations=True, normalized=True):
    """``log_prob`` (LL; with ``propagations`` MPE, GeneralLL and their flows), ``flows`` and ``em_step`` of ``B``
    samples with missing values and sample weights against the oracle; with ``normalized``, the probabilities of
    every assignment sum to one."""
    opts = options or jaxpc.Options()
    rng = np.random.default_rng(seed)
    if normalized:
        xa, ma = g.all_assignments()
        ll = np.asarray(c.log_prob(c.params, as_input(g, xa), np.broadcast_to(ma, xa.shape) if ma.any() else None,
                                   options=opts), np.float64)
        assert abs(np.exp(ll).sum() - 1) < 10 * tol
    x = g.data(B)
    miss = rng.random(x.shape) < 0.3
    w = rng.uniform(0.5, 2.0, B)
    fl, ll = c.flows(c.params, as_input(g, x), miss, ll_weights=w, options=opts, return_ll=True)
    _, ref = oracle.forward(c, c.params, x, miss)
    np.testing.assert_allclose(np.asarray(ll), ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, as_input(g, x), miss, options=opts)), ref, rtol=tol,
                               atol=tol)
    sums, ins, _ = oracle.flow_totals(c, c.params, x, miss, weights=w)
    oracle.check_flows(c, fl, sums, ins, rtol=3 * tol, atol=tol)
    step, pc = 0.6, 0.3
    new = c.em_step(c.params, as_input(g, x), miss, step_size=step, pseudocount=pc, ll_weights=w, options=opts)
    for ns in c.nodes:
        if ns.source is not ns:
            continue
        if ns.is_sum():
            W = np.asarray(c.get_node_params(c.params, ns), np.float64)
            want = oracle.em_sum_update(W, sums[ns.id], oracle.edge_mask(ns), ns.ch_block_size, step, pc)
            np.testing.assert_allclose(np.asarray(c.get_node_params(new, ns)), want, rtol=3 * tol, atol=tol,
                                       err_msg=ns.name)
        elif ns.is_input() and ns.id in ins:
            want = oracle.em_input_update(ns.dist, c.get_node_params(c.params, ns), ins[ns.id], step, pc)
            got = c.get_node_params(new, ns)
            for k in want if isinstance(want, dict) else [None]:
                np.testing.assert_allclose(np.asarray(got if k is None else got[k]), want if k is None else want[k],
                                           rtol=10 * tol, atol=10 * tol, err_msg=f"{ns.name} {k}")
    if not propagations:
        return
    for mode, alpha in (("MPE", None), ("GeneralLL", 1.7)):
        o = opts.replace(propagation=mode, alpha=alpha)
        _, want = oracle.forward(c, c.params, x, miss, mode=mode, alpha=alpha)
        fl, got = c.flows(c.params, as_input(g, x), miss, ll_weights=w, options=o, return_ll=True)
        np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol, err_msg=mode)
        if mode == "MPE":
            ref_fl = hard_edge_flows(c, c.params, x, miss, w)
        else:
            ref_fl = tied(c, oracle.flows(c, c.params, x, miss, weights=w, alpha=alpha)[0])
        check_sum_flows(c, fl, ref_fl, mode, tol)


def build(name, seed=0, **kw):
    g, root = SHAPES[name](seed)
    return g, jaxpc.compile(root, seed=seed, **kw)


# ---- fast cases --------------------------------------------------------------------------------------------------

def test_root_leaf_matches_oracle():
    """A circuit that is one input node: log-likelihoods, counts and EM, a batch of one and one of three."""
    g, c = build("root_leaf")
    check(g, c, 1, propagations=False)
    check(g, c, 3, seed=1, propagations=False, normalized=False)


@pytest.mark.slow
def test_shared_product_log_prob_and_flows():
    """One product vector read at five depths, a sum tied one layer below its source, block sizes 1, 3 and 7."""
    g, c = build("shared_product")
    rng = np.random.default_rng(0)
    x = g.data(3)
    miss = rng.random(x.shape) < 0.3
    w = rng.uniform(0.5, 2.0, 3)
    fl, ll = c.flows(c.params, as_input(g, x), miss, ll_weights=w, return_ll=True)
    _, ref = oracle.forward(c, c.params, x, miss)
    np.testing.assert_allclose(np.asarray(ll), ref, rtol=1e-5, atol=1e-5)
    sums, ins, _ = oracle.flow_totals(c, c.params, x, miss, weights=w)
    assert oracle.check_flows(c, fl, sums, ins) > 5


# ---- slow cases --------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", cases(list(SHAPES), fast=[]))
@pytest.mark.full
def test_shapes_match_oracle(name):
    g, c = build(name)
    if name.startswith("chain"):
        assert c.layout.chain is not None  # (the chain's own forward-backward runs)
    if name == "tree":
        assert c.layout.fold.tree is not None
    check(g, c, 3)


@pytest.mark.slow
@pytest.mark.parametrize("name,options,B", cases([
    ("mixed_leaves", jaxpc.Options(precision="fp32", param_flow_pass="batched"), 257),
    ("shared_product", jaxpc.Options(impl="pallas"), 3),
    ("deep_chain", jaxpc.Options(fold_products=False, scan_stages=False), 1),
    ("wide", jaxpc.Options(impl="pallas"), 3),
    ("chain_untied", jaxpc.Options(impl="pallas"), 257),
    ("chain_tied_leaves", jaxpc.Options(chain_scan=False), 1),
    ("tree", jaxpc.Options(impl="pallas", tuning=jaxpc.Tuning(tree_kernel_batch=64)), 3),
    ("zeros", jaxpc.Options(precision="bf16"), 3),
], fast=[], unpack=True), ids=lambda v: v if isinstance(v, (str, int)) else None)
@pytest.mark.full
def test_shapes_on_other_routes(name, options, B):
    g, c = build(name)
    check(g, c, B, options, propagations=False, tol=3e-2 if options.precision == "bf16" else 1e-4)


@pytest.mark.full
def test_shapes_on_the_gpu_routes(monkeypatch):
    """``impl="auto"`` as on a GPU (the Pallas kernels in interpret mode): leaf and counts kernels, in-place
    products and the fan-in backward on shared vectors, and max-product kernels."""
    from jaxpc.engine import routing

    monkeypatch.setattr(routing, "on_gpu", lambda: True)
    g, c = build("shared_product")
    check(g, c, 257, jaxpc.Options(tuning=jaxpc.Tuning(leaf_batch=1, counts_batch=1, max_product_kernels=True)))


@pytest.mark.full
def test_random_circuits_match_oracle():
    """A seeded loop over random circuits with heavy sharing, ties, deep single-child chains and wide products,
    every leaf type."""
    kinds = ("cat2", "cat3", "cat5", "bern", "gauss", "masked", "lit")
    for seed, kw, B in ((0, dict(share=0.8, tie=0.7, deep=12), 257), (1, dict(wide=200), 1),
                        (3, dict(kinds=kinds, share=0.8), 3)):
        g = Fuzz(seed, 3 if seed != 1 else 2, **kw)
        c = jaxpc.compile(g.circuit(), seed=seed)
        check(g, c, B, seed=seed, propagations=seed % 2 == 0)


def test_oracle_reads_literals_of_any_value():
    """``Literal(k)`` leaves with ``k >= 2`` (the oracle's table was two values wide and raised an IndexError)
    against the circuit, in a mixture with a five-valued categorical."""
    a = jaxpc.inputs(0, 1, dist=D.Literal(3))
    b = jaxpc.inputs(0, 1, dist=D.Categorical(5), params=[[0.1, 0.2, 0.3, 0.2, 0.2]])
    c = jaxpc.compile(jaxpc.summate(a, b, num_nodes=1, params=[[0.5, 0.5]]))
    x = np.array([[0], [3], [4]], np.int32)
    _, want = oracle.forward(c, c.params, x)
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x)), want, rtol=1e-6)
    np.testing.assert_allclose(np.exp(want), [0.05, 0.6, 0.1], rtol=1e-6)
