"""The layering contract's second half (the first is .importlinter, run in CI by lint-imports): no module of
jaxpc imports another module's private names, and no module reaches into the private attributes of objects
whose classes another module defines (``obj._name`` where ``_name`` is not an attribute of this module's own
classes). A package may keep private helper modules for its own modules (``structures/_util.py``)."""

import ast
from pathlib import Path

import jaxpc

ROOT = Path(jaxpc.__file__).parent


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        yield path.relative_to(ROOT.parent).as_posix(), ast.parse(path.read_text(), filename=str(path))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_imports_private_names():
    bad = []
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                if node.level == 0 and not (node.module or "").startswith("jaxpc"):
                    continue  # other packages
                parts = (node.module or "").split(".")
                bad += [f"{name}:{node.lineno} from {node.module} import {a.name}" for a in node.names
                        if _private(a.name)]
                same_package_helper = node.level == 1 and len(parts) == 1
                bad += [f"{name}:{node.lineno} from {node.module}" for p in parts
                        if _private(p) and not same_package_helper]
            elif isinstance(node, ast.Import):
                bad += [f"{name}:{node.lineno} import {a.name}" for a in node.names
                        if a.name.startswith("jaxpc") and any(_private(p) for p in a.name.split("."))]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def _own_attributes(tree) -> set[str]:
    """Private attributes of the classes a module defines: assigned on ``self``/``cls`` or in a class body."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                targets = item.targets if isinstance(item, ast.Assign) else (
                    [item.target] if isinstance(item, ast.AnnAssign) else [])
                own |= {t.id for t in targets if isinstance(t, ast.Name)}
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    own.add(item.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") \
                and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
    return {a for a in own if _private(a)}


def test_no_module_reaches_into_private_attributes():
    bad = []
    for name, tree in _modules():
        own = _own_attributes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                bad.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert not bad, "private attributes reached from outside their object:\n" + "\n".join(bad)
