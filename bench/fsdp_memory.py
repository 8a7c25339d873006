"""Memory per rank and communication per step of the VSRN paper-size model under DDP (Accelerate),
DeepSpeed ZeRO-1/2/3 and FSDP2, at 1, 2 and 4 gloo ranks on the CPU.

    python bench/fsdp_memory.py --json docs/results/fsdp_memory.json   # every case (15 torchruns)
    python bench/fsdp_memory.py --engines fsdp ddp --ranks 2            # some cases
    python bench/fsdp_memory.py --from docs/results/fsdp_memory.json    # the table, no runs

The model is jobs/vsrn_coco.yaml's (embed_size 2048, decoder_hidden 512, word_dim 300, 4 RRR
layers, a GRU) on 2048-d region features, with a vocabulary of --vocab words (COCO's is about
10,000). Each case is a real torchrun of W ranks (this file with --worker) that takes --steps
optimizer steps (Adam, fp32) on a global batch of --batch samples of 36 regions and 12-word
captions, each rank on its B/W rows. Per rank it reports:

- peak RSS (getrusage's ru_maxrss) at the end, and the RSS of the same process before the model
  was built (imports, process group): the difference is what the model, its training state and
  the step's activations added;
- the bytes of parameters, gradients and optimizer state it holds, read from the state after a
  step: parameters and gradients as stored on the rank (FSDP2: each DTensor's local slice;
  ZeRO-3: DeepSpeed's partition `ds_tensor`), optimizer state from the torch optimizer's state
  (under DeepSpeed, of the flat partitions it steps, plus the fp32 partition it keeps of the
  weights). DeepSpeed's gradients live in its buckets and partitions, not in `.grad`: under
  ZeRO those are given from the rule (1/2: a gradient partition of P/W plus a reduce bucket;
  3: P/W), marked so;
- the payload of its collectives in one step, counted by a dispatch mode that sees every c10d op
  dispatched on the rank's thread (DDP's reducer's all-reduce, FSDP2's and DeepSpeed's
  collectives; a step with no count shows "-"): the bytes of the tensors each collective takes or fills (all-reduce: the tensor; all-gather: the output;
  reduce-scatter: the input), beside the expected payload from the parameter count P (fp32):
  DDP all-reduce 4P; ZeRO-1/2 reduce(-scatter) of the gradients 4P and all-gather of the updated
  weights 4P; FSDP2 and ZeRO-3 all-gather of the weights for the forward 4P and again for the
  backward 4P, and reduce-scatter of the gradients 4P. A ring moves (W-1)/W of a payload in and out
  of each rank; one rank moves nothing (the counts there are of collectives on a world of one).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from helpers import torchrun  # noqa: E402  (the tests' torchrun command)

ENGINES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
LABELS = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp": "FSDP2"}
MIB = 2**20


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def _engine_overrides(engine: str) -> list[str]:
    if engine.startswith("zero"):
        return ["engine.backend=deepspeed", f"engine.deepspeed_config=jobs/deepspeed/{engine}.json"]
    return ["engine.backend=fsdp"] if engine == "fsdp" else []


class CollectiveBytes:
    """A dispatch mode that adds up the payload of every c10d collective called while it is on."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                if name.startswith("c10d.") and "barrier" not in name:
                    counts[name] = counts.get(name, 0) + _payload(name, args)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def total(self) -> int:
        return sum(self.counts.values())


def _payload(name: str, args) -> int:
    import torch

    def size(t):
        if isinstance(t, torch.Tensor):
            return t.numel() * t.element_size()
        if isinstance(t, (list, tuple)):
            return sum(size(x) for x in t)
        return 0

    if "allgather" in name or "all_gather" in name:
        return size(args[0])  # the output (list or flat)
    if "reduce_scatter" in name:
        return size(args[1])  # the input
    return size(args[0])


def _held_bytes(engine, name: str) -> dict:
    """Parameters, gradients and optimizer state this rank holds (bytes), read from the state."""
    import torch

    model = engine.unwrap()

    def nbytes(t):
        return t.numel() * t.element_size() if t is not None else 0

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    if name.startswith("zero"):
        ds = engine.model.optimizer  # DeepSpeed's ZeRO optimizer
        inner = getattr(ds, "optimizer", ds)
        optim = sum(nbytes(v) for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor))
        if name == "zero3":
            params = sum(nbytes(p.ds_tensor) for p in model.parameters())
            masters = sum(nbytes(t) for t in getattr(ds, "fp32_partitioned_groups_flat", []))
        else:
            params = sum(nbytes(p) for p in model.parameters())
            masters = sum(nbytes(t) for t in getattr(ds, "single_partition_of_fp32_groups", []))
        return {"params": params, "grads": None, "optimizer": optim + masters}
    optim = sum(
        nbytes(local(v)) for o in engine.optimizers.values() for s in o.state.values() for v in s.values() if v.dim()
    )
    params = sum(nbytes(local(p)) for p in model.parameters())
    return {"params": params, "grads": engine.last_grad_bytes, "optimizer": optim}


def worker(args) -> None:
    import numpy as np
    import torch

    from vldist.data.vocab import Vocab
    from vldist.distributed import make_engine
    from vldist.recipes.jobs import load_config
    from vldist.recipes.vsrn import VSRNRecipe
    from vldist.training.optimizers import build_optimizers

    config = load_config(
        "vsrn_coco",
        [
            f"data.batch_size={args.batch}",
            "train.device=cpu",
            "train.grad_clip=2.0",
            "data.max_regions=36",
            *_engine_overrides(args.engine),
        ],
    )
    engine = make_engine(config)
    before = _current_rss_mib()
    rank, world = engine.rank, engine.world_size
    words = [f"w{i}" for i in range(args.vocab)]
    recipe = VSRNRecipe(config, Vocab(words), feature_dim=2048)
    recipe.uniform_shapes = engine.uniform_shapes
    torch.manual_seed(0)
    model = recipe.build_model()
    n_params = sum(p.numel() for p in model.parameters())
    optimizers = build_optimizers(config, recipe.optimizer_groups(model))
    wrapped = engine.setup(model, optimizers)
    rng = np.random.default_rng(rank)
    per_rank = args.batch // world
    counter = CollectiveBytes()
    for step in range(args.steps):
        samples = [
            {
                "regions": rng.standard_normal((36, 2048)).astype(np.float32),
                "tokens": Vocab(words).encode(" ".join(rng.choice(words, size=12))),
            }
            for _ in range(per_rank)
        ]
        last = step == args.steps - 1
        with counter.mode if last else _nothing():
            losses = recipe.training_losses(wrapped, recipe.collate_train(samples))
            engine.backward(losses["loss"])
            engine.last_grad_bytes = sum(
                (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).numel() * 4
                for p in engine.unwrap().parameters()
                if p.grad is not None
            )
            engine.step("main", 2.0)
    held = _held_bytes(engine, args.engine)
    from vldist.distributed.collectives import gather_objects

    rows = gather_objects(
        {
            "rank": rank,
            "rss_before_mib": round(before, 1),
            "peak_rss_mib": round(_rss_mib(), 1),
            "held": held,
            "collective_bytes": counter.total(),
            "collectives": counter.counts,
        }
    )
    if rank == 0:
        Path(args.out).write_text(json.dumps({"params": n_params, "world_size": world, "ranks": rows}))
    engine.close()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def expected_payload(engine: str, n_params: int) -> int:
    factor = {"ddp": 1, "zero1": 2, "zero2": 2, "zero3": 3, "fsdp": 3}[engine]
    return factor * 4 * n_params


def run_case(engine: str, ranks: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "case.json"
        cmd = [
            *torchrun(ranks),
            __file__,
            "--worker",
            "--engine",
            engine,
            "--out",
            str(out),
            "--batch",
            str(args.batch),
            "--steps",
            str(args.steps),
            "--vocab",
            str(args.vocab),
        ]
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"{engine} on {ranks} ranks failed:\n{proc.stderr[-3000:]}")
        result = json.loads(out.read_text())
    result["expected_payload"] = expected_payload(engine, result["params"])
    return result


def _grads(engine: str, held: dict, n_params: int, world: int) -> tuple[float, bool]:
    """(MiB, from the rule?) of the gradients a rank holds."""
    if held["grads"] is not None:
        return held["grads"] / MIB, False
    bucket = 50_000_000 * 4 if engine != "zero3" else 0  # reduce_bucket_size of jobs/deepspeed/zero{1,2}.json
    whole = 4 * n_params
    if engine == "zero1":
        return (whole + min(bucket, whole)) / MIB, True  # stage 1 keeps the whole gradients
    return (whole / world + min(bucket, whole)) / MIB if engine == "zero2" else whole / world / MIB, True


def table(results: dict) -> str:
    cases = results["cases"]
    n_params = next(iter(cases.values()))["params"]
    lines = [
        f"VSRN paper size (jobs/vsrn_coco.yaml, vocabulary {results['vocab']:,}): {n_params / 1e6:.1f} M parameters "
        f"({4 * n_params / MIB:.0f} MiB fp32); global batch {results['batch']}, Adam fp32, {results['machine']}. "
        "Per rank (the largest over ranks): peak RSS, and what the model and its step added to the process "
        "(peak minus RSS before the model); parameters, gradients and optimizer state held (MiB, * from the "
        "rule: DeepSpeed keeps gradients in its own buckets); collective payload of one step, counted and expected.",
        "",
        "| engine | ranks | peak RSS MiB | added MiB | params MiB | grads MiB | optimizer MiB | "
        "payload counted MiB | payload expected MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, case in cases.items():
        engine, ranks = key.split("@")
        world = int(ranks)
        top = max(case["ranks"], key=lambda r: r["peak_rss_mib"])
        added = max(r["peak_rss_mib"] - r["rss_before_mib"] for r in case["ranks"])
        held = top["held"]
        grads, rule = _grads(engine, held, n_params, world)
        counted = max(r["collective_bytes"] for r in case["ranks"])
        counted_text = f"{counted / MIB:.0f}" if counted else "-"
        lines.append(
            f"| {LABELS[engine]} | {world} | {top['peak_rss_mib']:.0f} | {added:.0f} | {held['params'] / MIB:.0f} | "
            f"{grads:.0f}{'*' if rule else ''} | {held['optimizer'] / MIB:.0f} | {counted_text} | "
            f"{case['expected_payload'] / MIB:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES)
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=8, help="global batch (divisible by every --ranks)")
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps (the first makes Adam's state)")
    parser.add_argument("--vocab", type=int, default=10000)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--from", dest="source", type=Path, help="print the table of earlier results; no runs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.source:
        print(table(json.loads(args.source.read_text())))
        return
    import torch

    results = {
        "machine": f"2-core CPU VM, no GPU, torch {torch.__version__.split('+')[0]}"
        if os.cpu_count() == 2
        else f"{os.cpu_count()}-core {platform.machine()}, torch {torch.__version__}",
        "batch": args.batch,
        "steps": args.steps,
        "vocab": args.vocab,
        "command": "python bench/fsdp_memory.py " + " ".join(sys.argv[1:]),
        "cases": {},
    }
    for engine in args.engines:
        for ranks in args.ranks:
            print(f"{engine} on {ranks} ranks ...", file=sys.stderr, flush=True)
            results["cases"][f"{engine}@{ranks}"] = run_case(engine, ranks, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
