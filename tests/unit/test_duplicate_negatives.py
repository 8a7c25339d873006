"""No sample is its own negative: a batch holding one image twice (shards drawn with replacement)
gives every objective the loss and gradients of the same batch with the copy removed from each
row's candidates. References are written here loop by loop, independently of the losses' masks.
(Across 2 ranks: tests/integration/test_duplicate_negatives_ranks.py.)"""

import random

import pytest
import torch
import torch.nn.functional as F
from test_two_branch_loss import direct_loss  # tests/unit is on sys.path: pytest prepends it

from vldist.data.identity import identity_of, sample_identity
from vldist.data.job_shards import JobShards
from vldist.data.shardset import ShardSet
from vldist.losses import damsm_parts, two_branch_ranking_loss, vse_hinge_loss
from vldist.losses.damsm import cosine_matrix, word_region_scores
from vldist.losses.hinge import hardest_negative_hinge
from vldist.losses.negatives import draw_negatives
from vldist.losses.not_negative import other_image_rows

# rows 1 and 4 are one image (its copy may carry another caption)
IDENTITY = torch.tensor([10, 11, 12, 13, 11, 14])


def planted_pairs(identity=IDENTITY, d=8, seed=0):
    """Normalised (B, D) image and caption embeddings; copies of one image have nearly its vector."""
    g = torch.Generator().manual_seed(seed)
    first = {int(v): i for i, v in reversed(list(enumerate(identity.tolist())))}
    image = torch.randn(len(identity), d, generator=g, dtype=torch.float64)
    # a copy is the same image seen slightly differently: near, without exact ties
    image = image[[first[int(v)] for v in identity]] + 1e-3 * torch.randn(
        len(identity), d, generator=g, dtype=torch.float64
    )
    text = image + 0.8 * torch.randn(len(identity), d, generator=g, dtype=torch.float64)
    return F.normalize(image, dim=1).requires_grad_(), F.normalize(text, dim=1).requires_grad_()


# --- VSE++ hinge ------------------------------------------------------------------------------------


def hinge_without_copies(img, txt, identity, margin, max_violation):
    """Both directions, each row's negatives listed one by one: every column of another image."""
    s, ids = img @ txt.T, identity.tolist()
    total = s.new_zeros(())
    for i in range(len(ids)):
        others = [j for j in range(len(ids)) if ids[j] != ids[i]]
        for costs in ([margin + s[i, j] - s[i, i] for j in others], [margin + s[j, i] - s[i, i] for j in others]):
            costs = torch.stack(costs).clamp(min=0)
            total = total + (costs.max() if max_violation else costs.sum())
    return total


@pytest.mark.parametrize("max_violation", [True, False])
def test_hinge_leaves_the_copy_out_of_the_negatives(max_violation):
    img, txt = planted_pairs()
    loss = vse_hinge_loss(img, txt, 0.2, max_violation, identity=IDENTITY)
    ref = hinge_without_copies(img, txt, IDENTITY, 0.2, max_violation)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    grads = torch.autograd.grad(loss, (img, txt))
    ref_grads = torch.autograd.grad(ref, (img, txt))
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.allclose(g, r, atol=1e-12)
    # the copy was a negative before: masking by row alone gives another loss
    assert vse_hinge_loss(img, txt, 0.2, max_violation).item() > loss.item() + 1e-3


def test_hinge_not_negative_contract():
    scores = torch.tensor([[0.9, 0.8, 0.1], [0.2, 0.5, 0.4]], dtype=torch.float64)
    positives = torch.tensor([0, 1])
    not_negative = torch.tensor([[False, True, False], [False, False, False]])
    # row 0: column 1 is another copy of its image, so its hardest negative is column 2
    loss = hardest_negative_hinge(scores, positives, margin=0.2, not_negative=not_negative)
    assert loss.item() == pytest.approx(max(0.2 + 0.1 - 0.9, 0) + max(0.2 + 0.4 - 0.5, 0.2 + 0.2 - 0.5))
    with pytest.raises(ValueError, match="not_negative must be a bool tensor"):
        hardest_negative_hinge(scores, positives, not_negative=not_negative[:1])


# --- two-branch ranking loss (reference: test_two_branch_loss.direct_loss with identities) -------


@pytest.mark.parametrize("top_k", [1, 3])
def test_two_branch_ranking_leaves_the_copy_out(top_k):
    image, _ = planted_pairs()
    g = torch.Generator().manual_seed(3)
    text_image = torch.arange(len(IDENTITY)).repeat_interleave(2)  # two sentences a sample: neighbours
    text = F.normalize(
        image.detach()[text_image]
        + 0.7 * torch.randn(len(text_image), image.shape[1], generator=g, dtype=torch.float64),
        dim=1,
    ).requires_grad_()
    args = (0.1, top_k, 1.0, 2.0, 0.2)
    loss = two_branch_ranking_loss(image, text, text_image, *args, identity=IDENTITY)
    ref = direct_loss(image, text, text_image, *args, identity=IDENTITY)
    # the loss keeps distances differentiable at 0 (sqrt(d^2 + 1e-8)): equal to ~1e-8
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    for g_loss, g_ref in zip(
        torch.autograd.grad(loss, (image, text)), torch.autograd.grad(ref, (image, text)), strict=True
    ):
        assert torch.allclose(g_loss, g_ref, atol=1e-6)
    assert abs(two_branch_ranking_loss(image, text, text_image, *args).item() - loss.item()) > 1e-3


# --- DAMSM ------------------------------------------------------------------------------------------


def cross_entropy_without_copies(logits, identity):
    """Mean over rows of -log softmax at the diagonal, the softmax over the diagonal and the columns
    of other images only (the copies' columns taken out of the list)."""
    ids = identity.tolist()
    terms = []
    for i in range(len(ids)):
        kept = [j for j in range(len(ids)) if j == i or ids[j] != ids[i]]
        row = logits[i, kept]
        terms.append(torch.logsumexp(row, 0) - logits[i, i])
    return torch.stack(terms).mean()


def test_damsm_leaves_the_copy_out_of_both_softmaxes():
    g = torch.Generator().manual_seed(1)
    b, t, r, d = len(IDENTITY), 5, 4, 8
    words = torch.randn(b, t, d, generator=g, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([3, 5, 2, 4, 5, 1])
    regions = torch.randn(b, r, d, generator=g, dtype=torch.float64)
    regions[4] = regions[1]  # the copy: the same image
    regions.requires_grad_()
    sentence = torch.randn(b, d, generator=g, dtype=torch.float64, requires_grad=True)
    image = torch.randn(b, d, generator=g, dtype=torch.float64)
    image[4] = image[1]
    image.requires_grad_()
    parts = damsm_parts(words, lengths, regions, sentence, image, 4.0, 5.0, 10.0, identity=IDENTITY)
    word_logits = 10.0 * word_region_scores(words, lengths, regions, 4.0, 5.0)  # tested against AttnGAN elsewhere
    sentence_logits = 10.0 * cosine_matrix(sentence, image)
    ref = {
        "words_t2i": cross_entropy_without_copies(word_logits, IDENTITY),
        "words_i2t": cross_entropy_without_copies(word_logits.T, IDENTITY),
        "sentence_t2i": cross_entropy_without_copies(sentence_logits, IDENTITY),
        "sentence_i2t": cross_entropy_without_copies(sentence_logits.T, IDENTITY),
    }
    inputs = (words, regions, sentence, image)
    for name, value in parts.items():
        assert value.item() == pytest.approx(ref[name].item(), rel=1e-12), name
        for g_loss, g_ref in zip(
            torch.autograd.grad(value, inputs, retain_graph=True, allow_unused=True),
            torch.autograd.grad(ref[name], inputs, retain_graph=True, allow_unused=True),
            strict=True,
        ):
            assert (g_loss is None) == (g_ref is None) or torch.count_nonzero(g_loss if g_ref is None else g_ref) == 0
            if g_loss is not None and g_ref is not None:
                assert torch.allclose(g_loss, g_ref, atol=1e-12), name
    rows_only = damsm_parts(words, lengths, regions, sentence, image, 4.0, 5.0, 10.0)
    assert rows_only["sentence_t2i"].item() != pytest.approx(parts["sentence_t2i"].item(), rel=1e-6)


# --- drawn negatives (CL, the similarity network) and mismatched captions (LAViTeR's GAN) ------------


def test_drawn_negatives_never_take_a_caption_of_the_same_image():
    captions = IDENTITY.repeat_interleave(2)  # each caption's image identity, 2 captions a sample
    generator = torch.Generator().manual_seed(0)
    draw = draw_negatives(captions, 400, generator)
    assert not (captions[draw] == captions[None, :]).any()
    # and every caption of another image is drawn: the copy's captions are the only ones left out
    for t in range(len(captions)):
        allowed = {k for k in range(len(captions)) if captions[k] != captions[t]}
        assert set(draw[:, t].tolist()) == allowed


def test_mismatched_rows_skip_copies_of_the_same_image():
    rows = other_image_rows(torch.tensor([7, 7, 8, 7, 9]))
    assert rows.tolist() == [2, 2, 3, 4, 0]
    assert other_image_rows(torch.tensor([1, 2, 3])).tolist() == [1, 2, 0]  # roll(1) where it is fine
    with pytest.raises(ValueError, match="two different images"):
        other_image_rows(torch.tensor([5, 5]))


# --- identities -------------------------------------------------------------------------------------


def test_identity_is_the_key_or_the_image_id_and_stable():
    assert sample_identity({"__key__": "train-0000001", "json": b'{"captions": ["a"]}'}) == identity_of("train-0000001")
    shared = [
        sample_identity({"__key__": f"train-{i}", "json": b'{"image_id": 42, "captions": ["a"]}'}) for i in (1, 2)
    ]
    assert shared[0] == shared[1] != identity_of("train-1")
    assert 0 <= identity_of("x") < 2**63
    # blake2b, not Python's salted hash: the same number in every process
    assert identity_of("train-0000001") == 3352457989759269807


def test_training_batches_carry_the_identity_of_each_sample(planted_shards):
    from vldist.data.pipeline import StreamSpec, TrainStream

    spec = StreamSpec(
        urls=sorted(str(p) for p in planted_shards.glob("train-*.tar")),
        keep=("json",),
        sample_fn=lambda raw, rng: {"key": raw["__key__"]},
        collate_fn=lambda samples: {"keys": [s["key"] for s in samples]},
        batch_size=8,
        seed=3,
    )
    batches = list(TrainStream(spec, batches_per_rank=40, shuffle_buffer=4))
    keys = [k for b in batches for k in b["keys"]]
    identities = torch.cat([b["identity"] for b in batches]).tolist()
    assert identities == [identity_of(k) for k in keys]
    assert len(set(keys)) < len(keys)  # drawn with replacement: 320 draws of 200 samples repeat some


def test_recipes_pass_the_identity_to_their_losses():
    """VSRN's loss on a batch with a copy equals the hinge that leaves the copy out."""
    from vldist.data.vocab import Vocab
    from vldist.recipes.jobs import load_config
    from vldist.recipes.vsrn import VSRNRecipe

    vocab = Vocab(["red", "blue", "circle", "square"])
    config = load_config(
        "vsrn",
        [
            "model.embed_size=8",
            "model.word_dim=4",
            "model.decoder_hidden=8",
            "model.caption_loss=false",
            "model.max_violation_warmup_epochs=0",
            "data.max_regions=3",
        ],
    )
    recipe = VSRNRecipe(config, vocab, feature_dim=6)
    torch.manual_seed(0)
    model = recipe.build_model().eval()
    rng = random.Random(0)
    features = [torch.randn(3, 6).numpy() for _ in range(5)]
    samples = [
        {"regions": features[i], "tokens": vocab.encode(rng.choice(["red circle", "blue square", "red"]))}
        for i in (0, 1, 2, 3, 1)
    ]  # sample 4 is a copy of sample 1
    batch = recipe.collate_train(samples)
    batch["identity"] = torch.tensor([0, 1, 2, 3, 1])
    with torch.no_grad():
        loss = recipe.training_losses(model, batch)["matching"]
        out = model(batch["regions"], batch["mask"], batch["tokens"], batch["lengths"])
        ref = hinge_without_copies(out["image"].double(), out["text"].double(), batch["identity"], 0.2, True)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)


def test_the_similarity_network_draws_no_sentence_of_a_copy(planted_shards, monkeypatch):
    import vldist.recipes.two_branch as two_branch
    from tests.unit.test_two_branch_recipe import _raw_samples, _recipe

    draws = []

    def recorded(ids, k, generator):
        draw = draw_negatives(ids, k, generator)
        draws.append((ids, draw))
        return draw

    monkeypatch.setattr(two_branch, "draw_negatives", recorded)
    recipe = _recipe(two_branch.TwoBranchSimRecipe, planted_shards, "model.negatives_per_positive=3")
    model = recipe.build_model()
    recipe.initialize(model, None, JobShards(ShardSet.open(recipe.config.data.shards)))
    rng = random.Random(0)
    raws = list(_raw_samples(planted_shards, 5))
    batch = recipe.collate_train([recipe.train_sample(r, rng) for r in [*raws, raws[1]]])  # row 5 copies row 1
    batch["identity"] = torch.tensor([identity_of(r["__key__"]) for r in [*raws, raws[1]]])
    for step in range(4):
        recipe.start_step(step)
        recipe.training_losses(model, batch)
    for ids, draw in draws:
        assert torch.equal(ids, batch["identity"][batch["text_image"]])
        assert not (ids[draw] == ids[None, :]).any()


def test_embedding_network_and_cl_pass_the_identity(planted_shards, monkeypatch):
    import vldist.recipes.two_branch as two_branch
    from tests.unit.test_two_branch_recipe import _raw_samples, _recipe

    recipe = _recipe(two_branch.TwoBranchEmbedRecipe, planted_shards, "model.lambda_text_neighbors=0.2")
    model = recipe.build_model()
    recipe.initialize(model, None, JobShards(ShardSet.open(recipe.config.data.shards)))
    model.eval()
    rng = random.Random(0)
    raws = list(_raw_samples(planted_shards, 5))
    batch = recipe.collate_train([recipe.train_sample(r, rng) for r in [*raws, raws[2]]])
    batch["identity"] = torch.tensor([0, 1, 2, 3, 4, 2])
    with torch.no_grad():
        loss = recipe.training_losses(model, batch)["loss"]
        out = model(batch["images"], batch["tokens"])
        cfg = recipe.cfg
        ref = direct_loss(
            out["image"].double(),
            out["text"].double(),
            batch["text_image"],
            cfg.margin,
            cfg.top_k,
            cfg.lambda_image,
            cfg.lambda_text,
            cfg.lambda_text_neighbors,
            identity=batch["identity"],
        )
    assert loss.item() == pytest.approx(ref.item(), rel=1e-4)


def test_cl_draws_no_caption_of_a_copy(tmp_path):
    from tests.unit.test_cl_caption_recipe import _batch, _captioner_checkpoint, _recipe, _started

    recipe = _recipe(_captioner_checkpoint(tmp_path / "captioner"), "model.negatives=4")
    model = _started(recipe)
    batch = _batch(recipe, n_images=4)
    batch["identity"] = torch.tensor([5, 6, 5, 7])  # image 2 is a copy of image 0
    own = batch["identity"][batch["caption_images"]]
    for step in range(5):
        recipe.start_step(step)
        recipe.training_losses(model, batch)
        draw = recipe.last_draw
        assert torch.equal(draw["image_ids"], own)
        assert not (own[draw["draw"]] == own[None]).any()


@pytest.mark.parametrize("phase", ["vta", "joint"])
def test_laviter_passes_the_identity_to_damsm_and_the_mismatched_captions(phase, monkeypatch):
    import vldist.recipes.laviter as laviter
    from tests.unit.test_laviter_recipe import batch_for, recipe_for

    seen = {"damsm": [], "mismatched": []}

    def damsm(*args, identity=None, **kwargs):
        seen["damsm"].append(identity)
        return laviter.cross_rank_damsm_loss.__wrapped__(*args, identity=identity, **kwargs)

    damsm.__wrapped__ = laviter.cross_rank_damsm_loss
    monkeypatch.setattr(laviter, "cross_rank_damsm_loss", damsm)
    recipe = recipe_for(phase)
    model = recipe.build_model()
    forward = model.forward

    def recorded(*args, mismatched=None, **kwargs):
        seen["mismatched"].append(mismatched)
        return forward(*args, mismatched=mismatched, **kwargs)

    model.forward = recorded
    batch = batch_for(recipe, n=4)
    batch["identity"] = torch.tensor([3, 3, 4, 3])
    for update in recipe.updates(0):
        recipe.training_losses(model, batch, update)
    assert seen["damsm"] and all(torch.equal(i, batch["identity"]) for i in seen["damsm"])
    if phase == "joint":  # the GAN's discriminator step: each image's wrong caption is another image's
        rows = [m for m in seen["mismatched"] if m is not None]
        assert rows and rows[0].tolist() == [2, 2, 3, 2]
