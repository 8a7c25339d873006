"""Region features from a real CNN path: a ResNet trunk and roi_align over pixel boxes.

Each region gives one row of `channels x grid x grid` values: roi_align over the box on the
feature map of the chosen ResNet stage, pooled to a grid x grid layout and flattened.

Defaults (layer2, 2x2 grid: 512 x 4 = 2048 values, like bottom-up features) are chosen for the
seeded-random trunk that is all we have without downloadable weights. Measured with a linear probe
on synth objects (96 px inputs): random layer4 + mean pooling encodes an object's colour at 37%
and shape at 21% accuracy (chance 13% / 18%); random layer2 with a 2x2 grid at 99% and 86%. Deep
random stages wash the image out; shallow ones keep it. With ImageNet weights use the bottom-up
style layer="layer4", grid=1 (2048 channels, mean pooled).
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import torch
import torchvision
from PIL import Image
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval
from torchvision.ops import roi_align

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
STAGES = ("layer1", "layer2", "layer3", "layer4")
MIN_INPUT = 32
# Each output bin averages 2x2 roi_align bins of 2x2 samples, so small boxes are still sampled
# densely.
ROI_SUBBINS = 2
ROI_SAMPLING = 2
# Random-init stages (eval mode, BatchNorm at identity statistics) give activations far larger
# than ImageNet weights do (around 0.5). Dividing by a FIXED constant per stage puts them on a
# similar scale, so a recipe's defaults behave alike with both, and far inside float16's range.
# Pretrained weights are not rescaled.
RANDOM_INIT_SCALE = {"layer1": 1.0, "layer2": 1 / 4, "layer3": 1 / 8, "layer4": 1 / 32}
FLOAT16_LIMIT = 60000.0  # clip below float16's maximum (65504) so no value becomes inf


def fold_batchnorm(module: nn.Module) -> nn.Module:
    """Fold each eval-mode BatchNorm2d into the Conv2d just before it (same maths, one pass fewer
    over the activations: about 15% faster on CPU). In a ResNet every BN directly follows its conv
    among its parent's children (conv1, bn1, conv2, bn2...; downsample = [conv, bn])."""
    for child in module.children():
        fold_batchnorm(child)
    names = [name for name, _ in module.named_children()]
    for prev, name in pairwise(names):
        conv, bn = getattr(module, prev), getattr(module, name)
        if isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d):
            setattr(module, prev, fuse_conv_bn_eval(conv, bn))
            setattr(module, name, nn.Identity())
    return module


class RegionFeatureExtractor:
    """Turns images and their region boxes (pixel [x0, y0, x1, y1]) into float16 feature rows."""

    def __init__(
        self,
        backbone: str = "resnet50",
        weights: str | None = None,
        input_size: int = 96,
        seed: int = 0,
        device: str = "cpu",
        layer: str = "layer2",
        grid: int = 2,
    ):
        if input_size < MIN_INPUT:
            raise ValueError(f"input_size must be at least {MIN_INPUT} pixels, got {input_size}")
        if layer not in STAGES:
            raise ValueError(f"layer must be one of {', '.join(STAGES)}, not {layer!r}")
        if grid < 1:
            raise ValueError(f"grid must be at least 1, got {grid}")
        builder = getattr(torchvision.models, backbone, None)
        if builder is None or not backbone.startswith(("resnet", "resnext", "wide_resnet")):
            raise ValueError(f"backbone {backbone!r} is not a torchvision ResNet; try resnet50 or resnet101")
        torch.manual_seed(seed)  # random-init weights are reproducible from the seed
        try:
            # layer4 dilated instead of strided (stride 16, as Faster R-CNN's C4 head) when used
            model = builder(weights=weights, replace_stride_with_dilation=[False, False, layer == "layer4"])
        except Exception as err:  # unknown name, or no network to download the weights
            raise RuntimeError(
                f"cannot build {backbone} with weights={weights!r}: {err}. Use weights=None (seeded "
                "random) or a torchvision weight name such as IMAGENET1K_V2 on a machine that can download it."
            ) from err
        self.device = torch.device(device)
        stages = [model.conv1, model.bn1, model.relu, model.maxpool]
        stages += [getattr(model, name) for name in STAGES[: STAGES.index(layer) + 1]]
        self.trunk = fold_batchnorm(nn.Sequential(*stages).eval())
        self.trunk = self.trunk.to(self.device, memory_format=torch.channels_last)
        with torch.inference_mode():
            channels = self.trunk(torch.zeros(1, 3, MIN_INPUT, MIN_INPUT, device=self.device)).shape[1]
        self.layer, self.grid = layer, grid
        self.dim = channels * grid * grid
        self.input_size = input_size
        self.scale = 1.0 if weights else RANDOM_INIT_SCALE[layer]
        self.standardized = False  # see calibrate()
        self._shift = self._scale = None
        self._mean = torch.tensor(IMAGENET_MEAN, device=self.device).view(1, 3, 1, 1)
        self._std = torch.tensor(IMAGENET_STD, device=self.device).view(1, 3, 1, 1)

    def _batch(self, images: list[Image.Image]) -> torch.Tensor:
        size = (self.input_size, self.input_size)
        arrays = [np.asarray(im.convert("RGB").resize(size, Image.BILINEAR)) for im in images]
        x = torch.from_numpy(np.stack(arrays)).to(self.device).permute(0, 3, 1, 2).float().div_(255)
        return ((x - self._mean) / self._std).contiguous(memory_format=torch.channels_last)

    def _rois(self, images: list[Image.Image], boxes: list[list], fh: int, fw: int) -> torch.Tensor:
        """(K, 5) rows [batch index, x0, y0, x1, y1] in feature-map coordinates: each image is
        resized to a square input, so x and y scale separately (roi_align then uses scale 1)."""
        rows = []
        for i, (im, image_boxes) in enumerate(zip(images, boxes, strict=True)):
            sx, sy = fw / im.width, fh / im.height
            for x0, y0, x1, y1 in image_boxes:
                rows.append([i, x0 * sx, y0 * sy, x1 * sx, y1 * sy])
        return torch.tensor(rows, dtype=torch.float32, device=self.device).reshape(-1, 5)

    def _pooled(self, images: list[Image.Image], boxes: list[list]) -> torch.Tensor:
        """(total boxes, dim) float32 region rows, before any rescaling."""
        if len(images) != len(boxes):
            raise ValueError(f"got {len(images)} images but {len(boxes)} box lists")
        with torch.inference_mode():
            fmap = self.trunk(self._batch(images))
            rois = self._rois(images, boxes, fmap.shape[2], fmap.shape[3])
            pooled = roi_align(
                fmap,
                rois,
                output_size=self.grid * ROI_SUBBINS,
                spatial_scale=1.0,
                sampling_ratio=ROI_SAMPLING,
                aligned=True,
            )
            return nn.functional.avg_pool2d(pooled, ROI_SUBBINS).flatten(1).float()  # (R, C * grid * grid)

    def calibrate(self, images: list[Image.Image], boxes: list[list]) -> None:
        """Standardise every feature dimension with the mean and spread of these regions.

        Raw ReLU features of a random trunk share one dominant direction (the norm of their mean
        is 99% of their norm), so after VSRN's l2norm all images look alike and retrieval barely
        learns. Standardising with statistics of a fixed calibration set, like the ImageNet
        mean/std of the input, removes it: the same demo reaches R@1 ~20-28% instead of ~1%.
        """
        rows = self._pooled(images, boxes)
        self.set_standardization(rows.mean(dim=0), 1.0 / rows.std(dim=0).clamp(min=1e-3))

    def standardization(self) -> tuple[np.ndarray, np.ndarray]:
        """(shift, scale) per dimension, as set by calibrate(): to hand to another process."""
        if not self.standardized:
            raise RuntimeError("calibrate() has not run")
        return self._shift.cpu().numpy(), self._scale.cpu().numpy()

    def set_standardization(self, shift, scale) -> None:
        self._shift = torch.as_tensor(shift, dtype=torch.float32, device=self.device)
        self._scale = torch.as_tensor(scale, dtype=torch.float32, device=self.device)
        self.standardized = True

    def extract(self, images: list[Image.Image], boxes: list[list]) -> list[np.ndarray]:
        """One float16 array of shape (len(boxes[i]), dim) per image, rows in the order of boxes[i]."""
        if not images:
            return []
        feats = self._pooled(images, boxes)
        feats = (feats - self._shift) * self._scale if self.standardized else feats * self.scale
        feats = feats.clamp_(-FLOAT16_LIMIT, FLOAT16_LIMIT).to(torch.float16).cpu().numpy()
        if not np.isfinite(feats).all():
            raise FloatingPointError("region features are not finite; check the backbone weights")
        out, start = [], 0
        for image_boxes in boxes:
            out.append(feats[start : start + len(image_boxes)])
            start += len(image_boxes)
        return out
