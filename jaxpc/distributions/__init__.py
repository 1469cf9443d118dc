"""Input distributions (``jaxpc.dists``)."""

from .base import Distribution
from .categorical import Bernoulli, Categorical, MaskedCategorical
from .continuous import DiscreteLogistic, Gaussian
from .indicator import Indicator, Literal

__all__ = ["Distribution", "Categorical", "Bernoulli", "MaskedCategorical", "Gaussian", "DiscreteLogistic",
           "Indicator", "Literal"]
