"""train.accumulate_negatives: N micro-batches on W ranks take the step one process takes on the
whole global batch (loss, every gradient, the SGD update), for N in {1, 2, 4} and W in {1, 2},
under Accelerate's DDP and DeepSpeed ZeRO-2; plain accumulation does not.

One launch per (engine, W) loops over N inside the workers (workers/accumulate_negatives_step.py).
VSRN without BatchNorm (model.rrr_layers=0) and without dropout: hardest negatives over the whole
batch and its caption loss. Tolerances: tests/integration/test_distributed_equivalence.py's.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import SMALL_VSRN, train_vsrn

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import accumulate_negatives_step as worker  # noqa: E402
import equivalence_step as base  # noqa: E402
from engines import cpu_engine  # noqa: E402

WORKER = Path(worker.__file__)
ZERO2 = "jobs/deepspeed/zero2.json"


def _launch(tmp_path, ranks: int, backend: str) -> dict:
    out = tmp_path / f"{ranks}-{Path(backend).stem}.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    proc = subprocess.run(
        [*command, str(WORKER), str(out), backend],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def whole_batch():
    """One process, one micro-batch holding the whole global batch, the plain trainer step."""
    return base.step(cpu_engine(), base.make_recipe(True, *worker.NO_BATCHNORM))


@pytest.mark.parametrize(("ranks", "backend"), [(1, "accelerate"), (2, "accelerate"), (1, ZERO2), (2, ZERO2)], ids=str)
def test_micro_batches_on_ranks_take_the_whole_batch_step(tmp_path, whole_batch, ranks, backend):
    if ranks == 1 and backend == "accelerate":  # one process: no launch needed
        runs = {n: worker.cached_step(cpu_engine(), worker.make_recipe(backend, n), n) for n in worker.MICRO_BATCHES}
    else:
        runs = _launch(tmp_path, ranks, backend)
    assert sorted(runs) == list(worker.MICRO_BATCHES)
    for n, run in runs.items():
        assert run["world_size"] == ranks
        if backend == "accelerate":
            assert len(run["grads"]) == len(whole_batch["grads"])  # every gradient was compared
        worker.assert_whole_batch_step(run, whole_batch, (ranks, backend, n))


def test_plain_accumulation_is_not_the_whole_batch_step(whole_batch):
    """The same 2 micro-batches without the cache: hardest negatives among 4 rows each, a lower
    matching loss and another update; with the cache, the whole batch's (the test above)."""
    plain = base.step(cpu_engine(), base.make_recipe(True, *worker.NO_BATCHNORM), micro_batches=2)
    cached = worker.cached_step(cpu_engine(), worker.make_recipe("accelerate", 2), 2)
    assert plain["matching"] < whole_batch["matching"] - 1e-2
    assert cached["matching"] == pytest.approx(whole_batch["matching"], rel=1e-5)
    gap = max(float((plain["params"][n] - p).abs().max()) for n, p in whole_batch["params"].items())
    assert gap > 1e-2


# ---------------------------------------------------------------- through the trainer

TRAIN = [
    *SMALL_VSRN,
    *worker.NO_BATCHNORM,
    "model.decoder_dropout=0",
    "data.batch_size=8",
    "data.workers=0",
    "train.validate_every=0",
    "train.max_steps=2",
    "train.log_every=1",
]


def _logged_steps(capsys, shards: Path, out: Path, *extra: str) -> list[dict]:
    code, err = train_vsrn(capsys, f"data.shards={shards}", f"output.dir={out}", *TRAIN, *extra)
    assert code == 0, err[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["event"] == "train"]


def test_the_trainer_logs_and_steps_on_the_whole_batch(planted_shards, tmp_path, capsys):
    """`python -m vldist.train` with train.grad_accumulation=2: with accumulate_negatives its two
    steps log the losses of the whole batch of 8 (the second after the same update), without it
    the easier negatives of 4."""
    whole = _logged_steps(capsys, planted_shards, tmp_path / "whole")
    accumulation = ["train.grad_accumulation=2"]
    plain = _logged_steps(capsys, planted_shards, tmp_path / "plain", *accumulation)
    cached = _logged_steps(
        capsys, planted_shards, tmp_path / "cached", *accumulation, "train.accumulate_negatives=true"
    )
    for step in (0, 1):
        for key in ("loss", "matching", "caption"):
            assert cached[step][key] == pytest.approx(whole[step][key], rel=1e-4), (step, key)
    assert plain[0]["matching"] < whole[0]["matching"] - 1e-2
