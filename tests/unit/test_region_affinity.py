"""The PyTorch reference of region affinity aggregation (vldist/kernels/region_affinity.py): its
normalisations and padded regions. The Triton kernel against it: test_region_affinity_kernel.py."""

import torch

from vldist.kernels import region_affinity_torch


def test_softmax_normalisation_rows_sum_to_one():
    theta, phi, g = torch.randn(3, 2, 5, 4).unbind(0)
    out = region_affinity_torch(theta, phi, g, "softmax")
    weights = (theta @ phi.transpose(1, 2)).softmax(-1)
    assert torch.allclose(out, weights @ g, atol=1e-6)
    ones = region_affinity_torch(theta, phi, torch.ones_like(g), "softmax")
    assert torch.allclose(ones, torch.ones_like(ones), atol=1e-6)


def test_padded_regions_neither_give_nor_receive_messages():
    torch.manual_seed(1)
    theta, phi, g = torch.randn(3, 2, 6, 4).unbind(0)
    mask = torch.tensor([[True] * 4 + [False] * 2, [True] * 6])
    for norm in ("count", "softmax"):
        out = region_affinity_torch(theta, phi, g, norm, mask)
        assert torch.all(out[0, 4:] == 0)  # padded rows receive nothing
        noisy = [t.clone() for t in (theta, phi, g)]
        for t in noisy:
            t[0, 4:] = 100 * torch.randn(2, 4)  # padded rows give nothing
        again = region_affinity_torch(*noisy, norm, mask)
        assert torch.allclose(out, again, atol=1e-5)
        # the valid part equals the unpadded computation
        alone = region_affinity_torch(theta[:1, :4], phi[:1, :4], g[:1, :4], norm)
        assert torch.allclose(out[0, :4], alone[0], atol=1e-5)


def test_count_normalisation_divides_by_valid_regions():
    theta, phi, g = torch.ones(1, 3, 2), torch.ones(1, 3, 2), torch.ones(1, 3, 2)
    mask = torch.tensor([[True, True, False]])
    out = region_affinity_torch(theta, phi, g, "count", mask)
    # affinity 2 with each of 2 valid regions, divided by 2, times g = 1 -> 2
    assert torch.allclose(out[0, :2], torch.full((2, 2), 2.0))
