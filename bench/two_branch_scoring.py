"""The similarity network's retrieval cost: every image-sentence pair through the fusion layers.

    python bench/two_branch_scoring.py [--images 1000] [--sentences 5000] [--device cpu]

Times `TwoBranchModel.all_pair_scores` (each branch has run once) with its default blocks of pairs
(on CPU about CPU_PAIRS_PER_BLOCK pairs, one image at a time) and with 16 images x all sentences a
block (the earlier default, still the accelerator's) at the demo's sizes (embeddings 256, fusion 512-256-1) and the paper's
(embeddings 512, fusion 512-256-1), and the embedding network's dot products beside them.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vldist.models.two_branch import TwoBranchModel  # noqa: E402
from vldist.recipes.two_branch import FUSION_WIDTHS  # noqa: E402

SIZES = {"demo": 256, "paper": 512}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--sentences", type=int, default=5000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"{args.images} images x {args.sentences} sentences on {device} ({torch.get_num_threads()} threads)")
    for name, embed in SIZES.items():
        torch.manual_seed(0)
        model = TwoBranchModel(8, 8, "mean_words", 8, 8, embed, True, 0.0, "last", FUSION_WIDTHS).to(device).eval()
        images = torch.nn.functional.normalize(torch.randn(args.images, embed, device=device), dim=1)
        texts = torch.nn.functional.normalize(torch.randn(args.sentences, embed, device=device), dim=1)
        with torch.no_grad():
            for label, fn in (
                ("fusion", partial(model.all_pair_scores, images, texts)),
                ("fusion, 16 images a block", partial(model.all_pair_scores, images, texts, rows_at_once=16)),
                ("dot", partial(torch.matmul, images, texts.T)),
            ):
                fn()  # warm-up
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                print(f"  {name:<6} embed {embed}: {label:<26} {time.perf_counter() - start:8.2f} s")


if __name__ == "__main__":
    main()
