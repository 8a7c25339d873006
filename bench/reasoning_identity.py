"""Do the reasoning layers ever leave the identity? (issue 23, part 5)

    python bench/reasoning_identity.py RUN_DIR [RUN_DIR ...] [--split test] [--batches 4]
                                       [--shards DIR] [--device auto] [--json out.json]

VSRN's RRR layers and L2C's relation GCN are both vldist/models/gcn.py's RegionRelationReasoning,

    V* = V + BN(W_r (R g(V)))          BN's weight (gamma) and bias (beta) start at 0,

so every layer starts as the identity. For each run (a run directory or a checkpoint; a job of
several stages, such as L2C's baseline + l2c, is probed stage by stage) this loads the checkpoint
vldist.evaluate would (best, else the newest), reads a few batches of the eval split through the
same loader, and reports for every reasoning layer:

    |gamma| mean / max    the residual branch's BN weight (beta: mean |bias|)
    input rms             the layer input's rms per element (real regions): BN's output has unit
                          variance per channel, so a |gamma| of this size makes the branch as large
                          as the input; |gamma| is small or large only relative to it
    branch/input          ||BN branch output|| / ||layer input|| per sample over its real regions
                          (padding excluded), averaged over the samples read; max over samples too
    w/o beta              the same without the BN bias: beta shifts every region by one constant
                          vector; what depends on the regions, W_r (R g(V)), is gamma * its BN-normalised
    skip-all              what the layers change downstream: ||f - f_skip|| / ||f||, f the image
                          embedding (VSRN) or the pair's node difference (L2C), f_skip the same with
                          every reasoning layer replaced by the identity

and per run the optimizer settings the layers trained with (lr of their param group, weight
decay, which vldist applies to every parameter, BN's gamma included) and the real regions per
image of the split (VSRN: over the whole split; L2C: K nodes, all real). The ratios are measured
twice: with the model in eval mode as evaluation runs it (BN with its running statistics), and with
the reasoning layers' BNs on the batch's statistics as training sees them (a short run's running
variance is still mostly its initial 1). Measured with forward hooks: no model code changes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from contextlib import closing, nullcontext
from pathlib import Path

import torch

from vldist.checkpoint.format import find_checkpoint, read_meta
from vldist.checkpoint.trained_model import load_checkpoint
from vldist.errors import CheckpointError
from vldist.models.gcn import RegionRelationReasoning
from vldist.training.split_evaluation import SkipTally, eval_loader

RECIPES = ("vsrn", "l2c")


def reasoning_layers(model: torch.nn.Module) -> list[tuple[str, RegionRelationReasoning]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, RegionRelationReasoning)]


def _mask_of(args: tuple, kwargs: dict, v: torch.Tensor) -> torch.Tensor:
    mask = args[1] if len(args) > 1 else kwargs.get("mask")
    return torch.ones(v.shape[:2], dtype=torch.bool, device=v.device) if mask is None else mask.bool()


class BranchProbe:
    """Forward hooks on every RegionRelationReasoning of a model, recording per sample the norm of
    the residual branch's output over the sample's real regions and of the layer's input.

    The branch output is the layer's output minus its input (the layer is v + branch(v)); padded
    regions, zero in both, are left out explicitly all the same."""

    def __init__(self, model: torch.nn.Module):
        self.layers = reasoning_layers(model)
        self.records = {
            name: {"input": [], "branch": [], "branch_no_beta": [], "elements": []} for name, _ in self.layers
        }
        self.regions: list[torch.Tensor] = []  # real regions per sample, seen at the first layer
        self._handles = []

    def __enter__(self) -> BranchProbe:
        for i, (name, layer) in enumerate(self.layers):
            self._handles.append(layer.register_forward_hook(self._hook(name, layer, first=i == 0), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str, layer: RegionRelationReasoning, first: bool):
        def hook(module, args, kwargs, output):
            v = args[0] if args else kwargs["v"]
            mask = _mask_of(args, kwargs, v)
            keep = mask.unsqueeze(-1).to(v.dtype)
            branch = (output - v).float() * keep
            no_beta = (branch - layer.bn.bias.float()) * keep  # beta is added to real regions only
            rec = self.records[name]
            rec["input"].append(((v.float() * keep).flatten(1).norm(dim=1)).cpu())
            rec["branch"].append(branch.flatten(1).norm(dim=1).cpu())
            rec["branch_no_beta"].append(no_beta.flatten(1).norm(dim=1).cpu())
            rec["elements"].append((mask.sum(dim=1) * v.shape[-1]).cpu())
            if first:
                self.regions.append(mask.sum(dim=1).cpu())

        return hook

    def summary(self) -> dict[str, dict]:
        """Per layer: the ratios' mean and max over the samples seen (samples with no real region,
        or an all-zero input, have none)."""
        out = {}
        for name, _ in self.layers:
            rec, row = self.records[name], {}
            if rec["input"]:
                inp = torch.cat(rec["input"])
                real = inp > 0
                for key in ("branch", "branch_no_beta"):
                    ratio = torch.cat(rec[key])[real] / inp[real]
                    row[f"{key}_ratio_mean"] = ratio.mean().item() if len(ratio) else float("nan")
                    row[f"{key}_ratio_max"] = ratio.max().item() if len(ratio) else float("nan")
                row["samples"] = int(real.sum())
                # per-element rms of the input: a BN branch with |gamma| of this size is as large as
                # its input (BN's output has unit variance per channel)
                elements = torch.cat(rec["elements"])[real].double()
                row["input_rms"] = (inp[real].double() / elements.sqrt()).mean().item() if real.any() else float("nan")
            out[name] = row
        return out


def bn_weights(model: torch.nn.Module) -> dict[str, dict]:
    """|gamma| mean and max, |beta| mean and the mean running variance of every reasoning layer's BN."""
    out = {}
    for name, layer in reasoning_layers(model):
        gamma, beta = layer.bn.weight.detach().float().abs(), layer.bn.bias.detach().float().abs()
        out[name] = {
            "gamma_mean_abs": gamma.mean().item(),
            "gamma_max_abs": gamma.max().item(),
            "beta_mean_abs": beta.mean().item(),
            "running_var_mean": layer.bn.running_var.float().mean().item(),
            "bn_batches_tracked": int(layer.bn.num_batches_tracked),
        }
    return out


class BatchStatistics:
    """The reasoning layers' BNs normalise with the batch's statistics, as in training, while the
    rest of the model stays in eval mode; their running statistics are restored on exit."""

    def __init__(self, model: torch.nn.Module):
        self.bns = [layer.bn for _, layer in reasoning_layers(model)]
        self._saved = []

    def __enter__(self) -> BatchStatistics:
        self._saved = [{k: v.clone() for k, v in bn.named_buffers()} for bn in self.bns]
        for bn in self.bns:
            bn.train()
        return self

    def __exit__(self, *exc) -> None:
        for bn, saved in zip(self.bns, self._saved, strict=True):
            bn.eval()
            for k, v in bn.named_buffers():
                v.copy_(saved[k])


class SkipReasoning:
    """Every reasoning layer returns its input: the model as if the layers were the identity."""

    def __init__(self, model: torch.nn.Module):
        self.layers = reasoning_layers(model)
        self._handles = []

    def __enter__(self) -> SkipReasoning:
        for _, layer in self.layers:
            self._handles.append(
                layer.register_forward_hook(
                    lambda module, args, kwargs, output: args[0] if args else kwargs["v"], with_kwargs=True
                )
            )
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def forward_fn(recipe_name: str, model: torch.nn.Module, device: torch.device):
    """batch -> what the reasoning feeds downstream (the hooks see the layers on the way)."""
    if recipe_name == "vsrn":
        return lambda batch: model.embed_images(batch["regions"].to(device), batch["mask"].to(device))
    if recipe_name == "l2c":
        return lambda batch: model.features(batch["images"].to(device), batch["second"].to(device))[0]
    raise ValueError(f"reasoning_identity probes {', '.join(RECIPES)} runs, not {recipe_name!r}")


BN_MODES = ("running", "batch")


@torch.no_grad()
def measure(
    model: torch.nn.Module, batches, forward, max_batches: int | None = None, modes: tuple[str, ...] = BN_MODES
) -> dict:
    """Per-layer gamma, and per BN mode the branch/input ratios and the skip-all change of
    `forward`'s output, over the first `max_batches` batches (all with None).

    Modes: "running", the model in eval mode as evaluation runs it (BN with its running
    statistics); "batch", the reasoning layers' BNs with the batch's statistics, as training sees
    them (a short run's running variance is still mostly its initial 1: momentum 0.1, so after n
    steps 0.9^n of it remains). The model's mode and buffers are restored."""
    was_training = model.training
    model.eval()
    probes = {mode: BranchProbe(model) for mode in modes}
    changes: dict[str, list] = {mode: [] for mode in modes}
    used = 0
    try:
        for batch in itertools.islice(batches, max_batches):
            for mode, probe in probes.items():
                with BatchStatistics(model) if mode == "batch" else nullcontext():
                    with probe:
                        full = forward(batch).float()
                    if probe.layers:
                        with SkipReasoning(model):
                            skipped = forward(batch).float()
                        norm = full.flatten(1).norm(dim=1).clamp_min(1e-12)
                        changes[mode].append(((full - skipped).flatten(1).norm(dim=1) / norm).cpu())
            used += 1
    finally:
        model.train(was_training)
    weights = bn_weights(model)
    ratios = {mode: probe.summary() for mode, probe in probes.items()}
    layers = {name: {**row, **{mode: ratios[mode][name] for mode in modes}} for name, row in weights.items()}
    skip = {}
    for mode in modes:
        change = torch.cat(changes[mode]) if changes[mode] else torch.zeros(0)
        skip[mode] = {"mean": change.mean().item(), "max": change.max().item()} if len(change) else None
    first = next(iter(probes.values()))
    regions = torch.cat(first.regions) if first.regions else torch.zeros(0)
    return {"layers": layers, "batches": used, "skip_all_change": skip, "regions_seen": _counts(regions)}


def _counts(regions: torch.Tensor) -> dict | None:
    if not len(regions):
        return None
    return {
        "mean": regions.double().mean().item(),
        "min": int(regions.min()),
        "max": int(regions.max()),
        "images": len(regions),
    }


def training_settings(config, recipe, model: torch.nn.Module, layers) -> dict:
    """The lr and weight decay the reasoning layers' parameters were optimised with."""
    t = config.train
    settings = {
        "optimizer": t.optimizer,
        "lr": t.lr,
        "weight_decay": t.weight_decay,
        "lr_schedule": t.lr_schedule,
        "warmup_steps": t.warmup_steps,
        "lr_decay_epochs": t.lr_decay_epochs,
        "lr_decay_factor": t.lr_decay_factor,
        "grad_clip": t.grad_clip,
        "max_steps": t.max_steps,
        "epochs": t.epochs,
    }
    if layers:
        gamma = layers[0][1].bn.weight
        for opt_name, params in recipe.optimizer_groups(model).items():
            for group in params if params and isinstance(params[0], dict) else [{"params": params}]:
                if any(p is gamma for p in group["params"]):
                    settings["layer_optimizer"] = opt_name
                    settings["layer_lr"] = group.get("lr", t.lr)
                    settings["layer_weight_decay"] = group.get("weight_decay", t.weight_decay)
    return settings


def split_regions(config, recipe, shard_set, split: str) -> dict | None:
    """Real regions per image over the whole split (VSRN's padded region batches)."""
    counts = []
    tally = SkipTally(f"the {split} split of {shard_set.directory}")
    with closing(tally.batches(eval_loader(config, recipe, shard_set, split))) as batches:
        for batch in batches:
            counts.append(batch["mask"].sum(dim=1))
    return _counts(torch.cat(counts)) if counts else None


def run_dirs(path: Path) -> list[Path]:
    """The run itself, or each stage of a job of several stages (L2C: cnn_lstm, then l2c)."""
    try:
        find_checkpoint(path)
        return [path]
    except CheckpointError:
        stages = sorted(sub.parent for sub in path.glob("*/checkpoints") if sub.is_dir()) if path.is_dir() else []
        if stages and not (path / "checkpoints").is_dir():
            return stages
        raise


def probe_run(
    path: Path, split: str = "test", batches: int = 4, shards: str | None = None, device: str = "auto"
) -> dict:
    config, recipe, model, shard_set = load_checkpoint(path, shards, device)
    ckpt = find_checkpoint(path)
    meta = read_meta(ckpt)
    layers = reasoning_layers(model)
    # paths as results files keep them: the run relative to the working directory, the checkpoint to the run
    run = path.resolve()
    shown = run.relative_to(Path.cwd()) if run.is_relative_to(Path.cwd()) else Path(run.name)
    result = {
        "run": str(shown),
        "checkpoint": str(ckpt.resolve().relative_to(run)) if ckpt.resolve().is_relative_to(run) else ckpt.name,
        "recipe": config.recipe,
        "split": split,
        "step": meta.get("step"),
        "epoch": meta.get("epoch"),
        "training": training_settings(config, recipe, model, layers),
    }
    if config.recipe == "l2c":
        result["architecture"] = config.model.architecture
    if not layers:
        result["layers"] = {}
        result["note"] = "no reasoning layers in this model"
        return result
    if config.recipe not in RECIPES:
        raise ValueError(f"{path}: a {config.recipe} run; reasoning_identity probes {', '.join(RECIPES)} runs")
    dev = next(model.parameters()).device
    tally = SkipTally(f"the {split} split of {shard_set.directory}")
    with closing(tally.batches(eval_loader(config, recipe, shard_set, split))) as loaded:
        result.update(measure(model, loaded, forward_fn(config.recipe, model, dev), batches))
    if config.recipe == "vsrn":
        result["split_regions"] = split_regions(config, recipe, shard_set, split)
        result["max_regions"] = config.data.max_regions
    else:  # L2C's nodes are the K semantic classes (1 with average pooling), never padded
        result["split_regions"] = result["regions_seen"]
        result["regions_note"] = "L2C graph nodes = semantic classes, all real"
    return result


def _fmt(x, spec: str = ".2e") -> str:
    return "-" if x is None else format(x, spec)


def table(result: dict) -> str:
    lines = [
        f"{result['recipe']}"
        + (f" ({result['architecture']})" if "architecture" in result else "")
        + f"  {result['checkpoint']}  step {result.get('step')}  split {result['split']}"
    ]
    t = result["training"]
    lines.append(
        f"  trained with {t['optimizer']} lr {t.get('layer_lr', t['lr']):g} "
        f"weight_decay {t.get('layer_weight_decay', t['weight_decay']):g} (applied to BN gamma too) "
        f"schedule {t['lr_schedule']} warmup {t['warmup_steps']} grad_clip {t['grad_clip']}"
    )
    regions = result.get("split_regions")
    if regions:
        lines.append(
            f"  regions per image: mean {regions['mean']:.2f} min {regions['min']} max {regions['max']} "
            f"over {regions['images']} images"
            + (
                f" (max_regions {result['max_regions']})"
                if "max_regions" in result
                else f" ({result.get('regions_note')})"
            )
        )
    if not result["layers"]:
        lines.append(f"  {result.get('note', 'no reasoning layers')}")
        return "\n".join(lines)
    header = (
        f"  {'':<16}{'':>10}{'':>10}{'':>10}{'BN':>10}{'input':>10}  | {'eval (running stats)':<31}"
        "| batch stats (training)"
    )
    header2 = (
        f"  {'layer':<16}{'|gamma|':>10}{'|gamma|':>10}{'|beta|':>10}{'running':>10}{'rms per':>10}  | "
        f"{'branch/':>9}{'':>11}{'w/o':>9}  | {'branch/':>9}{'':>11}{'w/o':>9}"
    )
    header3 = (
        f"  {'':<16}{'mean':>10}{'max':>10}{'mean':>10}{'var':>10}{'element':>10}  | "
        f"{'input':>9}{'(max)':>11}{'beta':>9}  | {'input':>9}{'(max)':>11}{'beta':>9}"
    )
    lines += [header, header2, header3, "  " + "-" * (len(header3) - 2)]
    for name, row in result["layers"].items():
        cells = [
            f"  {name:<16}{_fmt(row['gamma_mean_abs'], '.1e'):>10}{_fmt(row['gamma_max_abs'], '.1e'):>10}"
            f"{_fmt(row['beta_mean_abs'], '.1e'):>10}{_fmt(row['running_var_mean'], '.1e'):>10}"
            f"{_fmt(row.get('running', {}).get('input_rms'), '.1e'):>10}  "
        ]
        for mode in BN_MODES:
            r = row.get(mode, {})
            cells.append(
                f"| {_fmt(r.get('branch_ratio_mean'), '.1e'):>9}{_fmt(r.get('branch_ratio_max'), '.1e'):>11}"
                f"{_fmt(r.get('branch_no_beta_ratio_mean'), '.1e'):>9}  "
            )
        lines.append("".join(cells).rstrip())
    samples = next(iter(result["layers"].values())).get(BN_MODES[0], {}).get("samples")
    skip = result["skip_all_change"]
    lines.append(
        "  skip all layers (identity): output changes by ||f - f_skip|| / ||f|| = "
        + ", ".join(
            f"{_fmt(skip[m]['mean'], '.2e')} (max {_fmt(skip[m]['max'], '.2e')}) with {m} stats"
            for m in BN_MODES
            if skip.get(m)
        )
        + f"; {result['batches']} batches, {samples} samples"
    )
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    """One markdown row per probed run: its reasoning layers' BN weight, the residual branch
    against the layer's input (evaluation mode, over real regions), and what skipping all of them
    changes; each over the layers, as mean (min-max)."""

    def spread(values: list[float]) -> str:
        return f"{sum(values) / len(values):.3g} ({min(values):.2g}-{max(values):.2g})"

    head = [
        "run",
        "step",
        "layers",
        "mean \\|gamma\\|",
        "branch / input",
        "input RMS per element",
        "skipping them changes the output by",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        layers = list(r["layers"].values())
        if not layers:
            lines.append(f"| {r['run']} | {r['step']} | 0 | – | – | – | – |")
            continue
        lines.append(
            "| "
            + " | ".join(
                [
                    r["run"],
                    str(r["step"]),
                    str(len(layers)),
                    spread([x["gamma_mean_abs"] for x in layers]),
                    spread([x["running"]["branch_ratio_mean"] for x in layers]),
                    spread([x["running"]["input_rms"] for x in layers]),
                    f"{r['skip_all_change']['running']['mean']:.3g}",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path, help="run directories or checkpoints (vsrn or l2c)")
    parser.add_argument(
        "--from",
        dest="from_results",
        type=Path,
        metavar="JSON",
        help="print the summary table of a --json file and probe nothing",
    )
    parser.add_argument("--split", default="test")
    parser.add_argument("--batches", type=int, default=4, help="eval batches run through the model")
    parser.add_argument("--shards", help="shard directory (default: the one each run was trained on)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args(argv)
    if args.from_results is not None:
        print(summary(json.loads(args.from_results.read_text())))
        return 0
    if not args.runs:
        parser.error("give run directories to probe, or --from a results file")
    results = []
    for path in args.runs:
        try:
            for run in run_dirs(path):
                result = probe_run(run, args.split, args.batches, args.shards, args.device)
                print(table(result) + "\n")
                results.append(result)
        except (CheckpointError, ValueError) as err:
            print(f"error: {path}: {err}", file=sys.stderr)
            return 2
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
