"""R-precision and AIMCoS (LAViTeR's evaluation) against brute-force Python loops."""

import importlib
import math
from collections import Counter

import numpy as np
import pytest
import torch

from vldist.metrics import aimcos, r_precision
from vldist.metrics.r_precision import _pools


def cos(a, b):
    return sum(x * y for x, y in zip(a, b, strict=True)) / (
        math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    )


def bruteforce(image, text, pools, k):
    """Per image, sort its pool (a collection of caption indices, own one included) best cosine
    first, distractors before the own caption at equal cosine (ties against the query); a hit
    when the own caption is among the first k."""
    image = [[float(v) for v in row] for row in np.asarray(image, dtype=np.float64)]
    text = [[float(v) for v in row] for row in np.asarray(text, dtype=np.float64)]
    hits = 0
    for i, pool in enumerate(pools):
        pool = [int(j) for j in pool]
        assert pool.count(i) == 1
        order = sorted(pool, key=lambda j: (-cos(image[i], text[j]), j == i))
        hits += order.index(i) < k
    return 100.0 * hits / len(pools)


def random_case(n, d, seed, duplicates=0, noise=1.5):
    """Weakly matched image/caption vectors; `duplicates` captions are exact copies of other
    images' captions, so some pools hold exact ties with the own caption."""
    rng = np.random.default_rng(seed)
    image = rng.standard_normal((n, d))
    text = image + noise * rng.standard_normal((n, d))
    for _ in range(duplicates):
        i, j = rng.choice(n, size=2, replace=False)
        text[j] = text[i]
    return image, text


# --- pools ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,candidates", [(1, 1), (5, 1), (5, 2), (7, 7), (30, 10), (600, 100)])
def test_pools_hold_own_caption_once_and_distinct_others(n, candidates):
    pools = _pools(n, candidates, seed=3)
    assert pools.shape == (n, candidates) and pools.dtype == torch.int64
    for i, row in enumerate(pools.tolist()):
        assert row[0] == i and row.count(i) == 1
        others = row[1:]
        assert len(set(others)) == candidates - 1
        assert all(0 <= j < n and j != i for j in others)


def test_pools_with_all_candidates_are_every_caption():
    pools = _pools(9, 9, seed=0)
    assert all(sorted(row) == list(range(9)) for row in pools.tolist())


def test_pools_are_deterministic_per_seed_and_differ_across_seeds():
    a, b = _pools(300, 20, seed=5), _pools(300, 20, seed=5)
    assert torch.equal(a, b)
    c = _pools(300, 20, seed=6)
    assert not torch.equal(a, c)
    # Not merely reordered: the distractor sets differ for most images.
    differ = sum(set(x[1:]) != set(y[1:]) for x, y in zip(a.tolist(), c.tolist(), strict=True))
    assert differ > 250


def test_pools_do_not_depend_on_the_global_rng():
    torch.manual_seed(0)
    a = _pools(50, 10, seed=1)
    torch.manual_seed(123)
    torch.rand(1000)
    assert torch.equal(a, _pools(50, 10, seed=1))


def test_pools_are_drawn_per_image_and_roughly_uniform():
    n, candidates, seeds = 10, 4, 300
    counts = Counter()
    for seed in range(seeds):
        for i, row in enumerate(_pools(n, candidates, seed).tolist()):
            counts.update((i, j) for j in row[1:])
    expected = seeds * (candidates - 1) / (n - 1)  # 100 per (image, other image) pair
    assert set(counts) == {(i, j) for i in range(n) for j in range(n) if i != j}
    assert all(0.6 * expected < c < 1.4 * expected for c in counts.values())
    # Different images get different distractor sets (not one shared draw).
    rows = _pools(n, candidates, 0).tolist()
    assert len({frozenset(r) for r in rows}) > 1


# --- r_precision against brute force --------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [1, 3])
def test_all_candidates_equals_bruteforce_over_every_caption(seed, k):
    # candidates = N: every caption is in every pool, whatever the draw.
    image, text = random_case(40, 6, seed, duplicates=6)
    expected = bruteforce(image, text, [range(40)] * 40, k)
    assert r_precision(image, text, candidates=40, seed=seed, k=k) == pytest.approx(expected)


@pytest.mark.parametrize("n,candidates,k", [(60, 10, 1), (60, 10, 3), (200, 100, 1), (300, 7, 2)])
def test_fewer_candidates_equals_bruteforce_over_exposed_pools(n, candidates, k):
    image, text = random_case(n, 5, seed=n + k, duplicates=n // 4, noise=2.5)
    for seed in (0, 9):
        pools = _pools(n, candidates, seed).tolist()
        expected = bruteforce(image, text, pools, k)
        out = r_precision(image, text, candidates=candidates, seed=seed, k=k)
        assert out == pytest.approx(expected)


def test_result_is_a_python_float_percent():
    image, text = random_case(20, 4, 0)
    out = r_precision(image, text, candidates=10)
    assert type(out) is float and 0.0 <= out <= 100.0


def test_perfect_and_chance_free_cases():
    eye = np.eye(8)
    assert r_precision(eye, eye, candidates=8) == 100.0
    # Every image's own caption is orthogonal to it, every other caption is aligned with it.
    assert r_precision(eye, np.ones((8, 8)) - eye, candidates=8) == 0.0


# --- ties -----------------------------------------------------------------------------------------


def test_tie_with_one_distractor_counts_against_the_query():
    image = np.eye(4)
    text = np.eye(4)
    text[1] = text[0]  # caption 1 is a copy of caption 0
    # Image 0: own caption tied with distractor 1 -> rank 2. Image 1: its caption (e0) is
    # orthogonal to it, like all three distractors -> four-way tie at 0 -> rank 4 (last).
    # Images 2, 3: rank 1.
    assert r_precision(image, text, candidates=4, k=1) == 50.0
    assert r_precision(image, text, candidates=4, k=2) == 75.0
    assert r_precision(image, text, candidates=4, k=3) == 75.0
    assert r_precision(image, text, candidates=4, k=4) == 100.0


def test_tie_below_does_not_matter_and_scale_does_not_matter():
    # x 0.5 / x 4 scalings (exact in binary) leave the cosines, ties included, unchanged.
    image = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    text = np.array([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0]])
    # cos(image 0, captions) = [.707, .707, -.707]: tied with distractor 1 -> rank 2.
    # Image 1: [.707, -.707, .707]: both distractors above -> rank 3.
    # Image 2: [-.707, -.707, .707]: the two distractors tie with each other, below -> rank 1.
    for scale_i, scale_t in ((1.0, 1.0), (4.0, 0.5)):
        args = (scale_i * image, scale_t * text)
        assert r_precision(*args, candidates=3, k=1) == pytest.approx(100 / 3)
        assert r_precision(*args, candidates=3, k=2) == pytest.approx(200 / 3)
        assert r_precision(*args, candidates=3, k=3) == 100.0


def test_constant_captions_score_zero_not_hundred():
    rng = np.random.default_rng(0)
    image = rng.standard_normal((30, 5))
    text = np.tile(rng.standard_normal(5), (30, 1))
    assert r_precision(image, text, candidates=10, k=1) == 0.0
    assert r_precision(image, text, candidates=10, k=9) == 0.0
    assert r_precision(image, text, candidates=10, k=10) == 100.0  # rank = pool size


def test_k_is_monotone_and_k_equal_to_candidates_is_hundred():
    image, text = random_case(200, 8, seed=4, noise=3.0)
    r1, r3, r10 = (r_precision(image, text, candidates=10, k=k) for k in (1, 3, 10))
    assert r1 <= r3 <= r10 == 100.0
    assert r1 < r3  # noisy enough that some own captions rank 2nd or 3rd


def test_candidates_one_is_trivially_hundred():
    image, text = random_case(5, 3, 0)
    assert r_precision(image, text, candidates=1) == 100.0


# --- seeds, inputs --------------------------------------------------------------------------------


def test_seed_determinism_and_different_seeds_differ():
    image, text = random_case(400, 6, seed=1, noise=2.5)
    a = r_precision(image, text, candidates=20, seed=11)
    assert a == r_precision(image, text, candidates=20, seed=11)
    assert a == r_precision(image, text, candidates=20, seed=np.int64(11))
    values = {r_precision(image, text, candidates=20, seed=s) for s in range(6)}
    assert len(values) > 1  # the pools, hence the score, change with the seed


def test_torch_numpy_and_dtype_agree():
    image, text = random_case(100, 8, seed=2, noise=2.0)
    ref = r_precision(image, text, candidates=30, seed=3)
    assert r_precision(torch.from_numpy(image), torch.from_numpy(text), 30, 3) == ref
    # float32 rounding does not move any generic (tie-free) comparison.
    image32, text32 = torch.from_numpy(image).float(), torch.from_numpy(text).float()
    assert r_precision(image32, text32, 30, 3) == ref
    assert r_precision(image.tolist(), text.tolist(), candidates=30, seed=3) == ref


def test_coco_sized_input_runs():
    g = torch.Generator().manual_seed(0)
    image = torch.randn(5000, 64, generator=g)
    text = image + 2.0 * torch.randn(5000, 64, generator=g)
    r1 = r_precision(image, text)
    assert 0.0 < r1 <= r_precision(image, text, k=3) <= 100.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"candidates": 11}, r"candidates=11.*only 10 images.*fewer candidates"),
        ({"candidates": 0}, "candidates must be a positive int"),
        ({"candidates": 5.0}, "candidates must be a positive int"),
        ({"candidates": True}, "candidates must be a positive int"),
        ({"candidates": 5, "k": 0}, r"k must be an int in 1\.\.candidates = 1\.\.5, got 0"),
        ({"candidates": 5, "k": 6}, r"k must be an int in 1\.\.candidates = 1\.\.5, got 6"),
        ({"candidates": 5, "k": 1.0}, "k must be an int"),
        ({"candidates": 5, "seed": 0.5}, "seed must be an int"),
        ({"candidates": 5, "seed": 2**64}, "seed must be an int"),
    ],
)
def test_r_precision_argument_errors(kwargs, match):
    image, text = random_case(10, 3, 0)
    with pytest.raises(ValueError, match=match):
        r_precision(image, text, **kwargs)


def test_r_precision_input_errors():
    image, text = random_case(10, 3, 0)
    with pytest.raises(ValueError, match="image and text must both be"):
        r_precision(image, text[:9], candidates=5)
    with pytest.raises(ValueError, match="image and text must both be"):
        r_precision(image, text[:, :2], candidates=5)
    with pytest.raises(ValueError, match="must be 2-D"):
        r_precision(image[0], text[0], candidates=1)
    bad = text.copy()
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        r_precision(image, bad, candidates=5)
    bad = text.copy()
    bad[4] = 0.0
    with pytest.raises(ValueError, match=r"text\[4\] is a zero vector"):
        r_precision(image, bad, candidates=5)


# --- AIMCoS ---------------------------------------------------------------------------------------


def aimcos_bruteforce(image, attributes, owners):
    image = np.asarray(image, dtype=np.float64).tolist()
    attributes = np.asarray(attributes, dtype=np.float64).tolist()
    owners = [int(o) for o in owners]
    per_image = []
    for n, v in enumerate(image):
        mine = [cos(v, attributes[m]) for m in range(len(owners)) if owners[m] == n]
        if mine:
            per_image.append(sum(mine) / len(mine))
    return sum(per_image) / len(per_image)


def test_aimcos_hand_example_weighs_images_not_attributes():
    image = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    attributes = np.array([[2.0, 0.0], [0.0, 3.0], [0.0, -1.0]])
    owners = [0, 0, 1]  # image 0: cos 1 and 0 -> 0.5; image 1: cos -1; image 2: no attributes
    assert aimcos(image, attributes, owners) == pytest.approx((0.5 - 1.0) / 2)
    # Not the flat mean over attribute texts (0.0), and image 2 is not counted as a zero.
    assert aimcos(image, attributes, owners) != pytest.approx(0.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aimcos_equals_double_loop_with_uneven_counts(seed):
    rng = np.random.default_rng(seed)
    n, d = 25, 7
    image = rng.standard_normal((n, d))
    counts = rng.integers(0, 6, size=n)  # some images without attributes, uneven counts
    counts[0] = 0
    owners = np.repeat(np.arange(n), counts)
    rng.shuffle(owners)  # any order
    attributes = 0.5 * image[owners] + rng.standard_normal((owners.size, d))
    out = aimcos(torch.from_numpy(image).float(), torch.from_numpy(attributes).float(), torch.from_numpy(owners))
    assert type(out) is float
    expected = aimcos_bruteforce(image, attributes, owners)
    assert out == pytest.approx(expected, abs=1e-6)  # float32 inputs
    assert aimcos(image, attributes, owners) == pytest.approx(expected, abs=1e-12)


def test_aimcos_chunks_over_many_attributes(monkeypatch):
    # importlib, not `import vldist.metrics.r_precision as mod`: the package attribute of that
    # name is the function (re-exported by vldist.metrics), which shadows the submodule.
    mod = importlib.import_module("vldist.metrics.r_precision")
    rng = np.random.default_rng(5)
    image = rng.standard_normal((12, 4))
    owners = rng.integers(0, 10, size=50)  # images 10, 11 have none
    attributes = rng.standard_normal((50, 4))
    expected = aimcos_bruteforce(image, attributes, owners)
    monkeypatch.setattr(mod, "_ATTR_CHUNK", 7)
    assert aimcos(image, attributes, owners) == pytest.approx(expected, abs=1e-12)


def test_aimcos_errors():
    image = np.eye(3)
    attributes = np.ones((4, 3))
    with pytest.raises(ValueError, match=r"owners\[2\] = 3 is out of range.*0\.\.2 for 3 images"):
        aimcos(image, attributes, [0, 1, 3, 0])
    with pytest.raises(ValueError, match=r"owners\[0\] = -1 is out of range"):
        aimcos(image, attributes, torch.tensor([-1, 0, 0, 0]))
    with pytest.raises(ValueError, match="no image has an attribute text"):
        aimcos(image, np.zeros((0, 3)), [])
    with pytest.raises(ValueError, match="no image has an attribute text"):
        aimcos(image, torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="same width D"):
        aimcos(image, np.ones((4, 2)), [0, 0, 1, 1])
    with pytest.raises(ValueError, match="one image index per attribute text"):
        aimcos(image, attributes, [0, 1, 2])
    with pytest.raises(ValueError, match="one image index per attribute text"):
        aimcos(image, attributes, [[0, 1], [2, 0]])
    with pytest.raises(ValueError, match="integer image indices"):
        aimcos(image, attributes, [0.0, 1.0, 2.0, 0.0])
    with pytest.raises(ValueError, match="integer image indices"):
        aimcos(image, attributes, [True, False, True, False])
    with pytest.raises(ValueError, match=r"attributes\[1\] is a zero vector"):
        aimcos(image, np.array([[1.0, 0, 0], [0, 0, 0]]), [0, 1])
