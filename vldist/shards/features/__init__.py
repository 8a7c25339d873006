"""Region features: the CNN extractor (`extractor`, imports torch), its command-line options
(`extractor_args`, does not) and the extractor of a shard set rebuilt for new images (`extractor_setup`)."""
