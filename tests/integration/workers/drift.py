"""A fault for the replica check's tests: after optimizer step STEP, rank 1 adds 1e-3 to its
model's first parameter (as a faulty device or a stray write would) and prints its name. Used by
replica_drift.py under torchrun and by the Ray processes' sitecustomize (small_embedded_set/)."""

import torch


def drift_after(trainer, step: int) -> None:
    """Wrap Trainer._step (`trainer`: the class) so that rank 1 drifts after optimizer step `step`."""
    take_step = trainer._step

    def step_then_drift(self, micro_batches):
        logged = take_step(self, micro_batches)
        if self.engine.rank == 1 and self.state.step + 1 == step:  # the counter moves after _step
            name, parameter = next(iter(self.engine.unwrap().named_parameters()))
            with torch.no_grad():
                parameter.add_(1e-3)
            print(f"drifted: {name} after step {step}", flush=True)
        return logged

    trainer._step = step_then_drift
