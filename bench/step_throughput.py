"""Training throughput of every recipe's demo job and of VSRN at the paper's sizes, eager against
each `train.compile` mode.

    python bench/step_throughput.py                                   # every case, every mode, this machine
    python bench/step_throughput.py --cases vsrn vsrn-paper --modes none model --window 10
    python bench/step_throughput.py --json docs/results/step_throughput_cpu2.json [--append]
    python bench/step_throughput.py --from docs/results/step_throughput_cpu2.json   # the table, no training
    python bench/step_throughput.py --cases vsrn-paper --modes step --set train.compile_mode=reduce-overhead --append ...

Each (case, mode) is one `python -m vldist.train <job>` as a user runs it (the job's own data,
workers and threads; no validation or untrained baseline), ended once its first stage has taken
two windows of `--window` steps (the progress records of metrics.jsonl, `train.log_every` =
window): the first window holds the warm-up and any compilation, the second is measured. Per row:

- samples/s and data-wait share: the second window's progress record;
- warm-up s: the first window's wall time (what compiling costs, beside the eager first window);
- FLOPs/sample: counted with torch's FlopCounterMode over one training step of the same model on
  one batch of the job's data, in this process, on CPU (matmuls, convolutions, attention: the usual
  MFU convention); MFU = FLOPs/sample x samples/s / the device's peak (CUDA cards vldist knows);
- peak memory: the run's peak CUDA allocation where it records one, else its peak resident size
  (VmHWM; each table says which);
- recompilations after warm-up: what the run records (compiled modes).

On CUDA the runs take `train.device=cuda engine.mixed_precision=bf16`; on CPU each job's own setting
(a job's `auto` is bf16 on a CPU with AMX or AVX512-BF16), and a case not in fp32 is marked with its
precision. The paper-size case is the demo job at the paper's VSRN sizes (B 128, 36 regions of
2,048, embed 2,048): the embedded shards' regions padded to 36, masked, so the step does the
paper's arithmetic. On CPU, where one such step
takes many seconds, its windows are of at most `--paper-window-cpu` steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# case -> (job, overrides, stage): every recipe's demo job, and VSRN at the paper's sizes. The stage
# measured is the job's first, except for CL, whose first stage is the captioner's (its own row), and
# the embedding network's phrase stage, a row of its own.
CASES = {
    "vsrn": ("vsrn", [], 0),
    "vsrn-paper": ("vsrn", ["model.embed_size=2048", "data.max_regions=36", "data.batch_size=128"], 0),
    "captioner": ("captioner", [], 0),
    "cl_caption": ("cl_caption", [], -1),
    "two_branch_embed": ("two_branch_embed", [], 0),
    "two_branch_embed-phrases": ("two_branch_embed", [], 1),  # its phrase stage: ~8,200 region rows a step
    "two_branch_sim": ("two_branch_sim", [], 0),
    "l2c": ("l2c", [], 0),
    "laviter": ("laviter", [], 0),
}
MODES = ["none", "model", "step"]
MEASURED = ["samples_per_s", "data_wait_share", "warmup_s", "flops_per_sample", "mfu", "peak_memory_mb"]


def run_args(case: str, device: str) -> list[str]:
    overrides = CASES[case][1]
    if device == "cuda":
        overrides = [*overrides, "train.device=cuda", "engine.mixed_precision=bf16"]
    return overrides


def stage_config(job: str, overrides: list[str], stage: int):
    """The configuration of the job's stage, and its directory under output.dir (a job of several
    stages runs each in its own)."""
    from vldist.recipes import get_recipe
    from vldist.recipes.jobs import load_config

    config = load_config(job, overrides)
    stages = get_recipe(config.recipe).stages(config)
    name, config = stages[stage]
    return config, (name if len(stages) > 1 else "")


def train_records(path: Path) -> list[dict]:
    """The progress records of one stage's metrics.jsonl."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip().endswith("}")]
    return [r for r in records if r.get("event") == "train"]


def timed_run(case: str, overrides: list[str], mode: str, window: int, batch: int, out: Path, timeout: float) -> dict:
    """One run until its second window is recorded; then it is ended (its test evaluation is not measured)."""
    job, _, stage = CASES[case]
    records_file = out / stage_config(job, overrides, stage)[1] / "metrics.jsonl"
    cmd = [
        sys.executable, "-m", "vldist.train", job, *overrides,
        f"output.dir={out}", f"train.max_steps={2 * window}", f"train.log_every={window}",
        "train.validate_every=0", "eval.baseline=false",
    ]  # fmt: skip
    if mode != "none":  # eager runs need no compile key: the same command measures commits from before it
        cmd.append(f"train.compile={mode}")
    log = (out.parent / f"{out.name}.log").open("w")
    deadline, proc, peak_kib = time.monotonic() + timeout, None, 0
    try:
        # its own session: ending it ends its loader workers and METEOR's JVM with it
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while time.monotonic() < deadline:
            peak_kib = max(peak_kib, resident_peak_kib(proc.pid))
            if proc.poll() is not None or len(train_records(records_file)) >= 2:
                break
            time.sleep(1.0)
    finally:  # also when this bench is ended (SIGTERM), and after an early exit (its workers)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the rest (checkpoint, test evaluation) is not measured
            proc.wait()
        log.close()
    records = train_records(records_file)
    if len(records) < 2:
        tail = (out.parent / f"{out.name}.log").read_text()[-1500:]
        ended = f"ran {timeout:.0f} s" if proc.returncode == -signal.SIGKILL else f"exited with {proc.returncode}"
        raise RuntimeError(f"{job} train.compile={mode}: {ended} before its second window:\n{tail}")
    warm, measured = records[0], records[1]
    peak_cuda = measured.get("cuda_peak_memory_bytes")
    return {
        "samples_per_s": measured["samples_per_second"],
        "data_wait_share": measured["data_wait_share"],
        "warmup_s": window * batch / warm["samples_per_second"],
        "recompilations": measured.get("recompilations"),
        "peak_memory_mb": (peak_cuda / 2**20) if peak_cuda else peak_kib / 1024,
        "peak_memory_kind": "cuda" if peak_cuda else "hwm",
    }


def resident_peak_kib(pid: int) -> int:
    """The process's peak resident size so far (VmHWM), 0 once it has gone. (Not the ru_maxrss of
    wait4: Linux starts a child's from its parent's peak, so it held this bench's own.)"""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def counted_flops(case: str, extra: list[str]) -> tuple[float, int]:
    """FLOPs of one training step (every update the recipe takes) over its samples, counted on CPU;
    and the step's samples. The weights are the initial ones (FLOPs do not depend on them)."""
    from torch.utils.flop_counter import FlopCounterMode

    from vldist.data.job_shards import build_missing, open_job_shards
    from vldist.data.streams import TrainingStreams
    from vldist.recipes import get_recipe

    job, overrides, stage = CASES[case]
    config, _ = stage_config(job, [*overrides, *extra, "data.workers=0", "train.device=cpu"], stage)
    recipe_cls = get_recipe(config.recipe)
    build_missing(config, recipe_cls)
    shards = open_job_shards(config, recipe_cls)
    with tempfile.TemporaryDirectory() as vocab_dir:
        vocab = shards.main.vocab(Path(vocab_dir), config.data.vocab_min_count, tuple(shards.others.values()))
    recipe = recipe_cls(config, vocab, shards.main.feature_dim())
    torch.manual_seed(config.seed)
    model = recipe.build_model()
    model.train()
    batch = next(iter(TrainingStreams(config, recipe, shards, 0, 1).batches(0)))
    samples = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))
    recipe.start_epoch(0)
    recipe.start_step(0)
    with FlopCounterMode(display=False) as counter:
        for update in recipe.updates(0):
            recipe.training_losses(model, batch, update)["loss"].backward()
    return counter.get_total_flops() / samples, samples


def device_label(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    cpuinfo = Path("/proc/cpuinfo")
    names = [
        line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
    ]
    return f"{names[0] if names else platform.machine()}, {os.cpu_count()} cores"


def measure(args, save=lambda results: None) -> dict:
    """Every (case, mode) run; `save` gets the results after each row (a run cut short keeps its rows)."""
    from vldist.distributed.precision import effective_precision
    from vldist.telemetry.flops import peak_flops

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            overrides = run_args(case, args.device) + args.set
            counted, batch = counted_flops(case, args.set)
            job, _, stage = CASES[case]
            # a job's auto: bf16 on a CPU with AMX or AVX512-BF16
            config = stage_config(job, overrides, stage)[0]
            precision = effective_precision(config.engine.mixed_precision, args.device)
            # the card's peak for what the step computes in (TF32 where fp32 matmuls may use it)
            peak = (
                peak_flops(device_label(args.device), precision, config.engine.tf32) if args.device == "cuda" else None
            )
            for mode in args.modes:
                print(f"{case} train.compile={mode} ...", flush=True)
                window = args.window
                if case == "vsrn-paper" and args.device == "cpu":
                    window = min(window, args.paper_window_cpu)
                row = {
                    "case": case,
                    "mode": mode,
                    "window": window,
                    "flops_per_sample": counted,
                    "precision": precision,
                }
                if args.set:
                    row["settings"] = args.set
                try:
                    row |= timed_run(case, overrides, mode, window, batch, Path(tmp) / f"{case}-{mode}", args.timeout)
                except RuntimeError as err:
                    row["error"] = str(err).splitlines()[0]
                    print(err, flush=True)
                if peak and "samples_per_s" in row:
                    row["mfu"] = counted * row["samples_per_s"] / peak
                rows.append(row)
                print(format_row(row), flush=True)
                save(results(args, rows))
    return results(args, rows)


def results(args, rows: list[dict]) -> dict:
    return {
        "machine": args.machine,
        "device": device_label(args.device),
        "torch": torch.__version__,
        "commands": [shlex.join(["python", "bench/step_throughput.py", *sys.argv[1:]])],
        "window": args.window,
        "rows": rows,
    }


PEAK_KINDS = {
    "cuda": "cuda: the run's peak CUDA allocation",
    "hwm": "hwm: the run's peak resident size on the host (VmHWM, read each second)",
    "rss": "rss (rows of an earlier bench): the run's ru_maxrss, which Linux starts from the bench's own "
    "peak, so an upper bound",
}
HEADER = (
    "| case | train.compile | samples/s | vs eager | data wait | warm-up s | GFLOP/sample | MFU | peak MB | recompiles |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def format_row(row: dict, eager: dict | None = None) -> str:
    # the case, with its precision where that is not fp32 (rows from before it was recorded: fp32 on CPU)
    case = row["case"] if row.get("precision", "no") == "no" else f"{row['case']} ({row['precision']})"
    mode = row["mode"] + (f" ({', '.join(row['settings'])})" if row.get("settings") else "")
    if "error" in row:
        return f"| {case} | {mode} | failed: {row['error']} |||||||"

    def num(key, fmt):
        value = row.get(key)
        return "n/a" if value is None else format(value, fmt)

    speedup = f"x{row['samples_per_s'] / eager['samples_per_s']:.2f}" if eager and "samples_per_s" in eager else ""
    mfu = "n/a" if row.get("mfu") is None else f"{100 * row['mfu']:.1f}%"
    flops = row.get("flops_per_sample")
    gflops = "n/a" if flops is None else f"{flops / 1e9:.2f}" if flops >= 1e8 else f"{flops / 1e9:.4f}"
    wait = "n/a" if row.get("data_wait_share") is None else f"{100 * row['data_wait_share']:.0f}%"
    return (
        f"| {case} | {mode} | {num('samples_per_s', '.1f' if row.get('samples_per_s', 100) < 100 else '.0f')} | {speedup} | {wait} | "
        f"{num('warmup_s', '.1f')} | {gflops} | {mfu} | {num('peak_memory_mb', '.0f')} | {num('recompilations', 'd')} |"
    )


def table(results: dict) -> str:
    windows = f"windows of {results['window']} steps"
    other = {r["window"] for r in results["rows"] if r["case"] == "vsrn-paper" and r["window"] != results["window"]}
    if other:
        windows += f" (vsrn-paper: {other.pop()})"
    lines = [
        f"{results['machine']}: {results['device']}, torch {results['torch']}, {windows}",
        *(f"`{command}`" for command in results["commands"]),
        "",
        HEADER,
    ]
    eager = {}  # each case's first plain eager row (files appended to may hold more)
    for row in results["rows"]:
        if row["mode"] == "none" and not row.get("settings"):
            eager.setdefault(row["case"], row)
    lines += [format_row(r, eager.get(r["case"]) if r is not eager.get(r["case"]) else None) for r in results["rows"]]
    kinds = {r.get("peak_memory_kind") for r in results["rows"] if "peak_memory_mb" in r}
    lines += [""] if kinds else []
    lines += [f"peak MB, {PEAK_KINDS[kind]}" for kind in sorted(kinds)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="KEY=VALUE", help="overrides for every run, recorded in each row"
    )
    parser.add_argument("--window", type=int, default=20, help="steps per progress window (two are run)")
    parser.add_argument("--paper-window-cpu", type=int, default=3, help="vsrn-paper's window on CPU")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take to its second window")
    parser.add_argument("--machine", default="cpu2", help="the machine's name in docs/benchmarks.md")
    parser.add_argument(
        "--json", type=Path, help="write the results here (docs/results/step_throughput_<machine>.json)"
    )
    parser.add_argument("--append", action="store_true", help="add the rows to those already in --json")
    parser.add_argument("--from", dest="source", type=Path, help="print the table of committed results; no runs")
    args = parser.parse_args()
    # ended by `timeout` (bench/gpu_checks.sh): unwind, so that the run in progress is ended too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.source:
        print(table(json.loads(args.source.read_text())))
        return
    # more cases measured on the same machine: added to the rows already there
    earlier = json.loads(args.json.read_text()) if args.json and args.append and args.json.exists() else None

    def save(measured: dict) -> dict:
        if earlier:
            measured = {**measured, "rows": earlier["rows"] + measured["rows"]}
            measured["commands"] = earlier["commands"] + measured["commands"]
        if args.json:  # whole or not at all: a bench ended mid-write leaves the last complete file
            partial = args.json.with_name(args.json.name + ".partial")
            partial.write_text(json.dumps(measured, indent=1) + "\n")
            os.replace(partial, args.json)
        return measured

    print()
    print(table(save(measure(args, save))))


if __name__ == "__main__":
    main()
