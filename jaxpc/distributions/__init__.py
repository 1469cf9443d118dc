"""Input distributions (``jaxpc.distributions``)."""

from .base import Distribution
from .categorical import Bernoulli, Categorical, MaskedCategorical
from .continuous import DiscreteLogistic, Gaussian
from .evidence import External, SoftEvidenceCategorical
from .indicator import Indicator, Literal

__all__ = ["Distribution", "Categorical", "Bernoulli", "MaskedCategorical", "Gaussian", "DiscreteLogistic",
           "Indicator", "Literal", "SoftEvidenceCategorical", "External"]
