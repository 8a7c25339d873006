"""Contrastive-captioning loss shares and global negatives on this rank's slice of a fixed batch.

Run by tests/integration/test_cl_cross_rank.py under torchrun (2 gloo processes); every rank saves
its results to OUT_DIR/rank{r}.pt. The test computes the same quantities in one process on the
whole batch from the data below and compares.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from vldist.distributed.collectives import world
from vldist.losses import cross_rank_contrastive_captioning_loss
from vldist.losses.negatives import draw_negatives, gather_captions

T, K, NU = 8, 3, 0.7
TERMS = ("full", "positive", "negative")
# Where rank 1's positives start: 4 + 4, and 3 + 5 as in the last batch of an exact epoch.
SPLITS = {"even": 4, "uneven": 3}
# Several captions per image, ids that are not positions, one image split across the two ranks.
CAPTION_IMAGES = [7, 7, 3, 3, 3, 12, 5, 5]
LENGTHS = [2, 3, 4, 2, 3, 6, 5, 2]
SEED = 1234


def global_log_probs() -> dict[str, torch.Tensor]:
    """Sentence log-probabilities of the whole batch, target and reference close enough that G
    spans both signs."""
    g = torch.Generator().manual_seed(0)
    pos_reference = -5 - 20 * torch.rand(T, generator=g, dtype=torch.float64)
    neg_reference = -10 - 20 * torch.rand(K, T, generator=g, dtype=torch.float64)
    return {
        "pos_target": pos_reference + 3 * torch.randn(T, generator=g, dtype=torch.float64),
        "pos_reference": pos_reference,
        "neg_target": neg_reference + 3 * torch.randn(K, T, generator=g, dtype=torch.float64),
        "neg_reference": neg_reference,
    }


def global_captions() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens (T, max length) padded with 0, lengths, image ids)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.zeros(T, max(LENGTHS), dtype=torch.long)
    for t, n in enumerate(LENGTHS):
        tokens[t, :n] = torch.randint(1, 10, (n,), generator=g)
    return tokens, torch.tensor(LENGTHS), torch.tensor(CAPTION_IMAGES)


def my_columns(split: str, rank: int) -> slice:
    cut = SPLITS[split]
    return slice(0, cut) if rank == 0 else slice(cut, T)


def loss_shares(columns: slice) -> dict:
    """This rank's share and the gradients of its inputs, for each `terms`."""
    data = global_log_probs()
    out = {}
    for terms in TERMS:
        pos_target = data["pos_target"][columns].clone().requires_grad_()
        neg_target = data["neg_target"][:, columns].clone().requires_grad_()
        pos_reference, neg_reference = data["pos_reference"][columns], data["neg_reference"][:, columns]
        share = cross_rank_contrastive_captioning_loss(
            pos_target, pos_reference, neg_target, neg_reference, nu=NU, terms=terms
        )
        share.backward()
        out[terms] = {
            "share": share.detach(),
            "pos_grad": pos_target.grad,
            "neg_grad": neg_target.grad,
            "reference_untouched": pos_reference.grad is None
            and neg_reference.grad is None
            and not pos_reference.requires_grad
            and not neg_reference.requires_grad,
        }
    return out


def negatives(columns: slice) -> dict:
    """The global captions as gathered, and two consecutive draws (two steps) from them."""
    tokens, lengths, image_ids = global_captions()
    mine_tokens = tokens[columns, : max(LENGTHS[columns])]  # padded to this rank's longest only
    all_tokens, all_lengths, all_ids, offset = gather_captions(mine_tokens, lengths[columns], image_ids[columns])
    generator = torch.Generator().manual_seed(SEED)
    draws = [draw_negatives(all_ids, K, generator) for _ in range(2)]
    return {"tokens": all_tokens, "lengths": all_lengths, "image_ids": all_ids, "offset": offset, "draws": draws}


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, size = world()
    assert size == 2, size
    result = {
        split: {"losses": loss_shares(my_columns(split, rank)), "negatives": negatives(my_columns(split, rank))}
        for split in SPLITS
    }
    torch.save(result, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()
