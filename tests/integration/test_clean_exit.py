"""No rank reaches interpreter teardown with a process group's C++ threads still running.

destroy_process_group() only forgets a gloo group; its worker and transport threads run until the
last Python reference to it goes, and torch, DeepSpeed and ZeRO-3 keep some past it
(vldist/distributed/teardown.py). A rank whose threads still ran in the teardown aborted once in
17 CI runs of test_resharding.py ("terminate called without an active exception"). The abort is
rare; the threads left running that make it possible are not: this test (vldist.training.on_each_rank's way, the
last engine destroys the group) and test_resharding.py (the script destroys it after
close(keep_process_group=True)) see them on every run without the release.

This file is also the worker, run by torchrun: an Accelerate engine (an asynchronous sharded save,
on a gloo group of its own, after which torch.distributed.nn.functional holds the default group
as a default argument) closes keeping the group, then a DeepSpeed ZeRO-3 engine takes two steps
(its parameter coordinator caches its trace from the second) and closes, destroying the group.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from exit_threads import assert_no_gloo_thread_at_exit, report_at_exit  # noqa: E402


def _worker(out: Path) -> None:
    report_at_exit()
    import torch

    from vldist.distributed.accelerate_engine import AccelerateEngine
    from vldist.distributed.deepspeed_engine import DeepSpeedEngine
    from vldist.recipes.jobs import load_config

    def config(*extra):
        return load_config(
            "vsrn", [f"output.dir={out}", "train.device=cpu", "data.batch_size=4", "train.grad_clip=1.0", *extra]
        )

    def train(engine, steps: int) -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        engine.setup(model, {"main": torch.optim.AdamW(model.parameters(), lr=0.05)})
        for _ in range(steps):
            engine.backward(engine.model(torch.randn(2, 3)).pow(2).sum())
            engine.step("main", 1.0)

    accelerate = AccelerateEngine(config())
    train(accelerate, 1)
    accelerate.save_sharded(out / "sharded", asynchronous=True).result()
    accelerate.close(keep_process_group=True)

    zero3 = DeepSpeedEngine(config("engine.backend=deepspeed", "engine.deepspeed_config=jobs/deepspeed/zero3.json"))
    train(zero3, 2)
    zero3.close()


def test_no_process_group_thread_survives_into_interpreter_teardown(tmp_path):
    from helpers import TORCHRUN  # here: this file is also the ranks' script, run where helpers is not

    cmd = [*TORCHRUN, __file__, str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_no_gloo_thread_at_exit(proc.stderr, ranks=2)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
