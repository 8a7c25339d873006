"""What the all-gathered negatives cost as the job grows, measured at 1, 2 and 4 gloo ranks on CPU,
and projected to 8-1,024 GPUs with a stated model.

    python bench/global_negatives.py --json docs/results/global_negatives.json
    python bench/global_negatives.py --from docs/results/global_negatives.json   # the docs' tables

Measured, each rank holding B_rank rows of D-dim embeddings (weak scaling: the global batch is
B_rank x W), median of --repeats after warm-up, every rank one thread:
  gather    all_gather_with_grad of the image and the text embeddings, forward and backward
  ids       the image identities gathered beside them (gather_identities)
  scores    the local-vs-global score matrices and the hardest-negative hinge, forward and backward
  loss      the whole cross_rank_vse_hinge_loss, forward and backward (gather + ids + scores)
  step      one VSRN training step of the demo job at the same B_rank (torchrun, shards/synth:
            built on first use), from metrics.jsonl; the share is loss / step.

Projected (the model, written out in project()): per optimizer step each rank receives (W-1)
B_rank D s bytes per modality in the forward all-gather, and the backward all-reduces the whole
gathered gradient (gloo has no reduce-scatter), 2 (W-1) B_rank D s bytes per modality in a ring;
a reduce-scatter would move half that. Time at a link's bandwidth per GPU; score matrices hold
B_rank x W B_rank floats per direction.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, repeats: int) -> float:
    import torch.distributed as dist

    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rank_main(rank: int, world: int, port: int, rows: int, dim: int, repeats: int, queue) -> None:
    import torch.distributed as dist

    from vldist.distributed.collectives import all_gather_with_grad
    from vldist.losses import cross_rank_vse_hinge_loss
    from vldist.losses.hinge import hardest_negative_hinge
    from vldist.losses.not_negative import gather_identities, same_identity

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    img = torch.nn.functional.normalize(torch.randn(rows, dim, generator=g), dim=1).requires_grad_()
    txt = torch.nn.functional.normalize(torch.randn(rows, dim, generator=g), dim=1).requires_grad_()
    identity = torch.arange(rows) + rank * rows

    def gather():
        (a, _), (b, _) = all_gather_with_grad(img), all_gather_with_grad(txt)
        (a.sum() + b.sum()).backward()

    def ids():
        gather_identities(identity, rows, img.device)

    all_img, all_txt = (t.detach().repeat(world, 1) for t in (img, txt))  # stand-ins of the gathered rows
    everyone = identity.repeat(world)
    positives = torch.arange(rows) + rank * rows

    def scores():
        same = same_identity(identity, everyone)
        loss = hardest_negative_hinge(img @ all_txt.T, positives, 0.2, True, same) + hardest_negative_hinge(
            txt @ all_img.T, positives, 0.2, True, same
        )
        loss.backward()

    def loss():
        cross_rank_vse_hinge_loss(img, txt, 0.2, True, identity=identity).backward()

    result = {
        name: timed(fn, repeats) for name, fn in (("gather", gather), ("ids", ids), ("scores", scores), ("loss", loss))
    }
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_parts(world: int, rows: int, dim: int, repeats: int) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, rows, dim, repeats, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    return result


def measure_step(world: int, rows: int, steps: int) -> float:
    """Seconds per VSRN step of the demo job with `rows` a rank, from the last progress window."""
    out = ROOT / "runs" / "bench_global_negatives" / f"w{world}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(world),
        "-m",
        "vldist.train",
        "vsrn",
        f"data.batch_size={rows * world}",
        f"train.max_steps={steps}",
        f"train.log_every={steps // 2}",
        "eval.baseline=false",
        "train.validate_every=0",
        "metrics.enabled=false",
        f"output.dir={out}",
        "train.resume=null",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(["rm", "-rf", str(out)], check=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    windows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [w for w in windows if w.get("event") == "train"][-1]
    return rows * world / last["samples_per_second"]


def project(rows: int, dim: int, bytes_per_value: int, step_seconds: float) -> list[dict]:
    """The cost model at the paper's sizes: bytes moved per rank per step, score-matrix memory,
    and time at the stated bandwidths (NVLink inside an 8-GPU node, InfiniBand across nodes)."""
    nvlink, infiniband = (
        450e9,
        50e9,
    )  # bytes/s per GPU, one direction: H100 NVLink 4 (900 GB/s both ways); 400 Gb/s NIC per GPU
    table = []
    for world in (8, 64, 512, 1024):
        per_modality = (world - 1) * rows * dim * bytes_per_value
        forward = 2 * per_modality  # image and text
        backward_allreduce = 2 * 2 * per_modality  # ring all-reduce of the gathered gradient
        backward_reduce_scatter = 2 * per_modality
        link = nvlink if world <= 8 else infiniband
        scores_bytes = 2 * rows * world * rows * 4  # two directions, fp32 scores
        flops = 3 * 2 * 2 * rows * (world * rows) * dim  # two matmuls, forward + backward (x3)
        table.append(
            {
                "gpus": world,
                "global_batch": world * rows,
                "link": "NVLink" if world <= 8 else "InfiniBand",
                "gathered_mb": forward / 1e6,
                "backward_allreduce_mb": backward_allreduce / 1e6,
                "comm_ms_allreduce": (forward + backward_allreduce) / link * 1e3,
                "comm_ms_reduce_scatter": (forward + backward_reduce_scatter) / link * 1e3,
                "score_matrix_mb": scores_bytes / 1e6,
                "score_gflop": flops / 1e9,
                "share_of_step_allreduce": (forward + backward_allreduce) / link / step_seconds,
            }
        )
    return table


def tables(results: dict) -> str:
    """The two tables of docs/distributed.md, "What global negatives cost", from the results."""
    lines = [
        "| ranks | all-gather fwd+bwd | identities | scores + hinge | whole loss | demo step | the loss's share "
        "of the demo step |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in results["measured"]:
        lines.append(
            f"| {m['ranks']} | {m['gather_ms']:.1f} ms | {m['ids_ms']:.1f} ms | {m['scores_ms']:.1f} ms | "
            f"{m['loss_ms']:.1f} ms | {m['demo_step_ms']:.0f} ms | {100 * m['demo_share']:.1f}% |"
        )
    lines += [
        "",
        "| GPUs | global batch | gathered a step | backward all-reduce | communication | share of the step "
        "| score matrices |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in results["projected"]:
        gpus = f"{p['gpus']} (NVLink)" if p["link"] == "NVLink" else f"{p['gpus']:,}"
        share = p["share_of_step_allreduce"] * 100
        lines.append(
            f"| {gpus} | {p['global_batch']:,} | {p['gathered_mb']:,.{1 if p['gathered_mb'] < 10 else 0}f} MB "
            f"| {p['backward_allreduce_mb']:,.{1 if p['backward_allreduce_mb'] < 100 else 0}f} MB | "
            f"{p['comm_ms_allreduce']:.{2 if p['comm_ms_allreduce'] < 1 else (1 if p['comm_ms_allreduce'] < 10 else 0)}f} ms | "
            f"{share:.{1 if share < 1 else 0}f}% | {p['score_matrix_mb']:.{1 if p['score_matrix_mb'] < 10 else 0}f} MB |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rows", type=int, default=128, help="rows per rank (the paper's batch of 128 on each GPU)")
    parser.add_argument("--dim", type=int, default=2048, help="embedding size (paper: 2048)")
    parser.add_argument("--step-rows", type=int, default=32, help="rows per rank of the timed demo steps")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--from", dest="source", type=Path, help="print the docs' tables from saved results")
    args = parser.parse_args()
    if args.source:
        print(tables(json.loads(args.source.read_text())))
        return
    measured = []
    for world in args.ranks:
        parts = measure_parts(world, args.rows, args.dim, args.repeats)
        small = measure_parts(world, args.step_rows, 256, args.repeats)  # the demo's embed_size
        step = measure_step(world, args.step_rows, args.steps)
        row = {
            "ranks": world,
            "rows": args.rows,
            "dim": args.dim,
            **{f"{k}_ms": v * 1e3 for k, v in parts.items()},
            "demo_rows": args.step_rows,
            "demo_loss_ms": small["loss"] * 1e3,
            "demo_step_ms": step * 1e3,
            "demo_share": small["loss"] / step,
        }
        measured.append(row)
        print(json.dumps(row))
    # At scale: the H100's measured bf16 VSRN step at B=128 (docs/benchmarks.md, "h100"): 54.5 ms
    projected = project(args.rows, args.dim, 2, 0.0545)
    for row in projected:
        print(json.dumps(row))
    results = {"measured": measured, "projected": projected}
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(tables(results))


if __name__ == "__main__":
    main()
