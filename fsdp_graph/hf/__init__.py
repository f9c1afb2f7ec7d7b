"""HF transformers models: sharding in one call, and the capture path for graphs.

``transformers`` is optional: it is imported when these functions run, not by ``fsdp_graph``.
"""

from .capture_path import take_capture_path
from .sharding import decoder_layers, shard_model

__all__ = ["decoder_layers", "shard_model", "take_capture_path"]
