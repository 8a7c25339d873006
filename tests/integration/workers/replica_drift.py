"""`python -m vldist.train` with one rank's model changed behind the trainer's back: run under
torchrun as `replica_drift.py STEP [train arguments...]`; rank 1 drifts after optimizer step STEP
(drift.py), every other rank trains as usual."""

import sys

from drift import drift_after  # this directory is on sys.path

from vldist.train import main
from vldist.training import loop

drift_after(loop.Trainer, int(sys.argv[1]))
sys.exit(main(sys.argv[2:]))
