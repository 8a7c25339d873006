"""Region relationship reasoning, VSRN's GCN layer (Eq. 2-3; vldist/models/gcn.py)."""

import pytest
import torch

from vldist.models.gcn import RegionRelationReasoning


def _identity_bn(layer: RegionRelationReasoning) -> None:
    """Eval-mode BN with weight 1, bias 0, running mean 0, var 1: the residual is W_r(...) itself."""
    with torch.no_grad():
        layer.bn.weight.fill_(1.0)
        layer.bn.bias.zero_()
    layer.eval()


@pytest.mark.parametrize("products", ["folded", "direct"])
def test_rrr_layer_matches_the_paper_formula_written_out(products):
    torch.manual_seed(0)
    B, K, D = 2, 4, 3
    layer = RegionRelationReasoning(D, normalize="count", products=products)
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


# ---------------------------------------------------------------- folded products (issue 42, part 5)


def _layer_and_input(products: str, normalize: str, dtype=torch.float64, b=3, k=5, d=4):
    torch.manual_seed(0)
    layer = RegionRelationReasoning(d, normalize, kernel="torch", products=products).to(dtype)
    with torch.no_grad():  # BN off the identity it starts as, so the branch reaches the output
        layer.bn.weight.uniform_(0.5, 1.5)
        layer.bn.bias.normal_()
    v = torch.randn(b, k, d, dtype=dtype)
    mask = torch.ones(b, k, dtype=torch.bool)
    mask[1, 3:] = False  # one image with two padded regions
    v[~mask] = 0
    return layer, v, mask


def _output_and_gradients(products: str, normalize: str, use_mask: bool, dtype=torch.float64):
    layer, v, mask = _layer_and_input(products, normalize, dtype)
    v.requires_grad_()
    out = layer(v, mask if use_mask else None)
    weights = torch.randn(out.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    (out * weights).sum().backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    return out.detach(), {**grads, "input": v.grad}, layer.bn.running_mean.clone()


@pytest.mark.parametrize("normalize", ["count", "softmax"])
@pytest.mark.parametrize("use_mask", [False, True])
def test_folded_products_compute_the_same_layer_and_gradients(normalize, use_mask):
    """In float64 the folded and direct products agree to rounding: the output, the running
    statistics and the gradient of every parameter and of the input."""
    out_f, grads_f, running_f = _output_and_gradients("folded", normalize, use_mask)
    out_d, grads_d, running_d = _output_and_gradients("direct", normalize, use_mask)
    torch.testing.assert_close(out_f, out_d, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(running_f, running_d, rtol=1e-10, atol=1e-10)
    assert grads_f.keys() == grads_d.keys()
    for name in grads_d:
        # w_r's bias feeds a batch norm, which takes the mean out: its gradient is zero up to rounding
        torch.testing.assert_close(grads_f[name], grads_d[name], rtol=1e-9, atol=1e-10, msg=name)


def test_folded_products_in_float32_within_a_stated_tolerance():
    out_f, grads_f, _ = _output_and_gradients("folded", "count", True, torch.float32)
    out_d, grads_d, _ = _output_and_gradients("direct", "count", True, torch.float32)
    torch.testing.assert_close(out_f, out_d, rtol=1e-5, atol=1e-5)
    for name in grads_d:
        if name != "w_r.bias":  # zero up to rounding (above)
            scale = grads_d[name].abs().max().item()
            torch.testing.assert_close(grads_f[name], grads_d[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


def _gemm_multiply_adds(layer, v) -> int:
    """Multiply-adds of the layer's matrix products over the region rows and the weights (mm,
    addmm), forward and backward, as torch's FLOP counter sees them."""
    from torch.utils.flop_counter import FlopCounterMode

    v = v.detach().requires_grad_()
    with FlopCounterMode(display=False) as counter:
        layer(v).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    return sum(n for op, n in counts.items() if str(op).split(".")[1] in ("mm", "addmm")) // 2


def test_folded_products_take_the_multiply_adds_counted_by_hand():
    """Direct: theta_phi_g (rows x D -> 3D) and W_r (D -> D), each forward, input and weight
    gradient: 12 rows D^2. Folded: V A and (R'V) M over the rows, A and M of D^3 each, all three
    ways: 6 rows D^2 + 6 D^3 (the bias terms are matrix-vector products, not counted here)."""
    b, k, d = 4, 9, 8
    rows = b * k
    for products, expected in (("direct", 12 * rows * d * d), ("folded", 6 * rows * d * d + 6 * d**3)):
        layer, v, _ = _layer_and_input(products, "count", torch.float32, b, k, d)
        assert _gemm_multiply_adds(layer, v) == expected, products


def test_auto_folds_only_where_it_saves_and_the_weights_are_whole():
    layer = RegionRelationReasoning(8, kernel="torch")
    assert layer.folds(torch.randn(2, 5, 8))  # 10 rows > 8 channels
    assert not layer.folds(torch.randn(1, 8, 8))  # 8 rows: no fewer multiply-adds
    assert not layer.folds(torch.randn(2, 5, 8, dtype=torch.float64))  # fp32 only under auto
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not layer.folds(torch.randn(2, 5, 8))
    compiled = torch.compile(lambda v: layer.folds(v), backend="eager", fullgraph=True)
    assert not compiled(torch.randn(2, 5, 8))  # no batch-size guard under torch.compile
    assert not RegionRelationReasoning(8, kernel="triton").folds(torch.randn(2, 5, 8))  # the kernel takes theta, phi, g
    assert RegionRelationReasoning(8, products="folded").folds(torch.randn(1, 2, 8, dtype=torch.float64))
    assert not RegionRelationReasoning(8, products="direct").folds(torch.randn(2, 5, 8))
    sharded = RegionRelationReasoning(8, products="folded")
    sharded.theta_phi_g.weight.ds_id = 3  # as DeepSpeed marks a ZeRO-3 partitioned parameter
    assert not sharded.folds(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="products must be"):
        RegionRelationReasoning(8, products="fused")
