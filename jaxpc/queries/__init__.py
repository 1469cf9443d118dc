"""Queries: marginals (hard and soft evidence), conditionals, sampling, MPE assignments."""

from .queries import conditional, marginal, mpe, sample

__all__ = ["marginal", "conditional", "sample", "mpe"]
