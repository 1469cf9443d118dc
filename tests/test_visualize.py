"""jaxpc.visualize: plot_circuit draws one marker per node (vector) and one line per edge (vector pair);
summary's table adds up to the circuit's node and edge counts."""

import matplotlib  # the test extra installs jaxpc.visualize's optional dependencies
import numpy as np
import pytest

matplotlib.use("Agg")

import jaxpc  # noqa: E402
from jaxpc import distributions  # noqa: E402
from jaxpc import visualize as vis  # noqa: E402
from jaxpc.compiler.layout import ScanSpec  # noqa: E402
from jaxpc.nodes import topological_order  # noqa: E402

from .random_circuits import Generator  # noqa: E402
from .test_api import hmm_like  # noqa: E402


def _artists(fig):
    ax = fig.axes[0]
    by_gid = {c.get_gid(): c for c in ax.collections}
    points = {k: len(by_gid[f"jaxpc-{k}"].get_offsets()) for k in ("input", "prod", "sum")}
    return points, len(by_gid["jaxpc-edges"].get_segments()), [t for t in ax.texts if t.get_gid() == "jaxpc-label"]


def _small():
    a = jaxpc.inputs(0, 2, 2, distributions.Categorical(3))
    b = jaxpc.inputs(1, 2, 2, distributions.Bernoulli())
    m = jaxpc.multiply(a, b)
    s = jaxpc.summate(m, num_node_blocks=1, block_size=2, edge_ids=[[0], [1]])
    return jaxpc.summate(s, jaxpc.multiply(a, b, edge_ids=[[1, 0]]), num_node_blocks=1, block_size=1)


def test_plot_circuit_vector_and_node_artists():
    import matplotlib.pyplot as plt

    root = _small()
    nodes = topological_order(root)
    fig = vis.plot_circuit(root)
    points, n_edges, labels = _artists(fig)
    assert points == {"input": 2, "prod": 2, "sum": 2}
    assert n_edges == sum(len(set(c.id for c in ns.children)) for ns in nodes) == 7
    assert len(labels) == len(nodes)
    plt.close(fig)

    c = jaxpc.compile(root)
    fig = vis.plot_circuit(c, granularity="node")
    points, n_edges, labels = _artists(fig)
    assert points == {"input": 8, "prod": 6, "sum": 3}
    assert sum(points.values()) == c.num_nodes
    assert n_edges == c.num_edges == 4 * 2 + 2 * 2 + 2 * 2 + 4  # m, m2, s (one 2x2 block), root
    assert len(labels) == 8  # inputs are labeled with their variable
    # edge opacity follows the weights of the params given
    lc = next(x for x in fig.axes[0].collections if x.get_gid() == "jaxpc-edges")
    assert len(np.unique(np.round(lc.get_colors()[:, 3], 6))) > 2
    plt.close(fig)

    # an existing Axes, a random circuit with ties
    g = Generator(3, 4)
    r = g.circuit()
    fig, ax = plt.subplots()
    assert vis.plot_circuit(r, ax=ax, labels=False) is fig
    points, n_edges, labels = _artists(fig)
    rn = topological_order(r)
    assert sum(points.values()) == len(rn) and not labels
    assert n_edges == sum(len(set(c.id for c in ns.children)) for ns in rn)
    plt.close(fig)

    with pytest.raises(ValueError, match="max_nodes"):
        vis.plot_circuit(root, granularity="node", max_nodes=5)
    with pytest.raises(ValueError, match="granularity"):
        vis.plot_circuit(root, granularity="edge")
    with pytest.raises(TypeError, match="node vector or a jaxpc.Circuit"):
        vis.plot_circuit("root")
    with pytest.raises(ValueError, match="params= needs a compiled circuit"):
        vis.plot_circuit(root, params={})


def _total(text):
    last = text.splitlines()[-1].split()
    assert last[0] == "total"
    return int(last[1]), int(last[2]), int(last[3])


def test_summary_table_adds_up():
    c = jaxpc.compile(hmm_like(7, L=4))
    text = vis.summary(c)
    lines = text.splitlines()
    assert lines[1].split() == ["step", "kind", "parts", "nodes", "edges", "params", "fan-in", "blocks"]
    assert _total(text) == (c.num_nodes, c.num_edges, c.num_parameters)
    scan = next(s for s in c.layout.steps if isinstance(s, ScanSpec))
    assert any(f"x{scan.repeats}" in ln and " sum " in ln for ln in lines)
    sum_row = next(ln for ln in lines if f"x{scan.repeats}" in ln and " sum " in ln).split()
    assert sum_row[-3:] == ["16", "4", "1x1"]  # tied transitions: 4 x 4 weights read in every step
    in_row = next(ln for ln in lines if ln.startswith("in")).split()
    assert in_row[1] == "input:categorical" and in_row[2] == "7" and in_row[3] == "28"

    g = Generator(0, 4)
    c = jaxpc.compile(g.circuit())
    text = vis.summary(c)
    assert _total(text) == (c.num_nodes, c.num_edges, c.num_parameters)
    n_rows = len(text.splitlines()) - 5  # header line, column names, two rules, total
    kinds = sum(bool(s.prods) + bool(s.sums) for s in c.layout.stages())
    assert n_rows == kinds + len(c.layout.input_layers)
    with pytest.raises(TypeError, match="compiled jaxpc.Circuit"):
        vis.summary(g.circuit())


def test_edge_weights_of_unnormalized_params_are_drawn():
    """Parameters after gradient training need not be normalized (weights above 1): each sum edge is drawn with its
    weight over its parent node's total, the opacities and widths stay in range and order."""
    import matplotlib.pyplot as plt

    c = jaxpc.compile(hmm_like(3, L=2, V=3))
    p = {"sum": {k: v + 2.0 for k, v in c.params["sum"].items()}, "input": c.params["input"]}
    fig = vis.plot_circuit(c, p, granularity="node")
    fig.canvas.draw()
    lc = next(x for x in fig.axes[0].collections if x.get_gid() == "jaxpc-edges")
    alpha, width = lc.get_colors()[:, 3], np.asarray(lc.get_linewidths())
    expect = []  # the drawn order of _graph: per vector, per edge block, per parent row, per child column
    for ns in c.nodes:
        if ns.is_prod():
            expect += [1.0] * (ns.num_nodes * len(ns.children))
        elif ns.is_sum():
            w = np.asarray(c.get_node_params(p, ns), np.float64)
            w = w / w.sum(axis=1, keepdims=True)
            expect += [w[int(q), int(r)] for q, r in ns.edge_ids.T]  # block size 1
    expect = np.asarray(expect)
    np.testing.assert_allclose(alpha, 0.15 + 0.85 * expect, rtol=1e-6)
    np.testing.assert_allclose(width, 0.3 + 2.0 * expect, rtol=1e-6)
    plt.close(fig)
    nan = {"sum": {k: v * np.nan for k, v in c.params["sum"].items()}, "input": c.params["input"]}
    with pytest.raises(ValueError, match="plot_circuit: the weights of .* are not finite"):
        vis.plot_circuit(c, nan, granularity="node")


def test_plot_circuit_argument_errors():
    root = _small()
    with pytest.raises(TypeError, match="plot_circuit: ax must be a matplotlib Axes, got int"):
        vis.plot_circuit(root, ax=3)
    with pytest.raises(ValueError, match="plot_circuit: max_nodes must be a positive int, got '10'"):
        vis.plot_circuit(root, granularity="node", max_nodes="10")


def _structures():
    from jaxpc import structures

    rng = np.random.default_rng(0)
    cat = distributions.Categorical(3)
    data = rng.integers(0, 3, (100, 4))
    return {"hmm": lambda: structures.HMM(4, 2, 3),
            "hmm-inhomogeneous": lambda: structures.HMM(3, 2, 3, homogeneous=False),
            "generalized-hmm": lambda: structures.GeneralizedHMM(3, 2, distributions.Gaussian()),
            "hclt": lambda: structures.HCLT(data, 2, input_dist=cat),
            "pd": lambda: structures.PD((2, 2), 2, split_intervals=1, input_dist=cat),
            "rat-spn": lambda: structures.RAT_SPN(4, 2, 1, 2, input_dist=cat),
            "pdhclt": lambda: structures.PDHCLT(data, (2, 2), 2, split_intervals=(1, 2), input_dist=cat),
            "one-leaf": lambda: jaxpc.inputs(0, 1, 1, cat)}


@pytest.mark.parametrize("name", list(_structures()))
def test_every_structure_is_drawn_and_tabulated(name):
    """Each structure (ties, scans, Gaussian leaves, a lone leaf): one marker per node vector and per node, one line
    per vector pair and per edge (weighted by the circuit's parameters, in [0, 1]), and a table that adds up."""
    import matplotlib.pyplot as plt

    root = _structures()[name]()
    c = jaxpc.compile(root)
    fig = vis.plot_circuit(root)
    points, n_edges, labels = _artists(fig)
    assert sum(points.values()) == len(c.nodes) == len(labels)
    assert n_edges == sum(len(set(ch.id for ch in ns.children)) for ns in c.nodes)
    plt.close(fig)
    fig = vis.plot_circuit(c, c.params, granularity="node", max_nodes=1000)
    points, n_edges, labels = _artists(fig)
    assert sum(points.values()) == c.num_nodes and n_edges == c.num_edges
    assert points["input"] == len(labels) == sum(ns.num_nodes for ns in c.nodes if ns.is_input())
    lc = next(x for x in fig.axes[0].collections if x.get_gid() == "jaxpc-edges")
    alpha = lc.get_colors()[:, 3] if n_edges else np.zeros(0)
    assert np.all((alpha >= 0.15 - 1e-6) & (alpha <= 1.0 + 1e-6))
    plt.close(fig)
    assert _total(vis.summary(c)) == (c.num_nodes, c.num_edges, c.num_parameters)
    assert str(c) == vis.summary(c) and f"num_nodes={c.num_nodes}" in repr(c)
