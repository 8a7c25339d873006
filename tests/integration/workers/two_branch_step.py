"""Three optimizer steps of a two-branch recipe on this rank's images of a fixed global batch.

Run by tests/integration/test_two_branch_equivalence.py under torchrun (2 gloo processes, DDP
through the Accelerate engine, batch norm over both ranks' rows) and in-process (1 process on the
whole batch): the two must agree. Dropout is 0, so both are deterministic.

    python two_branch_step.py OUT_FILE
"""

import sys
from pathlib import Path

import numpy as np
import torch

from vldist.data.vocab import Vocab
from vldist.distributed.accelerate_engine import AccelerateEngine
from vldist.distributed.engine import Engine
from vldist.models.global_batchnorm import convert_global_batchnorm
from vldist.recipes import get_recipe
from vldist.train import load_config

from sgd_steps import my_slice, sgd_steps  # noqa: E402  (this directory is on sys.path)

VOCAB = Vocab(["a", "red", "circle", "blue", "square", "green", "star", "small", "left", "of"])
DIM, IMAGES, STEPS, LR = 6, 8, 3, 0.5
TINY = ["model.hidden=12", "model.embed=8", "model.dropout=0", "train.grad_clip=null", "model.tasks=[retrieval]"]
# top_k 3: fewer than the negatives, so which violators are the K largest matters
JOBS = {
    "two_branch_embed": ["model.top_k=3", "model.margin=0.5", "model.lambda_text_neighbors=0.5"],
    "two_branch_sim": ["model.negatives_per_positive=2", "model.fusion_layers=2"],
}
# Images of rank 0 and rank 1: 4 + 4, and 3 + 5 (the ragged last batch of an exact epoch).
SPLITS = {"even": 4, "ragged": 3}


def make_recipe(job: str):
    config = load_config(job, [*TINY, *JOBS[job]])
    return get_recipe(job)(config, VOCAB, DIM)


def global_images() -> list[dict]:
    """Images with 1-3 captions of 1-6 words: ragged on purpose."""
    rng = np.random.default_rng(0)
    words = VOCAB.itos[4:]
    return [{"image": rng.standard_normal(DIM).astype(np.float32),
             "captions": [VOCAB.encode(" ".join(rng.choice(words, size=1 + (2 * i + j) % 6))) for j in range(1 + i % 3)]}
            for i in range(IMAGES)]


def run(engine: Engine, job: str, split: str) -> dict:
    """STEPS SGD steps on this rank's slice of the batch."""
    recipe = make_recipe(job)
    torch.manual_seed(0)
    module = convert_global_batchnorm(recipe.build_model())
    captions = [VOCAB.decode(c) for image in global_images() for c in image["captions"]]
    module.text_features.fit(VOCAB, captions)
    batch = recipe.collate_train(my_slice(global_images(), engine, SPLITS[split]))
    steps = sgd_steps(engine, recipe, module, batch, STEPS, LR)
    return {"steps": steps, "world_size": engine.world_size}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    engine = AccelerateEngine("cpu")
    results = {(job, split): run(engine, job, split) for job in JOBS for split in SPLITS}
    if engine.is_main:
        torch.save(results, out)
    engine.close()
