"""Pure functions over (layout, tables, params): forward values, flows and EM.

* :mod:`~jaxpc.engine.forward`: the circuit's values (``log_prob``, ``evaluate``, the input layers' values).
* :mod:`~jaxpc.engine.stages`: the forward pass over the node buffer, stage by stage.
* :mod:`~jaxpc.engine.flows`: the root values with the top-down flow pass as their VJP; parameter flows.
* :mod:`~jaxpc.engine.routing`: which kernel or pass each partition and call runs on.
* :mod:`~jaxpc.engine.partial`: partial evaluation on top of a node buffer.
* :mod:`~jaxpc.engine.chain`: chains (HMMs) as a forward-backward scan.
* :mod:`~jaxpc.engine.select`: sampling and MPE as the gradient of a selection pass.
* :mod:`~jaxpc.engine.em`: flows from ``jax.grad`` and the EM update.
"""

from . import em, forward

__all__ = ["forward", "em"]
