"""The exporter serves the documented metric names, with their types and labels."""

import socket
import urllib.request

import pytest
from helpers import free_port
from prometheus_client.parser import text_string_to_metric_families

from vldist.telemetry.prometheus import MetricsPortInUse, RankMetrics

DOCUMENTED = {
    "vldist_samples": "counter",
    "vldist_steps": "counter",
    "vldist_skipped_samples": "counter",
    "vldist_samples_per_second": "gauge",
    "vldist_step_seconds": "histogram",
    "vldist_data_wait_seconds": "histogram",
    "vldist_loss": "gauge",
    "vldist_learning_rate": "gauge",
    "vldist_grad_norm": "gauge",
    "vldist_checkpoint_save_seconds": "histogram",
    "vldist_restarts": "gauge",
    "vldist_cuda_memory_allocated_bytes": "gauge",
    "vldist_model_flops_utilization": "gauge",
    "vldist_step_own_seconds": "gauge",
    "vldist_recompilations": "counter",
    "vldist_source_samples": "counter",
}


@pytest.fixture
def exporter():
    metrics = RankMetrics("127.0.0.1", free_port(), job="demo", recipe="vsrn", rank=1)
    yield metrics
    metrics.close()


def _scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("vldist_")}


def test_names_types_and_labels(exporter):
    exporter.observe_step(
        samples=16,
        step_seconds=0.2,
        wait_seconds=0.05,
        lr=1e-3,
        grad_norm=2.5,
        skipped=2,
        losses={"loss": 3.0, "matching": 2.0, "caption": 1.0, "grad_norm": 2.5},
        own_seconds=0.15,
        recompilations=2,
        sources={"main": 11, "other": 5},
    )
    exporter.observe_checkpoint(0.7)
    exporter.set_restarts(1)
    exporter.set_device(cuda_memory_bytes=1024, mfu=0.4)
    families = _scrape(exporter.port)
    assert {name: f.type for name, f in families.items()} == DOCUMENTED
    for family in families.values():
        for sample in family.samples:
            assert {
                "job": "demo",
                "recipe": "vsrn",
                "rank": "1",
                "host": socket.gethostname(),
            }.items() <= sample.labels.items(), sample
    values = {(s.name, s.labels.get("component")): s.value for f in families.values() for s in f.samples}
    assert values[("vldist_samples_total", None)] == 16
    assert values[("vldist_steps_total", None)] == 1
    assert values[("vldist_skipped_samples_total", None)] == 2
    assert values[("vldist_samples_per_second", None)] == pytest.approx(16 / 0.25)
    assert values[("vldist_step_seconds_sum", None)] == pytest.approx(0.2)
    assert values[("vldist_data_wait_seconds_count", None)] == 1
    assert values[("vldist_loss", "caption")] == 1.0 and ("vldist_loss", "grad_norm") not in values
    assert values[("vldist_checkpoint_save_seconds_sum", None)] == pytest.approx(0.7)
    assert values[("vldist_step_own_seconds", None)] == pytest.approx(0.15)
    assert values[("vldist_recompilations_total", None)] == 2
    by_source = {
        s.labels["source"]: s.value for s in families["vldist_source_samples"].samples if s.name.endswith("_total")
    }
    assert by_source == {"main": 11, "other": 5}


def test_the_endpoint_binds_to_loopback_and_a_taken_port_is_named(exporter):
    assert exporter.server.server_address[0] == "127.0.0.1"
    with pytest.raises(MetricsPortInUse, match=f"127.0.0.1:{exporter.port} is in use.*metrics.port"):
        RankMetrics("127.0.0.1", exporter.port, job="demo", recipe="vsrn", rank=0)


def test_the_file_sd_file_lists_every_rank(exporter, tmp_path):
    import json

    from vldist.telemetry.prometheus import target_entry, write_targets

    entry = target_entry(exporter, "127.0.0.1")
    assert entry == {
        "targets": [f"127.0.0.1:{exporter.port}"],
        "labels": {"job": "demo", "recipe": "vsrn", "rank": "1", "host": socket.gethostname()},
    }
    other = {"targets": ["198.18.0.2:9400"], "labels": {**entry["labels"], "rank": "0", "host": "node1"}}
    path = write_targets(tmp_path / "targets", [other, entry])
    assert path.name == "targets.json" and json.loads(path.read_text()) == [other, entry]
    everywhere = target_entry(exporter, "0.0.0.0")
    assert not everywhere["targets"][0].startswith("0.0.0.0")  # a bind-all host is advertised by address


def test_node_address_is_the_one_towards_the_rendezvous_host():
    from vldist.launch.network import node_address

    assert node_address({}) == "127.0.0.1"  # one host: loopback
    assert node_address({"MASTER_ADDR": "127.0.0.1"}) == "127.0.0.1"
    assert node_address({"MASTER_ADDR": "no-such-host.invalid"}) == "127.0.0.1"


def test_the_grafana_dashboard_and_scrape_config_use_only_exported_names():
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    dashboard = json.loads((root / "cluster" / "grafana" / "vldist.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exported = {f"{name}_total" if kind == "counter" else name for name, kind in DOCUMENTED.items()}
    used = {re.sub(r"_(sum|count|bucket)$", "", n) for e in exprs for n in re.findall(r"vldist_\w+", e)}
    assert used <= exported, used - exported
    assert {
        "vldist_samples_total",
        "vldist_data_wait_seconds",
        "vldist_loss",
        "vldist_learning_rate",
        "vldist_model_flops_utilization",
        "vldist_cuda_memory_allocated_bytes",
    } <= used
    assert "honor_labels: true" in (root / "cluster" / "prometheus" / "prometheus.yml").read_text()
