"""Put on PYTHONPATH by a multi-node or Ray test: the embedded sets' builders make small sets (the
same code and format; 336 scenes instead of 6,500, 96 image pairs of 64 pixels instead of 2,750 of
128), so that each test node builds them in seconds, not the minutes of CPU the real ones take.

Every Python process started with it runs this, Ray's own services too: the builders are shrunk
when their modules are first imported, so that a process that never builds pays nothing (the
modules import torchvision, ~2 s).

With VLDIST_TEST_DRIFT_AFTER_STEP=N in its environment (test_ray.py's replica check under Ray),
rank 1's trainer also adds 1e-3 to its model's first parameter after optimizer step N, as a faulty
device would: workers/drift.py, as replica_drift.py does under torchrun."""

import functools
import importlib.abc
import os
import sys

SMALL = {
    # VSRN learns on it within about a hundred steps (test recall above chance on its 64 test
    # images), which 64 scenes of 32-pixel features did not show reliably
    "vldist.shards.synthetic.synth": (
        "build_synth",
        {"n_train": 256, "n_val": 16, "n_test": 64, "shard_size": 64, "feature_size": 64},
    ),
    "vldist.shards.synthetic.pairs": (
        "build_synth_pairs",
        {"n_train": 64, "n_val": 16, "n_test": 16, "shard_size": 16, "image_size": 64},
    ),
}


class ShrinkWhenImported(importlib.abc.MetaPathFinder):
    """Finds the builders' modules as the other finders do, then shrinks the builder once the
    module has run."""

    def find_spec(self, name, path, target=None):
        if name not in SMALL:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def run_and_shrink(module):
            run(module)
            if name == "vldist.training.loop":
                sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # workers/, for drift.py
                from drift import drift_after

                drift_after(module.Trainer, int(os.environ["VLDIST_TEST_DRIFT_AFTER_STEP"]))
                return
            builder, sizes = SMALL[name]
            setattr(module, builder, functools.partial(getattr(module, builder), **sizes))

        spec.loader.exec_module = run_and_shrink
        return spec


if os.environ.get("VLDIST_TEST_DRIFT_AFTER_STEP"):
    SMALL["vldist.training.loop"] = None
sys.meta_path.insert(0, ShrinkWhenImported())
