"""What vldist's CUDA switches gain: fused Adam, TF32 for fp32 matmuls, channels-last CNN trunks.

    python bench/cuda_switches.py              # on a CUDA GPU: docs/results/cuda_switches_<card>.json
    python bench/cuda_switches.py --from docs/results/cuda_switches_h100.json   # the table again
    python bench/cuda_switches.py --device cpu --small --json /tmp/cs.json      # smoke run of the script

Each row times one workload with the switch off and on (median of repeats after warm-up, each
measurement within --seconds, the whole run within --budget; what does not fit is recorded as
skipped), with vldist's own code for the "on" side:
- fused Adam (training/optimizers.py): one optimizer step over the paper-size VSRN's parameters,
  gradients set, torch's default (foreach) vs fused=True;
- TF32 (distributed/cuda_settings.py): the VSRN region projection's GEMM (128*36 x 2048 x 2048)
  and one whole paper-size VSRN training step (forward, backward, Adam) in fp32;
- channels-last (models/memory_format.py): forward+backward of L2C's encoder on its paper trunk
  (FCN ResNet-101, a pair batch of 16 at 224 px) and of LAViTeR's E_I (InceptionV3, 32 at 299 px),
  in fp32 (TF32 on, as vldist runs) and under bf16 autocast. Random weights: nothing downloads.
Without CUDA it says so and exits 0 (bench/gpu_checks.sh runs it on lent GPUs only); --small on
CPU checks the script end to end with toy sizes, and its numbers are not results.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vldist.distributed.cuda_settings import configure_fp32_math  # noqa: E402

CARDS = ("H200", "H100", "A100", "L40S", "A10")


def card_of(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100': the results file's suffix."""
    known = [c for c in CARDS if c in name.upper()]
    return known[0].lower() if known else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


class Clock:
    """Median seconds of a callable, each measurement within `seconds`, the run within `budget`."""

    def __init__(self, device: torch.device, seconds: float, budget: float, repeats: int):
        self.device, self.seconds, self.repeats = device, seconds, repeats
        self.deadline = time.monotonic() + budget

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, fn) -> float | None:
        """None when the run's budget is spent (the row is then recorded as skipped)."""
        if time.monotonic() > self.deadline:
            return None
        for _ in range(2):
            fn()
        self.sync()
        times, start = [], time.monotonic()
        while len(times) < self.repeats and (len(times) < 3 or time.monotonic() - start < self.seconds):
            begin = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - begin)
        return statistics.median(times)


# ---------------------------------------------------------------- workloads


def vsrn_setup(device: torch.device, small: bool):
    from vldist.data.vocab import Vocab
    from vldist.recipes.jobs import load_config
    from vldist.recipes.vsrn import VSRNRecipe

    embed, regions, batch, words = (256, 256, 8, 1000) if small else (2048, 2048, 128, 10000)
    config = load_config("vsrn", [f"model.embed_size={embed}", "data.max_regions=36"])
    recipe = VSRNRecipe(config, Vocab([f"w{i}" for i in range(words)]), feature_dim=regions)
    torch.manual_seed(0)
    model = recipe.build_model().to(device)
    batch = {
        "regions": torch.randn(batch, 36, regions, device=device),
        "mask": torch.ones(batch, 36, dtype=torch.bool, device=device),
        "tokens": torch.randint(4, words, (batch, 16), device=device),
        "lengths": torch.full((batch,), 16, device=device),
    }
    return recipe, model, batch


def bench_adam(clock: Clock, model) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    result = {"switch": "fused Adam", "workload": f"Adam step, VSRN's {count / 1e6:.1f} M parameters"}
    for side, fused in (("off", None), ("on", True)):
        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for p in copies:
            p.grad = torch.randn_like(p)
        optimizer = torch.optim.Adam(copies, lr=2e-4, fused=fused)
        result[side] = clock.time(optimizer.step)
    return result


def bench_tf32(clock: Clock, recipe, model, batch, small: bool) -> list[dict]:
    device = clock.device
    rows, size = (36 * 8, 256) if small else (128 * 36, 2048)
    a, b = torch.randn(rows, size, device=device), torch.randn(size, size, device=device)
    gemm = {"switch": "TF32", "workload": f"fp32 GEMM {rows} x {size} x {size}", "flops": 2 * rows * size * size}
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-4)

    def step():
        loss = recipe.training_losses(model, batch)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    train = {"switch": "TF32", "workload": f"VSRN training step, fp32, batch {batch['regions'].shape[0]}"}
    for side, tf32 in (("off", False), ("on", True)):
        configure_fp32_math(device, tf32)
        gemm[side] = clock.time(lambda: a @ b)
        train[side] = clock.time(step)
    configure_fp32_math(device, True)  # as vldist runs
    return [gemm, train]


def l2c_encoder(small: bool):
    from vldist.recipes.jobs import load_config
    from vldist.recipes.l2c import L2CModel

    trunk, size, pairs = ("small", 64, 2) if small else ("fcn_resnet101", 224, 16)
    overrides = [f"model.trunk={trunk}", "model.graph_dim=512", "model.hidden=512", f"model.image_size={size}"]
    model = L2CModel(load_config("l2c", overrides).model, vocab_size=100)

    def run(m, images):
        nodes, aux = m.features(images[:pairs], images[pairs:])
        return nodes.float().sum() + aux["mask_logits"].float().sum()

    return (
        f"L2C encoder ({trunk}), {pairs} pairs at {size} px",
        model,
        2 * pairs,
        size,
        run,
        lambda m: m.use_channels_last(),
    )


def laviter_image_encoder(small: bool):
    from vldist.models.alignment_encoders import build_image_encoder
    from vldist.models.memory_format import convert_to_channels_last

    name, size, batch = ("small", 64, 4) if small else ("inception_v3", 299, 32)
    model = build_image_encoder(name, 256, None, size)

    def run(m, images):
        regions, image = m(images)
        return regions.float().sum() + image.float().sum()

    def channels_last(m):  # what LAViTeRModel.use_channels_last does for its E_I
        convert_to_channels_last(m, [m])
        return m

    return f"LAViTeR E_I ({name}), {batch} images at {size} px", model, batch, size, run, channels_last


def forward_backward(model, precision: str, run, images) -> None:
    with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = run(model, images)
    model.zero_grad(set_to_none=True)
    loss.backward()


def bench_channels_last(clock: Clock, small: bool) -> list[dict]:
    device, results = clock.device, []
    for build in (l2c_encoder, laviter_image_encoder):
        label, model, batch, size, run, convert = build(small)
        default = model.to(device).train()
        converted = convert(copy.deepcopy(default))
        images = torch.randn(batch, 3, size, size, device=device)
        precisions = ["fp32"] if device.type == "cpu" else ["fp32", "bf16"]
        for precision in precisions:
            row = {"switch": "channels-last", "workload": f"{label}, fwd+bwd, {precision}"}
            for side, m in (("off", default), ("on", converted)):
                row[side] = clock.time(lambda m=m, p=precision, r=run, x=images: forward_backward(m, p, r, x))
            results.append(row)
        del default, converted
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


# ---------------------------------------------------------------- report


def table(results: dict) -> str:
    lines = [
        f"{results['device']} (torch {results['torch']}, CUDA {results['cuda']}, cuDNN {results['cudnn']})"
        + ("  [smoke run: not results]" if results["small"] else ""),
        "",
        "| switch | workload | off ms | on ms | speed-up |",
        "|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        off, on = row.get("off"), row.get("on")
        if off is None or on is None:
            lines.append(f"| {row['switch']} | {row['workload']} | skipped (time budget) | | |")
            continue
        extra = ""
        if "flops" in row:
            extra = f" ({row['flops'] / off / 1e12:.1f} -> {row['flops'] / on / 1e12:.1f} TFLOP/s)"
        lines.append(
            f"| {row['switch']} | {row['workload']}{extra} | {1e3 * off:.2f} | {1e3 * on:.2f} | x{off / on:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only with --small")
    parser.add_argument("--small", action="store_true", help="toy sizes: checks the script, measures nothing")
    parser.add_argument(
        "--json", type=Path, help="a file, or a folder for cuda_switches_<card>.json (default on CUDA: docs/results/)"
    )
    parser.add_argument("--from", dest="source", type=Path, help="print the table of committed results")
    parser.add_argument("--seconds", type=float, default=6.0, help="time limit of one measurement")
    parser.add_argument("--budget", type=float, default=150.0, help="time limit of all measurements")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if args.source:
        print(table(json.loads(args.source.read_text())))
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("cuda_switches: needs a CUDA GPU (none visible); --device cpu --small runs a smoke test of the script")
        return 0
    if device.type != "cuda" and not args.small:
        print("cuda_switches: the switches are CUDA's: on a CPU only --small (a smoke run of the script) makes sense")
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    configure_fp32_math(device, True)  # vldist's default on CUDA; TF32's own row turns it off and on
    clock = Clock(device, args.seconds, args.budget, args.repeats)
    started = time.monotonic()
    recipe, model, batch = vsrn_setup(device, args.small)
    rows = [bench_adam(clock, model), *bench_tf32(clock, recipe, model, batch, args.small)]
    del recipe, model, batch
    rows += bench_channels_last(clock, args.small)
    results = {
        "device": name,
        "card": card_of(name),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "small": args.small,
        "seconds": round(time.monotonic() - started, 1),
        "rows": rows,
    }
    path = args.json
    if path is None and device.type == "cuda" and not args.small:
        path = ROOT / "docs" / "results"
    if path is not None and path.is_dir():
        path = path / f"cuda_switches_{results['card']}.json"
    if path is not None:
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {path}")
    print(table(results))
    print(f"\n{results['seconds']} s of measurements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
