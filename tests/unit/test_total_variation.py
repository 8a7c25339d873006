"""L2C's total variation loss (Eq. 2) on confidence maps."""

import torch

from vldist.losses import total_variation_loss


def _loop_total_variation(maps):
    B, K, H, W = maps.shape
    total = 0.0
    for b in range(B):
        for k in range(K):
            for i in range(H):
                for j in range(W):
                    if i + 1 < H:
                        total += abs(maps[b, k, i + 1, j].item() - maps[b, k, i, j].item())
                    if j + 1 < W:
                        total += abs(maps[b, k, i, j + 1].item() - maps[b, k, i, j].item())
    return total / (B * K * H * W)


def test_matches_eq2_written_out():
    maps = torch.rand(2, 3, 4, 5, generator=torch.Generator().manual_seed(0))
    assert abs(total_variation_loss(maps).item() - _loop_total_variation(maps)) < 1e-6


def test_a_constant_map_has_no_variation():
    assert total_variation_loss(torch.full((2, 3, 4, 4), 0.7)).item() == 0.0


def test_a_vertical_step_edge_counts_one_per_row():
    B, K, H, W = 2, 3, 4, 6
    maps = torch.zeros(B, K, H, W)
    maps[..., W // 2 :] = 1.0  # a left/right step: one horizontal jump of 1 in each row, no vertical one
    expected = B * K * H / (B * K * H * W)
    assert abs(total_variation_loss(maps).item() - expected) < 1e-7
    assert abs(total_variation_loss(maps.transpose(2, 3)).item() - expected) < 1e-7  # and the top/bottom step


def test_gradient_flows_to_the_maps():
    maps = torch.rand(1, 2, 3, 3, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    total_variation_loss(maps).backward()
    assert maps.grad is not None and maps.grad.abs().sum() > 0


def test_the_plain_sum_is_eq2_over_the_whole_batch():
    maps = torch.rand(2, 3, 4, 5, generator=torch.Generator().manual_seed(1))
    assert abs(total_variation_loss(maps, "sum").item() - _loop_total_variation(maps) * maps.numel()) < 1e-4
