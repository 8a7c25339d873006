"""The shipped job files that claim a paper's schedule run it, counted in optimizer steps.

A vldist epoch is one pass over a split's samples (images, each with one random caption in VSRN),
while VSRN's paper and official code count an epoch as a pass over the (image, caption) pairs. So
the comparison is in optimizer steps: the trainer's steps for the job on the set's documented size
against the paper's, computed here independently. Only rounding may differ: each vldist epoch
rounds its last batch up, so at most one step per epoch.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from vldist.data.job_shards import JobShards
from vldist.data.shardset import ShardSet
from vldist.data.streams import TrainingStreams
from vldist.recipes import get_recipe
from vldist.recipes.jobs import load_config
from vldist.training.optimizers import build_scheduler

JOBS = Path(__file__).resolve().parents[2] / "jobs"

# Documented training-split sizes (every image has 5 captions: both papers and the converters
# keep the first 5; shards/README.md, vldist/shards/convert/karpathy.py).
# MS-COCO, Karpathy's split with restval joined to train, as VSE++/SCAN/VSRN train (coco_precomp's
# train_ims.npy): 82,783 train + 30,504 restval images. VSRN paper Sec. 4.1: "113,287 images for
# training ... Each image comes with 5 captions".
COCO_TRAIN_IMAGES = 113_287
# Flickr30K, Karpathy's split (f30k_precomp's train: 29,000 images, 145,000 captions; val 1,014 and
# test 1,000 images, as shards/README.md lists). The VSRN paper's Sec. 4.1 says 28,000, which
# matches neither the released split nor 31,783 - 1,000 - 1,000.
F30K_TRAIN_IMAGES = 29_000
CAPTIONS_PER_IMAGE = 5

# VSRN, Sec. 4.2: Adam, 30 epochs, lr x0.1 after 15, mini-batch 128. The official code's defaults
# are the same (train.py: num_epochs 30, lr_update 15, batch_size 128) for COCO and Flickr30K alike
# (its README's Flickr30K command changes only --max_len); its epoch is one pass over the pairs
# (data.py PrecompDataset: one sample per caption line), the last partial batch kept.
VSRN_PAPER = {"epochs": 30, "decay_after_epochs": 15, "batch_size": 128, "decay_factor": 0.1}

SETS = {"coco": COCO_TRAIN_IMAGES, "f30k": F30K_TRAIN_IMAGES}

# Shipped job files that claim a paper's schedule, and the sets each is meant for.
PAPER_SCHEDULE_JOBS = [
    ("vsrn_coco", "coco"),
    ("vsrn_f30k", "f30k"),
    ("vsrn_karpathy", "coco"),
    ("vsrn_karpathy", "f30k"),  # its comment: "COCO or Flickr30K" (data.shards=shards/f30k)
]
# The shard sets vldist builds itself: jobs on them are CPU demos sized in their own comments.
EMBEDDED_SETS = {"shards/synth", "shards/synth_pairs"}
OWN_DATA_JOBS = {"vsrn_folder"}  # your own converted data: no paper's set size to check


def paper_steps(train_images: int, paper: dict) -> tuple[int, int, int]:
    """(steps per paper epoch, total steps, the step at which lr first decays) as the paper's code
    counts them: an epoch is every (image, caption) pair once, in batches, the last one partial."""
    pairs = train_images * CAPTIONS_PER_IMAGE
    per_epoch = math.ceil(pairs / paper["batch_size"])
    return per_epoch, paper["epochs"] * per_epoch, paper["decay_after_epochs"] * per_epoch


def trainer_steps_per_epoch(config, train_images: int, directory: Path, world_size: int) -> int:
    """Steps per epoch as the Trainer counts them (its TrainingStreams, then its ceil over
    gradient accumulation), for a train split of `train_images` samples. The shard file is an empty
    stand-in: building the streams reads only the manifest's count."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "train-000000.tar").touch()
    manifest = {
        "splits": {
            "train": {"samples": train_images, "shards": [{"file": "train-000000.tar", "samples": train_images}]}
        }
    }
    accumulation = config.train.grad_accumulation
    streams = TrainingStreams(
        config,
        get_recipe(config.recipe)(config, vocab=None),
        JobShards(ShardSet(directory, manifest)),
        rank=0,
        world_size=world_size,
        accumulation=accumulation,
    )
    return math.ceil(streams.micro_per_epoch / accumulation)


def decay_steps(config, steps_per_epoch: int, total_steps: int) -> list[tuple[int, float]]:
    """Each step at which the trainer's lr factor changes, with the new factor."""
    import torch

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    factor = build_scheduler(config, optimizer, steps_per_epoch, total_steps).lr_lambdas[0]
    changes, previous = [], factor(0)
    for step in range(1, total_steps):
        now = factor(step)
        if now != previous:
            changes.append((step, now))
            previous = now
    return changes


@pytest.mark.parametrize("world_size", [1, 4])
@pytest.mark.parametrize(("job", "dataset"), PAPER_SCHEDULE_JOBS)
def test_job_runs_the_papers_schedule_in_optimizer_steps(job, dataset, world_size, tmp_path):
    config = load_config(str(JOBS / f"{job}.yaml"), [])  # by path: the shipped file itself
    t = config.train
    images = SETS[dataset]
    assert config.data.batch_size == VSRN_PAPER["batch_size"]
    assert t.max_steps is None and t.samples_per_epoch is None, "the schedule must come from epochs"
    assert t.lr_schedule == "step" and t.warmup_steps == 0

    per_epoch = trainer_steps_per_epoch(config, images, tmp_path / dataset, world_size)
    total = t.epochs * per_epoch  # as Trainer.__init__: total_steps = max_steps or epochs x steps_per_epoch
    changes = decay_steps(config, per_epoch, total)

    paper_per_epoch, paper_total, paper_decay = paper_steps(images, VSRN_PAPER)
    # One step of rounding per vldist epoch (its last batch rounded up), nothing more.
    assert abs(total - paper_total) <= t.epochs, (job, dataset, total, paper_total)
    assert len(changes) == 1, f"{job}: the paper decays the lr once; the trainer would at {changes}"
    decay_step, factor = changes[0]
    assert abs(decay_step - paper_decay) <= t.lr_decay_epochs, (job, dataset, decay_step, paper_decay)
    assert factor == pytest.approx(VSRN_PAPER["decay_factor"])

    # One validation (the best-snapshot check) per paper epoch, and one at the end.
    every = t.validate_every
    assert every and abs(every * per_epoch - paper_per_epoch) <= every
    assert t.epochs % every == 0 and t.epochs // every == VSRN_PAPER["epochs"]

    # The derivation in the file's comments states these numbers.
    text = (JOBS / f"{job}.yaml").read_text()
    for number in (per_epoch, total, decay_step, paper_per_epoch, paper_total, paper_decay):
        assert f"{number:,}" in text, f"{job}.yaml's comments do not state {number:,} ({dataset})"


def test_the_step_count_is_the_images_not_the_pairs(tmp_path):
    """The premise of the job files: the trainer's epoch is one pass over the images (one caption
    each), a fifth of the paper's pass over 5 captions per image."""
    config = load_config(str(JOBS / "vsrn_coco.yaml"), [])
    assert trainer_steps_per_epoch(config, COCO_TRAIN_IMAGES, tmp_path, 1) == math.ceil(COCO_TRAIN_IMAGES / 128)


def test_every_job_on_a_real_dataset_has_its_schedule_checked():
    """A job file for a downloaded set (not the embedded demo sets) must be listed above."""
    checked = {job for job, _ in PAPER_SCHEDULE_JOBS}
    for path in sorted(JOBS.glob("*.yaml")):
        config = load_config(str(path), [])
        if config.data.shards not in EMBEDDED_SETS and path.stem not in OWN_DATA_JOBS:
            assert path.stem in checked, f"{path.name} reads {config.data.shards}: add its paper schedule here"
