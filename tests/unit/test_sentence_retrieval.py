"""Sentence-to-sentence recall (two-branch networks, Table 4) against a brute-force sort per query."""

import tracemalloc

import numpy as np
import pytest
import torch

import vldist.metrics.sentence_retrieval as sentence_retrieval
from vldist.metrics.sentence_retrieval import sentence_to_sentence_recall


def bruteforce(sims, sentence_images, ks):
    """Sort the other sentences best first, other-image ones before same-image ones at equal score
    (ties against the query); the rank is the position of the first same-image sentence."""
    rows = [[float(v) for v in row] for row in np.asarray(sims)]
    images = [int(i) for i in sentence_images]
    m = len(images)
    ranks, without = [], 0
    for i in range(m):
        others = [j for j in range(m) if j != i]
        if not any(images[j] == images[i] for j in others):
            without += 1
            continue
        order = sorted(others, key=lambda j: (-rows[i][j], images[j] == images[i]))
        ranks.append(next(pos for pos, j in enumerate(order, 1) if images[j] == images[i]))
    n = len(ranks)
    out = {f"r{k}": 100.0 * sum(r <= k for r in ranks) / n for k in ks}
    s = sorted(ranks)
    out["median_rank"] = float(s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2)
    out["n_queries"] = n
    out["n_without_neighbour"] = without
    return out


def random_case(n_images, seed, counts=(1, 2, 5)):
    """Images with 1, 2 or 5 sentences (arbitrary, non-contiguous ids), shuffled; weakly informative
    embeddings, dot products rounded to one decimal so that ties are frequent."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(np.arange(-(10**9), 10**9, 7919), size=n_images, replace=False)
    per_image = rng.choice(counts, size=n_images)
    sentence_images = rng.permutation(np.repeat(ids, per_image))
    centres = {i: rng.normal(size=8) for i in ids}
    emb = np.stack([centres[i] for i in sentence_images]) * 0.6 + rng.normal(size=(len(sentence_images), 8))
    return np.round(emb @ emb.T / 4, 1), sentence_images


def check(sims, sentence_images, ks=(1, 5, 10)):
    got = sentence_to_sentence_recall(sims, sentence_images, ks)
    expected = bruteforce(sims, sentence_images, ks)
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-9), key
    assert type(got["n_queries"]) is int and type(got["n_without_neighbour"]) is int
    assert all(type(got[f"r{k}"]) is float for k in ks) and type(got["median_rank"]) is float
    return got


@pytest.mark.parametrize("n_images,seed", [(30, 0), (30, 1), (110, 2)])  # 110 images: ~300 rows > 1 chunk
def test_random_matches_bruteforce(n_images, seed):
    sims, sentence_images = random_case(n_images, seed)
    got = check(sims, sentence_images, ks=(1, 2, 5, 10, 1000))
    assert 0 < got["r1"] < got["r10"] < 100 and got["r1000"] == 100.0  # not a degenerate check
    assert got["n_without_neighbour"] > 0
    assert got["n_queries"] + got["n_without_neighbour"] == len(sentence_images)


def test_small_chunks_give_the_same_result(monkeypatch):
    sims, sentence_images = random_case(20, 3)
    ref = sentence_to_sentence_recall(sims, sentence_images)
    monkeypatch.setattr(sentence_retrieval, "_CHUNK", 7)  # many chunk boundaries
    assert sentence_to_sentence_recall(sims, sentence_images) == ref


def test_self_is_excluded_whatever_the_diagonal_holds():
    sims, sentence_images = random_case(25, 4)
    ref = check(sims, sentence_images)
    for diagonal in (np.inf, -np.inf, np.nan, 1e9):
        s = sims.copy()
        np.fill_diagonal(s, diagonal)
        assert sentence_to_sentence_recall(s, sentence_images) == ref
    # A +inf diagonal (a sentence's distance 0 to itself) must not rank anything ahead of itself.
    s = np.zeros((4, 4))
    np.fill_diagonal(s, np.inf)
    s[0, 1] = s[1, 0] = s[2, 3] = s[3, 2] = 1.0
    got = sentence_to_sentence_recall(s, [5, 5, 9, 9], ks=(1,))
    assert got == {"r1": 100.0, "median_rank": 1.0, "n_queries": 4, "n_without_neighbour": 0}


def test_ties_count_against_the_query():
    images = [0, 0, 1, 2, 2]
    s = np.full((5, 5), -1.0)
    s[0, 1], s[0, 2] = 0.5, 0.5  # sentence 0: its neighbour ties a sentence of image 1 -> rank 2
    s[3, 4], s[3, 0], s[3, 1] = 0.2, 0.2, 0.9  # sentence 3: one above, one tied -> rank 3
    got = check(s, images, ks=(1, 2, 3))
    # Query ranks: 0 -> 2; 1 -> 4 (all three others tie at -1); 3 -> 3; 4 -> 4; image 1 has no neighbour.
    assert got == {"r1": 0.0, "r2": 25.0, "r3": 50.0, "median_rank": 3.0, "n_queries": 4, "n_without_neighbour": 1}
    # Same-image sentences tied with the best do not count against it.
    s = np.full((4, 4), 0.0)
    s[0, 1] = s[0, 2] = 0.7  # both neighbours of sentence 0 tied at the top
    assert check(s, [3, 3, 3, 4], ks=(1,))["r1"] == pytest.approx(100 / 3)


def test_minus_infinity_and_torch_inputs():
    sims, sentence_images = random_case(15, 5)
    sims[2, :] = -np.inf  # all tied: sentence 2's neighbours rank behind every other sentence
    ref = check(sims, sentence_images)
    t = torch.from_numpy(sims)
    assert sentence_to_sentence_recall(t, torch.from_numpy(sentence_images)) == ref
    assert sentence_to_sentence_recall(t.float(), sentence_images.tolist()) == ref
    bf16 = t.bfloat16()
    assert sentence_to_sentence_recall(bf16, sentence_images) == check(bf16.double().numpy(), sentence_images)
    assert np.array_equal(t.numpy(), sims)  # the input is not written to (the diagonal trick)


def test_memory_stays_at_a_few_chunks():
    # 2000 sentences: a float64 copy of the whole matrix would be 32 MB; a chunk is 4 MB.
    m = 2000
    rng = np.random.default_rng(6)
    sims = rng.random((m, m), dtype=np.float32)
    sentence_images = np.arange(m) // 4
    tracemalloc.start()
    try:
        sentence_to_sentence_recall(sims, sentence_images)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 0.5 * m * m * 8


# --- validation ---


@pytest.mark.parametrize(
    "sims,images,match",
    [
        (np.zeros((3, 4)), [0, 0, 1], r"square \(M x M\)"),
        (np.zeros(3), [0, 0, 1], r"square \(M x M\)"),
        (np.zeros((0, 0)), [], r"M >= 1"),
        (np.zeros((3, 3)), [0, 0], r"one image id per sentence \(sims.shape\[0\] = 3\), got shape \(2,\)"),
        (np.zeros((3, 3)), [[0, 0, 1]], r"1-D"),
        (np.zeros((3, 3)), [0.0, 0.0, 1.0], r"integer image ids"),
        (np.zeros((3, 3)), [True, True, False], r"integer image ids"),
        (np.array([[0, 1, np.nan], [0, 0, 0], [0, 0, 0]]), [0, 0, 1], r"sims\[0, 2\] is NaN"),
        (np.zeros((3, 3)), [0, 1, 2], r"none of the 3 sentences shares its image"),
    ],
)
def test_bad_inputs_say_what_is_wrong(sims, images, match):
    with pytest.raises(ValueError, match=match):
        sentence_to_sentence_recall(sims, images)


def test_bad_ks():
    for ks in [(0,), (), (2.0,), (True,)]:
        with pytest.raises(ValueError, match="ks"):
            sentence_to_sentence_recall(np.zeros((2, 2)), [0, 0], ks)
