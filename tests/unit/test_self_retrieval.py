"""Self-retrieval recall (Dai & Lin 2017, §4.1) against a brute-force count in python loops."""

import numpy as np
import pytest
import torch

from vldist.metrics import self_retrieval_recall


def bruteforce(logp, ks):
    """Caption i's rank: 1 + the images j != i scoring at least as high as its own image i."""
    rows = [list(map(float, row)) for row in logp]
    n = len(rows)
    ranks = []
    for i in range(n):
        ahead = 0
        for j in range(n):
            if j != i and rows[i][j] >= rows[i][i]:
                ahead += 1
        ranks.append(1 + ahead)
    out = {}
    for k in ks:
        hits = 0
        for rank in ranks:
            if rank <= k:
                hits += 1
        out[f"r{k}"] = 100.0 * hits / n
    out["n_images"] = n
    return out


def check(logp, ks=(1, 5, 50, 500)):
    got = self_retrieval_recall(logp, ks)
    expected = bruteforce(np.asarray(logp), ks)
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-9), key
    assert type(got["n_images"]) is int and all(type(got[f"r{k}"]) is float for k in ks)
    return got


@pytest.mark.parametrize("n", [1, 2, 7, 60, 300])  # 300 rows cross the 256-row chunk
def test_random_matrices(n):
    rng = np.random.default_rng(n)
    logp = -20 * rng.random((n, n))
    logp[np.arange(n), np.arange(n)] += 3 * rng.random(n)  # the own image tends to score higher
    got = check(logp, ks=(1, 5, 50, 500, 3))
    if n > 5:
        assert 0 < got["r1"] < got["r5"] < 100  # the check is not all 0 or all 100


@pytest.mark.parametrize("n", [5, 40, 280])
def test_deliberate_ties_count_against_the_query(n):
    rng = np.random.default_rng(100 + n)
    logp = rng.integers(-3, 0, size=(n, n)).astype(float)  # three values: ties everywhere
    logp[0, :] = -1.0
    logp[0, 3] = -0.5  # caption 0: one image above, every other image tied with its own -> rank n
    got = check(logp, ks=(1, 2, 5, 50, n - 1, n))
    assert got[f"r{n}"] == 100.0 and got[f"r{n - 1}"] < 100.0
    # a tie-blind ranking (own image first among equals) would score far higher
    optimistic = 100.0 * np.mean([(row > row[i]).sum() + 1 <= 1 for i, row in enumerate(logp)])
    assert got["r1"] < optimistic


def test_hand_computed_ranks():
    logp = np.array(
        [
            [-1.0, -2.0, -3.0],  # caption 0: image 0 first           -> rank 1
            [-1.0, -1.0, -5.0],  # caption 1: tied with image 0       -> rank 2
            [-4.0, -2.0, -3.0],
        ]
    )  # caption 2: image 1 above it        -> rank 2
    assert self_retrieval_recall(logp, ks=(1, 2, 3)) == {
        "r1": pytest.approx(100 / 3),
        "r2": 100.0,
        "r3": 100.0,
        "n_images": 3,
    }
    constant = np.full((4, 4), -2.0)  # a model that cannot tell images apart: every caption ranks last
    assert self_retrieval_recall(constant, ks=(1, 3, 4)) == {"r1": 0.0, "r3": 0.0, "r4": 100.0, "n_images": 4}


def test_k_above_n_is_capped_at_n():
    logp = -np.random.default_rng(0).random((7, 7))
    got = self_retrieval_recall(logp)  # the default ks (1, 5, 50, 500)
    assert set(got) == {"r1", "r5", "r50", "r500", "n_images"} and got["n_images"] == 7
    assert got["r50"] == got["r500"] == 100.0
    assert self_retrieval_recall(logp, ks=(7, 8))["r8"] == 100.0


def test_torch_input_and_minus_infinity():
    logp = torch.randn(9, 9, generator=torch.Generator().manual_seed(0))
    assert self_retrieval_recall(logp) == self_retrieval_recall(logp.numpy())
    assert self_retrieval_recall(logp.bfloat16())["n_images"] == 9
    logp[2, :] = float("-inf")  # a log-probability of 0 is legal; all tied -> caption 2 ranks last
    check(logp.numpy(), ks=(1, 8, 9))


@pytest.mark.parametrize("logp", [np.zeros((3, 4)), np.zeros(3), np.zeros((0, 0)), np.zeros((2, 2, 2))])
def test_non_square_input_is_a_clear_error(logp):
    with pytest.raises(ValueError, match="square"):
        self_retrieval_recall(logp)


def test_nan_and_bad_ks_are_clear_errors():
    with pytest.raises(ValueError, match="NaN"):
        self_retrieval_recall(np.array([[0.0, np.nan], [0.0, 0.0]]))
    for ks in [(0,), (1.5,), (), (True,)]:
        with pytest.raises(ValueError, match="ks"):
            self_retrieval_recall(np.zeros((2, 2)), ks)
