"""The VSE hinge's share of this rank's rows on 4 gloo ranks, negatives gathered among blocks of
`size` consecutive ranks (train.negatives_group_size); rank 0 saves every rank's share and the
gradients of its rows.

Run by tests/integration/test_negatives_groups.py under torchrun --nproc_per_node 4:

    python negatives_groups.py OUT_FILE SIZE
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vldist.distributed.collectives import gather_objects, set_negatives_group_size
from vldist.errors import ConfigError
from vldist.losses import cross_rank_vse_hinge_loss

B, D = 8, 6  # 2 rows a rank


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    image = F.normalize(torch.randn(B, D, generator=g, dtype=torch.float64), dim=1)
    text = F.normalize(image + 0.8 * torch.randn(B, D, generator=g, dtype=torch.float64), dim=1)
    return image, text


def main(out: str, size: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        set_negatives_group_size(3)
        refused = None
    except ConfigError as err:  # 3 does not divide 4: refused on every rank, before any collective
        refused = str(err)
    set_negatives_group_size(size)
    image, text = global_batch()
    rows = slice(rank * B // world, (rank + 1) * B // world)
    img, txt = image[rows].clone().requires_grad_(), text[rows].clone().requires_grad_()
    share = cross_rank_vse_hinge_loss(img, txt, 0.2, True, identity=torch.arange(B)[rows])
    share.backward()
    everything = gather_objects({"share": share.item(), "image": img.grad, "text": txt.grad, "refused": refused})
    if rank == 0:
        torch.save(everything, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
