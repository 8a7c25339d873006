"""What rank 0 shows and records of training: a progress bar (throughput, ETA) on a terminal, a
progress line every `train.log_every` steps (the record in logs, where bars are noise), and the
same numbers as JSON lines in `<output dir>/metrics.jsonl`. Other ranks stay quiet."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger("vldist.train")


def hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class TrainingProgress:
    def __init__(self, enabled: bool, total_steps: int, first_step: int, log_every: int, jsonl: Path, sink=None):
        """sink(entry): also receives every record (the experiment trackers, trackers.py)."""
        self.enabled, self.total_steps, self.log_every, self.jsonl = enabled, total_steps, log_every, jsonl
        self.sink = sink
        # disable=None: a bar only on a terminal; logs and `ray job logs` get the lines instead
        self.bar = tqdm(
            total=total_steps,
            initial=first_step,
            unit="step",
            desc="train",
            dynamic_ncols=True,
            disable=None if enabled else True,
        )
        if enabled:
            jsonl.parent.mkdir(parents=True, exist_ok=True)
        self._reset()

    def _reset(self) -> None:
        self.start, self.samples, self.steps, self.wait = time.perf_counter(), 0, 0, 0.0

    def step(
        self,
        *,
        epoch: int,
        step: int,
        samples: int,
        wait: float,
        losses: dict,
        lr: float,
        note: str | None = None,
        recompilations: int | None = None,
        sources: dict[str, int] | None = None,
        cuda_peak_memory_bytes: int | None = None,
    ) -> None:
        """After each optimizer step; `samples` counts every rank's rows; `note` ends the progress
        line (the straggler the watchdog names); `recompilations`: under train.compile, the graphs
        compiled after warm-up so far (training/compiling.py), else None; `sources`: with data.sources,
        the samples trained on from each source so far in the run; `cuda_peak_memory_bytes`: on CUDA,
        the most this rank has had allocated so far."""
        self.samples, self.steps, self.wait = self.samples + samples, self.steps + 1, self.wait + wait
        if not self.enabled:
            return
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        rate = self.samples / elapsed
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{losses['loss']:.3f}", samples_s=f"{rate:.0f}", refresh=False)
        if step % self.log_every and step != self.total_steps:
            return
        eta = (self.total_steps - step) * elapsed / self.steps
        parts = " ".join(f"{k} {v:.3f}" for k, v in losses.items() if not k.endswith("grad_norm"))
        self.write(
            f"epoch {epoch + 1} step {step}/{self.total_steps} | {parts} | lr {lr:.2e} | grad {losses['grad_norm']:.2f} "
            f"| {rate:.0f} samples/s | data wait {100 * self.wait / elapsed:.0f}% | eta {hms(eta)}"
            + (f" | recompiled {recompilations}" if recompilations else "")
            + (f" | slowest: {note}" if note else "")
        )
        self.record(
            {
                "event": "train",
                "epoch": epoch + 1,
                "step": step,
                **losses,
                "lr": lr,
                "samples_per_second": rate,
                "data_wait_share": self.wait / elapsed,
                "eta_seconds": eta,
                **({"recompilations": recompilations} if recompilations is not None else {}),
                **({"cuda_peak_memory_bytes": cuda_peak_memory_bytes} if cuda_peak_memory_bytes is not None else {}),
                **({"samples_by_source": dict(sources)} if sources else {}),
                **({"straggler": note} if note else {}),
            }
        )
        self._reset()

    def write(self, line: str) -> None:
        if self.enabled:
            with tqdm.external_write_mode():  # the bar steps aside for the line
                log.info(line)

    def record(self, entry: dict) -> None:
        if not self.enabled:
            return
        if self.sink is not None:
            self.sink(entry)
        if self.jsonl is None:
            return
        try:
            with open(self.jsonl, "a") as fh:
                fh.write(json.dumps({"time": time.time(), **entry}) + "\n")
        except OSError as err:  # a full disk: training goes on, and the checkpoint save reports it
            log.warning("cannot append to %s (%s); progress records stop here, progress lines go on", self.jsonl, err)
            self.jsonl = None

    def close(self) -> None:
        self.bar.close()


def eval_batches(batches, total: int | None, split: str, enabled: bool):
    """Evaluation batches behind a progress bar (on a terminal, rank 0)."""
    return tqdm(
        batches,
        total=total,
        unit="batch",
        desc=f"eval {split}",
        leave=False,
        dynamic_ncols=True,
        disable=None if enabled else True,
    )
