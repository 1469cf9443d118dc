"""Pure functions over (layout, tables, params): forward values, flows and EM."""

from . import em, forward

__all__ = ["forward", "em"]
