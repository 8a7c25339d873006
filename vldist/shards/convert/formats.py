"""The converters by format name: `python -m vldist.shards convert FORMAT`."""

from __future__ import annotations

from vldist.shards.convert.base import Converter
from vldist.shards.convert.birds_to_words import BirdsToWordsConverter
from vldist.shards.convert.cub import CubConverter
from vldist.shards.convert.flickr30k_entities import Flickr30kEntitiesConverter
from vldist.shards.convert.folder import FolderConverter
from vldist.shards.convert.karpathy import KarpathyConverter
from vldist.shards.convert.precomp import PrecompConverter

FORMATS: dict[str, type[Converter]] = {
    c.name: c
    for c in (
        KarpathyConverter,
        PrecompConverter,
        CubConverter,
        BirdsToWordsConverter,
        FolderConverter,
        Flickr30kEntitiesConverter,
    )
}
