"""Contrastive captioning across 2 real gloo ranks equals one process on the whole batch.

One torchrun launch; each rank holds half the positives (4 + 4, and 3 + 5) with their K x T_local
negatives. The shares must sum to the one-process loss and each rank's gradients must be the
slices of the one-process gradients (a rank dividing by its local T instead of the global one is
off by 2x or more). The captions gathered across ranks, and the negatives drawn from them on each
rank, must equal those of one process holding every caption.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import cl_cross_rank_step as worker  # noqa: E402
from helpers import run_on_two_ranks  # noqa: E402

from vldist.losses import contrastive_captioning_loss  # noqa: E402
from vldist.losses.negatives import draw_negatives  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("cl_cross_rank")
    run_on_two_ranks(Path(worker.__file__), out, timeout=120)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def one_process(terms: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    data = worker.global_log_probs()
    pos_target = data["pos_target"].clone().requires_grad_()
    neg_target = data["neg_target"].clone().requires_grad_()
    loss = contrastive_captioning_loss(
        pos_target, data["pos_reference"], neg_target, data["neg_reference"], nu=worker.NU, terms=terms
    )
    loss.backward()
    return loss.detach(), pos_target.grad, neg_target.grad


def same_gradient(got, expected) -> bool:
    """Equal, or both absent (the excluded term of CL(P) / CL(N) leaves its input out of the graph)."""
    if got is None or expected is None:
        return got is None and expected is None
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-15)
    return True


@pytest.mark.parametrize("terms", worker.TERMS)
@pytest.mark.parametrize("split", list(worker.SPLITS))
def test_shares_sum_to_the_one_process_loss_and_gradients_are_its_slices(ranks, split, terms):
    loss, pos_grad, neg_grad = one_process(terms)
    assert (pos_grad is None) == (terms == "negative") and (neg_grad is None) == (terms == "positive")
    shares = [r[split]["losses"][terms] for r in ranks]
    assert abs(float(loss)) > 0.1
    torch.testing.assert_close(shares[0]["share"] + shares[1]["share"], loss, rtol=1e-12, atol=1e-12)
    for rank, share in enumerate(shares):
        columns = worker.my_columns(split, rank)
        assert same_gradient(share["pos_grad"], None if pos_grad is None else pos_grad[columns])
        assert same_gradient(share["neg_grad"], None if neg_grad is None else neg_grad[:, columns])
        assert share["reference_untouched"]


@pytest.mark.parametrize("split", list(worker.SPLITS))
def test_gathered_captions_and_their_negatives_match_one_process(ranks, split):
    tokens, lengths, image_ids = worker.global_captions()
    generator = torch.Generator().manual_seed(worker.SEED)
    draws = [draw_negatives(image_ids, worker.K, generator) for _ in range(2)]
    assert not torch.equal(draws[0], draws[1])  # re-drawn every step
    for rank, result in enumerate(ranks):
        got = result[split]["negatives"]
        assert got["offset"] == worker.my_columns(split, rank).start
        assert torch.equal(got["tokens"], tokens)  # each rank padded to its own width; gathered to the global one
        assert torch.equal(got["lengths"], lengths) and torch.equal(got["image_ids"], image_ids)
        for got_draw, draw in zip(got["draws"], draws, strict=True):
            assert torch.equal(got_draw, draw)
