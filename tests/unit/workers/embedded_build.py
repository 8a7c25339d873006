"""A process that builds the embedded set shards/synth in $VLDIST_DATA_HOME with a small, slow
builder of its own (the real .partial path: embedded_set.building), for
tests/unit/test_embedded_home.py to interrupt or let finish.

    embedded_build.py train RUN_DIR   `python -m vldist.train vsrn` as the command runs it (its exit
                                      code and its stderr), stopped by the test with SIGINT mid-build
    embedded_build.py build           the build alone (embedded_home.ensure_built), to its end

The builder writes <set>.partial/started, then waits 60 s (train) or 0.5 s (build) before it
writes the manifest and the set is renamed into place."""

import sys
import time

from vldist.data import embedded_home
from vldist.shards.synthetic.embedded_set import building

WAIT = {"train": 60.0, "build": 0.5}[sys.argv[1]]


def slow_builder(out_dir) -> None:
    with building(out_dir, overwrite=False) as partial:
        partial.mkdir()
        (partial / "started").write_text("")
        time.sleep(WAIT)
        (partial / "manifest.json").write_text("{}")


embedded_home.EMBEDDED_SETS["shards/synth"] = embedded_home.EmbeddedSet(
    "__main__", "slow_builder", "the embedded synthetic dataset", "a few bytes", "a moment"
)

if sys.argv[1] == "train":
    from vldist.train import main

    sys.exit(main(["vsrn", f"output.dir={sys.argv[2]}", "metrics.enabled=false"]))
print(embedded_home.ensure_built("shards/synth"))
