"""Converters from public dataset layouts to vldist shard sets: `python -m vldist.shards convert`."""

from vldist.shards.convert.base import BadInput, Converter
from vldist.shards.convert.birds_to_words import BirdsToWordsConverter
from vldist.shards.convert.cub import CubConverter
from vldist.shards.convert.engine import Result, convert
from vldist.shards.convert.flickr30k_entities import Flickr30kEntitiesConverter
from vldist.shards.convert.folder import FolderConverter
from vldist.shards.convert.karpathy import KarpathyConverter
from vldist.shards.convert.precomp import PrecompConverter

FORMATS: dict[str, type[Converter]] = {
    c.name: c for c in (KarpathyConverter, PrecompConverter, CubConverter, BirdsToWordsConverter, FolderConverter,
                         Flickr30kEntitiesConverter)
}

__all__ = ["FORMATS", "BadInput", "Converter", "Result", "convert"]
