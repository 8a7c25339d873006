"""What a shard-set directory holds, by name: the one place these file names are spelled.

manifest.json                          format, source, splits with their shards (written last)
vocab.json                             the vocabulary of the train captions
feature_standardization.safetensors    the region features' (shift, scale), when the set has features
<split>-NNNNNN.tar                     the shards
<split>-NNNNNN.tar.idx.json            each shard's sample index (data/sample_index.py)
"""

from __future__ import annotations

MANIFEST_NAME = "manifest.json"
VOCAB_NAME = "vocab.json"
STANDARDIZATION_NAME = "feature_standardization.safetensors"


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


def index_name(shard: str) -> str:
    """The sample index beside a shard (its file name, or a path or URL ending in it)."""
    return f"{shard}.idx.json"
