"""Deprecated alias of :mod:`jaxpc.edit`, kept for one release: importing it warns once."""

import importlib
import os
import warnings

from .edit import blockify, deepcopy, grow, hclt_latent_regions, lvd_init, merge, prune, unblockify

__all__ = ["deepcopy", "blockify", "unblockify", "merge", "prune", "grow", "lvd_init", "hclt_latent_regions"]

# The warning points at the user's import or attribute access, past the frames of importlib and jaxpc.
warnings.warn("jaxpc.transforms is deprecated and will be removed in the next release; use jaxpc.edit "
              "(the same functions)", DeprecationWarning, stacklevel=2,
              skip_file_prefixes=(os.path.dirname(__file__) + os.sep, os.path.dirname(importlib.__file__) + os.sep,
                                  "<frozen importlib"))
