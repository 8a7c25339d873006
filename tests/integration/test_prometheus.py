"""A real Prometheus server scrapes a real 2-process training run (Debian's `prometheus` binary).

Prometheus runs on 127.0.0.1 with its own config and storage dir, scraping both ranks every
second; the run keeps its endpoints up for 3 s after training (metrics.linger_seconds) so that the
last scrape sees the final counters.
"""

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
from helpers import free_port, free_port_pair

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="needs the prometheus binary (apt-get install prometheus)")

JOB = [
    "model.embed_size=32",
    "model.decoder_hidden=32",
    "model.word_dim=16",
    "data.batch_size=32",
    "data.shuffle_buffer=50",
    "data.eval_batch_size=64",
    "train.epochs=3",
    "eval.baseline=false",
    "engine.sync_batchnorm=true",
    "metrics.linger_seconds=3",
    "metrics.job=scraped",
]


@pytest.fixture
def prometheus(tmp_path):
    base, web = free_port_pair(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: vldist\n"
        "    honor_labels: true\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{base}', '127.0.0.1:{base + 1}']}}]\n"
    )
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{web}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/-/ready", timeout=2)
            break
        except OSError:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.time() < deadline, "prometheus did not become ready"
            time.sleep(0.3)
    yield url, base
    proc.terminate()
    proc.wait(timeout=30)


def _query(url: str, promql: str) -> dict[str, float]:
    reply = json.load(urllib.request.urlopen(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})))
    assert reply["status"] == "success", reply
    return {r["metric"]["rank"]: float(r["value"][1]) for r in reply["data"]["result"]}


def test_prometheus_sees_both_ranks_throughput_and_every_step(prometheus, planted_shards, tmp_path):
    url, base = prometheus
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "vldist.train",
            "vsrn",
            f"data.shards={planted_shards}",
            f"output.dir={tmp_path / 'run'}",
            f"metrics.port={base}",
            *JOB,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"]
    time.sleep(1.5)  # the last scrape's samples become queryable

    throughput = _query(url, 'max_over_time(vldist_samples_per_second{job="scraped",recipe="vsrn"}[10m])')
    assert set(throughput) == {"0", "1"} and min(throughput.values()) > 0
    assert _query(url, "max_over_time(vldist_steps_total[10m])") == {"0": steps, "1": steps}
    samples = _query(url, "max_over_time(vldist_samples_total[10m])")
    assert sum(samples.values()) == steps * 32  # each rank counts its own half of every global batch
    wait = _query(url, "max_over_time(vldist_data_wait_seconds_count[10m])")
    assert wait == {"0": steps, "1": steps}
