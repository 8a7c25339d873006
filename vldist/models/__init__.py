"""Model blocks. The issue-named entry points are importable from here."""

from vldist.models.semantic_pooling import SemanticPooling, masked_average_pool, semantic_pool

__all__ = ["semantic_pool", "masked_average_pool", "SemanticPooling"]
