"""L2C's encoder (Sec. 2.1-2.2), pixels in: trunk -> mask -> semantic pooling -> relation GCN.

    F   = trunk(I)                            (B, D, h, w), output stride 8
    B   = [sigmoid(mask_head(F)) > t]         the model's own object mask (detached)
    C   = SemanticPooling(F)                  (B, K, h, w)
    V   = semantic_pool(F, B, C)              Eq. 1, K nodes
    V^o = GCN(Linear(V))                      Eq. 3 affinity (W_i v_i)^T (W_j v_j): VSRN's layer

The comparison V^o_1 − V^o_2 and the decoders are the recipe's (vldist/recipes/l2c.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from vldist.models.gcn import RegionRelationReasoning
from vldist.models.semantic_pooling import SemanticPooling, masked_average_pool, semantic_pool

TRUNKS = ("small", "resnet50", "resnet101", "fcn_resnet50", "fcn_resnet101")
VOC_BIRD = 3  # torchvision's FCN weights are trained on the 20 Pascal VOC classes + background


def _conv_bn_relu(cin: int, cout: int, stride: int) -> nn.Sequential:
    conv = nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)  # BN follows: no bias
    return nn.Sequential(conv, nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class SmallTrunk(nn.Module):
    """A CPU-sized CNN with output stride 8 (128 px -> 16x16 maps) for the synthetic images."""

    def __init__(self, out_dim: int = 256):
        super().__init__()
        self.out_dim = out_dim
        self.net = nn.Sequential(
            _conv_bn_relu(3, 32, 2), _conv_bn_relu(32, 64, 2), _conv_bn_relu(64, 128, 2), _conv_bn_relu(128, out_dim, 1)
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)


class TorchvisionTrunk(nn.Module):
    """torchvision's ResNet in the FCN layout: layers 3 and 4 dilated instead of strided, so the
    output stride is 8 with 2048 channels (the paper's FCN ResNet-101 backbone).

    weights: a torchvision weights enum name ("IMAGENET1K_V2": downloads unless cached), a path to
    a local state dict of the torchvision model (its `fc.*` entries are ignored), or None (random).
    Submodules keep torchvision's names, so a torchvision state dict loads without renaming.
    """

    out_dim = 2048

    def __init__(self, name: str = "resnet101", weights: str | None = None):
        super().__init__()
        if name not in ("resnet50", "resnet101"):
            raise ValueError(f"TorchvisionTrunk: unknown ResNet {name!r}; choose resnet50 or resnet101")
        local = weights is not None and Path(weights).is_file()
        import torchvision  # here, not at the top: it loads torch._dynamo and sympy (~0.9 s), which --help need not pay

        resnet = getattr(torchvision.models, name)(
            weights=None if local else weights, replace_stride_with_dilation=[False, True, True]
        )
        self.conv1, self.bn1, self.relu, self.maxpool = resnet.conv1, resnet.bn1, resnet.relu, resnet.maxpool
        self.layer1, self.layer2, self.layer3, self.layer4 = resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4
        if local:
            self._load_local(weights)

    def _load_local(self, path: str) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        # the classifier is not part of the trunk; everything else must match
        self.load_state_dict({k: v for k, v in state.items() if not k.startswith("fc.")}, strict=True)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(images))))
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))


class FCNTrunk(nn.Module):
    """torchvision's FCN, the paper's pretrained segmentation network: its dilated ResNet backbone
    gives F (2048 channels, output stride 8) and its FCN head the mask, as the log-odds of one class
    (`mask_class`, Pascal VOC's bird by default) against the others, so sigmoid(mask_logits) is that
    class's softmax probability.

    weights: a torchvision weights enum name ("COCO_WITH_VOC_LABELS_V1": downloads unless cached),
    a path to a local state dict of the torchvision model (its auxiliary head is ignored), or None
    (random). The ImageNet backbone weights are never fetched on their own.
    """

    out_dim = 2048

    def __init__(self, name: str = "fcn_resnet101", weights: str | None = None, mask_class: int = VOC_BIRD):
        super().__init__()
        local = weights is not None and Path(weights).is_file()
        import torchvision  # here, not at the top: it loads torch._dynamo and sympy (~0.9 s), which --help need not pay

        builder = getattr(torchvision.models.segmentation, name)
        if weights is None or local:
            fcn = builder(weights=None, weights_backbone=None, num_classes=21, aux_loss=False)
        else:
            fcn = builder(weights=weights, weights_backbone=None)
        self.backbone, self.classifier, self.mask_class = fcn.backbone, fcn.classifier, mask_class
        if local:
            state = torch.load(weights, map_location="cpu", weights_only=True)
            self.load_state_dict({k: v for k, v in state.items() if not k.startswith("aux_classifier.")}, strict=True)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.backbone(images)["out"]

    def mask_logits(self, features: torch.Tensor) -> torch.Tensor:
        scores = self.classifier(features)
        others = torch.cat([scores[:, : self.mask_class], scores[:, self.mask_class + 1 :]], dim=1)
        return (scores[:, self.mask_class] - others.logsumexp(dim=1))[:, None]


def build_trunk(name: str, weights: str | None, mask_class: int = VOC_BIRD) -> tuple[nn.Module, int]:
    """(trunk, channel count) for a trunk name in TRUNKS. The FCN trunks bring their own mask
    (`mask_logits`); the others get a learned one from L2CEncoder."""
    if name == "small":
        trunk = SmallTrunk()
        if weights is not None:  # no published weights exist for it: only a local file makes sense
            if not Path(weights).is_file():
                raise ValueError(f"trunk 'small' takes a local state-dict file as weights, not {weights!r}")
            trunk.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        return trunk, trunk.out_dim
    if name in ("resnet50", "resnet101"):
        return TorchvisionTrunk(name, weights), TorchvisionTrunk.out_dim
    if name in ("fcn_resnet50", "fcn_resnet101"):
        return FCNTrunk(name, weights, mask_class), FCNTrunk.out_dim
    raise ValueError(f"unknown trunk {name!r}; choose one of {', '.join(TRUNKS)}")


class L2CEncoder(nn.Module):
    """Images (B, 3, H, W), already normalised -> dict with
    nodes (B, K, graph_dim), confidence (B, K, h, w) or None, mask_logits (B, 1, h, w) and
    mask (B, 1, h, w), the mask the pooling used. K = classes, or 1 with pooling="average".
    """

    def __init__(
        self,
        trunk: str = "small",
        trunk_weights: str | None = None,
        pooling: str = "semantic",
        classes: int = 9,
        graph_dim: int = 512,
        gcn_layers: int = 2,
        affinity_norm: str = "softmax",
        normalize_pool: bool = False,
        mask_threshold: float | None = 0.5,
        gcn_kernel: str = "auto",
        mask_class: int = VOC_BIRD,
        gcn_products: str = "auto",
    ):
        super().__init__()
        if pooling not in ("semantic", "average"):
            raise ValueError(f"pooling must be 'semantic' or 'average', not {pooling!r}")
        self.trunk, dim = build_trunk(trunk, trunk_weights, mask_class)
        # an FCN trunk's own segmentation is the mask (the paper's); other trunks learn one
        self.mask_head = getattr(self.trunk, "mask_logits", None) or nn.Conv2d(dim, 1, kernel_size=1)
        self.pooling = SemanticPooling(dim, classes) if pooling == "semantic" else None
        self.normalize_pool, self.mask_threshold = normalize_pool, mask_threshold
        self.project = nn.Linear(dim, graph_dim)
        # each layer starts as the identity (zero-initialised BN), so 2 layers cost nothing at step 0
        self.gcn = nn.ModuleList(
            RegionRelationReasoning(graph_dim, affinity_norm, gcn_kernel, gcn_products) for _ in range(gcn_layers)
        )

    def _pooling_mask(self, mask_logits: torch.Tensor) -> torch.Tensor:
        # Detached on purpose: the paper's mask comes from a separately trained FCN, so the captioning
        # losses must not teach the mask head; it learns from its own BCE only.
        probs = torch.sigmoid(mask_logits).detach()
        return probs if self.mask_threshold is None else (probs > self.mask_threshold).to(probs.dtype)

    def forward(self, images: torch.Tensor) -> dict:
        features = self.trunk(images)
        mask_logits = self.mask_head(features)
        mask = self._pooling_mask(mask_logits)
        if self.pooling is not None:
            confidence = self.pooling(features)
            nodes = semantic_pool(features, mask, confidence, self.normalize_pool)
        else:
            confidence, nodes = None, masked_average_pool(features, mask)
        nodes = self.project(nodes)
        for layer in self.gcn:
            nodes = layer(nodes)
        return {"nodes": nodes, "confidence": confidence, "mask_logits": mask_logits, "mask": mask}
