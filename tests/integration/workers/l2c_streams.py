"""L2C under torchrun, each rank writing down which stream each of its batches came from (and its
size), so the test can check that both streams advance in turn with equal steps on every rank.
Run by tests/integration/test_l2c_train.py; argv: OUT_FILE_PREFIX then the job's overrides."""

import os
import sys

from vldist.recipes.l2c import L2CRecipe
from vldist.train import main

prefix, argv = sys.argv[1], sys.argv[2:]
original = L2CRecipe.forward_inputs


def recording(self, batch, update="main"):
    with open(f"{prefix}-rank{os.environ['RANK']}.txt", "a") as f:
        f.write(f"{batch['stream']} {len(batch['images'])}\n")
    return original(self, batch, update)


L2CRecipe.forward_inputs = recording
sys.exit(main(["l2c", *argv]))
