"""Exact epochs over indexed shards, audited sample by sample (train.sample_log), across stops and resumes.

Real torchrun (gloo), real `python -m vldist.train vsrn` on the planted shards (200 train samples,
indexed by the writer). The global batch of 24 divides among 1, 2 and 3 ranks; an epoch is 8 full
steps and a ragged ninth of 8 rows. Runs are stopped by train.max_steps in the middle of epoch 2
(step 13 of 27: its checkpoint keeps the data position) and resumed with train.resume=latest.
Every rank logs the identities of the samples it trained on at each step; the tests count them.
"""

import json
import os
import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from helpers import read_shard_set, torchrun, write_planted_shards

from vldist.data.identity import identity_of

TRAIN, BATCH, EPOCHS = 200, 24, 3
EPOCH_STEPS = -(-TRAIN // BATCH)  # 8 full global batches and one of 8 rows
TOTAL = EPOCHS * EPOCH_STEPS
STOP = EPOCH_STEPS + 4  # mid-epoch 2: epoch 1 wholly before the stop, epoch 2 split, epoch 3 wholly after
JOB = [
    "model.embed_size=32",
    "model.decoder_hidden=32",
    "model.word_dim=16",
    f"data.batch_size={BATCH}",
    "data.shuffle_buffer=50",
    "data.eval_batch_size=64",
    f"train.epochs={EPOCHS}",
    "train.validate_every=0",
    "train.sample_log=true",
    "eval.baseline=false",
    "metrics.enabled=false",
    "engine.sync_batchnorm=true",
]
ZERO2 = str(Path(__file__).resolve().parents[2] / "jobs" / "deepspeed" / "zero2.json")
ENGINES = {
    "accelerate": [],
    "zero2": ["engine.backend=deepspeed", f"engine.deepspeed_config={ZERO2}"],
}
MODES = {"exact": ["data.resampled=false"], "resampled": ["data.resampled=true"]}


def _train(shards: Path, out: Path, ranks: int, *extra: str, timeout: float = 300) -> str:
    """`torchrun --nproc_per_node RANKS -m vldist.train vsrn` of JOB; asserts it ended well and
    returns its stderr. On a timeout the launcher, its ranks and their loader workers are killed."""
    cmd = [*torchrun(ranks), "-m", "vldist.train", "vsrn", f"data.shards={shards}", f"output.dir={out}", *JOB, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-4000:]
    assert "terminate called" not in err
    return err


def _sample_log(out: Path) -> dict[tuple[int, int], tuple[int, list[int]]]:
    """{(step, rank): (epoch, identities)} from every rank file of run `out` (all the runs that
    wrote there); a rank that logged a step twice, or out of order, fails."""
    logged = {}
    for path in sorted((out / "samples").glob("rank-*.jsonl")):
        rank = int(path.stem.removeprefix("rank-"))
        steps = []
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            assert (entry["step"], rank) not in logged, f"rank {rank} logged step {entry['step']} twice"
            logged[entry["step"], rank] = entry["epoch"], entry["identity"]
            steps.append(entry["step"])
        assert steps == sorted(steps), f"{path.name}: steps out of order {steps}"
    return logged


def _epoch_counts(logged: dict, epoch: int, steps=None) -> Counter:
    """How often each identity was trained on in `epoch` (in `steps` only, if given), over all ranks."""
    return Counter(
        i for (step, _), (e, ids) in logged.items() if e == epoch and (steps is None or step in steps) for i in ids
    )


def _assert_each_once(counts: Counter, expected: set[int], what: str) -> None:
    missing, repeated = expected - counts.keys(), {i: n for i, n in counts.items() if n != 1}
    foreign = counts.keys() - expected
    assert not (missing or repeated or foreign), (
        f"{what}: {len(missing)} samples never trained on, {len(repeated)} more than once, {len(foreign)} foreign"
    )


def _global_rows(step: int) -> int:
    """Rows of global batch `step` (1-based) of an exact epoch: BATCH, the epoch's last one fewer."""
    return min(BATCH, TRAIN - (step - 1) % EPOCH_STEPS * BATCH)


@pytest.fixture(scope="module")
def train_identities(planted_shards) -> dict[int, str]:
    """identity -> key of every train sample, read from the tars themselves (not their index)."""
    keys = [key for key, _ in read_shard_set(planted_shards)["train"]]
    identities = {identity_of(key): key for key in keys}
    assert len(keys) == len(identities) == TRAIN
    return identities


@pytest.fixture(scope="module")
def stopped(planted_shards, tmp_path_factory):
    """stopped(engine, ranks, mode): a run of `ranks` stopped by train.max_steps after step STOP,
    made once per module; tests copy it before resuming it."""
    made: dict[tuple, Path] = {}

    def run(engine: str, ranks: int, mode: str = "exact") -> Path:
        if (engine, ranks, mode) not in made:
            out = tmp_path_factory.mktemp(f"stopped-{engine}-{mode}-on-{ranks}")
            _train(planted_shards, out, ranks, *ENGINES[engine], *MODES[mode], f"train.max_steps={STOP}")
            assert json.loads((out / "metrics.json").read_text())["steps"] == STOP
            made[engine, ranks, mode] = out
        return made[engine, ranks, mode]

    return run


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


@pytest.mark.parametrize(
    ("engine", "stopped_on", "resumed_on"),
    [("accelerate", 2, 1), ("accelerate", 2, 3), ("zero2", 1, 2)],
)
def test_an_exact_epoch_resumed_on_another_number_of_ranks_trains_every_sample_once(
    planted_shards, stopped, train_identities, tmp_path, engine, stopped_on, resumed_on
):
    """Stopped mid-epoch on one number of ranks and resumed on another: every step is taken once,
    by every rank of the world that took it, with the global batch dealt evenly (the ragged last
    step as evenly as it goes), and over each epoch, the split one too, every train sample is
    trained on exactly once."""
    out = _copy(stopped(engine, stopped_on), tmp_path / "run")
    log = _train(planted_shards, out, resumed_on, *ENGINES[engine], *MODES["exact"], "train.resume=latest")
    assert f"step-{STOP:08d}" in log and f"written by {stopped_on} ranks, resumed on {resumed_on}" in log
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == resumed_on and metrics["steps"] == TOTAL and metrics["restarts"] == 1

    logged = _sample_log(out)
    for step in range(1, TOTAL + 1):
        world = stopped_on if step <= STOP else resumed_on
        ranks = sorted(r for s, r in logged if s == step)
        assert ranks == list(range(world)), f"step {step} logged by ranks {ranks}, taken on {world}"
        assert {logged[step, r][0] for r in ranks} == {(step - 1) // EPOCH_STEPS}, f"step {step}: epoch"
        rows = [len(logged[step, r][1]) for r in ranks]
        size = _global_rows(step)
        assert sum(rows) == size, f"step {step}: {rows} rows, the global batch has {size}"
        assert max(rows) - min(rows) <= (size % world > 0), f"step {step}: rows dealt unevenly {rows}"
    assert max(s for s, _ in logged) == TOTAL
    for epoch in range(EPOCHS):
        _assert_each_once(_epoch_counts(logged, epoch), set(train_identities), f"epoch {epoch + 1}")


@pytest.mark.parametrize("mode", ["exact", "resampled"])
def test_a_run_resumed_on_as_many_ranks_trains_on_the_uninterrupted_runs_samples(
    planted_shards, stopped, tmp_path, mode
):
    """Resumed mid-epoch on the same 2 ranks, a run trains on the samples the uninterrupted run
    trained on, step for step and rank for rank: the exact order, and the resampled draws."""
    out = _copy(stopped("accelerate", 2, mode), tmp_path / "resumed")
    _train(planted_shards, out, 2, *MODES[mode], "train.resume=latest")
    whole = tmp_path / "whole"
    _train(planted_shards, whole, 2, *MODES[mode])

    expected, got = _sample_log(whole), _sample_log(out)
    assert sorted(expected) == [(step, rank) for step in range(1, TOTAL + 1) for rank in (0, 1)]
    assert sorted(got) == sorted(expected)
    differing = [key for key in expected if got[key] != expected[key]]
    assert not differing, f"(step, rank) whose samples differ from the uninterrupted run's: {differing}"
    # the comparison means something: ranks and epochs train on other samples
    assert expected[1, 0][1] != expected[1, 1][1] and expected[1, 0][1] != expected[EPOCH_STEPS + 1, 0][1]
    if mode == "resampled":
        drawn = [i for (step, _), (_, ids) in expected.items() if step <= EPOCH_STEPS for i in ids]
        assert len(set(drawn)) < len(drawn)  # draws with replacement: some sample twice in an epoch


def test_a_resumed_epoch_reads_none_of_the_samples_before_its_step(planted_shards, stopped, train_identities, tmp_path):
    """A run resumed at step STOP needs none of the samples of its epoch's earlier steps: with those
    samples made unreadable in the shards it resumes on (same bytes elsewhere, same index layout), it
    trains the rest of the epoch without skipping one, and skips them only in the next epoch, where
    they are due (a resume that replayed the epoch would skip them twice); metrics.json counts the
    skips of both ranks."""
    resumed_on = 2
    before = _sample_log(stopped("accelerate", 2))
    earlier = range(EPOCH_STEPS + 1, STOP + 1)  # epoch 2's steps before the stop
    # the first two samples of each rank at each of those steps
    unreadable = {i for (step, _), (_, ids) in before.items() if step in earlier for i in ids[:2]}
    assert len(unreadable) == 2 * 2 * len(earlier)
    damaged = write_planted_shards(tmp_path / "damaged", unreadable=[train_identities[i] for i in unreadable])

    out = _copy(stopped("accelerate", 2), tmp_path / "run")
    _train(damaged, out, resumed_on, *MODES["exact"], "train.resume=latest")
    logged = _sample_log(out)
    for step in range(STOP + 1, 2 * EPOCH_STEPS + 1):  # the rest of epoch 2: every row, none skipped
        rows = sum(len(logged[step, rank][1]) for rank in range(resumed_on))
        assert rows == _global_rows(step), f"step {step}: {rows} rows"
    everything = set(train_identities)
    _assert_each_once(_epoch_counts(logged, 1), everything, "epoch 2")
    _assert_each_once(_epoch_counts(logged, 2), everything - unreadable, "epoch 3 on the damaged shards")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == TOTAL and metrics["world_size"] == resumed_on
    assert metrics["skipped_samples"] == len(unreadable)  # each once, in epoch 3
