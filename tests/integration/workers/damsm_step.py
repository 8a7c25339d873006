"""A few SGD steps of tiny DAMSM encoders on this rank's pairs of a fixed global batch.

Run by tests/integration/test_damsm_cross_rank.py under torchrun (2 gloo processes, DDP through the
Accelerate engine, `cross_rank_damsm_parts` for the loss) and in-process (1 process on the whole
batch): the two must agree. The encoders are linear projections of fixed random word and region
features; captions have uneven lengths, their padding holds random values (which must not
matter), and each rank pads its words only to its own longest caption, so the ranks' T differ.

    python damsm_step.py OUT_FILE
"""

import sys
from pathlib import Path

import torch
from engines import cpu_engine
from sgd_steps import sgd_steps  # noqa: E402  (this directory is on sys.path)
from torch import nn

from vldist.distributed.engine import Engine
from vldist.losses.damsm import PARTS, cross_rank_damsm_parts
from vldist.recipes.base import Recipe

WORD_FEATURES, REGION_FEATURES, REGIONS, DIM = 6, 5, 4, 8
# Rank 0's longest caption is shorter than rank 1's in one split and longer in the other.
LENGTHS = [3, 2, 5, 1, 7, 4, 6, 2]
PAIRS, STEPS, LR = len(LENGTHS), 3, 0.02  # small enough that every step lowers the loss
# Pairs of rank 0 (rank 1 holds the rest): 4 + 4, 5 + 3 (a ragged last batch), and 8 + 0.
SPLITS = {"even": 4, "uneven": 5, "empty": 8}


class TinyEncoders(nn.Module):
    """Word, region, sentence (mean of the real words) and image (mean of the regions) vectors."""

    def __init__(self):
        super().__init__()
        self.word = nn.Linear(WORD_FEATURES, DIM)
        self.region = nn.Linear(REGION_FEATURES, DIM)
        self.sentence = nn.Linear(WORD_FEATURES, DIM)
        self.image = nn.Linear(REGION_FEATURES, DIM)

    def forward(self, words, lengths, regions):
        real = torch.arange(words.shape[1])[None, :] < lengths[:, None]
        mean_words = torch.where(real[..., None], words, 0.0).sum(1) / lengths[:, None].clamp(min=1)
        return self.word(words), self.region(regions), self.sentence(mean_words), self.image(regions.mean(1))


class DamsmRecipe:
    """What `sgd_steps` asks of a recipe."""

    def optimizer_groups(self, module: nn.Module) -> dict:
        return {"main": list(module.parameters())}

    def start_step(self, step: int) -> None:
        pass

    training_losses = Recipe.training_losses  # the trainer's forward-then-losses

    def forward_inputs(self, batch: dict, update: str = "main") -> dict:
        return {"words": batch["words"], "lengths": batch["lengths"], "regions": batch["regions"]}

    def losses(self, outputs: tuple, batch: dict, update: str = "main", model=None) -> dict:
        words, regions, sentence, image = outputs
        parts = cross_rank_damsm_parts(words, batch["lengths"], regions, sentence, image)
        return {"loss": sum(parts[name] for name in PARTS), **parts}


def global_batch() -> dict:
    """Word features (PAIRS, max length, F) with random padding, lengths, region features."""
    g = torch.Generator().manual_seed(0)
    return {
        "words": torch.randn(PAIRS, max(LENGTHS), WORD_FEATURES, generator=g),
        "lengths": torch.tensor(LENGTHS),
        "regions": torch.randn(PAIRS, REGIONS, REGION_FEATURES, generator=g),
    }


def my_batch(engine: Engine, split: str) -> dict:
    """The whole batch in one process; on two ranks rank 0's first pairs or rank 1's rest, the
    words cut to the slice's longest caption."""
    data = global_batch()
    if engine.world_size > 1:
        cut = SPLITS[split]
        rows = slice(0, cut) if engine.rank == 0 else slice(cut, PAIRS)
        data = {k: v[rows] for k, v in data.items()}
    width = int(data["lengths"].max()) if len(data["lengths"]) else 1
    return dict(data, words=data["words"][:, :width])


def run(engine: Engine, split: str) -> dict:
    torch.manual_seed(0)
    module = TinyEncoders()
    batch = my_batch(engine, split)
    steps = sgd_steps(engine, DamsmRecipe(), module, batch, STEPS, LR)
    return {"steps": steps, "world_size": engine.world_size, "width": batch["words"].shape[1]}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    engine = cpu_engine()
    results = {split: run(engine, split) for split in SPLITS}
    widths = [None, None]
    torch.distributed.all_gather_object(widths, {split: r["width"] for split, r in results.items()})
    if engine.is_main:
        torch.save({"results": results, "widths": widths}, out)
    engine.close()
