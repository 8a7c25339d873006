"""The VSRN recipe: samples, region order, ablation switches, losses."""

import io
import json
import random

import numpy as np
import pytest
import torch
from helpers import bench_module

from vldist.data.vocab import Vocab
from vldist.recipes.jobs import load_config
from vldist.recipes.vsrn import VSRNRecipe

VOCAB = Vocab(["a", "red", "circle", "blue", "square"])


def _recipe(*overrides, feature_dim=6):
    config = load_config(
        "vsrn", ["model.embed_size=8", "model.word_dim=4", "model.decoder_hidden=8", "data.max_regions=4", *overrides]
    )
    return VSRNRecipe(config, VOCAB, feature_dim)


def _raw(key="k0", n_regions=3, areas=(1, 9, 4), dim=6):
    feats = np.stack([np.full(dim, i, np.float32) for i in range(n_regions)])
    buf = io.BytesIO()
    np.save(buf, feats)
    boxes = [[0, 0, 1, a] for a in areas]  # box i has area a
    meta = {"captions": ["a red circle", "a blue square", "red", "blue", "circle"], "region_boxes": boxes}
    return {"__key__": key, "json": json.dumps(meta).encode(), "regions.npy": buf.getvalue()}


def test_region_order_stored_size_and_random():
    stored = _recipe().train_sample(_raw(), random.Random(0))["regions"][:, 0]
    assert stored.tolist() == [0, 1, 2]
    by_size = _recipe("model.region_order=size").train_sample(_raw(), random.Random(0))["regions"][:, 0]
    assert by_size.tolist() == [1, 2, 0]  # areas 9, 4, 1: largest first
    orders = {
        tuple(_recipe("model.region_order=random").train_sample(_raw(), random.Random(s))["regions"][:, 0])
        for s in range(20)
    }
    assert len(orders) > 1 and all(sorted(o) == [0, 1, 2] for o in orders)


def test_regions_beyond_max_are_truncated_and_bad_features_rejected():
    sample = _recipe().train_sample(_raw(n_regions=6, areas=(1,) * 6), random.Random(0))
    assert sample["regions"].shape == (4, 6)
    with pytest.raises(ValueError, match="has 6 features, expected 5"):
        _recipe(feature_dim=5).train_sample(_raw(), random.Random(0))
    raw = _raw()
    raw["json"] = json.dumps({"captions": []}).encode()
    with pytest.raises(ValueError, match="no captions"):
        _recipe().train_sample(raw, random.Random(0))


def test_eval_samples_keep_up_to_five_captions_and_a_fixed_region_order():
    recipe = _recipe("model.region_order=random")
    a = recipe.eval_sample(_raw("img7"), random.Random(0))
    b = recipe.eval_sample(_raw("img7"), random.Random(99))
    assert len(a["captions"]) == 5
    assert np.array_equal(a["regions"], b["regions"])  # seeded by the key, not the stream
    batch = recipe.collate_eval([a, b])
    assert batch["tokens"].shape[0] == 10 and batch["mask"].shape == (2, 4)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.rrr_layers=0"],
        ["model.rrr_layers=1"],
        ["model.global_reasoning=mean"],
        ["model.rrr_layers=1", "model.global_reasoning=mean"],
        ["model.region_order=random"],
        ["model.caption_loss=false"],
        ["model.affinity_norm=softmax"],
        ["model.max_violation=false"],
    ],
)
def test_every_ablation_trains_one_step(overrides):
    torch.manual_seed(0)
    recipe = _recipe(*overrides)
    model = recipe.build_model()
    rng = random.Random(0)
    batch = recipe.collate_train([recipe.train_sample(_raw(f"k{i}", areas=(1, 2, 3)), rng) for i in range(4)])
    batch["regions"] += torch.randn_like(batch["regions"])  # distinct images
    losses = recipe.training_losses(model, batch)
    assert ("caption" in losses) == ("model.caption_loss=false" not in overrides)
    assert len(model.image.rrr) == (
        0 if "model.rrr_layers=0" in overrides else 1 if "model.rrr_layers=1" in overrides else 4
    )
    before = [p.detach().clone() for p in model.parameters()]
    losses["loss"].backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_hardest_negatives_start_after_the_warmup():
    recipe = _recipe("model.max_violation_warmup_epochs=2")
    assert not recipe.hardest_negatives
    recipe.start_epoch(1)
    assert not recipe.hardest_negatives
    recipe.start_epoch(2)
    assert recipe.hardest_negatives
    assert _recipe(
        "model.max_violation_warmup_epochs=0"
    ).hardest_negatives  # no warm-up: the paper's loss from the first step


def _raw_with(key, captions, seed):
    feats = np.random.default_rng(seed).standard_normal((3, 6)).astype(np.float32)
    buf = io.BytesIO()
    np.save(buf, feats)
    return {"__key__": key, "json": json.dumps({"captions": captions}).encode(), "regions.npy": buf.getvalue()}


def test_evaluation_takes_every_caption_an_image_has_and_ranks_as_a_brute_force_count():
    """Images with 1, 2 and 5 captions (7 with the cap at 5): the protocol scores the captions each
    image has. Reference: every image's best own caption and every caption's image, counted by hand
    from the model's own embeddings, ties against the query."""
    torch.manual_seed(0)
    recipe = _recipe()
    model = recipe.build_model().eval()
    words = ["a", "red", "circle", "blue", "square"]
    counts = [1, 2, 5, 1, 7, 2, 1, 5]
    rng = random.Random(0)
    samples = [
        recipe.eval_sample(_raw_with(f"k{i}", [" ".join(rng.choices(words, k=3)) for _ in range(n)], i), rng)
        for i, n in enumerate(counts)
    ]
    kept = [min(n, 5) for n in counts]  # eval.max_captions_per_image
    assert [len(s["captions"]) for s in samples] == kept
    batches = [recipe.collate_eval(samples[:3]), recipe.collate_eval(samples[3:])]
    result = recipe.evaluate(model, batches, torch.device("cpu"))
    assert result["n_images"] == 8 and result["n_captions"] == sum(kept)

    with torch.no_grad():
        images = torch.cat([model.embed_images(b["regions"], b["mask"]) for b in batches])
        captions = torch.cat([model.embed_captions(b["tokens"], b["lengths"]) for b in batches])
    sims = (images @ captions.T).double()
    owner = [i for i, n in enumerate(kept) for _ in range(n)]
    i2t, t2i = [], []
    for i in range(len(kept)):
        best = max(sims[i, j] for j in range(len(owner)) if owner[j] == i)
        i2t.append(1 + sum(1 for j in range(len(owner)) if owner[j] != i and sims[i, j] >= best))
    for j, i in enumerate(owner):
        t2i.append(1 + sum(1 for k in range(len(kept)) if k != i and sims[k, j] >= sims[i, j]))
    for k in (1, 5, 10):
        assert result["full"][f"i2t_r{k}"] == pytest.approx(100 * np.mean([r <= k for r in i2t]))
        assert result["full"][f"t2i_r{k}"] == pytest.approx(100 * np.mean([r <= k for r in t2i]))
    assert result["full"]["i2t_meanr"] == pytest.approx(np.mean(i2t))
    assert result["chance"]["t2i_r1"] == pytest.approx(100 / 8)


# ---------------------------------------------------------------- the ablation bench's rows (issue 45)


def _bench_row(key: str) -> list[str]:
    return next(row.overrides for row in bench_module("vsrn_ablation").ROWS if row.key == key)


def _by_hand_rrr(layer, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eq. 3 for one image's real regions v (n, D), the layer in eval mode: V + BN(W_r (R V W_g))
    with R = theta phi^T / n (the count normalisation), BN with its running statistics."""
    w, b = layer.theta_phi_g.weight, layer.theta_phi_g.bias
    d = v.shape[1]
    theta, phi, g = (v @ w[i * d : (i + 1) * d].T + b[i * d : (i + 1) * d] for i in range(3))
    y = (theta @ phi.T / v.shape[0]) @ g
    x = y @ layer.w_r.weight.T + layer.w_r.bias
    bn = layer.bn
    return v + (x - bn.running_mean) / torch.sqrt(bn.running_var + bn.eps) * bn.weight + bn.bias


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm()


def _reasoned_regions(model, regions: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Each image's V*, written out: fc, l2norm, the RRR layers by hand, l2norm; real regions only."""
    out = []
    proj = model.image.region_projection
    for x, m in zip(regions, mask, strict=True):
        v = torch.stack([_unit(r) for r in x[m] @ proj.weight.T + proj.bias])
        for layer in model.image.rrr:
            v = _by_hand_rrr(layer, v, m)
        out.append(torch.stack([_unit(r) for r in v]))
    return out


def _model_with_awake_layers(overrides: list[str]):
    """The row's model in eval mode, every RRR layer's BatchNorm moved off the identity it starts as."""
    torch.manual_seed(0)
    model = _recipe(*overrides).build_model().eval()
    with torch.no_grad():
        for layer in model.image.rrr:
            layer.bn.weight.uniform_(0.5, 1.5)
            layer.bn.bias.normal_()
            layer.bn.running_mean.normal_()
            layer.bn.running_var.uniform_(0.5, 2.0)
    regions = torch.randn(3, 4, 6)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    return model, regions, mask


def test_the_rrr_row_mean_pools_one_layers_reasoned_regions_and_has_no_gru():
    """Table 4's "RRR": the Mean-pool baseline with one RRR layer before its mean pooling."""
    overrides = _bench_row("rrr")
    model, regions, mask = _model_with_awake_layers(overrides)
    assert len(model.image.rrr) == 1 and model.image.gru is None
    assert not [name for name, _ in model.named_parameters() if "gru" in name and name.startswith("image.")]
    with torch.no_grad():
        image = model.embed_images(regions, mask)
        expected = torch.stack([_unit(v.mean(dim=0)) for v in _reasoned_regions(model, regions, mask)])
        assert torch.allclose(image, expected, atol=1e-5)
        # the layer does something here: without it (the Mean-pool row's encoder) the output differs
        plain = torch.stack(
            [
                _unit(
                    torch.stack(
                        [
                            _unit(r)
                            for r in x[m] @ model.image.region_projection.weight.T + model.image.region_projection.bias
                        ]
                    ).mean(0)
                )
                for x, m in zip(regions, mask, strict=True)
            ]
        )
        assert not torch.allclose(image, plain, atol=1e-3)


def test_the_1rrr_gsr_row_runs_the_gru_over_one_layers_reasoned_regions():
    model, regions, mask = _model_with_awake_layers(_bench_row("1rrr-gsr"))
    assert len(model.image.rrr) == 1 and model.image.gru is not None
    with torch.no_grad():
        image = model.embed_images(regions, mask)
        last = [model.image.gru(v[None])[1][-1, 0] for v in _reasoned_regions(model, regions, mask)]
        assert torch.allclose(image, torch.stack([_unit(h) for h in last]), atol=1e-5)


def test_the_synthetic_sets_stored_order_is_by_box_size_largest_first():
    """Why the bench's Table 5 puts VSRN-BboxSize beside the stored order: the set stores the
    whole image, then the objects largest first, so model.region_order=size keeps that order."""
    from vldist.shards.synthetic.scenes import generate_scene
    from vldist.shards.synthetic.synth import region_boxes

    rng = random.Random(0)
    for _ in range(30):
        boxes = region_boxes(generate_scene(rng, 128))
        areas = [(b[2] - b[0]) * (b[3] - b[1]) for b in boxes]
        assert areas == sorted(areas, reverse=True) and boxes[0] == [0, 0, 128, 128]
        if len(set(areas)) == len(areas):
            raw = _raw(n_regions=len(boxes), areas=())
            meta = json.loads(raw["json"])
            meta["region_boxes"] = boxes
            raw["json"] = json.dumps(meta).encode()
            sized = _recipe("model.region_order=size", "data.max_regions=5").train_sample(raw, random.Random(0))
            assert sized["regions"][:, 0].tolist() == list(range(len(boxes)))
    assert _bench_row("region-random") == ["model.region_order=random"]
