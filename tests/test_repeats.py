"""Stages whose sum edges repeat an earlier stage's up to a shift reuse its tables, shifted
(:mod:`jaxpc.compiler.repeats`): the compiled structure must be the one built stage by stage, array for array."""

import numpy as np
import pytest

from jaxpc import distributions, structures
from jaxpc.compiler import compile as compiler
from jaxpc.compiler import repeats

from .random_circuits import Generator


def _equal(a, b, path="") -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and np.array_equal(a, b), path
    else:
        assert a == b, path


CIRCUITS = {
    "hmm": lambda: structures.HMM(40, 6, 4),
    "hmm-inhomogeneous-blocks": lambda: structures.HMM(20, 8, 4, homogeneous=False, block_size=2),
    "gaussian-hmm": lambda: structures.GeneralizedHMM(30, 4, distributions.Gaussian()),
    "pd": lambda: structures.PD((8, 8), num_latents=4, split_intervals=(2, 2), input_dist=distributions.Categorical(4)),
    "hclt": lambda: structures.HCLT(np.random.default_rng(0).integers(0, 3, (200, 12)), num_latents=4,
                                    input_dist=distributions.Categorical(3)),
    "rat-spn": lambda: structures.RAT_SPN(16, num_latents=4, depth=3, num_repetitions=2,
                                          input_dist=distributions.Categorical(4)),
    **{f"random{seed}": (lambda seed=seed: Generator(seed, 5 + seed % 4).circuit()) for seed in range(6)},
}


@pytest.mark.parametrize("name", list(CIRCUITS))
def test_reused_stages_equal_the_stages_built_one_by_one(name, monkeypatch):
    root = CIRCUITS[name]()
    hits = []
    get = repeats.Repeats.get
    monkeypatch.setattr(repeats.Repeats, "get", lambda self, *a: hits.append(get(self, *a)) or hits[-1])
    reused = compiler.build(root)
    monkeypatch.setattr(repeats.Repeats, "get", lambda self, *a: None)
    built = compiler.build(root)
    assert reused.layout == built.layout and reused.stages == built.stages
    _equal(reused.tables, built.tables)
    _equal(reused.stage_tables, built.stage_tables)
    _equal(reused.block_rows, built.block_rows)
    assert [[[ns.id for ns in part] for part in own["sums"]] for own in reused.stage_owners] == \
        [[[ns.id for ns in part] for part in own["sums"]] for own in built.stage_owners]
    if name.startswith("hmm"):  # every step after the first few repeats one before it, in both plans
        T = 40 if name == "hmm" else 20
        assert sum(h is not None for h in hits) >= 2 * (T - 3)


def test_a_shift_that_reorders_the_child_rows_is_built_again():
    """A folded table lists each child row once, sorted; when its columns' rows shift by different amounts and their
    order changes, the stage's tables are built, not shifted."""
    ch = np.array([[[10, 20]], [[11, 21]]])  # two parents, one child each: a product of rows (10, 20), (11, 21)
    tab = {"ch": ch, "pid": np.array([[0], [1]], np.int32), "uch": np.array([10, 11, 20, 21], np.int32),
           "par": np.array([[0], [1], [0], [1]], np.int32), "ppid": np.array([[0], [1], [0], [1]], np.int32),
           "pcol": np.zeros((4, 1), np.int32), "eorder": np.array([0, 1], np.int32)}
    cols = repeats._columns(tab)
    np.testing.assert_array_equal(cols, [0, 0, 1, 1])
    kept = repeats._shifted(tab, np.array([5, 5]), np.array([5, 5])[cols], 3)
    np.testing.assert_array_equal(kept["uch"], [15, 16, 25, 26])
    np.testing.assert_array_equal(kept["ch"], ch + 5)
    np.testing.assert_array_equal(kept["ppid"], tab["ppid"] + 3)
    assert repeats._shifted(tab, np.array([15, 0]), np.array([15, 0])[cols], 0) is None  # 25, 26 pass 20, 21
