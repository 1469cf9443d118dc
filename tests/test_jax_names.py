"""Every JAX name that the library, its tests, benchmarks and notebooks use exists in the running JAX, is not
deprecated there, and every keyword they pass to a JAX function is one it takes.

CI runs this file under both JAX versions it supports (the venv's and the GPU image's, ``.ci/run``): a name or a
keyword that only one version has fails here, on the CPU, whatever code path uses it, rather than on a GPU. A
name reached inside a ``try`` block that catches its absence (``ImportError``, ``AttributeError``, ``Exception``)
is the code's own fallback and is not checked; names reached through ``getattr`` are not seen."""

import ast
import functools
import importlib
import inspect
import json
import pathlib
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "jaxpc").rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")])
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
_CAUGHT = {"ImportError", "ModuleNotFoundError", "AttributeError", "Exception", "BaseException"}
_MISSING = object()


def _source(path: pathlib.Path) -> str:
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    return "\n".join("\n".join(ln for ln in c.splitlines() if not ln.lstrip().startswith(("%", "!"))) for c in code)


def _aliases(tree: ast.AST) -> dict[str, set[str]]:
    """Each local name bound by an import of a JAX module or name, to the dotted names it stands for."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ("jax", "jaxlib"):
                    out.setdefault(a.asname or a.name.split(".")[0], set()).add(a.name if a.asname else
                                                                                a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in ("jax", "jaxlib"):
            for a in node.names:
                out.setdefault(a.asname or a.name, set()).add(f"{node.module}.{a.name}")
    return out


def _guarded(tree: ast.AST) -> set[int]:
    """The ids of the nodes inside a ``try`` body whose handlers catch a missing name."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            names = set()
            for h in node.handlers:
                types_ = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
                names |= {t.id if isinstance(t, ast.Name) else getattr(t, "attr", "") for t in types_ if t} or {
                    "BaseException"}
            if names & _CAUGHT:
                out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


@functools.cache
def _resolve(dotted: str):
    """``(object, "")`` for a dotted JAX name, or ``(_MISSING, why)``: the first part that is missing, or that
    its module lists as deprecated (once per name: the same names recur in every file)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    else:
        return _MISSING, f"no module {parts[0]}"
    for j, name in enumerate(parts[i:], start=i):
        if name in (getattr(obj, "_deprecations", None) or {}):  # JAX's table of a module's deprecated names
            return _MISSING, f"{'.'.join(parts[:j + 1])} is deprecated: {obj._deprecations[name][0]}"
        nxt = getattr(obj, name, _MISSING)
        if nxt is _MISSING and isinstance(obj, types.ModuleType):
            try:
                nxt = importlib.import_module(f"{obj.__name__}.{name}")
            except ImportError:
                pass
        if nxt is _MISSING:
            return _MISSING, f"{'.'.join(parts[:j + 1])} does not exist"
        obj = nxt
    return obj, ""


def _dotted(node: ast.AST, aliases: dict[str, set[str]]) -> list[str]:
    """The JAX names an attribute chain or a bare name stands for (none if it is not rooted at a JAX import)."""
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return []
    return [".".join([base, *reversed(chain)]) for base in sorted(aliases[node.id])]


def _keywords_taken(obj, keywords: list[str]) -> list[str]:
    """The keywords of ``keywords`` that callable ``obj`` does not take (none where its signature is unknown)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    params = sig.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return []
    names = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    return [k for k in keywords if k not in names]


def problems(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """What in ``path`` names a JAX object that the running JAX lacks or deprecates, or passes a keyword that a
    JAX callable does not take (each as ``file:line: why``, the file relative to ``root``)."""
    tree = ast.parse(_source(path))
    aliases = _aliases(tree)
    if not aliases:
        return []
    guarded = _guarded(tree)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    where = path.relative_to(root)
    out = []
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            found = [_resolve(d) for d in _dotted(node, aliases)]
            if found and all(obj is _MISSING for obj, _ in found):
                out.append(f"{where}:{node.lineno}: {found[0][1]}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                name = a.asname or (a.name if isinstance(node, ast.ImportFrom) else a.name.split(".")[0])
                for d in aliases.get(name, ()):
                    obj, why = _resolve(d)
                    if obj is _MISSING and (isinstance(node, ast.ImportFrom) or d == a.name):
                        out.append(f"{where}:{node.lineno}: {why}")
        elif isinstance(node, ast.Call) and node.keywords:
            keywords = [k.arg for k in node.keywords if k.arg is not None]
            for d in _dotted(node.func, aliases):
                obj, _ = _resolve(d)
                if inspect.isroutine(obj) or inspect.isclass(obj):  # not an instance's __call__
                    bad = _keywords_taken(obj, keywords)
                    if bad:
                        out.append(f"{where}:{node.lineno}: {d} takes no keyword {', '.join(bad)}")
    return sorted(set(out))


@pytest.mark.parametrize("path", SOURCES + NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_jax_names_exist_and_take_the_keywords_given(path):
    assert not problems(path)


def test_the_check_finds_missing_deprecated_and_misspelled_names(tmp_path):
    """The check itself: a missing name, a keyword a JAX function does not take and a deprecated name, each
    found; a guarded fallback and correct calls pass."""
    import jax.sharding

    # a deprecated name where this JAX deprecates it (0.12 does, 0.11.2 does not)
    table = getattr(jax.sharding, "_deprecations", {})
    deprecated = ([f"bad.py:13: jax.sharding.SingleDeviceSharding is deprecated: {table['SingleDeviceSharding'][0]}"]
                  if "SingleDeviceSharding" in table else [])
    bad = tmp_path / "bad.py"
    bad.write_text("import jax\nimport jax.numpy as jnp\nfrom jax.experimental import pallas as pl\n"
                   "from jax import no_such_name\n"
                   "a = jax.sharding.NoSuchSharding\n"
                   "b = jnp.sum(jnp.ones(3), axes=0)\n"
                   "c = pl.BlockSpec((8,), lambda i: (i,))\n"
                   "try:\n    d = jax.no_such_fallback\nexcept AttributeError:\n    d = None\n"
                   "e = jnp.sum(jnp.ones(3), axis=0)\n"
                   "f = jax.sharding.SingleDeviceSharding\n")
    found = problems(bad, tmp_path)
    assert sorted(found) == sorted(["bad.py:4: jax.no_such_name does not exist",
                                    "bad.py:5: jax.sharding.NoSuchSharding does not exist",
                                    "bad.py:6: jax.numpy.sum takes no keyword axes", *deprecated]), found
