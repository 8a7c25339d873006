"""Region affinity (VSRN's RRR core): eager PyTorch vs torch.compile vs the fused Triton kernel.

    python bench/gcn_kernel.py                 # CUDA if present, else CPU (eager vs compile)
    python bench/gcn_kernel.py --dtype bf16 --vsrn-embed 2048

For each shape (B=128; K=36 with D=1024 and 2048; K=9 with D=2048) and each implementation, the
median time of the forward and of forward+backward, the memory traffic that implies (inputs read
and outputs written once: the least any implementation must move) and the TFLOP/s of the
matmuls. Then one whole VSRN training step (forward, backward, Adam) with gcn_kernel=torch vs
triton. Triton needs CUDA; on CPU those rows say so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vldist.kernels.region_affinity import region_affinity, region_affinity_torch  # noqa: E402

SHAPES = [(128, 36, 1024), (128, 36, 2048), (128, 9, 2048)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def forward_backward(fn, x, normalize, mask, dy):
    return torch.autograd.grad(fn(*x, normalize, mask), x, dy)


def train_step(recipe, model, batch, optimizer, autocast):
    with autocast:
        loss = recipe.training_losses(model, batch)["loss"]
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def implementations(device: torch.device) -> dict:
    impls = {"eager": region_affinity_torch}
    try:
        compiled = torch.compile(region_affinity_torch, dynamic=False)
        impls["compile"] = compiled
    except Exception as err:  # noqa: BLE001 - report, do not stop the benchmark
        print(f"torch.compile unavailable: {err}")
    if device.type == "cuda":
        impls["triton"] = lambda *a: region_affinity(*a, kernel="triton")
    return impls


def bench_op(device: torch.device, dtype: torch.dtype, repeats: int, normalize: str) -> None:
    print(f"\nregion affinity, {normalize}, {str(dtype).replace('torch.', '')}, masked, on {device_name(device)}")
    print(
        f"{'B':>4} {'K':>4} {'D':>5} {'impl':>8} | {'fwd ms':>8} {'GB/s':>7} {'TFLOP/s':>8} | "
        f"{'fwd+bwd ms':>10} {'GB/s':>7} {'TFLOP/s':>8}"
    )
    for B, K, D in SHAPES:
        x = [torch.randn(B, K, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
        mask = torch.rand(B, K, device=device) > 0.2
        mask[:, 0] = True
        dy = torch.randn(B, K, D, device=device, dtype=dtype)
        elt = x[0].element_size()
        flops_fwd, flops_bwd = 4 * B * K * K * D, 8 * B * K * K * D
        bytes_fwd, bytes_all = 4 * B * K * D * elt, (4 + 7) * B * K * D * elt
        baseline = None
        if device.type == "cpu":
            if repeats > 5:
                repeats = 5
        for name, fn in implementations(device).items():
            try:
                with torch.no_grad():
                    fwd = timed(partial(fn, *x, normalize, mask), device, repeats)
                both = timed(partial(forward_backward, fn, x, normalize, mask, dy), device, repeats)
            except Exception as err:  # noqa: BLE001
                print(f"{B:>4} {K:>4} {D:>5} {name:>8} | failed: {str(err).splitlines()[0][:80]}")
                continue
            baseline = baseline or both
            print(
                f"{B:>4} {K:>4} {D:>5} {name:>8} | {1e3 * fwd:8.3f} {bytes_fwd / fwd / 1e9:7.1f} "
                f"{flops_fwd / fwd / 1e12:8.3f} | {1e3 * both:10.3f} {bytes_all / both / 1e9:7.1f} "
                f"{(flops_fwd + flops_bwd) / both / 1e12:8.3f}   x{baseline / both:.2f} vs eager"
            )
        if device.type == "cpu":
            print(f"{B:>4} {K:>4} {D:>5} {'triton':>8} | needs CUDA")


def bench_vsrn_step(device: torch.device, embed: int, repeats: int, dtype: str) -> None:
    from vldist.data.vocab import Vocab
    from vldist.recipes.jobs import load_config
    from vldist.recipes.vsrn import VSRNRecipe

    vocab = Vocab([f"w{i}" for i in range(1000)])
    print(f"\nwhole VSRN training step: B=128, K=36, regions 2048-d, embed {embed}, on {device_name(device)}")
    kernels = ["torch", "triton"] if device.type == "cuda" else ["torch"]
    for kernel in kernels:
        config = load_config("vsrn", [f"model.embed_size={embed}", f"model.gcn_kernel={kernel}", "data.max_regions=36"])
        recipe = VSRNRecipe(config, vocab, feature_dim=2048)
        torch.manual_seed(0)
        model = recipe.build_model().to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-4)
        batch = {
            "regions": torch.randn(128, 36, 2048, device=device),
            "mask": torch.ones(128, 36, dtype=torch.bool, device=device),
            "tokens": torch.randint(4, 1000, (128, 16), device=device),
            "lengths": torch.full((128,), 16, device=device),
        }
        autocast = torch.autocast(device.type, dtype=DTYPES[dtype], enabled=dtype != "fp32")

        seconds = timed(partial(train_step, recipe, model, batch, optimizer, autocast), device, repeats)
        print(f"  gcn_kernel={kernel:<7} {1e3 * seconds:9.1f} ms/step  {128 / seconds:8.0f} samples/s")
    if device.type == "cpu":
        print("  gcn_kernel=triton  needs CUDA")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--vsrn-embed", type=int, default=None, help="default: 2048 on CUDA, 256 on CPU")
    args = parser.parse_args()
    device = torch.device(args.device)
    for normalize in ("count", "softmax"):
        bench_op(device, DTYPES[args.dtype], args.repeats, normalize)
    embed = args.vsrn_embed or (2048 if device.type == "cuda" else 256)
    bench_vsrn_step(device, embed, min(args.repeats, 10) if device.type == "cuda" else 3, args.dtype)


if __name__ == "__main__":
    main()
