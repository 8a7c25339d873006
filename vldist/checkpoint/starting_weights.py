"""Reading the weights a run starts from (Recipe.starts_from): each rank does it (training/on_each_rank.py), the recipe
checks and uses what it is given (StartingWeights)."""

from __future__ import annotations

from pathlib import Path

from vldist.checkpoint.format import find_checkpoint, load_model_state, read_config
from vldist.data.vocab import Vocab
from vldist.errors import CheckpointError
from vldist.recipes.base import StartingWeights


def read_starting_weights(where: str | Path) -> StartingWeights:
    """The checkpoint at `where`, or a run directory's best (else newest) one."""
    checkpoint = find_checkpoint(Path(where))
    config = read_config(checkpoint)  # keys an older vldist wrote are upgraded
    try:
        words = Vocab.load(checkpoint / "vocab.json").itos
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {checkpoint / 'vocab.json'} ({err}); the checkpoint is damaged") from None
    return StartingWeights(checkpoint, config.get("recipe"), config, words, load_model_state(checkpoint))
