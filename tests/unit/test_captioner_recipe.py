"""The captioner recipe: samples, batches of several captions per image, the NLL loss."""

import io
import json
import math
import random

import numpy as np
import pytest
import torch

from vldist.data.vocab import Vocab
from vldist.recipes.captioner import CaptionerRecipe
from vldist.recipes.jobs import load_config

VOCAB = Vocab(["a", "red", "circle", "blue", "square"])


def _recipe(*overrides, feature_dim=6):
    config = load_config(
        "captioner", ["model.hidden=8", "model.embed=8", "data.max_regions=4", "model.dropout=0", *overrides]
    )
    return CaptionerRecipe(config, VOCAB, feature_dim)


def _raw(key, captions, n_regions=3, dim=6, value=0.0):
    buf = io.BytesIO()
    np.save(buf, np.full((n_regions, dim), value, np.float32))
    return {"__key__": key, "json": json.dumps({"captions": captions}).encode(), "regions.npy": buf.getvalue()}


def test_a_batch_holds_each_chosen_caption_beside_its_own_image():
    recipe = _recipe("model.captions_per_image=2")
    raws = [_raw("a", ["a red circle", "a blue square", "red"], value=1.0), _raw("b", ["blue"], value=2.0)]
    samples = [recipe.train_sample(r, random.Random(0)) for r in raws]
    assert [len(s["captions"]) for s in samples] == [2, 1]  # at most captions_per_image, fewer if fewer exist
    batch = recipe.collate_train(samples)
    assert batch["caption_images"].tolist() == [0, 0, 1]
    assert batch["regions"][batch["caption_images"], 0, 0].tolist() == [1.0, 1.0, 2.0]
    texts = [VOCAB.decode(row) for row in batch["tokens"].tolist()]
    assert set(texts[:2]) <= {"a red circle", "a blue square", "red"} and texts[2] == "blue"


def test_the_loss_is_the_mean_token_nll_of_every_caption_under_its_image():
    torch.manual_seed(0)
    recipe = _recipe("model.captions_per_image=3")
    raws = [_raw("a", ["a red circle", "a blue square", "red"], value=0.5), _raw("b", ["blue circle", "a"], value=-1.0)]
    batch = recipe.collate_train([recipe.train_sample(r, random.Random(1)) for r in raws])
    model = recipe.build_model()
    loss = recipe.training_losses(model, batch)["loss"].detach()
    # direct: -log p(word) at every real next token, one caption and its image at a time
    total, count = 0.0, 0
    for row, image in enumerate(batch["caption_images"].tolist()):
        tokens = batch["tokens"][row]
        tokens = tokens[: int((tokens != 0).sum())]
        with torch.no_grad():
            logits = model(batch["regions"][image : image + 1], batch["mask"][image : image + 1], tokens[None])[0]
        for t, target in enumerate(tokens[1:].tolist()):
            total -= math.log(float(logits[t].softmax(-1)[target]))
            count += 1
    assert loss.item() == pytest.approx(total / count, rel=1e-5)


@pytest.mark.parametrize("decoder", ["adaptive_attention", "show_tell"])
def test_both_base_models_build_and_caption(decoder):
    recipe = _recipe(f"model.decoder={decoder}")
    regions = [np.random.default_rng(0).standard_normal((3, 6)).astype(np.float32)] * 2
    captions = recipe.caption(recipe.build_model().eval(), regions, torch.device("cpu"))
    assert len(captions) == 2 and captions[0] == captions[1]  # same image, same caption
    assert all(w in VOCAB.stoi or w == "unk" for w in " ".join(captions).split())
