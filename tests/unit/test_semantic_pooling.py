"""L2C's semantic pooling (Eq. 1), its average-pooling ablation and the pooling module."""

import torch

from vldist.models.semantic_pooling import SemanticPooling, masked_average_pool, semantic_pool


def _loop_semantic_pool(features, mask, confidence, normalize):
    """v_k = Σ_{i,j} F ⊙ B ⊙ C_k written out one number at a time (mask as (B, H, W))."""
    B, D, H, W = features.shape
    K = confidence.shape[1]
    out = torch.zeros(B, K, D)
    for b in range(B):
        for k in range(K):
            weight = 0.0
            for i in range(H):
                for j in range(W):
                    w = mask[b, i, j].item() * confidence[b, k, i, j].item()
                    weight += w
                    for d in range(D):
                        out[b, k, d] += features[b, d, i, j].item() * w
            if normalize:
                out[b, k] /= max(weight, 1e-6)
    return out


def _random_inputs(seed, B=2, D=3, K=4, H=5, W=6):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(B, D, H, W, generator=g)
    mask = torch.rand(B, H, W, generator=g)
    confidence = torch.rand(B, K, H, W, generator=g).softmax(dim=1)
    return features, mask, confidence


def test_semantic_pool_is_eq1_for_both_mask_shapes_with_and_without_normalisation():
    features, mask, confidence = _random_inputs(0)
    for normalize in (False, True):
        expected = _loop_semantic_pool(features, mask, confidence, normalize)
        for shaped in (mask, mask[:, None]):
            assert torch.allclose(semantic_pool(features, shaped, confidence, normalize), expected, atol=1e-5)


def test_binary_mask_keeps_only_the_pixels_inside_it():
    features, mask, confidence = _random_inputs(1)
    binary = (mask > 0.5).float()
    expected = _loop_semantic_pool(features, binary, confidence, False)
    assert torch.allclose(semantic_pool(features, binary, confidence), expected, atol=1e-5)
    assert torch.all(semantic_pool(features, torch.zeros_like(mask), confidence, normalize=True) == 0)


def test_masked_average_pool_is_the_mean_over_the_mask_as_one_node():
    features, mask, _ = _random_inputs(2)
    B, D, H, W = features.shape
    for shaped in (mask, mask[:, None]):
        out = masked_average_pool(features, shaped)
        assert out.shape == (B, 1, D)
        for b in range(B):
            total = sum(mask[b, i, j].item() for i in range(H) for j in range(W))
            for d in range(D):
                s = sum(features[b, d, i, j].item() * mask[b, i, j].item() for i in range(H) for j in range(W))
                assert abs(out[b, 0, d].item() - s / total) < 1e-5


def test_pooling_module_gives_a_distribution_over_k_at_each_pixel():
    torch.manual_seed(3)
    module = SemanticPooling(in_dim=6, classes=5, hidden=8)
    confidence = module(torch.randn(2, 6, 7, 9))
    assert confidence.shape == (2, 5, 7, 9)
    assert torch.all(confidence >= 0)
    assert torch.allclose(confidence.sum(dim=1), torch.ones(2, 7, 9), atol=1e-6)


def test_gradient_reaches_the_features_and_the_confidence_maps():
    features, mask, confidence = _random_inputs(4)
    features.requires_grad_(True)
    confidence.requires_grad_(True)
    semantic_pool(features, mask, confidence).pow(2).sum().backward()
    assert features.grad is not None and features.grad.abs().sum() > 0
    assert confidence.grad is not None and confidence.grad.abs().sum() > 0
