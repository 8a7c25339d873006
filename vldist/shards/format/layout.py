"""What a shard-set directory holds, by name: the one place these file names are spelled.

manifest.json                          format, source, splits with their shards (written last)
vocab.json                             the vocabulary of the train captions
feature_standardization.safetensors    the region features' (shift, scale), when the set has features
<split>-NNNNNN.tar                     the shards
"""

from __future__ import annotations

MANIFEST_NAME = "manifest.json"
VOCAB_NAME = "vocab.json"
STANDARDIZATION_NAME = "feature_standardization.safetensors"


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"
