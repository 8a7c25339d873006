"""The replica check on 2 gloo ranks (torchrun): a rank whose model is changed behind the trainer's
back is stopped at the next check, every rank with exit 4 and one line naming the step, the tensor
and the ranks. (A recipe whose loss skips the engine's wrapper: tests/integration/test_plugin_recipe.py;
the hash and what is compared: tests/unit/test_replica_hash.py.)"""

import re
import subprocess
from pathlib import Path

from helpers import PREEMPT_JOB, TORCHRUN

DRIFT = Path(__file__).parent / "workers" / "replica_drift.py"


def test_a_rank_whose_parameter_drifts_is_stopped_at_the_next_check(planted_shards, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(
        [
            *TORCHRUN,
            str(DRIFT),
            "6",
            "vsrn",
            f"data.shards={planted_shards}",
            f"output.dir={run}",
            *PREEMPT_JOB,
            "train.replica_check_every=4",
            "train.save_every_steps=2",
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    drifted = re.search(r"drifted: (\S+) after step 6", out)
    assert drifted, out[-3000:]
    assert "replica check at step 1: the 2 ranks hold the same" in out  # the first update: in step
    assert (
        f"error: the ranks' replicas of the model diverged by step 8: parameter {drifted.group(1)} differs (2 "
        "values: rank 0; rank 1; 1 of "
    ) in out, out[-3000:]
    assert "they agreed at step 4, so checkpoints after it hold rank 0's copy of a diverged run" in out
    assert len(re.findall(r"exitcode\s*: 4", out)) >= 1, out[-3000:]  # torchrun's table of the failed ranks
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [f"step-{s:08d}" for s in (2, 4, 6)]
