"""vldist: distributed training of vision-language models on streaming WebDataset shards."""

__version__ = "0.3.0"
