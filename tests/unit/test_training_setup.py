"""What the trainer builds before its first step: the learning-rate schedules (training/optimizers.py), and the refusal of a world that cannot split the global batch."""

import math
from itertools import pairwise

import pytest
import torch

from vldist.recipes.jobs import load_config
from vldist.training.optimizers import build_scheduler


def _lrs(overrides, steps_per_epoch=10, total=40):
    config = load_config("vsrn", ["train.lr=1.0", *overrides])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(config, opt, steps_per_epoch, total)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_step_schedule_is_the_papers_decay():
    lrs = _lrs(["train.lr_decay_epochs=2", "train.lr_decay_factor=0.1"])
    assert lrs[0] == lrs[19] == 1.0
    assert lrs[20] == pytest.approx(0.1) and lrs[39] == pytest.approx(0.1)


def test_cosine_with_warmup():
    lrs = _lrs(["train.lr_schedule=cosine", "train.warmup_steps=4"])
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0)
    assert lrs[22] == pytest.approx(0.5 * (1 + math.cos(math.pi * 18 / 36)))
    assert lrs[-1] < 0.01 and all(a >= b for a, b in pairwise(lrs[4:]))


def test_a_world_that_cannot_split_the_global_batch_is_refused_by_name():
    """The global batch is the job's, kept when a run resumes on another number of ranks: 3 ranks
    cannot share 32 rows, and the error names both numbers before anything is built."""
    from types import SimpleNamespace

    from vldist.errors import ConfigError
    from vldist.training.loop import Trainer

    config = load_config("vsrn", ["data.batch_size=32"])
    with pytest.raises(
        ConfigError, match="data.batch_size=32 must be divisible by 3 ranks x train.grad_accumulation=1"
    ):
        Trainer(config, recipe=None, engine=SimpleNamespace(world_size=3), shards=SimpleNamespace(main=None))
    config = load_config("vsrn", ["data.batch_size=30", "train.grad_accumulation=2"])
    with pytest.raises(ConfigError, match="by 2 ranks x train.grad_accumulation=2"):
        Trainer(config, recipe=None, engine=SimpleNamespace(world_size=2), shards=SimpleNamespace(main=None))
