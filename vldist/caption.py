"""Caption your own images: `python -m vldist.caption <checkpoint or run dir> IMAGE... [--shards DIR]`.

Prints `path<TAB>caption`, one line per image, in the order given. A region-feature model's
features of each image are computed by the extractor its shard set was built with, standardised
with the statistics stored beside the set's manifest (vldist/shards/features/extractor_setup.py).
A model that reads pixels and describes pairs (L2C) takes IMAGE1 IMAGE2 [IMAGE1 IMAGE2 ...] and
prints `path1 path2<TAB>description`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from vldist.checkpoint.trained_model import load_checkpoint
from vldist.errors import CheckpointError, ConfigError
from vldist.exit_codes import DONE, REFUSED, REPORTED_ERRORS, exit_status
from vldist.recipes.capabilities import CaptionsPixels, CaptionsRegions

EPILOG = """\
Region features: computed on the CPU by the feature extractor recorded in the shard set's
manifest.json (backbone, stage, grid, input size, seed) and standardised with the statistics stored
beside it (feature_standardization.safetensors; recomputed for a synth set built before they were
stored). Region boxes: for a converted image set, the same G x G grid its converter used (the
manifest's region_grid), so an image of the set gets its stored features (to float16 rounding); for a synth set,
whose samples use the whole image plus up to 4 object boxes, a new image has no object boxes and
gets the whole image plus a 2x2 grid (5 regions).

Exit status: 0 when every image was captioned; 2 when an image cannot be read (each one is named on
stderr and the others are still captioned) or when the checkpoint, its shard set or the feature
extractor cannot be used (one line `error: ...`)."""


class CaptionError(Exception):
    """A problem this command reports as `error: ...` and exit status 2."""


def read_image(path: str):
    """The image at `path`, decoded in full and in RGB; CaptionError naming the file otherwise."""
    from PIL import Image, UnidentifiedImageError

    file = Path(path)
    if not file.exists():
        raise CaptionError(f"{path}: no such file")
    if file.is_dir():
        raise CaptionError(f"{path}: is a directory, not an image")
    try:
        with Image.open(file) as opened:
            return opened.convert("RGB")  # forces a full decode: a truncated file fails here
    except UnidentifiedImageError:
        raise CaptionError(f"{path}: not an image file (PIL cannot identify its format)") from None
    except Image.DecompressionBombError as err:
        raise CaptionError(f"{path}: too large to decode ({err})") from None
    except (OSError, ValueError, SyntaxError) as err:
        detail = " ".join(str(err).split())
        raise CaptionError(f"{path}: cannot be read or decoded ({type(err).__name__}: {detail})") from None


def caption_images(
    checkpoint, images: list, shards: str | None = None, device: str = "auto", beam_size: int | None = None
) -> list[str]:
    """One caption per PIL image, from a checkpoint or run directory. Raises CaptionError (and the
    checkpoint and shard-set errors of vldist.checkpoint.trained_model.load_checkpoint)."""
    from vldist.shards.features.extractor_setup import extractor_for

    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise CaptionError("--device cuda but no CUDA device is visible; use --device auto or cpu")
    config, recipe, model, shard_set = load_checkpoint(checkpoint, shards, device)
    if beam_size is not None:
        config.eval.beam_size = beam_size  # validated on assignment; recipe.config is this config
    if isinstance(recipe, CaptionsPixels):  # reads pixels, not region features (L2C)
        return recipe.caption_pixels(model, images, next(model.parameters()).device)
    if not isinstance(recipe, CaptionsRegions):
        raise CaptionError(
            f"recipe {config.recipe} does not generate captions; caption with a run of a "
            "captioning recipe (e.g. captioner)"
        )
    features = extractor_for(shard_set)
    # one image at a time: an image's features (and caption) do not depend on the others given
    regions = [features([image])[0] for image in images]
    return recipe.caption(model, regions, next(model.parameters()).device)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vldist.caption",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its best checkpoint)")
    parser.add_argument("images", nargs="+", metavar="IMAGE", help="image files to caption (JPEG, PNG, ...)")
    parser.add_argument(
        "--shards",
        help="shard directory whose feature extractor to use (default: the one the checkpoint was trained on)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the model generates (default auto); features are computed on the CPU",
    )
    parser.add_argument(
        "--beam-size",
        type=_positive,
        default=None,
        help="beam width of generation, 1 for greedy (default: the run's eval.beam_size)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    group = images_per_caption(args.checkpoint)  # L2C describes pairs: IMAGE1 IMAGE2 ...
    if len(args.images) % group:
        print(
            f"error: this run describes {group} images at a time (a pair: IMAGE1 IMAGE2 ...); "
            f"{len(args.images)} were given",
            file=sys.stderr,
        )
        return REFUSED
    groups, images, failed = [], [], False
    for start in range(0, len(args.images), group):
        paths, read = args.images[start : start + group], []
        for path in paths:
            try:
                read.append(read_image(path))
            except CaptionError as err:
                print(f"error: {err}", file=sys.stderr)
        if len(read) == len(paths):  # a pair with an unreadable image is left out whole
            groups.append(paths)
            images += read
        failed = failed or len(read) < len(paths)
    if not images:
        return REFUSED
    try:
        captions = caption_images(args.checkpoint, images, args.shards, args.device, args.beam_size)
    except CaptionError as err:
        print(f"error: {err}", file=sys.stderr)
        return REFUSED
    except REPORTED_ERRORS as err:
        code, message = exit_status(err)
        print(message, file=sys.stderr)
        return code
    for paths, caption in zip(groups, captions, strict=True):
        print(" ".join(paths) + f"\t{caption}")
    return REFUSED if failed else DONE


def images_per_caption(checkpoint) -> int:
    """How many images one caption of this run's recipe reads (2 for L2C's pairs, else 1). A
    checkpoint that cannot be read counts 1: loading it then says what is wrong."""
    from vldist.checkpoint.format import find_checkpoint, read_config
    from vldist.recipes import get_recipe

    try:
        recipe = get_recipe(read_config(find_checkpoint(checkpoint))["recipe"])
    except (CheckpointError, ConfigError, KeyError, ValueError, OSError):
        return 1
    return recipe.images_per_caption


if __name__ == "__main__":
    sys.exit(main())
