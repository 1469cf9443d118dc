"""Host-side compilation of node graphs into layouts and index tables."""

from .layout import InputLayerSpec, Layout, PFlowSpec, ProdPart, ScanSpec, StageSpec, SumGroupSpec, SumPart

__all__ = ["Layout", "InputLayerSpec", "ProdPart", "SumPart", "StageSpec", "ScanSpec", "SumGroupSpec", "PFlowSpec"]
