"""Ready-made circuit structures (PyJuice's arguments and semantics). Each returns the root
node vector; pass it to :func:`jaxpc.compile`."""

from .hclt import HCLT, chow_liu_tree, mutual_information
from .hmm import HMM, GeneralizedHMM
from .pd import PD, PDHCLT
from .rat_spn import RAT_SPN

__all__ = ["HMM", "GeneralizedHMM", "HCLT", "PD", "PDHCLT", "RAT_SPN", "mutual_information", "chow_liu_tree"]
