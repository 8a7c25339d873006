"""vldist: distributed training of vision-language models on streaming WebDataset shards."""

__version__ = "0.2.0"
