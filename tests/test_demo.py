"""What a new user reads stays true: the README's main command runs (a short run of the demo trains and beats
uniform), the README's snippets run as written, and the docs call only names that exist."""

import ast
import builtins
import importlib.util
import math
import re
from pathlib import Path

import numpy as np
import pytest

import jaxpc
from jaxpc import demo

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
# names that the README's snippets leave to the reader: their own data, and the sketch of gated sum vectors
SUPPLIED = {"data", "train_images", "s", "t", "B", "gs"}


def _python_blocks(path: Path) -> list[tuple[str, str]]:
    """``(section heading, code)`` of every fenced python block of a markdown file, in order."""
    blocks, heading = [], ""
    for part in re.split(r"(^```python\n.*?^```$)", path.read_text(), flags=re.S | re.M):
        if part.startswith("```python"):
            blocks.append((heading, part[len("```python\n"):-3]))
        else:
            prose = re.sub(r"^```.*?^```$", "", part, flags=re.S | re.M)  # not the comments of other blocks
            heading = ([heading] + re.findall(r"^#+ (.*)$", prose, flags=re.M))[-1]
    return blocks


def _top_level_names(module: ast.Module) -> set[str]:
    """Names that a module's top level defines, assigns or imports."""
    names = set()
    for node in module.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        else:
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names


def test_demo_trains_hclt_on_digits(capsys):
    out = demo.main(["--epochs", "2", "--latents", "8", "--batch-size", "256"])
    text = capsys.readouterr().out
    assert "bits per dimension" in text and "HCLT-8" in text
    assert out["test_bpd"] < math.log2(17) - 1.0  # far better than a uniform model over 17 levels
    assert out["train_ll"] > out["test_ll"] - 20


def test_readme_stays_a_short_users_guide():
    """The README is for users (what it is, install, quick start, concepts, one performance table): at most 12,000
    bytes; the rest belongs in docs/."""
    assert len(README.read_bytes()) <= 12_000


def test_readme_snippets_use_only_names_they_define_or_import():
    """Each snippet, read after the ones above it, uses only names that they or it define or import (and the
    reader's own data, ``SUPPLIED``): pasted in order, they raise no ``NameError``."""
    blocks = _python_blocks(README)
    assert [h for h, _ in blocks][:3] == ["Quick start", "Training", "Queries"]
    defined = set(dir(builtins)) | SUPPLIED
    for heading, code in blocks:
        for stmt in ast.parse(code).body:
            nodes = list(ast.walk(stmt))
            local = {n.id for c in nodes if isinstance(c, ast.comprehension) for n in ast.walk(c.target)
                     if isinstance(n, ast.Name)}
            used = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            assert used <= defined | local, f"README, {heading}: {sorted(used - defined - local)} not defined"
            defined |= {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            defined |= {(a.asname or a.name).split(".")[0] for n in nodes if isinstance(n, ast.Import | ast.ImportFrom)
                        for a in n.names}


def test_docs_call_only_names_that_exist():
    """A dotted ``jaxpc.a.b(`` that the README or docs/ call is reachable from ``import jaxpc``: ``a`` is one of
    ``jaxpc.__all__`` (what ``import jaxpc`` binds, whatever else a process has imported) or a module that the same
    page imports (``import jaxpc.a``), and ``b`` exists."""
    for path in DOCS:
        text = path.read_text()
        imported = set(re.findall(r"import jaxpc\.(\w+)", text))
        for call in sorted(set(re.findall(r"(?<![\w.])jaxpc((?:\.\w+)+)\(", text))):
            head, *rest = call[1:].split(".")
            assert head in jaxpc.__all__ or head in imported, \
                f"{path.name} calls jaxpc{call}, but `import jaxpc` does not bind jaxpc.{head}: import it first"
            if head not in jaxpc.__all__:  # read the module's source: importing it may import an optional package
                module = ast.parse(Path(importlib.util.find_spec(f"jaxpc.{head}").origin).read_text())
                assert rest[0] in _top_level_names(module), f"{path.name} calls jaxpc{call}, which does not exist"
                continue
            obj = getattr(jaxpc, head)
            for name in rest:
                assert hasattr(obj, name), f"{path.name} calls jaxpc{call}, which does not exist"
                obj = getattr(obj, name)


@pytest.mark.slow
def test_readme_quick_start_training_and_queries_run_as_written():
    """The README's Quick start, Training and Queries snippets run in order in one namespace (the reader's
    ``data``: 256 rows of the quick start's two 5-valued variables) and give what their comments say."""
    blocks = _python_blocks(README)
    ns = {"data": np.random.default_rng(0).integers(0, 5, (256, 2)).astype(np.int32)}
    for heading, code in blocks:
        if heading in ("Quick start", "Training", "Queries"):
            exec(compile(code, f"README.md ({heading})", "exec"), ns)
    x, params, circuit = ns["x"], ns["params"], ns["circuit"]
    assert ns["ll"].shape == (2,) and ns["mp"].shape == (2,)
    assert np.all(np.asarray(ns["mp"]) <= np.asarray(circuit.log_prob(params, x)) + 1e-6)
    assert np.asarray(ns["w"]).shape == (1, 8)
    np.testing.assert_allclose(np.asarray(ns["w"]).sum(), 1.0, rtol=1e-5)
    assert ns["res"].epoch_ll.shape == (40,)
    assert ns["samples"].shape == (1000, 2)
    assert np.asarray(ns["assignment"])[:, 0].tolist() == x[:, 0].tolist()  # observed values kept


@pytest.mark.parametrize("argv", [["--batch-size", "0"], ["--batch-size", "-3"], ["--epochs", "-1"],
                                  ["--seed", "-1"], ["--latents", "x"]])
def test_demo_names_a_bad_option(argv, capsys):
    """A batch size below 1 (a ZeroDivisionError or an empty concatenation before), a negative epoch count (no
    training, silently), a negative seed (numpy's unnamed "expected non-negative integer") or a non-integer is an
    argparse error naming the option and the value."""
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {argv[0]}: must be an integer >= " in err and repr(argv[1]) in err
