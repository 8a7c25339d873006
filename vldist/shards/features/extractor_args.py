"""Command-line options of the CNN region-feature extractor, shared by `synth` and `convert`
(kept apart from extractor.py so that parsing arguments does not import torch)."""

from __future__ import annotations


def add_extractor_arguments(parser, input_size: int) -> None:
    parser.add_argument(
        "--feature-size",
        type=int,
        default=input_size,
        help=f"side the feature extractor resizes images to (default {input_size})",
    )
    parser.add_argument(
        "--layer",
        default="layer2",
        choices=["layer1", "layer2", "layer3", "layer4"],
        help="ResNet stage the region features come from (default layer2; with --weights use layer4)",
    )
    parser.add_argument(
        "--grid",
        type=int,
        default=2,
        help="roi_align grid side: a region row has channels x grid^2 values (default 2; with layer4 use 1)",
    )
    parser.add_argument(
        "--backbone", default="resnet50", help="torchvision ResNet for region features (default resnet50)"
    )
    parser.add_argument(
        "--weights",
        default=None,
        help="torchvision weight name, e.g. IMAGENET1K_V2 (needs a download); default: seeded random",
    )
