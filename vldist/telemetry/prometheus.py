"""Prometheus metrics of one training rank, served on `metrics.host:metrics.port + local_rank`.

Names follow Prometheus conventions: the `vldist_` prefix, base units (seconds, bytes), `_total`
on counters (prometheus-client adds it). Every series carries `job`, `recipe`, `rank` and `host` labels;
scrape with `honor_labels: true` so that the `job` label is vldist's (cluster/prometheus/).
Each rank counts its own samples and steps: sum over `rank` for the job's totals.
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, start_http_server

from vldist.distributed.collectives import gather_objects
from vldist.file_integrity import write_json_atomic
from vldist.launch.network import node_address

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
WAIT_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
SAVE_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
TARGETS_FILE = "targets.json"  # in metrics.targets_dir: every rank's endpoint, for Prometheus file_sd


log = logging.getLogger("vldist.metrics")
disable_created_metrics()  # no `*_created` series beside every counter and histogram


class MetricsPortInUse(OSError):
    pass


def start_rank_metrics(config, rank: int, local_rank: int) -> RankMetrics | None:
    """This rank's exporter, or None when metrics are off or the port is taken (training goes on).
    Collective where metrics.targets_dir is set: rank 0 writes every rank's endpoint there."""
    m = config.metrics
    if not m.enabled:
        return None
    host = node_address() if m.host == "node" else m.host
    metrics = None
    try:
        metrics = RankMetrics(host, m.port + local_rank, m.job.format(recipe=config.recipe), config.recipe, rank)
    except MetricsPortInUse as err:
        log.warning("%s; training goes on without metrics", err)
    if metrics is not None and rank == 0:
        log.info("Prometheus metrics on http://%s:%d/metrics (rank r: port %d + local rank)", host, m.port, m.port)
    if m.targets_dir:
        entries = gather_objects(target_entry(metrics, host) if metrics is not None else None)
        if rank == 0:
            write_targets(Path(m.targets_dir), [e for e in entries if e is not None])
    return metrics


def target_entry(metrics: RankMetrics, host: str) -> dict:
    """One rank's endpoint as a Prometheus file_sd entry; a bind-all host is advertised by the
    address the other nodes reach this one at."""
    address = node_address() if host in ("0.0.0.0", "::", "") else host
    return {"targets": [f"{address}:{metrics.port}"], "labels": metrics.labels}


def write_targets(directory: Path, entries: list[dict]) -> Path:
    """Every rank's endpoint in one Prometheus file_sd file, <directory>/targets.json, written by
    rank 0 (so its node needs no disk shared with the others): a Prometheus with
    `file_sd_configs: [{files: [<directory>/*.json]}]` finds every rank wherever the scheduler put
    it. Written atomically (Prometheus rereads the file as it changes)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / TARGETS_FILE
    write_json_atomic(path, entries)
    return path


class RankMetrics:
    """The metrics of one rank and the HTTP endpoint that serves them."""

    def __init__(self, host: str, port: int, job: str, recipe: str, rank: int):
        self.registry = registry = CollectorRegistry()
        self.labels = {"job": job, "recipe": recipe, "rank": str(rank), "host": socket.gethostname()}
        self._children: dict[tuple, object] = {}
        names = list(self.labels)

        def metric(kind, name, doc, extra=(), **kw):
            return kind(name, doc, [*names, *extra], registry=registry, **kw)

        self.samples = metric(Counter, "vldist_samples", "training samples this rank processed")
        self.steps = metric(Counter, "vldist_steps", "optimizer steps this rank took")
        self.source_samples = metric(
            Counter, "vldist_source_samples", "training samples this rank took from each of data.sources", ["source"]
        )
        self.skipped = metric(Counter, "vldist_skipped_samples", "corrupt samples this rank's loader skipped")
        self.samples_per_second = metric(
            Gauge, "vldist_samples_per_second", "this rank's samples per second, last step"
        )
        self.step_seconds = metric(
            Histogram,
            "vldist_step_seconds",
            "compute time of an optimizer step (forward, backward, update)",
            buckets=STEP_BUCKETS,
        )
        self.data_wait_seconds = metric(
            Histogram,
            "vldist_data_wait_seconds",
            "time the training loop blocked on the loader before a step",
            buckets=WAIT_BUCKETS,
        )
        self.own_seconds = metric(
            Gauge,
            "vldist_step_own_seconds",
            "this rank's own time of the last step: compute and data wait, without "
            "the time it waited in collectives for the other ranks (the straggler has the largest)",
        )
        self.loss = metric(Gauge, "vldist_loss", "global batch loss of the last step, by component", ["component"])
        self.learning_rate = metric(Gauge, "vldist_learning_rate", "learning rate of the last step")
        self.grad_norm = metric(Gauge, "vldist_grad_norm", "global gradient norm before clipping, last step")
        self.checkpoint_save_seconds = metric(
            Histogram, "vldist_checkpoint_save_seconds", "time to write a checkpoint", buckets=SAVE_BUCKETS
        )
        self.recompilations = metric(
            Counter,
            "vldist_recompilations",
            "graphs torch.compile compiled after warm-up (train.compile; 0 in a steady run)",
        )
        self._recompilations_seen = 0
        self.restarts = metric(Gauge, "vldist_restarts", "times this run was resumed from a checkpoint")
        self.cuda_memory_allocated_bytes = metric(Gauge, "vldist_cuda_memory_allocated_bytes", "CUDA memory allocated")
        self.model_flops_utilization = metric(
            Gauge, "vldist_model_flops_utilization", "achieved model FLOP/s over the device's peak (0-1)"
        )
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=registry)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise MetricsPortInUse(
                    f"metrics port {host}:{port} is in use (another run?): set metrics.port to a free base port, "
                    "or metrics.enabled=false"
                ) from None
            raise
        self.port = port

    def _l(self, metric, **extra):
        """The series of `metric` with this rank's labels; looked up once, then reused every step."""
        key = (id(metric), *extra.values())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self.labels, **extra)
        return child

    def observe_step(
        self,
        *,
        samples: int,
        step_seconds: float,
        wait_seconds: float,
        losses: dict[str, float],
        lr: float,
        grad_norm: float,
        skipped: int = 0,
        own_seconds: float | None = None,
        recompilations: int = 0,
        sources: dict[str, int] | None = None,
    ) -> None:
        """`recompilations`: this process's count so far (the counter goes up by what is new);
        `sources`: this step's samples from each of data.sources."""
        self._l(self.samples).inc(samples)
        for source, count in (sources or {}).items():
            self._l(self.source_samples, source=source).inc(count)
        self._l(self.steps).inc()
        if skipped:
            self._l(self.skipped).inc(skipped)
        self._l(self.samples_per_second).set(samples / max(step_seconds + wait_seconds, 1e-9))
        self._l(self.step_seconds).observe(step_seconds)
        self._l(self.data_wait_seconds).observe(wait_seconds)
        if own_seconds is not None:
            self._l(self.own_seconds).set(own_seconds)
        for component, value in losses.items():
            if not component.endswith("grad_norm"):
                self._l(self.loss, component=component).set(value)
        self._l(self.learning_rate).set(lr)
        self._l(self.grad_norm).set(grad_norm)
        self._l(self.recompilations).inc(max(recompilations - self._recompilations_seen, 0))
        self._recompilations_seen = max(recompilations, self._recompilations_seen)

    def observe_checkpoint(self, seconds: float) -> None:
        self._l(self.checkpoint_save_seconds).observe(seconds)

    def set_restarts(self, restarts: int) -> None:
        self._l(self.restarts).set(restarts)

    def set_device(self, cuda_memory_bytes: int | None = None, mfu: float | None = None) -> None:
        if cuda_memory_bytes is not None:
            self._l(self.cuda_memory_allocated_bytes).set(cuda_memory_bytes)
        if mfu is not None:
            self._l(self.model_flops_utilization).set(mfu)

    def close(self, linger_seconds: float = 0.0) -> None:
        """Stop serving, after `linger_seconds` so that a last scrape sees the final values."""
        if linger_seconds > 0:
            time.sleep(linger_seconds)
        self.server.shutdown()
        self.server.server_close()
