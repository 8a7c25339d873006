"""The two-branch recipes: neighbourhood sampling on streamed shards, the similarity network's
logistic loss, tf-idf fitted from the shards, and evaluation through the fusion layers."""

import io
import json
import math
import random

import numpy as np
import pytest
import torch

from vldist.data.job_shards import JobShards
from vldist.data.pipeline import StreamSpec, TrainStream, batches_per_rank, make_loader
from vldist.data.shardset import ShardSet
from vldist.data.vocab import Vocab
from vldist.losses.negatives import draw_negatives, step_generator
from vldist.models import two_branch as two_branch_model
from vldist.recipes.jobs import load_config
from vldist.recipes.two_branch import TwoBranchEmbedRecipe, TwoBranchSimRecipe, sentence_chance

TINY = ["model.hidden=16", "model.embed=8", "model.dropout=0", "data.max_regions=3", "model.tasks=[retrieval]"]


def _recipe(cls, shards, *overrides):
    config = load_config(cls.name, [f"data.shards={shards}", *TINY, *overrides])
    set_ = ShardSet.open(shards)
    return cls(config, set_.vocab(shards), set_.feature_dim())


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("per_image", [1, 2, 3])
def test_each_image_brings_its_sentences_on_every_rank_and_worker_with_equal_steps(planted_shards, workers, per_image):
    """Neighbourhood sampling: every image of every batch has `per_image` distinct captions of its
    own (planted images have 5) beside it, streamed, on 2 ranks x `workers` loader workers."""
    recipe = _recipe(TwoBranchEmbedRecipe, planted_shards, f"model.sentences_per_image={per_image}")
    shards = ShardSet.open(planted_shards)
    urls = shards.urls("train")
    steps = batches_per_rank(samples_per_epoch=200, global_batch=2 * 10)
    counts = []
    for rank in range(2):
        spec = StreamSpec(
            urls=urls,
            keep=recipe.sample_keys,
            sample_fn=recipe.train_sample,
            collate_fn=recipe.collate_train,
            batch_size=10,
            seed=0,
            rank=rank,
            world_size=2,
        )
        batches = list(make_loader(TrainStream(spec, steps, shuffle_buffer=20), workers))
        counts.append(len(batches))
        for batch in batches:
            assert batch["images"].shape[0] == 10
            per = torch.bincount(batch["text_image"], minlength=10)
            assert per.tolist() == [per_image] * 10
            for image in range(10):
                rows = batch["tokens"][batch["text_image"] == image]
                # a planted image's captions are orderings of its own three words
                assert len({frozenset(recipe.vocab.decode(r).split()) for r in rows.tolist()}) == 1
    assert counts == [steps, steps]


def test_an_image_brings_distinct_captions_and_all_it_has_when_fewer():
    vocab = Vocab(["a", "b"])
    config = load_config("two_branch_embed", [*TINY, "model.sentences_per_image=3"])
    recipe = TwoBranchEmbedRecipe(config, vocab, 4)
    buf = io.BytesIO()
    np.save(buf, np.ones((2, 4), np.float32))
    raw = {"__key__": "k", "json": json.dumps({"captions": ["a", "b"]}).encode(), "regions.npy": buf.getvalue()}
    sample = recipe.train_sample(raw, random.Random(0))
    assert sorted(vocab.decode(c) for c in sample["captions"]) == ["a", "b"]
    assert (sample["image"] == 1).all()
    raw["json"] = json.dumps({"captions": ["a", "b", "a b", "b a"]}).encode()
    for seed in range(5):  # three different captions of the four, never one twice
        chosen = [vocab.decode(c) for c in recipe.train_sample(raw, random.Random(seed))["captions"]]
        assert len(chosen) == len(set(chosen)) == 3


def test_the_similarity_loss_is_the_logistic_loss_of_each_positive_and_its_drawn_negatives(planted_shards):
    torch.manual_seed(0)
    recipe = _recipe(TwoBranchSimRecipe, planted_shards, "model.negatives_per_positive=2", "seed=7")
    model = recipe.build_model()
    recipe.initialize(model, None, JobShards(ShardSet.open(recipe.config.data.shards)))
    rng = random.Random(0)
    raws = list(_raw_samples(planted_shards, 6))
    batch = recipe.collate_train([recipe.train_sample(r, rng) for r in raws])
    recipe.start_step(5)
    loss = recipe.training_losses(model, batch)["loss"]
    # direct: the same draw (seed 7, step 5, first micro-batch), then pair by pair
    draw = draw_negatives(batch["text_image"], 2, step_generator(7, 5, 0))
    with torch.no_grad():
        image = model.embed_images(batch["images"])
        text = model.embed_captions(batch["tokens"])
    expected = 0.0
    for j, i in enumerate(batch["text_image"].tolist()):
        expected += math.log1p(math.exp(-float(model.fusion(image[i] * text[j]).detach())))
        for k in draw[:, j].tolist():
            assert batch["text_image"][k] != i  # a negative is never a sentence of the image itself
            expected += math.log1p(math.exp(float(model.fusion(image[i] * text[k]).detach())))
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)


def test_tfidf_is_fitted_on_the_train_captions_at_initialize(planted_shards):
    from sklearn.feature_extraction.text import TfidfVectorizer

    from vldist.data.vocab import tokenize

    recipe = _recipe(TwoBranchEmbedRecipe, planted_shards)
    model = recipe.build_model()
    assert not model.text_features.fitted
    recipe.initialize(model, None, JobShards(ShardSet.open(recipe.config.data.shards)))
    words = recipe.vocab.itos[4:]
    sklearn = TfidfVectorizer(vocabulary=words, tokenizer=tokenize, lowercase=False, token_pattern=None)
    sklearn.fit(list(ShardSet.open(planted_shards).train_captions()))
    torch.testing.assert_close(model.text_features.idf[4:], torch.tensor(sklearn.idf_, dtype=torch.float32))
    assert "text_features.idf" in model.state_dict()  # saved with the checkpoint's weights


def test_evaluation_scores_every_pair_through_the_fusion_layers(planted_shards):
    torch.manual_seed(0)
    recipe = _recipe(TwoBranchSimRecipe, planted_shards)
    model = recipe.build_model().eval()
    recipe.initialize(model, None, JobShards(ShardSet.open(recipe.config.data.shards)))
    rng = random.Random(0)
    batch = recipe.collate_eval([recipe.eval_sample(r, rng) for r in _raw_samples(planted_shards, 7)])
    with torch.no_grad():
        image, text = model.embed_images(batch["images"]), model.embed_captions(batch["tokens"])
        got = model.all_pair_scores(image, text, rows_at_once=3)
        for i in range(image.shape[0]):
            for j in range(text.shape[0]):
                assert float(got[i, j]) == pytest.approx(float(model.fusion(image[i] * text[j]).detach()), abs=1e-5)
    metrics = recipe.evaluate(model, [batch], torch.device("cpu"))
    assert metrics["n_images"] == 7 and metrics["n_captions"] == 35 and "sentence_to_sentence" not in metrics


@pytest.mark.parametrize("pairs_per_block", [4, 35, 100])
def test_cpu_blocks_of_pairs_score_every_pair_once(monkeypatch, pairs_per_block):
    """The CPU default cuts the pairs into cache-sized blocks: a run of one image's sentences (4:
    ragged column blocks), one image's all (35), or two images' (100: a ragged last row block)."""
    monkeypatch.setattr(two_branch_model, "CPU_PAIRS_PER_BLOCK", pairs_per_block)
    torch.manual_seed(0)
    model = two_branch_model.TwoBranchModel(8, 8, "mean_words", 8, 8, 8, True, 0.0, "last", (16, 8)).eval()
    image, text = torch.randn(7, 8), torch.randn(35, 8)
    with torch.no_grad():
        got = model.all_pair_scores(image, text)
        for i in range(7):
            for j in range(35):
                assert float(got[i, j]) == pytest.approx(float(model.fusion(image[i] * text[j])), abs=1e-5)


def test_embedding_evaluation_adds_sentence_to_sentence_recall(planted_shards):
    torch.manual_seed(0)
    recipe = _recipe(TwoBranchEmbedRecipe, planted_shards)
    model = recipe.build_model()
    recipe.initialize(model, None, JobShards(ShardSet.open(recipe.config.data.shards)))
    rng = random.Random(0)
    batch = recipe.collate_eval([recipe.eval_sample(r, rng) for r in _raw_samples(planted_shards, 7)])
    metrics = recipe.evaluate(model, [batch], torch.device("cpu"))
    s2s = metrics["sentence_to_sentence"]
    assert s2s["n_queries"] == 35 and 0 <= s2s["r1"] <= 100
    assert "s2s_r1" in recipe.headline(metrics)


def test_sentence_chance_is_the_expected_recall_of_a_random_ranking():
    counts = [2, 3, 1]  # m = 6 sentences; the image with 1 has no neighbour and is left out
    # image 0's 2 queries have 1 neighbour among the 5 others, image 1's 3 queries have 2
    assert sentence_chance(counts, 1) == pytest.approx(100 * (2 * (1 / 5) + 3 * (2 / 5)) / 5)
    # top 2 of 5: a query misses only if both picks are strangers
    miss = [math.comb(4, 2) / math.comb(5, 2)] * 2 + [math.comb(3, 2) / math.comb(5, 2)] * 3
    assert sentence_chance(counts, 2) == pytest.approx(100 * (1 - sum(miss) / 5))


def _raw_samples(shards, n):
    import webdataset as wds

    urls = ShardSet.open(shards).urls("test")
    for i, sample in enumerate(wds.tarfile_samples({"url": u} for u in urls)):
        if i == n:
            return
        yield {"__key__": sample["__key__"], "json": sample["json"], "regions.npy": sample["regions.npy"]}


@pytest.mark.parametrize("cls", [TwoBranchEmbedRecipe, TwoBranchSimRecipe])
def test_the_phrase_stage_trains_without_dropout_and_with_weight_decay(cls):
    """One job, both tasks, each with the paper's settings: retrieval keeps model.dropout and the
    job's weight decay (§5: dropout 0.5); phrases take model.phrase_dropout and
    model.phrase_weight_decay (§4.3: weight decay 0.005; §5.3: no dropout for phrases)."""
    config = load_config(cls.name, ["model.tasks=[retrieval,phrases]", "model.dropout=0.4", "train.weight_decay=0"])
    stages = dict(cls.stages(config))
    assert list(stages) == ["retrieval", "phrases"]
    assert (stages["retrieval"].model.dropout, stages["retrieval"].train.weight_decay) == (0.4, 0)
    assert (stages["phrases"].model.dropout, stages["phrases"].train.weight_decay) == (0.0, 0.005)
    mine = dict(cls.stages(load_config(cls.name, ["model.tasks=[phrases]", "model.phrase_dropout=0.25"])))
    assert mine["phrases"].model.dropout == 0.25
    assert dict(cls.stages(mine["phrases"]))["phrases"].model.dropout == 0.25  # a stage's own stages: itself


def test_the_similarity_network_takes_every_positive_proposal_the_embedding_network_one():
    """Algorithm 1: pair sampling (similarity) takes all positives, triplet sampling (embedding)
    one random positive per ground-truth pair and visit."""
    assert load_config("two_branch_sim", []).model.all_positives is True
    assert load_config("two_branch_embed", []).model.all_positives is False
