"""Every parameter of the public API is named in its docstring.

The public API: the names in ``jaxpc.__all__``, in the ``__all__`` of each public submodule (those in
``jaxpc.__all__``, plus :mod:`jaxpc.nn` and :mod:`jaxpc.autotune`), and the public methods of
:class:`jaxpc.Circuit` and :class:`jaxpc.nn.CircuitModule`. A class is checked by its constructor's parameters
against its own and its ``__init__``'s docstrings. Every parameter but ``self`` / ``cls``, ``*args`` /
``**kwargs`` and names starting with ``_`` must be *named*: written as a word inside a code literal (``name``,
``f(name)``, ``name=...``) or as an ``Args:``-style entry ``name: ...`` (at the start of a line, or after ``;`` or
``,``). Plain prose does not count: "name", "key", "path" and "batch" are English words too.
"""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

import jaxpc

# (qualified name, parameter): parameters whose docstring rightly defers elsewhere, or whose fix is pending in a
# file that this test's owner does not edit. Each entry says why.
EXCEPTIONS: set = set()  # (qualified name, parameter) pairs whose docstring rightly defers, each with a comment

# the public submodules whose ``__all__`` is walked besides those listed in ``jaxpc.__all__``
EXTRA_MODULES = ("jaxpc.nn", "jaxpc.autotune")


def named(name: str, doc: str) -> bool:
    """Whether ``doc`` names parameter ``name`` (see the module docstring)."""
    word = rf"(?<![\w.]){re.escape(name)}(?!\w)"
    literal = rf"`[^`\n]*{word}[^`\n]*`"
    entry = rf"(^|[;,]\s)\s*(\w+,\s*)*\**{re.escape(name)}(,\s*\w+)*(\s*\([^)\n]*\))?\s*:"
    return re.search(literal, doc) is not None or re.search(entry, doc, re.M) is not None


def checked_params(fn) -> list[str]:
    """The parameters of ``fn`` that its docstring must name."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature
        return []
    return [p.name for p in sig.parameters.values()
            if p.name not in ("self", "cls") and not p.name.startswith("_")
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _class_doc(cls) -> str:
    init = vars(cls).get("__init__")
    return "\n".join(d for d in (inspect.getdoc(cls), init and inspect.getdoc(init)) if d)


def public_api() -> list[tuple[str, object, str]]:
    """``(qualified name, callable, docstring)`` of every public function, class and method."""
    modules = {"jaxpc": jaxpc}
    for n in jaxpc.__all__:
        if inspect.ismodule(getattr(jaxpc, n)):
            modules[f"jaxpc.{n}"] = getattr(jaxpc, n)
    classes = [jaxpc.Circuit]
    for name in EXTRA_MODULES:
        try:
            modules[name] = importlib.import_module(name)
        except ImportError:  # jaxpc.nn without flax
            continue
        if name == "jaxpc.nn":
            classes.append(modules[name].CircuitModule)
    out, seen = [], set()
    for mname, mod in modules.items():
        for n in getattr(mod, "__all__", ()):
            obj = getattr(mod, n)
            if inspect.ismodule(obj) or not callable(obj) or id(obj) in seen:
                continue
            seen.add(id(obj))
            doc = _class_doc(obj) if inspect.isclass(obj) else inspect.getdoc(obj) or ""
            out.append((f"{mname}.{n}", obj, doc))
    for cls in classes:
        for n, v in vars(cls).items():
            fn = getattr(cls, n)
            if n.startswith("_") or isinstance(v, property) or not callable(fn):
                continue
            out.append((f"{cls.__name__}.{n}", fn, inspect.getdoc(fn) or ""))
    return out


def test_every_public_parameter_is_named_in_its_docstring():
    api = public_api()
    names = {q for q, _, _ in api}
    assert {"jaxpc.summate", "jaxpc.structures.GeneralizedHMM", "jaxpc.parallel.em_step", "Circuit.em_update",
            "jaxpc.io.load_params", "jaxpc.autotune.Autotuner"} <= names  # the walk reaches the public API
    missing = [(q, p) for q, fn, doc in api for p in checked_params(fn)
               if not named(p, doc) and (q, p) not in EXCEPTIONS]
    assert not missing, "parameters not named in their docstrings:\n" + "\n".join(f"  {q}: {p}" for q, p in missing)
    # each exception names a real parameter of a walked function (a rename leaves no dead entry)
    params = {(q, p) for q, fn, _ in api for p in checked_params(fn)}
    assert EXCEPTIONS <= params, f"stale exceptions: {sorted(EXCEPTIONS - params)}"


def _documented(a, b, *, c=1, _private=0, **kw):
    """Sums ``a`` and ``b``.

    Args:
        c: a scale."""


def _in_prose(key, path, *args):
    """Uses the key at the path."""


def _inline(x, missing, flows, seg):
    """x: data; missing: a mask, ``jax.grad(f)(flows)``, ``seg[p]``."""


@pytest.mark.parametrize("fn,want", [(_documented, []), (_in_prose, ["key", "path"]), (_inline, [])])
def test_the_rule_names_literals_and_entries_not_prose(fn, want):
    doc = inspect.getdoc(fn)
    assert [p for p in checked_params(fn) if not named(p, doc)] == want
    assert not named("jax", "``jaxpc``") and not named("random", "``jax.random.key``")
