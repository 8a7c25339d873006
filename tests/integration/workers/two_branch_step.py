"""Three optimizer steps of a two-branch recipe on this rank's images of a fixed global batch:
retrieval batches, and phrase batches (phrase localisation, jobs "<recipe>/phrases...") whose
images have coreference chains and one image twice, a copy on each rank.

Run by tests/integration/test_two_branch_equivalence.py under torchrun (2 gloo processes, DDP
through the Accelerate engine, batch norm over both ranks' rows) and in-process (1 process on the
whole batch): the two must agree. Dropout is 0, so both are deterministic.

    python two_branch_step.py OUT_FILE
"""

import io
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch
from engines import cpu_engine
from sgd_steps import my_slice, sgd_steps  # noqa: E402  (this directory is on sys.path)

from vldist.data.identity import sample_identity
from vldist.data.vocab import Vocab
from vldist.distributed.engine import Engine
from vldist.models.global_batchnorm import convert_global_batchnorm
from vldist.recipes import get_recipe
from vldist.recipes.jobs import load_config

VOCAB = Vocab(["a", "red", "circle", "blue", "square", "green", "star", "small", "left", "of"])
DIM, IMAGES, STEPS, LR = 6, 8, 3, 0.5
TINY = ["model.hidden=12", "model.embed=8", "model.dropout=0", "train.grad_clip=null", "model.tasks=[retrieval]"]
PHRASE_LAMBDAS = ["model.phrase_lambda_image=0.1", "model.phrase_lambda_text=0.4"]
# top_k 3: fewer than the negatives, so which violators are the K largest matters
JOBS = {
    "two_branch_embed": ["model.top_k=3", "model.margin=0.5", "model.lambda_text_neighbors=0.5"],
    "two_branch_sim": ["model.negatives_per_positive=2", "model.fusion_layers=2"],
    # phrases: region anchors rank every rank's phrases; "batch" adds every rank's regions. The
    # paper's lambdas 1 and 4 over a tenth: at full weight the summed hinges (~350) make lr 0.5
    # steps that blow the activations up to where float32 rounding fails the comparison
    "two_branch_embed/phrases": [
        "model.phrase_top_k=3",
        "model.margin=0.5",
        "model.phrase_negatives=all",
        *PHRASE_LAMBDAS,
    ],
    "two_branch_embed/phrases-batch": [
        "model.phrase_top_k=3",
        "model.margin=0.5",
        "model.phrase_negatives=2",
        "model.phrase_negatives_from=batch",
        *PHRASE_LAMBDAS,
    ],
    "two_branch_sim/phrases": ["model.phrase_negatives=2", "model.fusion_layers=2"],
}
# Images of rank 0 and rank 1: 4 + 4, and 3 + 5 (the ragged last batch of an exact epoch).
SPLITS = {"even": 4, "ragged": 3}


def make_recipe(job: str):
    name = job.split("/")[0]
    config = load_config(name, [*TINY, *JOBS[job]])
    return get_recipe(name)(config, VOCAB, DIM)


def global_images() -> list[dict]:
    """Images with 1-3 captions of 1-6 words: ragged on purpose."""
    rng = np.random.default_rng(0)
    words = VOCAB.itos[4:]
    return [
        {
            "image": rng.standard_normal(DIM).astype(np.float32),
            "captions": [VOCAB.encode(" ".join(rng.choice(words, size=1 + (2 * i + j) % 6))) for j in range(1 + i % 3)],
        }
        for i in range(IMAGES)
    ]


def _npy(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(array, dtype=np.float32))
    return buf.getvalue()


def phrase_raws() -> list[dict]:
    """Raw samples of images with 1-3 entities of 1-2 phrases each (a chain shares its box),
    proposals around each box and elsewhere; image 6 is image 1 again (the same key)."""
    rng = np.random.default_rng(1)
    words = VOCAB.itos[4:]
    raws = []
    for i in range(IMAGES - 1):
        objects, proposals = [], []
        for entity in range(1 + i % 3):
            x0, y0 = 30 * entity, 5 * (i % 4)
            box = [x0, y0, x0 + 20, y0 + 20]
            for n in range(1 + (i + entity) % 2):
                phrase = " ".join(rng.choice(words, size=2 + (i + n) % 2))
                objects.append({"phrase": phrase, "box": box, "region": 1 + entity, "entity": str(entity)})
            proposals += [box, [x0, y0, x0 + 20, y0 + 18], [x0, y0, x0 + 20, y0 + 10], [x0 + 10, y0, x0 + 30, y0 + 20]]
        proposals += [[0, 60, 10, 70], [50, 50, 70, 80], [5, 40, 25, 45]]
        meta = {"captions": [o["phrase"] for o in objects], "objects": objects, "proposal_boxes": proposals}
        raws.append(
            {
                "__key__": f"image-{i}",
                "json": json.dumps(meta).encode(),
                "regions.npy": _npy(rng.standard_normal((4, DIM))),
                "proposals.npy": _npy(rng.standard_normal((len(proposals), DIM))),
            }
        )
    return raws[:6] + [raws[1]] + raws[6:]


def phrase_batch(recipe, engine: Engine, split: str) -> dict:
    raws = phrase_raws()
    samples = [recipe.phrase_sample(raw, random.Random(i)) for i, raw in enumerate(raws)]
    for sample, raw in zip(samples, raws, strict=True):
        sample["identity"] = sample_identity(raw)
    mine = my_slice(samples, engine, SPLITS[split])
    batch = recipe.collate_phrases(mine)
    batch["identity"] = torch.tensor([s["identity"] for s in mine])
    batch["stream"] = "phrases"
    return batch


def run(engine: Engine, job: str, split: str) -> dict:
    """STEPS SGD steps on this rank's slice of the batch."""
    recipe = make_recipe(job)
    torch.manual_seed(0)
    module = convert_global_batchnorm(recipe.build_model())
    captions = [VOCAB.decode(c) for image in global_images() for c in image["captions"]]
    module.text_features.fit(VOCAB, captions)
    if "/phrases" in job:
        batch = phrase_batch(recipe, engine, split)
    else:
        batch = recipe.collate_train(my_slice(global_images(), engine, SPLITS[split]))
    steps = sgd_steps(engine, recipe, module, batch, STEPS, LR)
    return {"steps": steps, "world_size": engine.world_size}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    engine = cpu_engine()
    results = {(job, split): run(engine, job, split) for job in JOBS for split in SPLITS}
    if engine.is_main:
        torch.save(results, out)
    engine.close()
