"""Converters from public dataset layouts to vldist shard sets: `python -m vldist.shards convert`."""

from vldist.shards.convert.base import BadInput, Converter
from vldist.shards.convert.engine import Result, convert
from vldist.shards.convert.formats import FORMATS

__all__ = ["FORMATS", "BadInput", "Converter", "Result", "convert"]
