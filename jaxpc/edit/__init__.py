"""Edit node graphs: structure transformations and latent variable distillation.

Every function here is pure: it reads the graph reachable from ``root`` and returns the root
of a *new* graph; the input vectors (their edges, parameters and ties) are never modified.
Sharing is kept (a vector used by several parents is copied once) and so are parameter ties:
the first new vector of an old tie group (in topological order) owns the parameters and the
others are tied to it. A tie is dropped only where an edit makes the edges of the tied
vectors differ (then each keeps its own copy of the parameters, and the function is unchanged).

Sum gates (:meth:`~jaxpc.nodes.SumNodes.set_gates`) are kept too: each new sum vector has the gate
block size of the vector(s) it replaces, its gate columns are those of its own edge blocks (in the
order of its ``edge_ids``, see :meth:`jaxpc.Circuit.gate_slice`), and a ``tie_to`` reads the new vector
of the old target. An edit never drops gates: where a gate block size would no longer divide a new
block size, or merged vectors' gates differ, it raises a ``ValueError`` naming them. A gate tie is
kept while the two vectors' new edge blocks come from the same old edge blocks; where they no longer
do (pruned differently, blocked differently, grown at the root), the reading vector gets gate columns
of its own.

Parameters come from the vectors themselves (``params=`` given to ``inputs``/``summate``) or,
when a compiled ``circuit`` (and optionally a ``params`` pytree of it, default
``circuit.params``) is passed, from ``circuit.get_node_params(params, node)``, so a trained
circuit can be edited. Sum weights are carried over in the block form
``[num_edge_blocks, block_size, ch_block_size]`` and categorical probabilities row by row, as the
circuit computes with them: an edit does not renormalize them, so the edited circuit's ``log_prob`` is
the old one's wherever the edit promises an unchanged function, also for parameters off the simplex
(gradient training on logits). Where an edit sets new weights (:func:`grow`'s copies, :func:`prune`'s kept
edges unless ``renormalize=False``) each node keeps its old total weight, so normalized parameters stay
normalized; :func:`lvd_init`'s estimates from counts are normalized. Values a node
vector cannot hold (a Bernoulli row that does not sum to one, a Gaussian ``sigma`` below ``min_sigma``,
a sum node whose weights are all zero) are a ``ValueError`` that names the vector;
``params=jaxpc.optim.normalize(circuit, params)`` edits the normalized circuit (the one
``jaxpc.optim.log_prob`` evaluates) instead. Vectors without parameters (neither given on the node nor
a circuit passed) stay without; ``jaxpc.compile`` then draws them at random.

Functions:

* :func:`deepcopy`: copy a graph, optionally renaming variables.
* :func:`blockify` / :func:`unblockify`: larger / smaller block sizes, same function.
* :func:`merge`: collapse vectors over one scope into one vector, same function.
* :func:`prune`: drop sum edge blocks with low flows (or any score).
* :func:`grow`: duplicate every vector, with multiplicative noise on the copies' parameters.
* :func:`lvd_init`: latent variable distillation, sum and input parameters from counts of
  latent assignments (e.g. k-means cluster ids); :func:`hclt_latent_regions` finds the
  vectors of an HCLT's latents.
"""

from ._blocks import blockify, unblockify
from ._copy import deepcopy
from ._grow import grow
from ._lvd import hclt_latent_regions, lvd_init
from ._merge import merge
from ._prune import prune

__all__ = ["deepcopy", "blockify", "unblockify", "merge", "prune", "grow", "lvd_init", "hclt_latent_regions"]
