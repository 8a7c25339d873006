"""Where shard sets live: a local directory or a URL of any fsspec filesystem (s3://, gs://,
http(s)://), read through one module (location.py) so a URL never passes through pathlib and its
credentials never reach a message."""
