"""PyJuice's runtime table side by side: seconds per training epoch of 60,000 samples on PD and HCLT
circuits of growing size, each system at the largest batch that fits under one cap for both, on one GPU.

    python benchmarks/scale.py [--structures pd1,...,pd5,hclt1,...,hclt5] [--systems jaxpc,pyjuice]
                               [--epoch-samples 60000] [--epochs 2] [--max-timed-s 60] [--start-batch B]
                               [--images-npy imgs.npy] [--budget-s 570] [--child-timeout 560] [--json out.json]
                               [--own-cap] [--tuning field=value+...]
    python benchmarks/scale.py --merge a.json,b.json       # one table from several runs

On the H200 (one command may run 10 minutes: split the sizes over calls, then merge; the PyJuice 2.6.3 wheel
travels in the git-ignored ``.whl_pj``)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl_pj/*.whl && export PYTHONPATH=/tmp/site
    python3 benchmarks/scale.py --structures hclt1,pd1 --epochs 1 --json $OUT/scale_1.json
    python3 benchmarks/scale.py --structures hclt2,pd2,hclt3 --epochs 1 --json $OUT/scale_2.json
    python3 benchmarks/scale.py --structures hclt4 --epochs 1 --json $OUT/scale_3.json   # then pd3, hclt5, pd4, pd5

(On the H200, hclt1 and pd1 took 50 + 27 s and 43 + 57 s for jaxpc + PyJuice: build, compile, the first call and
one timed epoch; hclt2, pd2 and hclt3 318 s together, hclt4 about 150 s; PyJuice's ``juice.compile`` alone 4.1 s at
2.45M edges, 23.5-26.3 s for the PDs of 14.6M and 56.5M, 18.1 s for hclt4's 152M.)

The ten structures are those of PyJuice's README (RTX 4090; edges 15.6M / 56.3M / 213M / 829M / 2.03B for PD,
2.56M / 10.1M / 39.9M / 159M / 633M for HCLT). Edges are counted as PyJuice counts them in ``pc.num_edges``:
sum edges (``num_edges`` of every sum node vector, edge blocks x block size x child block size) plus product
edges (product nodes x children); nodes as in ``pc.num_nodes``: input and sum nodes. Its README's node counts
grow as 1:2:4:8:12 for PD and 1:2:4:8:16 for HCLT, as the latent sizes below (PD 64..768, HCLT 64..1024). Its PD
split intervals are not published; ``(2, 7)`` is the only ``split_intervals=(a, b)``, 2 <= a <= b <= 7, that
brings all five PD sizes within 10% of its edge counts at those latents (-7%, +0%, +4%, +6%, -2%; its node
counts stay 32% below). The HCLT tree is learned from the first 10,000 images: ``_data.blurred_noise_images``,
as no MNIST is at hand (``--images-npy``: your own ``[N, 784]`` array, 256 levels); its edge counts land 4-5%
below PyJuice's MNIST trees.

Each system runs in its own child process per structure, one after the other, within ``--budget-s`` seconds in
all (each child at most ``--child-timeout``); a child that overruns is stopped and reported with what it had
measured. jaxpc: ``optim.fit(c, params, x, 1, B, step_size=0.1, pseudocount=0.1)`` on device-resident data,
each epoch one executable (shuffled batches, the last one padded with zero-weight rows: ceil(N / B) steps);
its persistent compile cache is off (``--warm-cache`` keeps it), so the first call compiles; JAX may use
``--mem-fraction`` of the GPU. PyJuice 2.6.3 on its fastest path: per step ``pc(x)`` under ``no_grad``,
``pc.backward(x, flows_memory=1.0)``, ``opt.step()`` with ``juice.optim.MiniBatchEM(pc, step_size=0.1,
pseudocount=0.1)``, CUDA graphs recorded at the batch size, ceil(N / B) steps over consecutive rows (wrapping).
The batch: the largest power of two that fits (or all N samples), at most ``--max-batch`` and at most the
largest with the node buffer ``[rows, B]`` under 2^31 elements (``index_cap``: PyJuice's kernels address it with
32-bit offsets and fail with an illegal memory access past it; jaxpc's kernels then give way to XLA's sum layers,
slower and slow to compile), found by trying down from an estimate of the memory per sample (``--start-batch``
overrides it) and catching the out-of-memory error; after a failure the next try is scaled by the memory the
failed allocation asked for, and at least halved. Both systems' caps count PyJuice's rows (its nodes and product
elements), so that they train at the same batch and take as many EM steps per epoch. ``--own-cap`` caps jaxpc by
its own rows instead, its folded plan's (:func:`jaxpc_rows`: input and sum nodes, the products never stored): a
PD's jaxpc batch then goes up to 4x PyJuice's, and on the H200 its epochs took longer there (``pd3`` 4.00 s at B =
4,096 against 3.62 at 1,024, ``pd4`` 15.53 at 2,048 against 14.78 at 512, ``pd5`` 35.42 at 1,024 against 35.26 at
256). ``--tuning field=value+...``: jaxpc's calls with ``Options(tuning=Tuning(...))``.

Columns: ``edges`` sum + product edges (PyJuice's count from its own DAG; README: PyJuice's published count); ``B``
the batch used; ``s/epoch`` mean seconds of the timed epochs (``--epochs`` of them, fewer when they would pass
``--max-timed-s``; jaxpc's after its first call, PyJuice's after its first step and recording); ``README`` PyJuice's
published seconds (RTX 4090); ``PyJuice / jaxpc`` the ratio of the two measured figures; ``build + compile`` host
seconds: structure (HCLT: the tree) + compile (``jaxpc.compile``; PyJuice ``juice.compile`` and the move to the
GPU); ``first step`` jaxpc's first ``em_step`` call at the estimated batch (``first_step_B``; compiling its
executable, then one step), the first thing the child runs, PyJuice's first eager step at B; ``first`` jaxpc's
first ``fit`` call (compiling the epoch, and one epoch), PyJuice's first eager step at B plus its CUDA-graph
recording; ``peak GiB`` jaxpc ``memory_stats()["peak_bytes_in_use"]`` (the process's peak,
compiling included; a larger try that ran out held less than the run that fits) and XLA's analysis of the epoch
executable (temporaries + arguments + outputs), PyJuice ``torch.cuda.max_memory_allocated()`` from its first step at
B; ``LL`` the mean log-likelihood per sample of the last timed epoch (both systems train from their own random
initialization). ``OOM``: no batch fits; ``n/a``: PyJuice or a CUDA device missing; ``timeout`` / ``skipped``: the
child overran ``--child-timeout`` / the budget was spent first; ``failed``: another error (printed below).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _children  # noqa: E402

# PyJuice README's figures (RTX 4090): edges, nodes, seconds per epoch of 60K samples.
SPECS = {
    "pd1": dict(kind="pd", latents=64, split=(2, 7), edges=15.6e6, nodes=172e3, seconds=2.0),
    "pd2": dict(kind="pd", latents=128, split=(2, 7), edges=56.3e6, nodes=344e3, seconds=5.3),
    "pd3": dict(kind="pd", latents=256, split=(2, 7), edges=213e6, nodes=688e3, seconds=15.4),
    "pd4": dict(kind="pd", latents=512, split=(2, 7), edges=829e6, nodes=1.38e6, seconds=57.1),
    "pd5": dict(kind="pd", latents=768, split=(2, 7), edges=2.03e9, nodes=2.06e6, seconds=203.7),
    "hclt1": dict(kind="hclt", latents=64, edges=2.56e6, nodes=89e3, seconds=0.8),
    "hclt2": dict(kind="hclt", latents=128, edges=10.1e6, nodes=178e3, seconds=1.3),
    "hclt3": dict(kind="hclt", latents=256, edges=39.9e6, nodes=355e3, seconds=2.6),
    "hclt4": dict(kind="hclt", latents=512, edges=159e6, nodes=710e3, seconds=8.8),
    "hclt5": dict(kind="hclt", latents=1024, edges=633e6, nodes=1.42e6, seconds=24.9),
}
SYSTEMS = ("jaxpc", "pyjuice")
TREE_ROWS = 10_000  # images the HCLT's Chow-Liu tree is learned from
EM = dict(step_size=0.1, pseudocount=0.1)


def hyper(name: str, short: bool = False) -> str:
    s = SPECS[name]
    if short:
        return f"L={s['latents']}" + (f", {s['split'][0]}x{s['split'][1]}" if s["kind"] == "pd" else "")
    split = f", split_intervals={s['split']}" if s["kind"] == "pd" else ""
    return f"{s['kind'].upper()} num_latents={s['latents']}{split}"


def build_root(name: str, data):
    """The root node of structure ``name`` of :data:`SPECS` over 28 x 28 images with 256 levels (an HCLT's tree
    learned from the first :data:`TREE_ROWS` rows of ``data``)."""
    from jaxpc import distributions, structures

    spec, cat = SPECS[name], distributions.Categorical(num_cats=256)
    if spec["kind"] == "pd":
        return structures.PD((28, 28), spec["latents"], split_intervals=spec["split"], input_dist=cat)
    return structures.HCLT(data[:TREE_ROWS], spec["latents"], input_dist=cat)


def images(args):
    """``[N, 784]`` int32 images with 256 levels: ``--images-npy`` rows (repeated up to N) or blurred noise."""
    import numpy as np

    if args.images_npy:
        a = np.load(args.images_npy).reshape(-1, 784)
        return a[np.arange(args.epoch_samples) % len(a)].astype(np.int32)
    from _data import blurred_noise_images
    return blurred_noise_images(args.epoch_samples)


def dag_counts(nodes, children) -> dict:
    """Nodes and edges of a node-vector DAG (jaxpc's or PyJuice's) counted as PyJuice's ``pc.num_nodes`` /
    ``pc.num_edges``: input + sum nodes; sum edges + product edges (product nodes x children)."""
    c = dict(sum_edges=0, prod_edges=0, nodes=0, prod_nodes=0)
    for ns in nodes:
        if ns.is_sum():
            c["sum_edges"] += int(ns.num_edges)
            c["nodes"] += int(ns.num_nodes)
        elif ns.is_prod():
            c["prod_edges"] += int(ns.num_nodes) * len(children(ns))
            c["prod_nodes"] += int(ns.num_nodes)
        else:
            c["nodes"] += int(ns.num_nodes)
    c["edges"] = c["sum_edges"] + c["prod_edges"]
    return c


# ---------------------------------------------------------------------------------------------------------
# the batch search, shared by both systems
# ---------------------------------------------------------------------------------------------------------
class OutOfMemory(Exception):
    """A try that ran out of device memory; ``need`` the bytes its failed allocation asked for (None if unsaid)."""

    def __init__(self, message: str, need: int | None):
        super().__init__(message)
        self.need = need


_UNITS = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _requested_bytes(msg: str) -> int | None:
    """The size in an out-of-memory message ("... allocate 123 bytes", "Tried to allocate 2.00 GiB"), if any."""
    m = re.search(r"allocate\s+([\d.]+)\s*(bytes|B|KiB|MiB|GiB|TiB)\b", msg)
    return None if m is None else int(float(m.group(1)) * _UNITS[m.group(2)])


def _pow2_floor(n: float) -> int:
    return 1 << max(0, int(math.floor(math.log2(max(n, 1)))))


def start_batch(n: int, per_sample: float, free: float, optimism: float) -> int:
    """The first batch to try: all ``n`` samples when the estimate allows, else the largest power of two under
    ``optimism`` times the estimate ``free / per_sample``."""
    est = optimism * free / max(per_sample, 1.0)
    return n if est >= n else _pow2_floor(est)


def index_cap(rows: int) -> int:
    """The largest power of two B with ``rows * B`` below 2^31: both systems' kernels address the node buffer
    ``[rows, B]`` with 32-bit offsets (PyJuice's fail with an illegal memory access past it; jaxpc's
    ``impl="auto"`` then leaves its kernels for XLA's sum layers)."""
    return _pow2_floor((2**31 - 1) / max(rows, 1))


def jaxpc_rows(circuit) -> int:
    """Rows of the node buffer that jaxpc's default call runs on: the folded plan's (input and sum nodes and the
    padding; products are summed from their children's rows in each read, never stored), else the layout's."""
    return (circuit.layout.fold or circuit.layout).num_rows


def search(row: dict, try_batch, start: int, args, free_now, log, emit):
    """:func:`largest_batch` with its outcome in ``row``: ``(B, result)``, B None (and ``row`` emitted with the
    error "OOM") when no batch fits."""
    B, got, failed = largest_batch(try_batch, start, args.min_batch, free_now, log)
    row.update(start_batch=start, oom_batches=failed)
    if B is None:
        row["error"] = "OOM"
        emit(row)
    return B, got


def largest_batch(try_batch, start: int, min_batch: int, free_now, log) -> tuple[int | None, object, list]:
    """Call ``try_batch(B)`` from ``B = start`` down until it returns; it raises :class:`OutOfMemory` for a
    batch that does not fit. Returns ``(B, its result, failed batches)``, B None when even ``min_batch``
    failed. After a failure the next B is the largest power of two below B, or below ``B * free / need``
    (``free_now()``: the device bytes free now) where that is less: when memory grows affinely in B, that
    product over-estimates the batch that fits, so no power of two that fits is skipped."""
    B, failed = max(start, min_batch), []
    while B >= min_batch:
        try:
            return B, try_batch(B), failed
        except OutOfMemory as e:
            failed.append(B)
            nxt = _pow2_floor(B - 1)
            if e.need:
                nxt = min(nxt, _pow2_floor(B * free_now() / e.need))
            log(f"B={B}: out of memory ({str(e)[:160]}); next {nxt}")
            B = nxt
    return None, None, failed


# ---------------------------------------------------------------------------------------------------------
# children: one system on one structure; snapshots of its row appended as JSON lines to --rows-file
# ---------------------------------------------------------------------------------------------------------
def _log(name, system):
    return lambda msg: print(f"{system:7s} {name:5s} {msg}", flush=True)


def child_jaxpc(args, name: str, emit) -> None:
    import jax
    import jax.numpy as jnp

    import jaxpc
    from _options import tuning
    from jaxpc import optim
    from jaxpc.nodes import topological_order

    log = _log(name, "jaxpc")
    dev = jax.devices()[0]
    row = dict(system="jaxpc", structure=name, device=dev.device_kind, version=jax.__version__)
    em = EM
    if args.tuning:
        em = dict(EM, options=jaxpc.Options(tuning=tuning(args.tuning)))
        row.update(tuning=args.tuning)
    data = images(args)
    t0 = time.perf_counter()
    root = build_root(name, data)
    t1 = time.perf_counter()
    counts = dag_counts(topological_order(root), lambda ns: ns.children)
    t2 = time.perf_counter()
    c = jaxpc.compile(root)
    jax.block_until_ready(c.params)
    row.update(counts, build_s=t1 - t0, compile_s=time.perf_counter() - t2)
    log(f"built in {row['build_s']:.1f} s, jaxpc.compile {row['compile_s']:.1f} s; {counts}")
    emit(row)
    del root

    x = jax.device_put(jnp.asarray(data, jnp.int32))
    n = x.shape[0]
    stats = dev.memory_stats()
    if stats and "bytes_limit" in stats:
        limit, optimism = stats["bytes_limit"], args.optimism

        def free_now():
            return limit - dev.memory_stats()["bytes_in_use"]
    else:  # a host device: no allocator limit to run into, so no optimism past the host budget
        limit, optimism = args.host_memory_gb * 2**30, 1.0

        def free_now():
            return limit
    nparams = sum(a.size for a in jax.tree_util.tree_leaves(c.params))
    # per sample: node values and their flows, with room for the layers' temporaries; fixed: parameters, flows,
    # the updated parameters and the EM temporaries
    rows = jaxpc_rows(c) if args.own_cap else counts["nodes"] + counts["prod_nodes"]
    per_sample = args.bytes_per_node * rows
    start = args.start_batch or min(start_batch(n, per_sample, free_now() - 16 * nparams, optimism),
                                    index_cap(rows), args.max_batch)
    row.update(buffer_rows=rows)

    try:  # a user's first EM step at the estimated batch, before anything else compiles: em_step's executable
        t = time.perf_counter()
        jax.block_until_ready(c.em_step(c.params, x[:start], **em))
        row.update(first_step_s=time.perf_counter() - t, first_step_B=start)
        log(f"first em_step at B={start}: {row['first_step_s']:.1f} s")
    except Exception as e:  # noqa: BLE001 - out of memory at the estimate: the search below finds the batch
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        log(f"first em_step at B={start}: out of memory")

    def first_fit(B):
        before = c.cache_info().compile_seconds
        t = time.perf_counter()
        try:
            res = optim.fit(c, c.params, x, 1, B, **em, progress=False)
            jax.block_until_ready(res.params)
        except Exception as e:  # noqa: BLE001 - only an out-of-memory error is a verdict on B
            msg = str(e)
            if "RESOURCE_EXHAUSTED" not in msg and "out of memory" not in msg.lower():
                raise
            raise OutOfMemory(msg.splitlines()[0], _requested_bytes(msg)) from None
        return res, time.perf_counter() - t, c.cache_info().compile_seconds - before

    B, got = search(row, first_fit, start, args, free_now, log, emit)
    if B is None:
        return
    res, first_s, xla_s = got
    exe = c.compiled("optim.fit")
    try:
        m = exe.memory_analysis()
        row["exe_gib"] = (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes) / 2**30
    except Exception:  # noqa: BLE001 - not every backend reports it
        row["exe_gib"] = None
    row.update(B=B, steps=-(-n // B), first_s=first_s, first_compile_s=xla_s)
    log(f"B={B}: first fit {first_s:.1f} s ({xla_s:.1f} s compiling)")
    emit(row)

    c.wait_compiled()  # the timed epochs run the optimized executable (Tuning.quick_first_compile)
    params, times = res.params, []
    epoch_s = max(first_s - xla_s, 1e-3)  # the first call's epoch, compiling aside
    while len(times) < max(args.epochs, 1) and (not times or sum(times) + epoch_s <= args.max_timed_s):
        t = time.perf_counter()
        res = optim.fit(c, params, x, 1, B, **em, progress=False, start_epoch=1 + len(times))
        jax.block_until_ready(res.params)
        times.append(time.perf_counter() - t)
        params = res.params
        epoch_s = times[-1]
    peak = (dev.memory_stats() or {}).get("peak_bytes_in_use")
    row.update(epoch_s=sum(times) / len(times), epochs_timed=len(times), ll=float(res.epoch_ll[-1]),
               peak_gib=None if peak is None else peak / 2**30)
    log(f"B={B}: {row['epoch_s']:.3f} s per epoch of {n} ({len(times)} timed), LL {row['ll']:.2f}, "
        f"peak {row['peak_gib']} GiB, executable {row['exe_gib']} GiB")
    emit(row)


def child_pyjuice(args, name: str, emit) -> None:
    import _pyjuice

    spec, log = SPECS[name], _log(name, "pyjuice")
    reason = _pyjuice.available()
    if reason is not None:
        log(f"unavailable: {reason}")
        emit(dict(system="pyjuice", structure=name, error=f"unavailable: {reason}"))
        return
    from importlib import metadata

    import pyjuice as juice
    import torch

    dev = _pyjuice._DEVICE
    row = dict(system="pyjuice", structure=name, device=torch.cuda.get_device_name(),
               version=f"pyjuice {metadata.version('pyjuice')}, torch {torch.__version__}")
    data = images(args)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    ns = _pyjuice._structure(juice, torch, spec["kind"], spec["latents"], None, None, data,
                             split_intervals=spec.get("split", (4, 4)))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    counts = dag_counts(ns, lambda n: n.chs)
    t2 = time.perf_counter()
    pc = juice.compile(ns, verbose=False).to(dev)
    torch.cuda.synchronize()
    row.update(counts, build_s=t1 - t0, compile_s=time.perf_counter() - t2, pc_num_edges=int(pc.num_edges),
               pc_num_nodes=int(pc.num_nodes))
    log(f"built in {row['build_s']:.1f} s, juice.compile {row['compile_s']:.1f} s; {counts}; "
        f"pc.num_edges {pc.num_edges}")
    emit(row)
    opt = juice.optim.MiniBatchEM(pc, step_size=EM["step_size"], pseudocount=EM["pseudocount"])
    xs = torch.as_tensor(data, dtype=torch.long, device=dev)
    n = xs.shape[0]
    total = torch.cuda.get_device_properties(0).total_memory

    def free_now():
        return total - torch.cuda.memory_allocated()

    # per sample: node and element values and their flows (float32)
    per_sample = 8.0 * (pc.num_nodes + pc.num_elements)
    start = args.start_batch or min(start_batch(n, per_sample, free_now(), args.optimism),
                                    index_cap(pc.num_nodes + pc.num_elements), args.max_batch)
    state = {}

    def step(x, ll_sum=None):
        with torch.no_grad():
            lls = pc(x)  # a view of PyJuice's node values: summed before anything else runs
            if ll_sum is not None:
                ll_sum += lls.sum()
        pc.backward(x, flows_memory=1.0)
        opt.step()

    def first_step(B):
        state.clear()
        pc._recorded_cuda_graphs.clear()  # graphs hold buffer pointers: never reuse across B
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            steps = -(-n // B)
            state["x"] = xs[torch.arange(steps * B, device=dev) % n]  # ceil(N / B) full batches, wrapping
            x = state["x"][:B]
            torch.cuda.synchronize()
            t = time.perf_counter()
            step(x)
            torch.cuda.synchronize()
            eager = time.perf_counter() - t
            with torch.no_grad():
                pc(x, record_cudagraph=True)
            pc.backward(x, flows_memory=1.0, record_cudagraph=True)
            pc.init_param_flows(flows_memory=0.0)
            torch.cuda.synchronize()
            return eager, time.perf_counter() - t - eager
        except torch.cuda.OutOfMemoryError as e:
            state.clear()
            pc._recorded_cuda_graphs.clear()
            torch.cuda.empty_cache()
            raise OutOfMemory(str(e).splitlines()[0], _requested_bytes(str(e))) from None

    B, got = search(row, first_step, start, args, free_now, log, emit)
    if B is None:
        return
    eager_s, record_s = got
    steps = -(-n // B)
    row.update(B=B, steps=steps, first_s=eager_s + record_s, first_eager_s=eager_s, record_s=record_s)
    log(f"B={B}: first step {eager_s:.1f} s, graph recording {record_s:.1f} s")
    emit(row)

    def epoch():
        ll_sum = torch.zeros((), device=dev)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(steps):
            step(state["x"][i * B:(i + 1) * B], ll_sum)
        torch.cuda.synchronize()
        return time.perf_counter() - t, float(ll_sum) / (steps * B)

    times = []
    while len(times) < max(args.epochs, 1) and (not times or sum(times) + times[-1] <= args.max_timed_s):
        dt, ll = epoch()
        times.append(dt)
    row.update(epoch_s=sum(times) / len(times), epochs_timed=len(times), ll=ll,
               peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    log(f"B={B}: {row['epoch_s']:.3f} s per epoch of {n} ({len(times)} timed), LL {ll:.2f}, "
        f"peak {row['peak_gib']:.2f} GiB")
    emit(row)


CHILDREN = {"jaxpc": child_jaxpc, "pyjuice": child_pyjuice}


# ---------------------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------------------
def _n(v):
    """1.23M / 456K style."""
    if v is None:
        return "-"
    for div, suf in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if v >= div:
            return f"{v / div:.3g}{suf}"
    return f"{v:.0f}"


def _f(v, nd=2):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def _secs(r):
    """A system's cell: seconds per epoch, or OOM, n/a (not installed), timeout, skipped, failed."""
    if r is None:
        return "-"
    if r.get("epoch_s") is not None:
        return f"{r['epoch_s']:.2f}"
    err = r.get("error", "")
    for prefix, cell in (("OOM", "OOM"), ("unavailable", "n/a"), ("child stopped", "timeout"),
                         ("skipped", "skipped")):
        if err.startswith(prefix):
            return cell
    return "failed" if err else "-"


def tables(rows, names) -> str:
    """PyJuice's README layout per structure family (sizes as columns), then one row per structure with
    every measurement."""
    get = {(r.get("system"), r.get("structure")): r for r in rows}
    out = []
    for kind in ("pd", "hclt"):
        cols = [s for s in names if SPECS[s]["kind"] == kind]
        if not cols:
            continue
        j = [get.get(("jaxpc", s)) for s in cols]
        p = [get.get(("pyjuice", s)) for s in cols]
        out += [f"| {kind.upper()} | " + " | ".join(hyper(s, short=True) for s in cols) + " |",
                "| --- |" + " ---: |" * len(cols),
                "| # nodes, jaxpc / PyJuice / README | " + " | ".join(
                    f"{_n((a or {}).get('nodes'))} / {_n((b or {}).get('nodes'))} / {_n(SPECS[s]['nodes'])}"
                    for s, a, b in zip(cols, j, p)) + " |",
                "| # edges, jaxpc / PyJuice / README | " + " | ".join(
                    f"{_n((a or {}).get('edges'))} / {_n((b or {}).get('edges'))} / {_n(SPECS[s]['edges'])}"
                    for s, a, b in zip(cols, j, p)) + " |",
                "| **jaxpc** s/epoch | " + " | ".join(f"**{_secs(r)}**" for r in j) + " |",
                "| PyJuice 2.6.3, this GPU | " + " | ".join(_secs(r) for r in p) + " |",
                "| PyJuice README (RTX 4090) | " + " | ".join(f"{SPECS[s]['seconds']}" for s in cols) + " |", ""]
    out += ["| structure | edges jaxpc / PyJuice | B jaxpc / PyJuice | s/epoch jaxpc | s/epoch PyJuice | README "
            "| PyJuice / jaxpc | build + compile s jaxpc / PyJuice | first step s jaxpc / PyJuice | first s jaxpc / "
            "PyJuice | peak GiB jaxpc (exe) / PyJuice | LL jaxpc / PyJuice |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in names:
        a, b = get.get(("jaxpc", s)) or {}, get.get(("pyjuice", s)) or {}
        ratio = (f"{b['epoch_s'] / a['epoch_s']:.2f}x" if a.get("epoch_s") and b.get("epoch_s") else "-")

        def bc(r):
            return "-" if r.get("build_s") is None else f"{r['build_s']:.1f} + {r['compile_s']:.1f}"

        out.append(f"| {s}: {hyper(s)} | {_n(a.get('edges'))} / {_n(b.get('edges'))} "
                   f"| {a.get('B', '-')} / {b.get('B', '-')} | {_secs(a or None)} | {_secs(b or None)} "
                   f"| {SPECS[s]['seconds']} | {ratio} | {bc(a)} / {bc(b)} | {_f(a.get('first_step_s'), 1)} / "
                   f"{_f(b.get('first_eager_s'), 1)} | {_f(a.get('first_s'), 1)} / "
                   f"{_f(b.get('first_s'), 1)} | {_f(a.get('peak_gib'))} ({_f(a.get('exe_gib'))}) / "
                   f"{_f(b.get('peak_gib'))} | {_f(a.get('ll'))} / {_f(b.get('ll'))} |")
    return "\n".join(out)


def report(rows, names) -> None:
    print("\n" + tables(rows, names), flush=True)
    for r in rows:
        if r.get("error") and r["error"] != "OOM":
            print(f"{r.get('system')} {r.get('structure')}: {r['error']}", flush=True)
    dev = {r["system"]: f"{r.get('device')} ({r.get('version')})" for r in rows if r.get("device")}
    if dev:
        print("devices: " + "; ".join(f"{k} on {v}" for k, v in dev.items()), flush=True)


# ---------------------------------------------------------------------------------------------------------
# parent
# ---------------------------------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--structures", default=",".join(SPECS))
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--epoch-samples", "--epochs-samples", dest="epoch_samples", type=int, default=60_000,
                   help="samples per epoch (short epochs for smoke runs)")
    p.add_argument("--epochs", type=int, default=2, help="timed epochs after the first call")
    p.add_argument("--max-timed-s", type=float, default=60.0, help="stop timing epochs past this many seconds")
    p.add_argument("--start-batch", type=int, default=None, help="first batch to try (default: estimated)")
    p.add_argument("--max-batch", type=int, default=60_000,
                   help="largest batch to try (beside the 32-bit node-buffer cap, see index_cap)")
    p.add_argument("--min-batch", type=int, default=2, help="smallest batch to try before reporting OOM")
    p.add_argument("--own-cap", action="store_true",
                   help="cap jaxpc's batch by its own node buffer's rows (the folded plan's), not PyJuice's")
    p.add_argument("--tuning", default="", help="jaxpc's calls with Options(tuning=Tuning(...)): a=1+b=0")
    p.add_argument("--optimism", type=float, default=2.0,
                   help="the first try on a GPU is this many times the estimated batch that fits")
    p.add_argument("--bytes-per-node", type=float, default=16.0,
                   help="jaxpc's estimated bytes per node and sample (values, flows, temporaries)")
    p.add_argument("--host-memory-gb", type=float, default=3.0,
                   help="jaxpc on a host device: the memory its batch may use (there is no allocator limit)")
    p.add_argument("--mem-fraction", default="0.9", help="XLA_PYTHON_CLIENT_MEM_FRACTION of the jaxpc children")
    p.add_argument("--warm-cache", action="store_true", help="keep jaxpc's persistent compile cache on")
    p.add_argument("--images-npy", default=None, help="[N, 784] images with 256 levels instead of blurred noise")
    p.add_argument("--budget-s", type=float, default=570.0, help="seconds for all children together")
    p.add_argument("--child-timeout", type=float, default=560.0, help="seconds for one child")
    p.add_argument("--json", default=None, help="write the rows and tables here")
    p.add_argument("--merge", default=None, help="comma-separated --json files: print their combined tables")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rows-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    names = [s for s in args.structures.split(",") if s]
    unknown = set(names) - set(SPECS)
    if unknown:
        raise SystemExit(f"unknown --structures {sorted(unknown)}; choose from {list(SPECS)}")
    if args.merge:
        best = {}  # per system and structure: the last measured row, else the last row
        for f in args.merge.split(","):
            for r in json.load(open(f))["rows"]:
                k = (r.get("system"), r.get("structure"))
                if r.get("epoch_s") is not None or best.get(k, {}).get("epoch_s") is None:
                    best[k] = r
        rows = list(best.values())
        seen = [s for s in SPECS if any(r.get("structure") == s for r in rows)]
        report(rows, seen)
        return rows
    if args.child:
        system, name = args.child.split(":")
        CHILDREN[system](args, name, lambda row: _children.append_rows(args.rows_file, [row]))
        return None

    systems = [s for s in args.systems.split(",") if s]
    if set(systems) - set(SYSTEMS):
        raise SystemExit(f"unknown --systems {sorted(set(systems) - set(SYSTEMS))}; choose from {SYSTEMS}")
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    t_end = time.perf_counter() + args.budget_s
    rows = []
    for name in names:
        for system in (s for s in SYSTEMS if s in systems):
            env = dict(os.environ)
            if system == "jaxpc":
                env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", args.mem_fraction)
                if not args.warm_cache:
                    env["JAXPC_PERSISTENT_CACHE"] = "0"
            snaps, err = _children.run(__file__, passthrough, f"{system}:{name}", f"{system} {name}: {hyper(name)}",
                                       t_end, args.child_timeout, env=env)
            row = snaps[-1] if snaps else dict(system=system, structure=name)  # the child's last snapshot
            if err and "error" not in row:
                row["error"] = err
            rows.append(row)
    report(rows, names)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "tables": tables(rows, names), "args": vars(args)}, f, indent=1, default=float)
    return rows


if __name__ == "__main__":
    main()
