"""Experiment trackers beside Prometheus (`metrics.trackers`): TensorBoard, Weights & Biases and
MLflow, each through its own client, written by rank 0 alone.

They receive what `metrics.jsonl` receives (progress.py): every progress window's losses, learning
rate, samples/s and data-wait share as `train/...`, each validation's numbers as `val/...`, the
final evaluation's as `test/...`, all at the optimizer step; captioning recipes add a table of
generated captions beside their references (`captions/<split>`) at each evaluation.

Where they write (`metrics.trackers_dir`, default `<output dir>/trackers`): TensorBoard event files
in `tensorboard/`; a W&B run in `wandb/` (offline unless `metrics.wandb_mode=online`, which reads
WANDB_API_KEY from the environment; `wandb sync` uploads an offline run later); MLflow runs at
`metrics.mlflow_tracking_uri`, by default a file store in `mlruns/`. The experiment or project is
`metrics.job`, the run is named after the output directory.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import os
import time
from pathlib import Path

from vldist.errors import ConfigError

log = logging.getLogger("vldist.metrics")

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny"}
SCOPES = {"train": "train", "validation": "val", "test": "test"}
CAPTION_COLUMNS = ["image", "generated", "references"]


def check_installed(names) -> None:
    """Refuse, on every rank alike, a tracker whose package is missing (before any rank trains)."""
    for name in names:
        if importlib.util.find_spec(PACKAGES[name].split("-")[0]) is None:
            raise ConfigError(
                f"metrics.trackers lists {name}, but its package is not installed: pip install '{PACKAGES[name]}' "
                "(or pip install 'vldist[trackers]' for all three), or drop it from metrics.trackers"
            )


def _require(name: str):
    check_installed([name])
    return importlib.import_module(
        {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "mlflow": "mlflow"}[name]
    )


class TensorBoardTracker:
    def __init__(self, directory: Path, run: str, config: dict):
        writer_class = _require("tensorboard").SummaryWriter
        self.writer = writer_class(str(directory / "tensorboard" / run))
        self.writer.add_text("config", _markdown_table(["key", "value"], _flat(config).items()), 0)

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self.writer.add_text(name, _markdown_table(columns, rows), step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, directory: Path, run: str, config: dict, project: str, mode: str):
        self.wandb = _require("wandb")
        os.environ.setdefault("WANDB_SILENT", "true")  # its banner would interleave with the progress lines
        directory.mkdir(parents=True, exist_ok=True)
        self.run = self.wandb.init(
            mode=mode,
            dir=str(directory),
            project=project,
            name=run,
            config=config,
            settings=self.wandb.Settings(console="off"),
        )

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self.run.log({name: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, uri: str, run: str, config: dict, experiment: str):
        mlflow = _require("mlflow")
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store in maintenance mode and refuses it unless asked; a local
            # directory needs no database or server, which is what a training job on a node wants
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param

        self.Metric = Metric
        self.client = mlflow.tracking.MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in _flat(config).items()]
        for first in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[first : first + 100])

    def log(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.Metric(k, v, now, step) for k, v in values.items()])

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self.client.log_table(
            self.run_id,
            data={c: [r[i] for r in rows] for i, c in enumerate(columns)},
            artifact_file=f"{name}/step-{step:08d}.json",
        )

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackers:
    """Every tracker the job lists, fed from rank 0's progress records."""

    def __init__(self, trackers: list):
        self.trackers = trackers

    @classmethod
    def start(cls, config, is_main: bool) -> Trackers | None:
        m = config.metrics
        check_installed(m.trackers)
        if not m.trackers or not is_main:
            return None
        directory = Path(m.trackers_dir) if m.trackers_dir else config.output_dir / "trackers"
        run, job = config.output_dir.name, m.job.format(recipe=config.recipe)
        settings = config.model_dump(mode="json")
        made = {
            "tensorboard": lambda: TensorBoardTracker(directory, run, settings),
            "wandb": lambda: WandbTracker(directory, run, settings, job, m.wandb_mode),
            "mlflow": lambda: MlflowTracker(
                m.mlflow_tracking_uri or (directory / "mlruns").resolve().as_uri(), run, settings, job
            ),
        }
        trackers = [made[name]() for name in dict.fromkeys(m.trackers)]
        log.info("trackers: %s, in %s", ", ".join(m.trackers), directory)
        return cls(trackers)

    def record(self, entry: dict) -> None:
        """One progress record (metrics.jsonl's): its numbers, at its step."""
        scope = SCOPES.get(entry.get("event"))
        if scope is None:
            return
        values = {
            f"{scope}/{k}": float(v)
            for k, v in entry.items()
            if k not in ("event", "epoch", "step", "time")
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
            and math.isfinite(v)
        }
        self._each("log", values, entry["step"])

    def examples(self, split: str, step: int, examples: list[dict]) -> None:
        """A captioning evaluation's generated captions beside their references."""
        rows = [[str(e["key"]), e["generated"], " | ".join(e["references"])] for e in examples]
        self._each("table", f"captions/{split}", CAPTION_COLUMNS, rows, step)

    def close(self) -> None:
        self._each("close")

    def _each(self, method: str, *args) -> None:
        for tracker in self.trackers:
            try:
                getattr(tracker, method)(*args)
            except Exception as err:  # noqa: BLE001 - a tracker's failure must not end the training it records
                log.warning("%s: %s failed (%s); training goes on", type(tracker).__name__, method, err)


def _flat(config: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _markdown_table(columns: list[str], rows) -> str:
    def cell(v) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
