"""One VSRN training step on this rank's slice of a fixed global batch; rank 0 saves the outcome.

Run by tests/integration/test_distributed_equivalence.py under torchrun (2 gloo processes) and
in-process (1 process): the two must agree.
"""

import random
import sys

import numpy as np
import torch

from vldist.data.vocab import Vocab
from vldist.dist.engine import AccelerateEngine
from vldist.dist.collectives import global_sum
from vldist.recipes.vsrn import VSRNRecipe
from vldist.train import load_config

GLOBAL_BATCH = 8
VOCAB = Vocab(["a", "red", "blue", "green", "circle", "square", "star", "left", "of", "above"])


def make_recipe(gather: bool) -> VSRNRecipe:
    config = load_config("vsrn", [
        "model.embed_size=16", "model.word_dim=8", "model.decoder_hidden=16", "model.decoder_dropout=0",
        "model.max_violation_warmup_epochs=0", f"model.gather_negatives={str(gather).lower()}", "data.max_regions=5",
    ])
    return VSRNRecipe(config, VOCAB, feature_dim=12)


def global_samples() -> list[dict]:
    """Ragged on purpose: 2-5 regions per image and captions of different lengths."""
    rng = np.random.default_rng(0)
    words = VOCAB.itos[4:]
    samples = []
    for i in range(GLOBAL_BATCH):
        regions = rng.standard_normal((2 + i % 4, 12)).astype(np.float32)
        caption = " ".join(rng.choice(words, size=3 + (i * 3) % 5))
        samples.append({"regions": regions, "tokens": VOCAB.encode(caption)})
    return samples


def build_model(recipe: VSRNRecipe) -> torch.nn.Module:
    torch.manual_seed(0)
    model = recipe.build_model()
    for module in model.modules():  # BN starts at 0 (identity RRR); make the GCN branch matter
        if isinstance(module, torch.nn.BatchNorm1d):
            torch.nn.init.constant_(module.weight, 0.5)
    return model


def step(engine: AccelerateEngine, recipe: VSRNRecipe, ragged: bool = False) -> dict:
    """ragged: rank 0 takes 3 rows and rank 1 takes 5, as in the last batch of an exact epoch."""
    bounds = [0, 3, 8] if ragged and engine.world_size == 2 else [
        r * GLOBAL_BATCH // engine.world_size for r in range(engine.world_size + 1)]
    mine = global_samples()[bounds[engine.rank]:bounds[engine.rank + 1]]
    batch = recipe.collate_train(mine)
    model, optimizer = engine.setup(build_model(recipe), lambda m: torch.optim.SGD(m.parameters(), lr=0.5))
    losses = recipe.losses(model, batch)
    engine.backward(losses["loss"])
    grads = {n: p.grad.clone() for n, p in engine.unwrap(model).named_parameters()}
    engine.step()
    return {
        "loss": float(global_sum(losses["loss"])),
        "matching": float(global_sum(losses["matching"])),
        "caption": float(global_sum(losses["caption"])),
        "grads": grads,
        "params": {n: p.detach().clone() for n, p in engine.unwrap(model).named_parameters()},
        "world_size": engine.world_size,
    }


if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]  # gather | local | ragged
    random.seed(0)
    engine = AccelerateEngine("cpu", sync_batchnorm=True)
    result = step(engine, make_recipe(mode != "local"), ragged=mode == "ragged")
    if engine.is_main:
        torch.save(result, out)
    engine.close()
