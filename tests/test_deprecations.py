"""Deprecated names kept for one release: ``jaxpc.transforms`` (now ``jaxpc.edit``) and ``jaxpc.dists``
(now ``jaxpc.distributions``) still work, are the same objects, and warn once, at the caller's line."""

import sys
import warnings

import pytest

import jaxpc
from jaxpc import edit


def _deprecations(caught, name):
    return [w for w in caught if issubclass(w.category, DeprecationWarning) and name in str(w.message)]


@pytest.mark.parametrize("how", ["attribute", "from", "import"])
def test_transforms_is_a_deprecated_alias_of_edit(how, monkeypatch):
    monkeypatch.delitem(sys.modules, "jaxpc.transforms", raising=False)
    monkeypatch.delitem(vars(jaxpc), "transforms", raising=False)  # delattr would import it (hasattr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "attribute":
            assert jaxpc.transforms.merge is jaxpc.transforms.merge
            transforms = jaxpc.transforms
        elif how == "from":
            from jaxpc import transforms
        else:
            import jaxpc.transforms as transforms
    [w] = _deprecations(caught, "jaxpc.transforms")
    assert "jaxpc.edit" in str(w.message) and w.filename == __file__
    assert transforms.__all__ == edit.__all__
    for name in edit.__all__:
        assert getattr(transforms, name) is getattr(edit, name), name


def test_dists_is_a_deprecated_alias_of_distributions():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert jaxpc.dists is jaxpc.distributions
    [w] = _deprecations(caught, "jaxpc.dists")
    assert "jaxpc.distributions" in str(w.message) and w.filename == __file__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from jaxpc import dists
    assert dists is jaxpc.distributions and len(_deprecations(caught, "jaxpc.dists")) == 1
    assert "dists" not in jaxpc.__all__ and "transforms" not in jaxpc.__all__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        jaxpc.nope  # noqa: B018
