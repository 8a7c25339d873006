"""The L2C recipe's samples, losses and generation on a miniature pair set, in one process."""

import json
import random
from itertools import islice

import pytest
import torch

from vldist.config import updated
from vldist.data.shardset import ShardSet
from vldist.data.streams import StreamSource
from vldist.losses import total_variation_loss
from vldist.recipes.jobs import load_config
from vldist.recipes.l2c import L2CRecipe
from vldist.shards.synthetic.pairs import swap_image_tokens

TINY = [
    "model.image_size=64",
    "model.graph_dim=32",
    "model.hidden=32",
    "model.embed=16",
    "model.classes=3",
    "model.captions_per_sample=2",
    "data.max_caption_len=20",
    "model.gcn_kernel=torch",
]


def _recipe(pair_shards, *overrides) -> L2CRecipe:
    config = load_config("l2c", [f"data.shards={pair_shards}", *TINY, *overrides])
    shards = ShardSet.open(pair_shards)
    return L2CRecipe(config, shards.vocab(pair_shards), shards.feature_dim())


def _raw_pairs(pair_shards, split="train", n=4) -> list[dict]:
    import webdataset as wds

    shards = ShardSet.open(pair_shards)
    samples = wds.tarfile_samples({"url": u} for u in shards.urls(split))
    return list(islice(samples, n))


def _flips(rng_seed: int) -> bool:
    return random.Random(rng_seed).random() < 0.5


def test_a_flipped_pair_swaps_its_images_masks_and_image_tokens(pair_shards):
    recipe = _recipe(pair_shards, "model.captions_per_sample=20")  # every description, in a seeded order
    raw = _raw_pairs(pair_shards)[0]
    kept_seed, flipped_seed = next(s for s in range(50) if not _flips(s)), next(s for s in range(50) if _flips(s))
    kept = recipe.train_sample(raw, random.Random(kept_seed))
    flipped = recipe.train_sample(raw, random.Random(flipped_seed))
    assert torch.equal(kept["images"], flipped["second"]) and torch.equal(kept["second"], flipped["images"])
    assert torch.equal(kept["masks"][0], flipped["masks"][1]) and torch.equal(kept["masks"][1], flipped["masks"][0])
    decoded = {recipe.vocab.decode(ids) for ids in flipped["captions"]}
    swapped = {
        recipe.vocab.decode(recipe.vocab.encode(swap_image_tokens(c), 20)) for c in json.loads(raw["json"])["captions"]
    }
    assert decoded == swapped and any("image1" in d for d in decoded)


def test_pair_and_single_batches_give_their_losses_and_the_mask_loss_only_where_masks_are_stored(pair_shards):
    recipe = _recipe(pair_shards)
    torch.manual_seed(0)
    model = recipe.build_model()
    rng = random.Random(0)
    pairs = recipe.collate_train([recipe.train_sample(r, rng) for r in _raw_pairs(pair_shards)])
    assert bool(pairs["mask_present"].all())  # the embedded pairs store both masks
    out = recipe.training_losses(model, pairs)
    assert set(out) == {"loss", "diff", "tv", "mask"}
    assert float(out["loss"].detach()) == pytest.approx(float(out["diff"] + out["tv"] + out["mask"]), rel=1e-5)
    # a single-image batch without stored masks: L_single + λ L_TV, nothing for the mask head
    singles = [
        {"images": p["images"], "second": None, "masks": [None], "captions": p["captions"]}
        for p in (recipe.train_sample(r, rng) for r in _raw_pairs(pair_shards))
    ]
    out = recipe.training_losses(model, recipe.collate_train(singles))
    assert set(out) == {"loss", "single", "tv", "mask"} and float(out["mask"]) == 0.0  # same parts on every rank
    out["loss"].backward()
    assert not model.encoder.mask_head.weight.grad.any()


def test_a_batch_holds_its_masks_in_the_encoders_order_first_images_then_second_images(pair_shards):
    recipe = _recipe(pair_shards)
    samples = [recipe.train_sample(r, random.Random(0)) for r in _raw_pairs(pair_shards)]
    assert len({float(m.sum()) for s in samples for m in s["masks"]}) > 4  # the masks tell apart
    batch = recipe.collate_train(samples)
    n = len(samples)
    for i, sample in enumerate(samples):
        assert torch.equal(batch["masks"][i], sample["masks"][0])  # with images[i]
        assert torch.equal(batch["masks"][n + i], sample["masks"][1])  # with second[i]


def test_the_tv_term_is_the_total_variation_of_the_confidence_maps_of_both_images(pair_shards):
    recipe = _recipe(pair_shards, "model.mask_weight=0")
    torch.manual_seed(0)
    model = recipe.build_model()
    batch = recipe.collate_train([recipe.train_sample(r, random.Random(1)) for r in _raw_pairs(pair_shards)])
    out = recipe.training_losses(model, batch)
    confidence = model.encoder(torch.cat([batch["images"], batch["second"]]))["confidence"]
    assert confidence.shape[0] == 2 * len(batch["images"])
    assert float(out["tv"]) == pytest.approx(float(total_variation_loss(confidence).detach()), rel=1e-5)


@pytest.mark.parametrize("threshold", ["0.5", "null"])
def test_evaluation_reads_the_predicted_mask_never_the_stored_one(pair_shards, threshold):
    recipe = _recipe(pair_shards, f"model.mask_threshold={threshold}")
    torch.manual_seed(0)
    model = recipe.build_model().eval()
    batch = recipe.collate_eval([recipe.eval_sample(r, random.Random(0)) for r in _raw_pairs(pair_shards, "test")])
    texts, aux = recipe.describe(model, batch["images"], batch["second"])
    probability = torch.sigmoid(aux["mask_logits"])
    predicted = probability if threshold == "null" else (probability > 0.5).float()
    assert torch.equal(aux["mask"], predicted)
    # whatever the stored masks hold, the descriptions are the same (describe never sees them)
    batch["masks"] = 1 - batch["masks"]
    again, _ = recipe.describe(model, batch["images"], batch["second"])
    assert again == texts and all(isinstance(t, str) for t in texts)


def test_the_baseline_reads_pooled_features_of_both_images_and_pairs_only(pair_shards):
    recipe = _recipe(pair_shards, "model.architecture=cnn_lstm")
    assert list(recipe.train_streams(recipe.config)) == ["pairs"]
    torch.manual_seed(0)
    model = recipe.build_model()
    batch = recipe.collate_train([recipe.train_sample(r, random.Random(2)) for r in _raw_pairs(pair_shards)])
    features, aux = model.features(batch["images"], batch["second"])
    pooled = model.trunk(torch.cat([batch["images"], batch["second"]])).mean(dim=(2, 3))
    first, second = pooled.chunk(2)
    assert torch.allclose(features[:, 0], torch.cat([first, second], dim=-1), atol=1e-6) and aux == {}
    assert set(recipe.training_losses(model, batch)) == {"loss", "diff"}


def test_the_job_trains_the_baseline_then_l2c_and_single_images_take_turns_one_for_one(pair_shards):
    config = load_config("l2c", [f"data.shards={pair_shards}", *TINY])
    assert [name for name, _ in L2CRecipe.stages(config)] == ["cnn_lstm", "l2c"]
    baseline = L2CRecipe.stages(config)[0][1]
    assert baseline.model.architecture == "cnn_lstm" and not baseline.eval.baseline
    assert [name for name, _ in L2CRecipe.stages(updated(config, {"model": {"baseline_stage": False}}))] == ["l2c"]
    streams = (r := _recipe(pair_shards)).train_streams(r.config)
    assert streams["pairs"] == "train"
    assert streams["single"] == StreamSource(
        "train", shards="shards/synth", batch_size=32, keys=("json",), steps_like="pairs"
    )
    assert list((r := _recipe(pair_shards, "model.single_images=false")).train_streams(r.config)) == ["pairs"]


def test_the_issue_named_functions_import_from_their_packages():
    from vldist.losses import total_variation_loss as tv
    from vldist.models import semantic_pool

    features, mask, confidence = torch.rand(1, 2, 3, 3), torch.ones(1, 3, 3), torch.rand(1, 4, 3, 3)
    assert torch.allclose(
        semantic_pool(features, mask, confidence)[0, 1], (features[0] * confidence[0, 1]).sum(dim=(1, 2))
    )
    assert callable(tv)
