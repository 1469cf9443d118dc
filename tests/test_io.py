"""jaxpc.io: structure files rebuild identical node vectors; orbax checkpoints restore params and optimizer
states; a resumed fit equals an uninterrupted one bit for bit."""

import json
import re
import zipfile

import jax
import numpy as np
import optax
import pytest

import jaxpc
from jaxpc import distributions, io, optim, structures
from jaxpc.nodes import topological_order

from .random_circuits import Generator
from .test_optim import _small_circuit
from .tiers import cases


def _assert_same_graph(a, b):
    ga, gb = topological_order(a, follow_ties=True), topological_order(b, follow_ties=True)
    assert len(ga) == len(gb)
    ia = {ns.id: i for i, ns in enumerate(ga)}
    ib = {ns.id: i for i, ns in enumerate(gb)}
    for x, y in zip(ga, gb):
        assert type(x) is type(y) and x.name == y.name
        assert (x.num_node_blocks, x.block_size, x.scope) == (y.num_node_blocks, y.block_size, y.scope)
        assert [ia[c.id] for c in x.children] == [ib[c.id] for c in y.children]
        assert (x._source is None) == (y._source is None)
        if x._source is not None:
            assert ia[x._source.id] == ib[y._source.id]
        if not x.is_input():
            np.testing.assert_array_equal(x.edge_ids, y.edge_ids)
        if x.is_input():
            assert x.var == y.var and x.dist == y.dist and repr(x.dist) == repr(y.dist)
            assert (x._params is None) == (y._params is None)
            if x._params is not None:
                assert sorted(x._params) == sorted(y._params)
                for k in x._params:
                    np.testing.assert_array_equal(x._params[k], y._params[k])
                    assert x._params[k].dtype == y._params[k].dtype
        if x.is_sum():
            assert x.ch_block_size == y.ch_block_size
            assert (x.gates is None) == (y.gates is None)
            if x.gates is not None:
                assert x.gates.block_size == y.gates.block_size
                assert (None if x.gates.tie_to is None else ia[x.gates.tie_to.id]) == \
                    (None if y.gates.tie_to is None else ib[y.gates.tie_to.id])
            assert (x._params is None) == (y._params is None)
            if x._params is not None:
                np.testing.assert_array_equal(x._params, y._params)


def _roundtrip(root, tmp_path, name="c.jpc"):
    path = tmp_path / name  # written exactly at this path (no .npz suffix appended)
    io.save_structure(root, path)
    assert path.exists()
    return io.load_structure(path)


@pytest.mark.parametrize("seed", cases([0, 3, 5], fast=[5]))
def test_random_circuits_round_trip_identically(seed, tmp_path):
    gen = Generator(seed, num_vars=4)  # every distribution, ties of sums and inputs, block-sparse edges
    root = gen.circuit()
    loaded = _roundtrip(root, tmp_path)
    _assert_same_graph(root, loaded)
    c1, c2 = jaxpc.compile(root, seed=seed), jaxpc.compile(loaded, seed=seed)
    assert c1.layout == c2.layout
    for u, v in zip(jax.tree_util.tree_leaves(c1.params), jax.tree_util.tree_leaves(c2.params)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    x = gen.sample_data(7)
    np.testing.assert_array_equal(np.asarray(c1.log_prob(c1.params, x)), np.asarray(c2.log_prob(c2.params, x)))


def test_structures_and_circuits_round_trip(tmp_path):
    hmm = structures.HMM(7, 4, 5, alpha=np.full((4, 4), 0.25), beta=np.full((4, 5), 0.2), gamma=np.full(4, 0.25))
    pd = structures.PD((4, 4), 4, split_intervals=2, tie_homogeneous_params=True,
                       input_dist=distributions.Categorical(3))
    for i, root in enumerate((hmm, pd)):
        loaded = _roundtrip(root, tmp_path, f"s{i}.npz")
        _assert_same_graph(root, loaded)
    circuit = jaxpc.compile(hmm)
    loaded = _roundtrip(circuit, tmp_path, "circ")  # a Circuit saves its root
    _assert_same_graph(hmm, loaded)


def test_tied_source_outside_the_graph_is_kept(tmp_path):
    template = jaxpc.inputs(5, 1, 2, distributions.Categorical(3), params=np.full((2, 3), 1 / 3))  # not reachable
    a = template.duplicate(0, tie_params=True)
    b = template.duplicate(1, tie_params=True)
    root = jaxpc.summate(jaxpc.multiply(a, b), num_nodes=1)
    loaded = _roundtrip(root, tmp_path)
    _assert_same_graph(root, loaded)
    assert loaded.children[0].children[0].source.var == 5


def test_structure_files_are_checked(tmp_path):
    root = jaxpc.summate(jaxpc.inputs(0, 1, 2, distributions.Categorical(3)), num_nodes=1)
    path = tmp_path / "c.npz"
    io.save_structure(root, path)
    with zipfile.ZipFile(path) as z:  # a plain npz: no pickled objects inside
        assert all(n.endswith(".npy") for n in z.namelist())
    with np.load(path, allow_pickle=False) as z:
        header = json.loads(bytes(z["__header__"]).decode())
        arrays = {k: z[k] for k in z.files}
    assert header["format"] == "jaxpc.structure" and header["version"] == io.VERSION
    header["version"] = io.VERSION + 1
    arrays["__header__"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    future = tmp_path / "future.npz"
    np.savez(future, **arrays)
    with pytest.raises(ValueError, match="version"):
        io.load_structure(future)
    np.savez(tmp_path / "other.npz", a=np.zeros(3))
    with pytest.raises(ValueError, match="not a jaxpc structure file"):
        io.load_structure(tmp_path / "other.npz")
    with pytest.raises(TypeError, match="node vector or a jaxpc.Circuit"):
        io.save_structure("root", tmp_path / "x.npz")

    class Custom(distributions.Categorical):
        pass

    odd = jaxpc.summate(jaxpc.inputs(0, 1, 2, Custom(3)), num_nodes=1)
    with pytest.raises(TypeError, match="register_distribution"):
        io.save_structure(odd, tmp_path / "odd.npz")
    io.register_distribution(Custom, lambda d: {"num_cats": d.num_cats}, lambda a: Custom(**a), name="test.Custom")
    loaded = _roundtrip(odd, tmp_path, "odd.npz")
    assert type(loaded.children[0].dist) is Custom


def _gated_root():
    """Two parameter-tied sums whose gates are tied, the first to the second (listed after it in the file), one
    gate per parent node; a gated root (one gate per edge block)."""
    cat = distributions.Categorical(3)
    a, b, c, d = (jaxpc.inputs(v, 2, 2, cat) for v in range(4))
    s01 = jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=2, block_size=2, name="s01")
    s23 = s01.duplicate(jaxpc.multiply(c, d), tie_params=True, name="s23").set_gates(1)
    s01.set_gates(tie_to=s23)
    return jaxpc.summate(jaxpc.multiply(s01, s23), num_nodes=1, name="root").set_gates()


def test_sum_gates_round_trip(tmp_path):
    root = _gated_root()
    loaded = _roundtrip(root, tmp_path)
    _assert_same_graph(root, loaded)
    c1, c2 = jaxpc.compile(root, seed=0), jaxpc.compile(loaded, seed=0)
    assert c1.num_gates == c2.num_gates == 4 * 2 + 2  # s23: 4 edge blocks of 2 parent nodes; root: 2 edge blocks
    for x, y in zip(c1.nodes, c2.nodes):
        if x.is_sum():
            assert c1.gate_slice(x) == c2.gate_slice(y)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 3, (5, 4)).astype(np.int32)
    ev = {"sum_gates": rng.normal(size=(5, c1.num_gates)).astype(np.float32)}
    np.testing.assert_array_equal(np.asarray(c1.log_prob(c1.params, x, evidence=ev)),
                                  np.asarray(c2.log_prob(c2.params, x, evidence=ev)))
    # a version 1 file (no gates) still loads, without gates
    with np.load(tmp_path / "c.jpc", allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    header = json.loads(bytes(arrays["__header__"]).decode())
    header["version"] = 1
    for e in header["nodes"]:
        e.pop("gates", None)
    arrays["__header__"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    np.savez(tmp_path / "v1.npz", **arrays)
    assert all(ns.gates is None for ns in topological_order(io.load_structure(tmp_path / "v1.npz")) if ns.is_sum())
    s01 = root.children[0].children[0]
    outside = jaxpc.summate(*s01.children, num_node_blocks=2, block_size=2).set_gates()
    s01.set_gates(tie_to=outside)
    with pytest.raises(ValueError, match="reads the gates of .* which is not part of the saved graph"):
        io.save_structure(root, tmp_path / "out.npz")


def test_evidence_leaves_round_trip(tmp_path):
    soft = jaxpc.inputs(0, 2, dist=distributions.SoftEvidenceCategorical(3), params=np.full((2, 3), 1 / 3))
    ext = jaxpc.inputs(1, 2, dist=distributions.External())
    root = jaxpc.summate(jaxpc.multiply(soft, ext), num_nodes=1)
    loaded = _roundtrip(root, tmp_path)
    _assert_same_graph(root, loaded)
    c1, c2 = jaxpc.compile(root), jaxpc.compile(loaded)
    rng = np.random.default_rng(0)
    x = np.zeros((3, 2), np.int32)
    ev = {"categorical_logp": rng.normal(size=(3, 2, 3)).astype(np.float32),
          "external": rng.normal(size=(3, 2, 2)).astype(np.float32)}
    np.testing.assert_array_equal(np.asarray(c1.log_prob(c1.params, x, evidence=ev)),
                                  np.asarray(c2.log_prob(c2.params, x, evidence=ev)))


DAMAGE = {
    "child index": (lambda h, a: h["nodes"][1].update(children=[5]), r"node 1 .* has child 5, which is not the index"),
    "root index": (lambda h, a: h.update(root=9), "the header has root 9, which is not the index of a node"),
    "no var": (lambda h, a: h["nodes"][0].pop("var"), "node 0 .* has no 'var' field"),
    "kind": (lambda h, a: h["nodes"][0].update(kind="leaf"), "node 0 .* has unknown kind 'leaf'"),
    "nodes": (lambda h, a: h.update(nodes={}), "the header has an invalid 'nodes' field"),
    "edge array": (lambda h, a: a.pop("n1.edge_ids"), "node 1 .* misses its array 'n1.edge_ids'"),
    "distribution": (lambda h, a: h["nodes"][0].update(dist={"type": "Nope"}), "'Nope', which is not registered"),
}


@pytest.mark.parametrize("what", list(DAMAGE))
def test_damaged_structure_files_name_the_file_and_the_damage(what, tmp_path):
    root = jaxpc.summate(jaxpc.inputs(0, 2, dist=distributions.Categorical(3)), num_nodes=1)
    _check_damaged(root, *DAMAGE[what], tmp_path)


def _check_damaged(root, edit, message: str, tmp_path, kinds=None) -> None:
    """Save ``root``, apply ``edit(header, arrays)`` to the file's contents, and check that loading it raises a
    ``ValueError`` naming the file and matching ``message``; ``kinds``: the header's node kinds, checked first."""
    io.save_structure(root, tmp_path / "ok.npz")
    with np.load(tmp_path / "ok.npz", allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    header = json.loads(bytes(arrays["__header__"]).decode())
    if kinds is not None:
        assert [e["kind"] for e in header["nodes"]] == kinds
    edit(header, arrays)
    arrays["__header__"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=f"load_structure: {re.escape(str(path))}.*{message}"):
        io.load_structure(path)


def test_files_that_are_not_structure_files(tmp_path):
    (tmp_path / "text.npz").write_text("hello")
    np.save(tmp_path / "array.npy", np.zeros(3))
    for name in ("text.npz", "array.npy"):
        with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path / name))} is not a jaxpc structure file"):
            io.load_structure(tmp_path / name)


def test_params_and_optimizer_states_round_trip(tmp_path):
    circuit, _, data = _small_circuit()
    for i, tx in enumerate((optax.adam(0.01), optim.full_batch_em(circuit, 2, 0.1))):
        state = tx.init(circuit.params)
        if isinstance(tx, optim.EMTransformation):
            _, state = tx.step(circuit.flows(circuit.params, data[:10]), state, circuit.params)
        io.save_params(tmp_path / f"ck{i}", circuit.params, state, step=5)
        ck = io.load_params(tmp_path / f"ck{i}", params=circuit.params, opt_state=tx.init(circuit.params))
        assert ck.step == 5
        assert jax.tree_util.tree_structure(ck.opt_state) == jax.tree_util.tree_structure(state)
        for u, v in zip(jax.tree_util.tree_leaves((circuit.params, state)),
                        jax.tree_util.tree_leaves((ck.params, ck.opt_state))):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    raw = io.load_params(tmp_path / "ck0")
    assert raw.step == 5 and isinstance(raw.params, dict)
    # a template asks for what the checkpoint holds, no more and no less
    with pytest.raises(ValueError, match="holds an optimizer state; pass opt_state=<template>"):
        io.load_params(tmp_path / "ck0", params=circuit.params)
    io.save_params(tmp_path / "bare", circuit.params, step=1)
    with pytest.raises(ValueError, match=r"bare holds no optimizer state \(save_params was given none\)"):
        io.load_params(tmp_path / "bare", params=circuit.params, opt_state=optax.adam(0.01).init(circuit.params))
    assert io.load_params(tmp_path / "bare", params=circuit.params).opt_state is None
    io.save_params(tmp_path / "p", circuit.params)
    ck = io.load_params(tmp_path / "p", params=circuit.params)
    assert ck.opt_state is None and ck.step is None
    with pytest.raises(ValueError, match="opt_state"):
        io.load_params(tmp_path / "ck0", params=circuit.params)
    with pytest.raises(ValueError, match="already exists"):
        io.save_params(tmp_path / "p", circuit.params)  # exists
    io.save_params(tmp_path / "p", circuit.params, overwrite=True)
    with pytest.raises(ValueError, match="step must be a non-negative int, got -1"):
        io.save_params(tmp_path / "neg", circuit.params, step=-1)
    with pytest.raises(TypeError, match="step must be a non-negative int, got float 2.0"):
        io.save_params(tmp_path / "neg", circuit.params, step=2.0)
    other = jax.tree_util.tree_map(lambda a: np.zeros(a.shape[:-1] + (a.shape[-1] + 1,), a.dtype), circuit.params)
    with pytest.raises(ValueError, match=r"stores params\.\S+ with shape \[.*\], but the template has shape"):
        io.load_params(tmp_path / "p", params=other)


@pytest.mark.parametrize("kind", cases(["em", "adam"], fast=[]))
def test_resumed_fit_equals_uninterrupted_bit_for_bit(kind, tmp_path):
    circuit, _, data = _small_circuit()
    if kind == "em":
        tx = optim.em(circuit, optax.linear_schedule(0.5, 0.05, 12), 0.1)
    else:
        tx = optax.adam(optax.exponential_decay(0.05, 4, 0.5))
    key = jax.random.key(11)
    full = optim.fit(circuit, circuit.params, data, 4, 48, optimizer=tx, key=key, progress=False)
    half = optim.fit(circuit, circuit.params, data, 2, 48, optimizer=tx, key=key, progress=False)
    io.save_structure(circuit, tmp_path / "structure.npz")
    io.save_params(tmp_path / "ck", half.params, half.opt_state, step=2)
    # a new process would rebuild everything from the files
    circuit2 = jaxpc.compile(io.load_structure(tmp_path / "structure.npz"))
    tx2 = optim.em(circuit2, optax.linear_schedule(0.5, 0.05, 12), 0.1) if kind == "em" else tx
    ck = io.load_params(tmp_path / "ck", params=circuit2.params, opt_state=tx2.init(circuit2.params))
    rest = optim.fit(circuit2, ck.params, data, 2, 48, optimizer=tx2, opt_state=ck.opt_state, start_epoch=ck.step,
                     key=key, progress=False)
    for u, v in zip(jax.tree_util.tree_leaves((full.params, full.opt_state)),
                    jax.tree_util.tree_leaves((rest.params, rest.opt_state))):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    np.testing.assert_array_equal(full.epoch_ll, np.concatenate([half.epoch_ll, rest.epoch_ll]))


def _damaged_params_root():
    """A Gaussian vector with parameters (node 0), a categorical one (node 1) with its tied copy (node 4), and a
    root with weights (node 6)."""
    g = jaxpc.inputs(0, 1, 2, distributions.Gaussian(), params={"mu": np.zeros(2), "sigma": np.ones(2)})
    a = jaxpc.inputs(1, 1, 2, distributions.Categorical(3), params=np.full((2, 3), 1 / 3))
    s = jaxpc.summate(jaxpc.multiply(g, a), num_node_blocks=1, block_size=2)
    return jaxpc.summate(jaxpc.multiply(s, a.duplicate(2, tie_params=True)), num_nodes=1, params=np.ones((1, 2)))


DAMAGED_PARAMS = {
    "sigma": (lambda h, a: a.update({"n0.params.sigma": -np.ones(2)}), r"node 0 .*Gaussian sigma must be positive"),
    "shape": (lambda h, a: a.update({"n0.params.mu": np.zeros(3)}), r"node 0 .*Gaussian mu must have shape \[2\]"),
    "field": (lambda h, a: (h["nodes"][0].update(params=["mu", "nu", "sigma"]), a.update({"n0.params.nu": np.ones(2)})),
              r"node 0 .*unknown parameter\(s\) \['nu'\]"),
    "probs": (lambda h, a: a.update({"n1.params.probs": np.full((2, 3), np.nan)}),
              "node 1 .*probabilities must be finite"),
    "weights": (lambda h, a: a.update({"n6.params.blocks": np.zeros((1, 1, 2))}),
                "node 6 .*invalid sum parameters: .*weights summing to zero"),
    "tie": (lambda h, a: h["nodes"][4].update(dist={"type": "Categorical", "args": {"num_cats": 4}}),
            "node 4 .*is tied to node 1 but has another distribution or shape"),
    "tie kind": (lambda h, a: h["nodes"][4].update(kind="sum", children=[2]),
                 "node 4 .*is a sum vector tied to node 1"),
    "tied params": (lambda h, a: (h["nodes"][4].update(params=["probs"]),
                                  a.update({"n4.params.probs": np.ones((2, 3))})),
                    "node 4 .*is tied to node 1 but has parameters of its own"),
    "children": (lambda h, a: h["nodes"][1].update(children=[0]), "node 1 .*is an input vector with children"),
    "edge dtype": (lambda h, a: a.update({"n2.edge_ids": a["n2.edge_ids"] + 0.5}), "multiply: edge_ids must hold"),
}


@pytest.mark.parametrize("what", list(DAMAGED_PARAMS))
def test_damaged_parameters_and_ties_are_named(what, tmp_path):
    """Stored parameters get the checks that given ones get (a file loads nothing that inputs(params=...) or
    summate(params=...) would refuse), and a tied vector must match the vector it is tied to."""
    _check_damaged(_damaged_params_root(), *DAMAGED_PARAMS[what], tmp_path,
                   kinds=["input", "input", "prod", "sum", "input", "prod", "sum"])


def test_checkpoint_of_another_circuit_names_the_leaves(tmp_path):
    """Templates of another circuit, whose leaves have other names than the checkpoint's, raise a ValueError naming
    the leaves on either side (not orbax's advice to pass an option load_params lacks); params without arrays are
    refused when saved, an optimizer template without a params template when loaded (it would be ignored)."""
    circuit, _, _ = _small_circuit()
    other = jaxpc.compile(jaxpc.summate(jaxpc.multiply(jaxpc.inputs(0, 1, 3, distributions.Gaussian()),
                                                       jaxpc.inputs(1, 1, 3, distributions.Gaussian())), num_nodes=1))
    for empty in (None, {}, {"sum": {}}):
        with pytest.raises(ValueError, match="save_params: params holds no arrays"):
            io.save_params(tmp_path / "empty", empty)
    io.save_params(tmp_path / "p", circuit.params, optax.adam(0.01).init(circuit.params), step=1)
    with pytest.raises(ValueError, match=r"load_params: .*p does not match the templates: leaves in the checkpoint "
                                         r"but not in the templates: .*params\.input\.categorical\.log_probs.*; in the "
                                         r"templates but not in the checkpoint: .*params\.input\.gaussian\.mu"):
        io.load_params(tmp_path / "p", params=other.params, opt_state=optax.adam(0.01).init(other.params))
    with pytest.raises(ValueError, match=r"load_params: opt_state=<template> needs params=<template> too"):
        io.load_params(tmp_path / "p", opt_state=optax.adam(0.01).init(circuit.params))


def test_register_distribution_checks_its_arguments():
    """A registration that could only fail later, at the first save or load, is refused when made."""
    cat = distributions.Categorical
    with pytest.raises(TypeError, match="register_distribution: encode must be callable, got NoneType"):
        io.register_distribution(cat, None, lambda a: cat(**a), name="bad")
    with pytest.raises(TypeError, match="register_distribution: decode must be callable, got dict"):
        io.register_distribution(cat, lambda d: {}, {}, name="bad")
    with pytest.raises(TypeError, match="register_distribution: name must be a non-empty str or None, got 3"):
        io.register_distribution(cat, lambda d: {}, lambda a: cat(3), name=3)
