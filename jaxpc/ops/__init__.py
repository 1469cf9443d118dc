"""Hot layer ops: each has a plain-jnp ``*_reference`` and a dispatching entry point."""

from .product_layer import product_layer, product_layer_reference
from .sum_layer import sum_layer, sum_layer_reference

__all__ = ["sum_layer", "sum_layer_reference", "product_layer", "product_layer_reference"]
