"""Region relationship reasoning, VSRN's GCN layer (Eq. 2-3; vldist/models/gcn.py)."""

import torch

from vldist.models.gcn import RegionRelationReasoning


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
            expected = [a + c for a, c in zip(lin(layer.w_r, y), vs[i], strict=True)]  # V* = W_r(R V W_g) + V
            assert torch.allclose(out[b, i], torch.tensor(expected), atol=1e-5)


def test_rrr_starts_as_identity_because_bn_is_zero_initialised():
    layer = RegionRelationReasoning(8)
    v = torch.randn(3, 5, 8)
    assert torch.equal(layer(v), v)
