"""Each cross-batch objective on this rank's rows of a fixed global batch that holds one image
twice, with the copies on two ranks ("split") or both on one ("same_rank").

Run by tests/integration/test_duplicate_negatives_ranks.py under torchrun (2 gloo processes; rank 0
saves every objective's global loss and the gradient of every row) and in-process (1 process on the
whole batch): the two must agree, and equal the test's loops that leave the copy out.

    python duplicate_negatives.py OUT_FILE
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vldist.distributed.collectives import all_gather_rows, global_sum, world
from vldist.losses import cross_rank_damsm_parts, cross_rank_two_branch_ranking_loss, cross_rank_vse_hinge_loss
from vldist.losses.negatives import draw_negatives, gather_captions, step_generator
from vldist.losses.not_negative import local_identities

B, D, T, R = 8, 6, 5, 3
# Image identities: rows 1 and 5 are one image (rank 0 holds rows 0-3, rank 1 rows 4-7), or rows 1 and 2
PLACEMENTS = {"split": [0, 1, 2, 3, 4, 1, 6, 7], "same_rank": [0, 1, 1, 3, 4, 5, 6, 7]}
LENGTHS = torch.tensor([3, 5, 2, 4, 1, 5, 3, 2])


def global_inputs(placement: str) -> dict:
    """Embeddings of the whole batch (float64); a copy has its image's vectors, not its caption's."""
    identity = torch.tensor(PLACEMENTS[placement])
    first = [PLACEMENTS[placement].index(v) for v in PLACEMENTS[placement]]
    g = torch.Generator().manual_seed(0)

    def images(*shape):
        # a copy is the same image, seen slightly differently (augmentation, dropout): no exact
        # ties, whose hardest negative either copy could be
        same = torch.randn(B, *shape, generator=g, dtype=torch.float64)[first]
        return same + 1e-3 * torch.randn(B, *shape, generator=g, dtype=torch.float64)

    image = F.normalize(images(D), dim=1)
    return {
        "identity": identity,
        "image": image,
        "text": F.normalize(image + 0.8 * torch.randn(B, D, generator=g, dtype=torch.float64), dim=1),
        "sentences": F.normalize(
            image.repeat_interleave(2, 0) + 0.7 * torch.randn(2 * B, D, generator=g, dtype=torch.float64), dim=1
        ),
        "words": torch.randn(B, T, D, generator=g, dtype=torch.float64),
        "regions": images(R, D),
        "sentence": torch.randn(B, D, generator=g, dtype=torch.float64),
        "global_image": images(D),
    }


def share(objective: str, inputs: dict, rank: int, size: int) -> tuple[torch.Tensor, dict]:
    """This rank's share of `objective` and the leaf tensors of its rows, by name."""
    rows = slice(rank * B // size, (rank + 1) * B // size)
    identity = inputs["identity"][rows]
    if objective in ("hinge", "hinge_sum"):
        leaves = {k: inputs[k][rows].clone().requires_grad_() for k in ("image", "text")}
        loss = cross_rank_vse_hinge_loss(leaves["image"], leaves["text"], 0.2, objective == "hinge", identity=identity)
    elif objective == "two_branch":
        leaves = {
            "image": inputs["image"][rows].clone().requires_grad_(),
            "sentences": inputs["sentences"][2 * rows.start : 2 * rows.stop].clone().requires_grad_(),
        }
        text_image = torch.arange(rows.stop - rows.start).repeat_interleave(2)
        loss = cross_rank_two_branch_ranking_loss(
            leaves["image"], leaves["sentences"], text_image, 0.1, 3, 1.0, 2.0, 0.2, identity=identity
        )
    elif objective.startswith("damsm_"):
        leaves = {k: inputs[k][rows].clone().requires_grad_() for k in ("words", "regions", "sentence", "global_image")}
        parts = cross_rank_damsm_parts(
            leaves["words"],
            LENGTHS[rows],
            leaves["regions"],
            leaves["sentence"],
            leaves["global_image"],
            identity=identity,
        )
        loss = parts[objective[len("damsm_") :]]
    else:
        raise ValueError(objective)
    return loss, leaves


OBJECTIVES = [
    "hinge",
    "hinge_sum",
    "two_branch",
    "damsm_words_t2i",
    "damsm_words_i2t",
    "damsm_sentence_t2i",
    "damsm_sentence_i2t",
]


def drawn_negatives(inputs: dict, rank: int, size: int) -> torch.Tensor:
    """CL's and the similarity network's draw, two captions an image: (K, 2B) global caption rows,
    this rank's columns gathered back into the global order."""
    rows = slice(rank * B // size, (rank + 1) * B // size)
    n = rows.stop - rows.start
    caption_images = torch.arange(n).repeat_interleave(2)
    ids = local_identities(inputs["identity"][rows], n, torch.device("cpu"))[caption_images]
    tokens = torch.arange(2 * n)[:, None] + 2 * rows.start  # each caption's global row as its "token"
    _, _, all_ids, offset = gather_captions(tokens, torch.ones(2 * n, dtype=torch.long), ids)
    draw = draw_negatives(all_ids, 50, step_generator(0, 3))[:, offset : offset + 2 * n]
    return all_gather_rows(draw.T.contiguous())[0].T


def run(rank: int, size: int) -> dict:
    results = {}
    for placement in PLACEMENTS:
        inputs = global_inputs(placement)
        for objective in OBJECTIVES:
            loss, leaves = share(objective, inputs, rank, size)
            loss.backward()
            results[placement, objective] = {
                "loss": float(global_sum(loss.detach())),
                "grads": {
                    k: all_gather_rows(torch.zeros_like(v) if v.grad is None else v.grad)[0] for k, v in leaves.items()
                },
            }
        results[placement, "draw"] = drawn_negatives(inputs, rank, size)
    return results


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = world()
    results = run(rank, size)
    if rank == 0:
        torch.save(results, sys.argv[1])
    dist.destroy_process_group()
