"""Region relationship reasoning (Eq. 2-3) and global semantic reasoning (Eq. 4-7) of VSRN."""

import torch

from vldist.kernels import region_affinity_torch
from vldist.models.gcn import RegionRelationReasoning
from vldist.models.image_encoder import RegionReasoningEncoder


def _identity_bn(layer: RegionRelationReasoning) -> None:
    """Eval-mode BN with weight 1, bias 0, running mean 0, var 1: the residual is W_r(...) itself."""
    with torch.no_grad():
        layer.bn.weight.fill_(1.0)
        layer.bn.bias.zero_()
    layer.eval()


def test_rrr_layer_matches_the_paper_formula_written_out():
    torch.manual_seed(0)
    B, K, D = 2, 4, 3
    layer = RegionRelationReasoning(D, normalize="count")
    _identity_bn(layer)
    v = torch.randn(B, K, D)
    out = layer(v)

    def lin(m, x, rows=None):  # y = W x + b, one vector at a time (rows: a slice of W's outputs)
        rows = rows or range(D)
        return [sum(m.weight[o, i].item() * x[i] for i in range(D)) + m.bias[o].item() for o in rows]

    # theta, phi, g are the three D-row blocks of the fused projection
    theta_rows, phi_rows, g_rows = range(0, D), range(D, 2 * D), range(2 * D, 3 * D)
    for b in range(B):
        vs = [v[b, k].tolist() for k in range(K)]
        th = [lin(layer.theta_phi_g, x, theta_rows) for x in vs]
        ph = [lin(layer.theta_phi_g, x, phi_rows) for x in vs]
        gg = [lin(layer.theta_phi_g, x, g_rows) for x in vs]
        for i in range(K):
            # R(v_i, v_j) = phi(v_i)^T psi(v_j), row-normalised by the number of regions (official code)
            r = [sum(th[i][d] * ph[j][d] for d in range(D)) / K for j in range(K)]
            y = [sum(r[j] * gg[j][d] for j in range(K)) for d in range(D)]
            expected = [a + c for a, c in zip(lin(layer.w_r, y), vs[i])]  # V* = W_r(R V W_g) + V
            assert torch.allclose(out[b, i], torch.tensor(expected), atol=1e-5)


def test_rrr_starts_as_identity_because_bn_is_zero_initialised():
    layer = RegionRelationReasoning(8)
    v = torch.randn(3, 5, 8)
    assert torch.equal(layer(v), v)


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
