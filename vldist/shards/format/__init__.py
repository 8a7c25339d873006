"""The shard-set format: the files of a set (`layout`), writing them (`writer`), checking them
(`verify`) and the stored feature standardisation (`standardization`)."""
