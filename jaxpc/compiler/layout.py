"""Static layout of a compiled circuit: hashable Python-only descriptions of its layers.

Node values live in one buffer ``[R, B]`` (rows = nodes, B = batch). Rows ``[0, Kmax)`` hold
zeros and ``[Kmax, 2 Kmax)`` hold ``-inf`` (padding targets for products and sums), then come the
input layers, then one contiguous range per *stage*. A stage holds every product and sum
vector of one topological level; its partitions read rows of lower levels only, so they are
independent and their outputs are written with a single ``dynamic_update_slice``.

Consecutive stages with identical shapes (the steps of an HMM, tied or not) form a
:class:`ScanSpec` and run under ``lax.scan`` with stacked index tables, so trace and compile
time do not grow with the sequence length.

Index tables (``int32`` device arrays) are not part of the layout: they are a pytree passed into
the jitted functions, see :mod:`jaxpc.compiler.compile`.
"""

from __future__ import annotations

import dataclasses

from ..distributions import Distribution


@dataclasses.dataclass(frozen=True)
class InputLayerSpec:
    """All input nodes whose distributions share a layer key.

    Attributes:
        key: the layer's entry in ``params["input"]``.
        dist: the distribution that evaluates the layer (any member; they behave identically).
        offset: first buffer row.
        num_nodes: nodes (buffer rows) in the layer.
        num_rows: parameter rows (tied vectors share rows).
        run: ``r > 1`` when node ``i`` reads parameter row ``i`` and the nodes come in runs of ``r`` over one
            variable (a vector of latents per variable, as in HCLTs, PDs and HMMs): the layer's sufficient
            statistics are then one batched matrix product per run instead of a scatter; else 1.
        distinct_runs: ``run > 1`` and every run is over a different variable (one vector of latents per variable,
            as in HCLTs): a variable's reached leaf is its run's, written without a reduction over the runs.
    """

    key: str
    dist: Distribution
    offset: int
    num_nodes: int
    num_rows: int
    run: int = 1
    distinct_runs: bool = False


@dataclasses.dataclass(frozen=True)
class ProdPart:
    """``n`` product blocks of ``K`` nodes, each the element-wise sum of ``m`` child blocks."""

    n: int
    m: int
    K: int

    @property
    def num_rows(self) -> int:
        return self.n * self.K


@dataclasses.dataclass(frozen=True)
class SumPart:
    """``n`` sum blocks of ``Kp`` nodes with fan-in ``C`` child blocks of ``Kc`` nodes.

    ``group`` names the parameter array (``params["sum"][group]``, ``[P, Kp, Kc]``). ``dense``: every
    block reads the same children (no padding), so children are gathered once. ``M``: each child block
    is the sum of ``M`` row blocks (``ch [n, C, M]``; 1 except in the folded plan, see ``Layout.fold``).
    ``U``/``D``: shape of the inverse tables (``uch [U]``, ``par``/``ppid [U, D]``) the backward kernels walk;
    ``D == 1``: every child row block is read once in the partition. ``unique_pid``: no parameter block is used
    twice in it. Either makes the matching scatter of the backward free of conflicts (no atomic adds).
    ``gated``: a block of it has BlockScale gates (``SumNodes.set_gates``); its tables then hold ``gid [n, C, Kp]``,
    the gate column of each slot's parent rows (``Layout.num_gates`` where the slot has no gate).
    """

    n: int
    C: int
    Kp: int
    Kc: int
    group: str
    dense: bool
    U: int = 0  # distinct child blocks (inverse tables for the child-side backward kernel)
    D: int = 0  # most parents of one child block within the partition
    M: int = 1  # rows added up per child block (> 1 in the folded plan: a folded product's children)
    unique_pid: bool = False  # every edge has its own parameter block (no padding, no tying inside the partition)
    gated: bool = False  # tables["gid"]: gate columns (SumNodes.set_gates)

    @property
    def num_rows(self) -> int:
        return self.n * self.Kp

    @property
    def blockwise(self) -> bool:
        """Whether its children can be gathered block by block: not dense, or a single block (a tree's top levels).
        The partitions of the batched parameter-flow pass (:class:`PFlowSpec`)."""
        return not self.dense or self.n == 1

    @property
    def pflow_key(self) -> tuple:
        """Its :class:`PFlowSpec`'s ``key`` (when ``blockwise``)."""
        return (self.group, self.C, self.Kp, self.Kc)


@dataclasses.dataclass(frozen=True)
class StageSpec:
    prods: tuple[ProdPart, ...]
    sums: tuple[SumPart, ...]
    offset: int  # first output row (tables carry it too, for stages inside a scan)

    @property
    def num_rows(self) -> int:
        return sum(p.num_rows for p in self.prods) + sum(s.num_rows for s in self.sums)

    @property
    def signature(self) -> tuple:
        return (self.prods, self.sums)


@dataclasses.dataclass(frozen=True)
class ScanSpec:
    """``repeats`` repetitions of a period of stages with identical shapes, run by ``lax.scan``. ``offsets[r][j]``:
    the first row of repetition ``r``'s stage ``j`` (the stacked tables' ``"out"``), which the stages run unrolled
    read as constants (empty: read from the tables)."""

    period: tuple[StageSpec, ...]
    repeats: int
    offsets: tuple[tuple[int, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class SumGroupSpec:
    """Sum parameters of one block shape: ``params["sum"][key]`` is ``[num_blocks, Kp, Kc]`` log-weights,
    normalized per node over ``num_segments`` parent blocks. ``untied``: no vector of the group is tied to another,
    so each parameter block belongs to exactly one edge block of the circuit. ``single_segments``: every segment is
    one parameter block (each parent block of the group's vectors has one edge block: a node's total is its own
    block's row sum)."""

    key: str
    Kp: int
    Kc: int
    num_blocks: int
    num_segments: int
    untied: bool = False
    single_segments: bool = False


@dataclasses.dataclass(frozen=True)
class ChainSpec:
    """A chain found by :func:`jaxpc.compiler.chain.detect_chain` (an HMM-shaped circuit).

    Attributes:
        K: nodes per step (the latent states).
        R: transition steps (``R + 1`` emission blocks).
        group, Kp, Kc: parameter group and block shape of the transition sums (``K // Kp`` parent
            blocks of ``K // Kc`` child blocks each).
        root_group, root_Kc: the same for the root sum (one parent node).
        tied: every transition reads the same parameter blocks (one matrix for all steps).
        order: for chain position ``t = 0 .. R``, the emission block's index among the input layer's
            ``R + 1`` blocks of ``K`` rows.
    """

    K: int
    R: int
    group: str
    Kp: int
    Kc: int
    root_group: str
    root_Kc: int
    tied: bool
    order: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """A run of tree levels in the folded plan (an HCLT's), found by :func:`jaxpc.compiler.tree.detect_tree`, which
    the persistent kernels of :mod:`jaxpc.ops.pallas_tree` evaluate in one launch per direction at small batches.

    Steps ``start .. stop - 1`` of the plan are ``levels`` stages of one sum partition each, every parent block
    reading one child block (the sum of at most ``M`` row blocks) that no other block reads, with its own
    parameter block of ``params["sum"][group]`` (``[P, Kp, Kc]``). Its tables (``tables["tree"]``) list the
    ``blocks`` real parent blocks level by level (padding blocks of evened levels left out): ``lev [levels + 1]``
    the first block of each level, ``prow [blocks]`` each block's first parent row, ``ch [blocks, 1, M]`` the rows
    of its child's row blocks (the zero rows pad shorter ones) and ``pid [blocks, 1]`` its parameter block.
    """

    start: int
    stop: int
    levels: int
    blocks: int
    group: str
    Kp: int
    Kc: int
    M: int

    @property
    def pflow_key(self) -> tuple:
        """The ``key`` of the :class:`PFlowSpec` that holds its blocks."""
        return (self.group, 1, self.Kp, self.Kc)


@dataclasses.dataclass(frozen=True)
class PFlowSpec:
    """The sum partitions of one block shape and fan-in gathered block by block (``SumPart.blockwise``), as one
    table for the batched parameter-flow pass (``Options.param_flow_pass``): ``n`` parent blocks of ``C`` child
    blocks (each the sum of ``M`` row blocks), sorted by parameter block. Its tables: ``prow [n]`` each block's
    first parent row, ``ch [n, C]`` (``[n, C, M]`` when ``M > 1``, shorter products padded with the zero rows),
    ``pid [n, C]`` and ``part [n]``, the block's partition among the members.

    Its members are the partitions with ``blockwise`` and ``pflow_key == key``, in the order of the steps, a
    scanned stage's period once (:meth:`Layout.pflow_members`; every repeat's blocks in the table).

    Attributes:
        start: the blocks' parameter ids are ``start, start + 1, ..`` in table order (``n * C`` of them: the flows
            are added to one slice of the group's array), else -1.
        unique: no parameter id appears twice (a scatter without atomic adds).
    """

    group: str
    C: int
    Kp: int
    Kc: int
    M: int
    n: int
    start: int
    unique: bool

    @property
    def key(self) -> tuple:
        return (self.group, self.C, self.Kp, self.Kc)


@dataclasses.dataclass(frozen=True)
class Layout:
    num_rows: int
    kmax: int
    input_layers: tuple[InputLayerSpec, ...]
    steps: tuple[StageSpec | ScanSpec, ...]
    sum_groups: tuple[SumGroupSpec, ...]
    root_row: int
    num_vars: int
    chain: ChainSpec | None = None  # set when the circuit is a chain (an HMM): jaxpc.compiler.chain
    # the folded plan (products folded into the sums' gathers; tables["fold"]), when the circuit has products
    fold: Layout | None = None
    # the batched parameter-flow pass's tables, one per block shape and fan-in (tables["pflows"])
    pflows: tuple[PFlowSpec, ...] = ()
    # every row above the padding is read by at most one block of one partition (a tree, such as an HCLT): a row's
    # flow is zero until its one reader's backward, whose XLA scatter then writes it instead of adding to it
    single_reader: bool = False
    # with single_reader: the (start, stop) row ranges whose flows no backward writes (padding rows, padded nodes,
    # nodes without a parent), all but the root's row; the flow pass zeros these and leaves the rest unset.
    # None: unknown, the flow pass starts from zeros
    flow_gaps: tuple[tuple[int, int], ...] | None = None
    # columns of evidence["sum_gates"] [B, num_gates] (SumNodes.set_gates; 0: no sum vector has gates)
    num_gates: int = 0
    # the folded plan's run of tree levels (tables["tree"]), when it has one: jaxpc.compiler.tree
    tree: TreeSpec | None = None
    # reading edge blocks per product block (sums' edge blocks whose child is a product, over the product blocks;
    # 0 without products): what the folded plan reads each product's child rows for, against writing it once
    product_reads: float = 0.0

    @property
    def ninf_row(self) -> int:
        return self.kmax

    def pflow_members(self, key: tuple) -> list:
        """The sum partitions of :class:`PFlowSpec` ``key``, numbered as its ``part`` table."""
        return [p for _, p in self.pflow_member_steps(key)]

    def pflow_member_steps(self, key: tuple) -> list:
        """``(step index, partition)`` of each of :meth:`pflow_members`, in its order."""
        return [(i, p) for i, step in enumerate(self.steps)
                for spec in (step.period if isinstance(step, ScanSpec) else (step,))
                for p in spec.sums if p.blockwise and p.pflow_key == key]

    def stages(self):
        """All stage specs in evaluation order (scans unrolled: a scanned spec repeats, and its ``offset`` is
        that of the first repeat; the tables hold the others)."""
        for step in self.steps:
            if isinstance(step, ScanSpec):
                for _ in range(step.repeats):
                    yield from step.period
            else:
                yield step
