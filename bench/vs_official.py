"""vldist's VSRN training step against the official VSRN code's (bench/official_vsrn.py), one process.

    python bench/vs_official.py --json docs/results/vs_official.json          # demo and paper sizes
    python bench/vs_official.py --sizes demo --steps 20
    python bench/vs_official.py --kernels                                     # F.linear vs 1x1 conv
    python bench/vs_official.py --from docs/results/vs_official.json          # the tables, no runs

Both models get the same batch every step: the same regions (all real, as the official code has
no padding), captions and lengths (sorted longest first, as the official loader does); the
official decoder's max_len is the batch's caption length, so both decode T - 1 steps. Sides:

- official: the port's VSRN.train_emb (forward, retrieval + caption loss, backward, clip, Adam);
- vldist: the recipe's model and loss as the trainer computes them (`recipe.training_losses`),
  backward, clip_grad_norm_ at train.grad_clip, the optimizer `build_optimizers` makes;
- vldist-linear (--linear-side): the same, with vldist.models.projection's convolution path off
  (every projection on F.linear, as before it), to show what the path changes;
- vldist-direct (--direct-side): the same, with the RRR layers' products taken one by one
  (`model.gcn_products=direct`), as before the folded products (vldist/models/gcn.py).

The sides run alternately (official, vldist[, vldist-linear], official, ...), each on its own
model; the first `--warmup` rounds are dropped. Per side: the median step time and its spread
(min-max); the ratio is official / vldist (above 1: vldist faster), as medians and per round.
`--kernels` times F.linear against the 1x1 convolution path on the step's projection shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.official_vsrn import OfficialVSRN  # noqa: E402
from vldist.models import projection  # noqa: E402

# jobs/vsrn.yaml's sizes, and the paper's (official train.py/opts.py: embed 2048, dim_hidden 512,
# word_dim 300; 36 bottom-up regions of 2,048). Vocabulary: the embedded shards' (86 words + 4).
SIZES = {
    "demo": {"batch": 128, "regions": 5, "region_dim": 2048, "embed": 256, "word_dim": 300, "decoder_hidden": 256},
    "paper": {"batch": 128, "regions": 36, "region_dim": 2048, "embed": 2048, "word_dim": 300, "decoder_hidden": 512},
}
VOCAB_WORDS = 86
WORDS_PER_CAPTION = (4, 19)  # the shards' captions: 4-24 words, mean 11.6; these: mean 11.5
DEFAULT_STEPS = {"demo": 30, "paper": 5}
DEFAULT_WARMUP = {"demo": 3, "paper": 1}


def make_batch(size: dict, seed: int = 0) -> dict:
    """Regions, and captions `<start> words <end>` padded with 0, sorted by length, longest first."""
    g = torch.Generator().manual_seed(seed)
    b, k = size["batch"], size["regions"]
    words = torch.randint(WORDS_PER_CAPTION[0], WORDS_PER_CAPTION[1] + 1, (b,), generator=g)
    lengths = (words + 2).sort(descending=True).values
    tokens = torch.zeros(b, int(lengths[0]), dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        tokens[i, 0], tokens[i, n - 1] = 1, 2
        tokens[i, 1 : n - 1] = torch.randint(4, VOCAB_WORDS + 4, (n - 2,), generator=g)
    return {
        "regions": torch.randn(b, k, size["region_dim"], generator=g),
        "mask": torch.ones(b, k, dtype=torch.bool),
        "tokens": tokens,
        "lengths": lengths,
    }


class VldistStep:
    """The recipe's model, loss and optimizer; one call = one training step as the trainer takes it."""

    def __init__(self, size: dict, conv_path: bool = True, products: str = "auto"):
        from vldist.data.vocab import Vocab
        from vldist.recipes.jobs import load_config
        from vldist.recipes.vsrn import VSRNRecipe
        from vldist.training.optimizers import build_optimizers

        overrides = [
            f"model.embed_size={size['embed']}",
            f"model.word_dim={size['word_dim']}",
            f"model.decoder_hidden={size['decoder_hidden']}",
            f"data.max_regions={size['regions']}",
            f"data.batch_size={size['batch']}",
            "model.max_violation_warmup_epochs=0",  # hardest negatives from step 1, as the official code
            "train.device=cpu",
            f"model.gcn_products={products}",
        ]
        config = load_config("vsrn", overrides)
        self.recipe = VSRNRecipe(config, Vocab([f"w{i}" for i in range(VOCAB_WORDS)]), feature_dim=size["region_dim"])
        torch.manual_seed(0)
        self.model = self.recipe.build_model().train()
        self.optimizer = build_optimizers(config, self.recipe.optimizer_groups(self.model), torch.device("cpu"))["main"]
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.grad_clip = config.train.grad_clip
        self.conv_path = conv_path

    def __call__(self, batch: dict) -> float:
        saved = projection.MIN_CONV_MACS
        if not self.conv_path:
            projection.MIN_CONV_MACS = float("inf")
        try:
            loss = self.recipe.training_losses(self.model, batch)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        finally:
            projection.MIN_CONV_MACS = saved
        return float(loss.detach())


class OfficialStep:
    def __init__(self, size: dict, batch: dict):
        torch.manual_seed(0)
        self.model = OfficialVSRN(
            vocab_size=VOCAB_WORDS + 4,
            max_len=batch["tokens"].shape[1],
            img_dim=size["region_dim"],
            embed_size=size["embed"],
            word_dim=size["word_dim"],
            dim_hidden=size["decoder_hidden"],
        ).train()
        tokens = batch["tokens"]
        self.inputs = (batch["regions"], tokens, batch["lengths"].tolist(), tokens, (tokens > 0).float())

    def __call__(self, batch: dict) -> float:
        return self.model.train_step(*self.inputs)


def alternate(size_name: str, steps: int, warmup: int, linear_side: bool, direct_side: bool = False) -> dict:
    size = SIZES[size_name]
    batch = make_batch(size)
    sides = {"official": OfficialStep(size, batch), "vldist": VldistStep(size)}
    if linear_side:
        sides["vldist-linear"] = VldistStep(size, conv_path=False)
    if direct_side:
        sides["vldist-direct"] = VldistStep(size, products="direct")
    first_layer = sides["vldist"].model.image.rrr[0]
    layer_input = torch.empty(size["batch"], size["regions"], size["embed"])  # what `folds` decides on: the shape
    times = {name: [] for name in sides}
    for round_ in range(warmup + steps):
        for name, step in sides.items():
            start = time.perf_counter()
            step(batch)
            elapsed = time.perf_counter() - start
            if round_ >= warmup:
                times[name].append(elapsed)
        print(
            f"{size_name} round {round_}: " + " ".join(f"{n} {times[n][-1]:.3f}s" for n in times if times[n]),
            flush=True,
        )
    per_round = [o / v for o, v in zip(times["official"], times["vldist"], strict=True)]
    kept = {  # what vldist.models.projection measured on this CPU, shape by shape
        f"up to {rows} rows x {n_in} -> {n_out}": "1x1 conv" if conv else "F.linear"
        for (rows, n_in, n_out, _), conv in projection._conv_faster.items()
    }
    projection._conv_faster.clear()
    return {
        "size": size_name,
        **size,
        "caption_tokens": batch["tokens"].shape[1],
        "vocab": VOCAB_WORDS + 4,
        "steps": steps,
        "warmup": warmup,
        "seconds": times,
        "ratio_median": statistics.median(times["official"]) / statistics.median(times["vldist"]),
        "ratio_per_round": [min(per_round), max(per_round)],
        "kernels_kept": kept,
        "gcn_folded": first_layer.folds(layer_input),
    }


# (rows, in, out) of the step's projections: the image fc, theta_phi_g, w_r, the decoder's keys,
# its GRU cell's input and hidden products, at the paper's and the demo's sizes.
KERNEL_SHAPES = [
    (4608, 2048, 2048),
    (4608, 2048, 6144),
    (4608, 2048, 512),
    (128, 2348, 1536),
    (128, 512, 1536),
    (640, 2048, 256),
    (640, 256, 768),
    (640, 256, 256),
    (128, 556, 768),
    (128, 256, 768),
]


def time_kernels(repeats: int = 5) -> list[dict]:
    def forward_backward(fn, x, w, b):
        x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
        y = fn(x, w, b)
        y.backward(torch.ones_like(y))

    rows_out = []
    for rows, n_in, n_out in KERNEL_SHAPES:
        x, w, b = torch.randn(rows, n_in), torch.randn(n_out, n_in) * 0.02, torch.randn(n_out)
        row = {"rows": rows, "in": n_in, "out": n_out}
        for name, fn in (("linear_ms", F.linear), ("conv_ms", projection.conv_linear)):
            times = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                forward_backward(fn, x, w, b)
                times.append(time.perf_counter() - start)
            row[name] = 1e3 * statistics.median(times[1:])
        rows_out.append(row)
        print(kernel_row(row, projection.MIN_CONV_MACS), flush=True)
    return rows_out


def kernel_row(row: dict, threshold: float) -> str:
    macs = row["rows"] * row["in"] * row["out"]
    taken = "yes" if macs >= threshold else "no"
    return (
        f"| {row['rows']} x {row['in']} -> {row['out']} | {macs / 1e9:.2f} | {row['linear_ms']:.1f} | "
        f"{row['conv_ms']:.1f} | x{row['linear_ms'] / row['conv_ms']:.2f} | {taken} |"
    )


def cpu_label() -> str:
    names = [
        line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in line
    ]
    return f"{names[0] if names else platform.machine()}, {os.cpu_count()} cores"


def table(results: dict) -> str:
    lines = [
        f"{results['device']}, torch {results['torch']}, {results['threads']} threads",
        f"`{results['command']}`",
        "",
    ]
    if results.get("sizes"):
        sides = [
            s
            for s in ("official", "vldist", "vldist-linear", "vldist-direct")
            if any(s in r["seconds"] for r in results["sizes"])
        ]
        lines.append(
            "| sizes | B | regions | embed | decoder hidden | caption tokens | steps a side | "
            + " | ".join(f"{s} s/step median (min-max)" for s in sides)
            + " | official / vldist: medians | per round (min-max) |"
        )
        lines.append("|---" * (9 + len(sides)) + "|")
        for r in results["sizes"]:
            cells = []
            for s in sides:
                t = r["seconds"].get(s)
                cells.append(f"{statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f})" if t else "")
            lines.append(
                f"| {r['size']} | {r['batch']} | {r['regions']} | {r['embed']} | {r['decoder_hidden']} | "
                f"{r['caption_tokens']} | {r['steps']} | " + " | ".join(cells) + f" | x{r['ratio_median']:.2f} | "
                f"x{r['ratio_per_round'][0]:.2f}-x{r['ratio_per_round'][1]:.2f} |"
            )
        for r in results["sizes"]:
            if "gcn_folded" in r:
                lines.append(f"\n{r['size']} sizes, vldist's RRR products: {'folded' if r['gcn_folded'] else 'direct'}")
            if r.get("kernels_kept"):
                kept = "; ".join(f"{shape}: {k}" for shape, k in r["kernels_kept"].items())
                lines.append(f"\n{r['size']} sizes, the kernel vldist measured faster and kept: {kept}")
    if results.get("kernels"):
        lines += [
            "",
            "| projection (rows x in -> out) | GMAC | F.linear ms | 1x1 conv ms | conv speed-up | timed by vldist (over 2^30) |",
            "|---|---|---|---|---|---|",
            *(kernel_row(row, results["min_conv_macs"]) for row in results["kernels"]),
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="*", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--steps", type=int, help="measured rounds (default: demo 30, paper 5)")
    parser.add_argument("--warmup", type=int, help="rounds dropped first (default: demo 3, paper 1)")
    parser.add_argument("--linear-side", action="store_true", help="also time vldist with the conv path off")
    parser.add_argument("--direct-side", action="store_true", help="also time vldist with gcn_products=direct")
    parser.add_argument("--kernels", action="store_true", help="time F.linear vs the 1x1 conv path per shape")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--from", dest="source", type=Path, help="print the tables of committed results; no runs")
    args = parser.parse_args()
    if args.source:
        print(table(json.loads(args.source.read_text())))
        return
    results = {
        "device": cpu_label(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "command": " ".join(["python", "bench/vs_official.py", *sys.argv[1:]]),
        "min_conv_macs": projection.MIN_CONV_MACS,
        "kernels": time_kernels() if args.kernels else [],
        "sizes": [
            alternate(
                name,
                args.steps or DEFAULT_STEPS[name],
                DEFAULT_WARMUP[name] if args.warmup is None else args.warmup,
                args.linear_side,
                args.direct_side,
            )
            for name in args.sizes
        ],
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print()
    print(table(results))


if __name__ == "__main__":
    main()
