"""L2C's encoder: trunks, the model's own detached mask, pooling choices and the relation GCN."""

import pytest
import torch

from vldist.models.l2c import L2CEncoder, TorchvisionTrunk, build_trunk


def _images(n=2, side=128, seed=0):
    return torch.randn(n, 3, side, side, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("pooling,nodes", [("semantic", 5), ("average", 1)])
@pytest.mark.parametrize("gcn_layers", [0, 2])
def test_shapes_of_every_output(pooling, nodes, gcn_layers):
    torch.manual_seed(0)
    enc = L2CEncoder(pooling=pooling, classes=5, graph_dim=12, gcn_layers=gcn_layers)
    out = enc(_images())
    assert out["nodes"].shape == (2, nodes, 12)
    assert out["mask_logits"].shape == (2, 1, 16, 16) and out["mask"].shape == (2, 1, 16, 16)
    if pooling == "semantic":
        assert out["confidence"].shape == (2, 5, 16, 16)
    else:
        assert out["confidence"] is None
    assert len(enc.gcn) == gcn_layers


def test_the_mask_used_is_the_thresholded_prediction():
    torch.manual_seed(1)
    enc = L2CEncoder(classes=3, graph_dim=8, gcn_layers=0, mask_threshold=0.5)
    out = enc(_images())
    probs = torch.sigmoid(out["mask_logits"])
    assert torch.equal(out["mask"], (probs > 0.5).float())
    soft = L2CEncoder(classes=3, graph_dim=8, gcn_layers=0, mask_threshold=None)
    out = soft(_images())
    assert torch.allclose(out["mask"], torch.sigmoid(out["mask_logits"]))


def test_an_empty_predicted_mask_gives_zero_pooled_nodes():
    torch.manual_seed(2)
    enc = L2CEncoder(classes=4, graph_dim=8, gcn_layers=0, normalize_pool=False)
    with torch.no_grad():
        enc.mask_head.bias.fill_(-1e4)  # the model predicts "no object" everywhere
    pooled = {}
    enc.project.register_forward_hook(lambda module, args, output: pooled.update(v=args[0]))
    out = enc(_images())
    assert torch.all(out["mask"] == 0)
    assert torch.all(pooled["v"] == 0)  # Eq. 1 over an empty mask
    # so each node is the projection of zero: its bias
    assert torch.allclose(out["nodes"], enc.project.bias.expand_as(out["nodes"]))


@pytest.mark.parametrize("threshold", [0.5, None])
def test_no_gradient_reaches_the_mask_head_through_the_nodes(threshold):
    torch.manual_seed(3)
    enc = L2CEncoder(classes=3, graph_dim=8, gcn_layers=1, mask_threshold=threshold)
    out = enc(_images())
    assert not out["mask"].requires_grad
    out["nodes"].pow(2).sum().backward()
    assert enc.mask_head.weight.grad is None and enc.mask_head.bias.grad is None
    assert enc.project.weight.grad is not None  # while the rest of the encoder does learn


def test_build_trunk_rejects_an_unknown_name_and_lists_the_choices():
    with pytest.raises(ValueError, match="resnet101"):
        build_trunk("vgg16", None)


def test_small_trunk_is_stride_8():
    trunk, dim = build_trunk("small", None)
    assert trunk(_images(1)).shape == (1, dim, 16, 16)


def test_torchvision_trunk_is_the_fcn_layout_with_2048_channels_and_stride_8():
    torch.manual_seed(4)
    trunk, dim = build_trunk("resnet50", None)  # random init: nothing is downloaded
    assert isinstance(trunk, TorchvisionTrunk) and dim == 2048
    with torch.no_grad():
        assert trunk.eval()(_images(1, side=64)).shape == (1, 2048, 8, 8)


def test_torchvision_trunk_loads_a_local_torchvision_state_dict(tmp_path):
    import torchvision

    torch.manual_seed(5)
    reference = torchvision.models.resnet50(weights=None, replace_stride_with_dilation=[False, True, True])
    path = tmp_path / "resnet50.pth"
    torch.save(reference.state_dict(), path)
    trunk = TorchvisionTrunk("resnet50", str(path))
    assert torch.equal(trunk.layer4[0].conv2.weight, reference.layer4[0].conv2.weight)


def test_an_fcn_trunk_masks_with_its_own_segmentation_of_the_class(tmp_path):
    import torchvision

    torch.manual_seed(6)
    reference = torchvision.models.segmentation.fcn_resnet50(
        weights=None, weights_backbone=None, num_classes=21, aux_loss=True
    )
    path = tmp_path / "fcn.pth"
    torch.save(reference.state_dict(), path)  # a local file of the torchvision model, its aux head too
    encoder = L2CEncoder("fcn_resnet50", str(path), classes=3, graph_dim=16, mask_class=3).eval()
    assert torch.equal(encoder.trunk.classifier[0].weight, reference.classifier[0].weight)
    images = _images(2, side=64)
    with torch.no_grad():
        out = encoder(images)
        reference.eval()
        bird = reference.classifier(reference.backbone(images)["out"]).softmax(dim=1)[:, 3:4]  # VOC's bird
    assert out["mask_logits"].shape == (2, 1, 8, 8)
    assert torch.allclose(torch.sigmoid(out["mask_logits"]), bird, atol=1e-5)
    assert not isinstance(encoder.mask_head, torch.nn.Conv2d)  # no learned head beside the FCN's
