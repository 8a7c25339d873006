"""Converters from public dataset layouts to vldist shard sets: `python -m vldist.shards convert`."""

from .base import BadInput, Converter
from .birds_to_words import BirdsToWordsConverter
from .cub import CubConverter
from .engine import Result, convert
from .flickr30k_entities import Flickr30kEntitiesConverter
from .folder import FolderConverter
from .karpathy import KarpathyConverter
from .precomp import PrecompConverter

FORMATS: dict[str, type[Converter]] = {
    c.name: c for c in (KarpathyConverter, PrecompConverter, CubConverter, BirdsToWordsConverter, FolderConverter,
                         Flickr30kEntitiesConverter)
}

__all__ = ["FORMATS", "BadInput", "Converter", "Result", "convert"]
