"""Put on PYTHONPATH by a multi-node test: the embedded set's builder makes a small set (the same
code and format, 96 images instead of 6,500), so that each test node builds it in seconds, not the
minute of CPU the real one takes."""

import functools

import vldist.shards.synthetic.synth as synth

synth.build_synth = functools.partial(synth.build_synth, n_train=64, n_val=16, n_test=16, shard_size=32,
                                      feature_size=32)
