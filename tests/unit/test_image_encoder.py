"""VSRN's image encoder and its global semantic reasoning (Eq. 4-7; vldist/models/image_encoder.py)."""

import torch

from vldist.models.image_encoder import RegionReasoningEncoder


def test_global_reasoning_shapes_and_padding_is_ignored():
    torch.manual_seed(2)
    for mode in ("gru", "mean"):
        enc = RegionReasoningEncoder(region_dim=10, embed_size=6, rrr_layers=2, global_reasoning=mode).eval()
        regions = torch.randn(3, 5, 10)
        mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
        image, v_star = enc(regions, mask)
        assert image.shape == (3, 6) and v_star.shape == (3, 5, 6)
        assert torch.allclose(image.norm(dim=-1), torch.ones(3), atol=1e-5)
        assert torch.all(v_star[~mask] == 0)
        changed = regions.clone()
        changed[~mask] = 50 * torch.randn(int((~mask).sum()), 10)
        image2, _ = enc(changed, mask)
        assert torch.allclose(image, image2, atol=1e-5), mode


def test_gru_reasoning_is_the_last_memory_of_the_region_sequence():
    torch.manual_seed(3)
    enc = RegionReasoningEncoder(region_dim=4, embed_size=4, rrr_layers=0, global_reasoning="gru").eval()
    regions = torch.randn(1, 3, 4)
    image, v_star = enc(regions, torch.ones(1, 3, dtype=torch.bool))
    _, h = enc.gru(v_star)
    assert torch.allclose(image[0], h[-1, 0] / h[-1, 0].norm(), atol=1e-6)
    # order matters for the GRU (the paper's region-order ablation), not for mean pooling
    flipped, _ = enc(regions.flip(1), torch.ones(1, 3, dtype=torch.bool))
    assert not torch.allclose(image, flipped, atol=1e-4)
