"""`python -m vldist.train` with one rank's model changed behind the trainer's back: run under
torchrun as `replica_drift.py STEP [train arguments...]`. After optimizer step STEP, rank 1 adds
1e-3 to its model's first parameter (as a faulty device or a stray write would) and prints that
parameter's name; every other rank trains as usual."""

import os
import sys

import torch

from vldist import trainer
from vldist.train import main

DRIFT_AFTER = int(sys.argv[1])

if os.environ.get("RANK") == "1":
    take_step = trainer.Trainer._step

    def step_then_drift(self, micro_batches):
        logged = take_step(self, micro_batches)
        if self.state.step + 1 == DRIFT_AFTER:  # the step just taken (the counter moves after _step)
            name, parameter = next(iter(self.engine.unwrap().named_parameters()))
            with torch.no_grad():
                parameter.add_(1e-3)
            print(f"drifted: {name} after step {DRIFT_AFTER}", flush=True)
        return logged

    trainer.Trainer._step = step_then_drift

sys.exit(main(sys.argv[2:]))
