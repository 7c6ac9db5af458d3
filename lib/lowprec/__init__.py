"""lowprec: instruments for the bf16 flash-attention training failure (arXiv 2510.04212).

Layers, lowest first: formats -> attention -> model -> telemetry/data -> train/runs -> experiments -> viz/cli.
"""

__version__ = "0.1.0"
