"""PyJuice (2.6.3) runners for jaxpc's side-by-side benchmarks.

The same workloads as jaxpc's benchmarks, run in PyJuice on one CUDA GPU: HMM, HCLT and PD circuits
(forward, forward + backward with parameter flows, and a mini-batch EM step) and the CoDD workload
(a homogeneous HMM with top-k soft evidence). torch and pyjuice are imported inside the functions, so
this module imports without them; call `available()` first.

Modes (`CALLS` spells out each one's calls): "graph" is PyJuice's fastest path, an explicit forward
then `pc.backward(x, flows_memory=1.0)`, after one dry run with `record_cudagraph=True` (PyJuice then
replays the recorded CUDA graphs of its inner layers on later calls with the same buffers and batch
size; input layers always run eagerly); "graph_hook" replays the same graphs through the autograd hook
(`pc(x).mean().backward()`); "eager" is the README loop without graphs.
"""

from __future__ import annotations

import random
import time

import numpy as np

_DEVICE = "cuda"


def available() -> str | None:
    """None if pyjuice and a CUDA device are usable here, else a short reason."""
    try:
        import pyjuice  # noqa: F401
        import torch
    except Exception as e:  # ImportError, or a broken install
        return f"import failed: {e!r}"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def _ms_per_step(torch, fn, xs, reps, warmup):
    """Median ms of `fn(x)` over `reps` individually synchronized calls, after `warmup` untimed ones,
    rotating through the batches `xs`."""
    for i in range(warmup):
        fn(xs[i % len(xs)])
    ts = []
    for i in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(xs[i % len(xs)])
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    return float(np.median(ts))


def _structure(juice, torch, model, latents, hmm_seq, hmm_vocab, images, split_intervals=(4, 4),
               max_prod_block_conns=4):
    """The circuit DAG of `model` ("hmm", "hclt" or "pd"; a PD splits every `split_intervals` pixels per axis and
    joins each sum block to at most `max_prod_block_conns` of its products, PyJuice's default 4)."""
    if model == "hmm":
        return juice.structures.HMM(seq_length=hmm_seq, num_latents=latents, num_emits=hmm_vocab,
                                    homogeneous=True)
    cat = juice.distributions.Categorical(num_cats=256)
    if model == "hclt":
        # the Chow-Liu tree is learned from (up to) the first 10000 images
        tree_x = torch.as_tensor(np.asarray(images[:10000]), dtype=torch.float32, device=_DEVICE)
        return juice.structures.HCLT(tree_x, num_latents=latents, input_dist=cat)
    if model == "pd":
        return juice.structures.PD(data_shape=(28, 28), num_latents=latents, split_intervals=tuple(split_intervals),
                                   structure_type="sum_dominated", input_dist=cat,
                                   max_prod_block_conns=max_prod_block_conns)
    raise ValueError(f"unknown model {model!r}")


def to_jaxpc(root_ns, made: dict | None = None):
    """PyJuice node vectors as jaxpc node vectors with the same blocks, edges, ties and parameters: compiling each
    gives one circuit in both systems. Every node must hold its parameters (``root_ns.init_parameters()`` or
    given); input nodes must be categorical and product edges block-sparse (what PyJuice's HCLT, PD and HMM
    build). ``made``: a dict filled with each PyJuice node vector's jaxpc counterpart."""
    from pyjuice.nodes.nodes import node_iterator

    import jaxpc
    from jaxpc import distributions

    def arr(t):
        return t.detach().cpu().numpy()

    made = {} if made is None else made
    for ns in node_iterator(root_ns):  # children first
        src = ns._source_node
        if src is not None and src not in made:
            raise ValueError(f"{ns} is tied to a vector that comes after it")
        if ns.is_input():
            var = ns.scope.to_list()
            if len(var) != 1 or type(ns.dist).__name__ != "Categorical":
                raise ValueError(f"only univariate categorical inputs convert, got {ns.dist} over {var}")
            if src is not None:
                made[ns] = made[src].duplicate(var[0], tie_params=True)
                continue
            if getattr(ns, "_params", None) is None:
                raise ValueError("input nodes without parameters: call init_parameters() first")
            probs = arr(ns._params).astype(np.float64).reshape(ns.num_nodes, ns.dist.num_cats)
            made[ns] = jaxpc.inputs(var[0], num_node_blocks=ns.num_node_blocks, block_size=ns.block_size,
                                    dist=distributions.Categorical(ns.dist.num_cats), params=probs)
        elif ns.is_prod():
            if not ns.is_block_sparse():
                raise ValueError("sparse product edges (one per node) do not convert")
            made[ns] = jaxpc.multiply(*[made[c] for c in ns.chs], edge_ids=arr(ns.edge_ids))
        else:
            chs = [made[c] for c in ns.chs]
            if src is not None:
                made[ns] = made[src].duplicate(*chs, tie_params=True)
                continue
            if getattr(ns, "_params", None) is None:
                raise ValueError("sum nodes without parameters: call init_parameters() first")
            made[ns] = jaxpc.summate(*chs, num_node_blocks=ns.num_node_blocks, block_size=ns.block_size,
                                     edge_ids=arr(ns.edge_ids), params=arr(ns._params).astype(np.float64))
    return made[root_ns]


def _batches(torch, model, B, seed, hmm_seq, hmm_vocab, images, n=4):
    """`n` distinct batches of size B to rotate through: uniform random tokens for the HMM, consecutive
    image rows (wrapping around) for HCLT/PD."""
    if model == "hmm":
        g = torch.Generator(device=_DEVICE).manual_seed(seed * 100003 + B)
        return [torch.randint(0, hmm_vocab, (B, hmm_seq), generator=g, device=_DEVICE) for _ in range(n)]
    N = len(images)
    return [torch.as_tensor(np.asarray(images)[np.arange(i * B, (i + 1) * B) % N], dtype=torch.long,
                            device=_DEVICE) for i in range(n)]


# Modes of `run_structure` and the exact calls each one times (x: a [B, V] int64 CUDA tensor; `opt` a
# `juice.optim.MiniBatchEM(pc, step_size=0.1, pseudocount=0.1)`).
MODES = ("graph", "graph_hook", "eager")
CALLS = {
    "graph": dict(
        setup="one dry run `with torch.no_grad(): pc(x, record_cudagraph=True)`; "
              "`pc.backward(x, flows_memory=1.0, record_cudagraph=True)`, then replay",
        fwd="`with torch.no_grad(): pc(x)`",
        fwdbwd="`with torch.no_grad(): pc(x)`; `pc.backward(x, flows_memory=1.0)`",
        em="`with torch.no_grad(): pc(x)`; `pc.backward(x, flows_memory=1.0)`; `opt.step()`"),
    "graph_hook": dict(
        setup="the same recorded CUDA graphs as `graph`",
        fwd="(not timed: graph's forward)",
        fwdbwd="`pc(x).mean().backward()` (autograd hook calling `pc.backward`)",
        em="`pc(x).mean().backward()`; `opt.step()`"),
    "eager": dict(
        setup="no CUDA graph recorded (PyJuice's README loop)",
        fwd="`with torch.no_grad(): pc(x)`",
        fwdbwd="`pc(x).mean().backward()`",
        em="`pc(x).mean().backward()`; `opt.step()`"),
}
_ALIASES = {"default": "eager"}  # the mode's earlier name


def run_structure(model, batches, *, latents, reps=25, warmup=5, modes=MODES, em=True, seed=0,
                  hmm_seq=64, hmm_vocab=4096, images=None) -> list[dict]:
    """Time PyJuice on `model` for each batch size in `batches` and each mode in `modes` (see `CALLS`).

    Per (B, mode) row: `fwd_ms` (forward), `fwdbwd_ms` (forward + backward with parameter flows, which
    accumulate: flows_memory = 1.0), `em_ms` (the same plus the mini-batch EM step, or None without `em`),
    `peak_mib` (max allocated GPU memory during the fwd+bwd timing), `first_fwdbwd_s` (the first eager
    fwd+bwd at this batch size: kernel JIT and per-shape tuning), `compile_s` (juice.compile + move to the
    GPU) and `sum_edges` (sum edges in the circuit's DAG). Eager modes run before any graph is recorded at
    that batch size; the graph modes share one recording. A failing (B, mode) gets `error` instead.
    """
    import pyjuice as juice
    import torch

    modes = tuple(_ALIASES.get(m, m) for m in modes)
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ValueError(f"unknown PyJuice modes {sorted(unknown)}; choose from {MODES}")
    base = dict(system="pyjuice", workload=model)
    try:
        torch.manual_seed(seed)
        ns = _structure(juice, torch, model, latents, hmm_seq, hmm_vocab, images)
        sum_edges = int(sum(n.num_edges for n in ns if n.is_sum()))
        torch.cuda.synchronize()
        t = time.perf_counter()
        pc = juice.compile(ns, verbose=False).to(_DEVICE)
        torch.cuda.synchronize()
        base.update(compile_s=time.perf_counter() - t, sum_edges=sum_edges)
        opt = juice.optim.MiniBatchEM(pc, step_size=0.1, pseudocount=0.1) if em else None
    except Exception as e:
        return [dict(base, error=repr(e))]

    def fwd(x):
        with torch.no_grad():
            pc(x)

    def fwdbwd_explicit(x):
        with torch.no_grad():
            pc(x)
        pc.backward(x, flows_memory=1.0)

    def fwdbwd_hook(x):
        pc(x).mean().backward()  # the autograd hook runs pc.backward, accumulating parameter flows

    steps = {"graph": fwdbwd_explicit, "graph_hook": fwdbwd_hook, "eager": fwdbwd_hook}

    def em_step(step):
        def f(x):
            step(x)
            opt.step()  # mini-batch EM update from the flows, then resets them
        return f

    order = [m for m in MODES if m in modes]  # eager first: no graph is recorded yet
    rows = []
    for B in batches:
        xs = None
        recorded = False
        try:
            pc._recorded_cuda_graphs.clear()  # graphs hold buffer pointers: never reuse across B
            xs = _batches(torch, model, B, seed, hmm_seq, hmm_vocab, images)
            torch.cuda.synchronize()
            t = time.perf_counter()
            fwdbwd_hook(xs[0])  # first call at this shape (kernel JIT, per-shape tuning)
            torch.cuda.synchronize()
            first = time.perf_counter() - t
        except Exception as e:
            rows += [dict(base, B=B, mode=m, error=repr(e)) for m in order]
            continue
        for mode in order:
            row = dict(base, B=B, mode=mode, first_fwdbwd_s=first, calls=CALLS[mode])
            try:
                if mode != "eager" and not recorded:
                    with torch.no_grad():
                        pc(xs[0], record_cudagraph=True)
                    pc.backward(xs[0], flows_memory=1.0, record_cudagraph=True)
                    torch.cuda.synchronize()
                    recorded = True
                # (graph_hook's forward is graph's: the same call replaying the same graph)
                row["fwd_ms"] = None if mode == "graph_hook" else _ms_per_step(torch, fwd, xs, reps, warmup)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                row["fwdbwd_ms"] = _ms_per_step(torch, steps[mode], xs, reps, warmup)
                row["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
                row["em_ms"] = _ms_per_step(torch, em_step(steps[mode]), xs, reps, warmup) if em else None
            except Exception as e:
                row["error"] = repr(e)
            rows.append(row)
        pc._recorded_cuda_graphs.clear()
        del xs
        torch.cuda.empty_cache()
    return rows


def run_mpe_flows(model, batches, *, latents, reps=20, warmup=5, seed=0, hmm_seq=64, hmm_vocab=4096,
                  images=None) -> list[dict]:
    """Time PyJuice's hard-EM flow pass on `model` at each batch size in `batches`, on its fastest path:
    `with torch.no_grad(): pc(x, propagation_alg="MPE")` then `pc.backward(x, flows_memory=1.0,
    propagation_alg="MPE")`, replaying CUDA graphs recorded by one dry run with `record_cudagraph=True`.

    Per B: `mpe_flows_ms` (median of synchronized calls), `peak_mib`, `first_s` (the first eager call at this batch
    size) and `compile_s`; a failing B gets `error` instead."""
    import pyjuice as juice
    import torch

    base = dict(system="pyjuice", workload=model, mode="graph", calls=MPE_CALL)
    try:
        torch.manual_seed(seed)
        ns = _structure(juice, torch, model, latents, hmm_seq, hmm_vocab, images)
        torch.cuda.synchronize()
        t = time.perf_counter()
        pc = juice.compile(ns, verbose=False).to(_DEVICE)
        torch.cuda.synchronize()
        base.update(compile_s=time.perf_counter() - t)
    except Exception as e:
        return [dict(base, error=repr(e))]

    def step(x, record=False):
        with torch.no_grad():
            pc(x, propagation_alg="MPE", record_cudagraph=record)
        pc.backward(x, flows_memory=1.0, propagation_alg="MPE", record_cudagraph=record)

    rows = []
    for B in batches:
        row = dict(base, B=B)
        try:
            pc._recorded_cuda_graphs.clear()  # graphs hold buffer pointers and the propagation: record anew
            xs = _batches(torch, model, B, seed, hmm_seq, hmm_vocab, images)
            torch.cuda.synchronize()
            t = time.perf_counter()
            step(xs[0])
            torch.cuda.synchronize()
            row["first_s"] = time.perf_counter() - t
            step(xs[0], record=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            row["mpe_flows_ms"] = _ms_per_step(torch, step, xs, reps, warmup)
            row["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        except Exception as e:
            row["error"] = repr(e)
        rows.append(row)
        pc._recorded_cuda_graphs.clear()
        torch.cuda.empty_cache()
    return rows


MPE_CALL = ('`with torch.no_grad(): pc(x, propagation_alg="MPE")`; `pc.backward(x, flows_memory=1.0, '
            'propagation_alg="MPE")`, CUDA graphs recorded once, then replayed')


def run_codd(*, latents=1024, vocab=32768, topk=1024, seq=32, steps=60, seed=0) -> dict:
    """The CoDD workload in PyJuice: a homogeneous HMM (`latents` states) whose emissions are
    `SoftEvidenceCategorical(vocab)`, given top-k soft evidence.

    Every step draws a batch size b in 10..26, tokens x [b, seq], `topk` candidate ids per position
    (distinct, the observed token among them, sorted by id as PyJuice recommends) and random normal
    log-probs [b, seq, topk]. The timed step is a forward with the evidence, then a backward that
    computes the parameter flows of this step (flows_memory = 0.0) and the gradient of sum_b LL_b with
    respect to the evidence log-probs, which PyJuice accumulates into the zeroed
    `categorical_evidence_logp_grad` buffer. Eager mode only: PyJuice re-allocates its buffers whenever
    the batch size changes, so a recorded CUDA graph would be re-recorded on nearly every step.
    Reports median/p10/p90 ms over steps whose batch size was seen before and `first_step_s_max`, the
    slowest step that met a new batch size (kernel JIT and per-shape tuning).
    """
    out = dict(system="pyjuice", workload="codd", mode="default", steps=steps)
    try:
        import pyjuice as juice
        import torch

        torch.manual_seed(seed)
        ns = juice.structures.GeneralizedHMM(
            seq_length=seq, num_latents=latents, homogeneous=True,
            input_dist=juice.distributions.SoftEvidenceCategorical(num_cats=vocab))
        torch.cuda.synchronize()
        t = time.perf_counter()
        pc = juice.compile(ns, verbose=False).to(_DEVICE)
        torch.cuda.synchronize()
        out["compile_s"] = time.perf_counter() - t

        g = torch.Generator(device=_DEVICE).manual_seed(seed)
        sizes = random.Random(seed)
        seen, first_s, ms = set(), [], []
        for _ in range(steps):
            b = sizes.randint(10, 26)
            x = torch.randint(0, vocab, (b, seq), generator=g, device=_DEVICE)
            scores = torch.rand(b, seq, vocab, generator=g, device=_DEVICE)
            scores.scatter_(2, x.unsqueeze(2), 2.0)  # the observed token always makes the top k
            ids = scores.topk(topk, dim=2).indices.sort(dim=2).values
            logp = torch.randn(b, seq, topk, generator=g, device=_DEVICE)
            ev = dict(categorical_evidence_logp=logp, soft_evidence_cat_ids=ids)
            del scores
            torch.cuda.synchronize()
            t = time.perf_counter()
            logp_grad = torch.zeros_like(logp)
            with torch.no_grad():
                pc(x, **ev)
            pc.backward(x, flows_memory=0.0, categorical_evidence_logp_grad=logp_grad, **ev)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            if b in seen:
                ms.append(dt * 1e3)
            else:
                first_s.append(dt)
                seen.add(b)
        if not ms:
            raise RuntimeError("every step met a new batch size; increase steps")
        out.update(median_ms=float(np.median(ms)), p10_ms=float(np.percentile(ms, 10)),
                   p90_ms=float(np.percentile(ms, 90)), first_step_s_max=max(first_s))
    except Exception as e:
        out["error"] = repr(e)
    return out
