"""Three cl_caption optimizer steps on this rank's images of a fixed global batch; rank 0 saves them.

Run by tests/integration/test_cl_caption_equivalence.py under torchrun (2 gloo processes, DDP
through the Accelerate engine) and in-process (1 process on the whole batch): the two must agree.
Dropout is 0, so both are deterministic. Step 2 replaces the reference by the target
(model.replace_reference_every=2), through DDP's wrapper.

    python cl_caption_step.py CAPTIONER_CHECKPOINT OUT_FILE
"""

import sys
from pathlib import Path

import numpy as np
import torch
from engines import cpu_engine
from sgd_steps import my_slice, sgd_steps  # noqa: E402  (this directory is on sys.path)

from vldist.checkpoint.format import save_checkpoint
from vldist.checkpoint.starting_weights import read_starting_weights
from vldist.config import to_yaml
from vldist.data.vocab import Vocab
from vldist.distributed.engine import Engine
from vldist.recipes.captioner import CaptionerRecipe
from vldist.recipes.cl_caption import CLCaptionRecipe
from vldist.recipes.jobs import load_config

VOCAB = Vocab(["a", "red", "circle", "blue", "square", "green", "star", "small", "left", "of"])
DIM, IMAGES, STEPS, LR = 6, 6, 3, 0.5
TINY = ["model.hidden=12", "model.embed=8", "model.dropout=0", "data.max_regions=4", "data.vocab_min_count=1"]
# Images of rank 0 and rank 1: 3 + 3, and 2 + 4 (the ragged last batch of an exact epoch).
SPLITS = {"even": 3, "ragged": 2}


def write_captioner(directory: Path) -> Path:
    config = load_config("captioner", TINY)
    torch.manual_seed(0)
    model = CaptionerRecipe(config, VOCAB, DIM).build_model()
    return save_checkpoint(
        directory,
        model_state=model.state_dict(),
        train_state={},
        config_yaml=to_yaml(config),
        vocab=VOCAB,
        meta={"step": 1},
    )


def make_recipe(captioner: Path) -> CLCaptionRecipe:
    config = load_config(
        "cl_caption",
        [
            *TINY,
            f"model.init_from={captioner}",
            "model.negatives=3",
            "model.replace_reference_every=2",
            "train.grad_clip=null",
        ],
    )
    return CLCaptionRecipe(config, VOCAB, DIM)


def global_images() -> list[dict]:
    """Images with 2-4 regions and 1-3 captions of 1-6 words: ragged on purpose."""
    rng = np.random.default_rng(0)
    words = VOCAB.itos[4:]
    return [
        {
            "regions": rng.standard_normal((2 + i % 3, DIM)).astype(np.float32),
            "captions": [VOCAB.encode(" ".join(rng.choice(words, size=1 + (2 * i + j) % 6))) for j in range(1 + i % 3)],
        }
        for i in range(IMAGES)
    ]


def run(engine: Engine, recipe: CLCaptionRecipe, split: str) -> dict:
    """STEPS optimizer steps (SGD, whose update shows any error in the gradient's scale; Adam's
    first step is about lr * sign(gradient)) on the same batch; rank 0 gets the outcome."""
    torch.manual_seed(0)
    module = recipe.build_model()
    recipe.initialize(module, read_starting_weights(recipe.starts_from()), None)
    batch = recipe.collate_train(my_slice(global_images(), engine, SPLITS[split]))
    steps = sgd_steps(engine, recipe, module, batch, STEPS, LR)
    return {"steps": steps, "world_size": engine.world_size}


if __name__ == "__main__":
    captioner, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    engine = cpu_engine()
    results = {split: run(engine, make_recipe(captioner), split) for split in SPLITS}
    if engine.is_main:
        torch.save(results, out)
    engine.close()
