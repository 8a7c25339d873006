"""train.negatives_group_size: 4 real gloo ranks whose negatives come from blocks of 2 consecutive
ranks take, block by block, the loss and gradients of the VSE hinge of that block's rows alone;
with the whole job as the block (the default) they take the global batch's. Checked against the
hinge written loop by loop (tests/unit/test_duplicate_negatives.py)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import negatives_groups as worker  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_duplicate_negatives import hinge_without_copies  # noqa: E402

pytestmark = pytest.mark.slow
FOUR_RANKS = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4"]


@pytest.mark.parametrize("size", [2, 4])
def test_each_block_of_ranks_takes_the_loss_of_its_own_rows(tmp_path, size):
    out = tmp_path / "ranks.pt"
    proc = subprocess.run(
        [*FOUR_RANKS, worker.__file__, str(out), str(size)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", **__import__("os").environ},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = torch.load(out, weights_only=True)
    assert ranks[0]["refused"].startswith("train.negatives_group_size=3 must divide the 4 ranks")
    image, text = worker.global_batch()
    per_block = worker.B * size // 4
    for first in range(0, worker.B, per_block):
        rows = slice(first, first + per_block)
        img, txt = image[rows].clone().requires_grad_(), text[rows].clone().requires_grad_()
        ref = hinge_without_copies(img, txt, torch.arange(per_block), 0.2, True)
        ref.backward()
        block = ranks[first // 2 : (first + per_block) // 2]  # 2 rows a rank
        assert sum(r["share"] for r in block) == pytest.approx(ref.item(), rel=1e-12)
        assert torch.allclose(torch.cat([r["image"] for r in block]), img.grad, atol=1e-12)
        assert torch.allclose(torch.cat([r["text"] for r in block]), txt.grad, atol=1e-12)
