"""A fault soak over exact data: one training run, interrupted by several faults and resumed after
each as its launcher would, ends as if nothing had happened.

    python bench/fault_soak.py                                        # seed 0, about 3 minutes on 2 cores
    python bench/fault_soak.py --seed 3 --faults kill-rank sigterm lost-node kill-rank
    python bench/fault_soak.py --json docs/results/fault_soak.json
    python bench/fault_soak.py --from docs/results/fault_soak.json    # the table, nothing run

The run: VSRN, tiny (tests/helpers.py PREEMPT_JOB), 3 exact epochs (data.resampled=false) of a
planted, indexed set of 240 training samples in 6 shards, global batch 8: 30 steps an epoch, 90 in
all, a checkpoint every 4 steps, train.sample_log=true. It runs on two nodes of one rank each
(network namespaces, tests/netns.py), each node through cluster/torchrun/train.sh (torchrun
--max-restarts 3, train.resume=auto), and reads its shards from a SeaweedFS S3 store
(tests/seaweed.py) through a proxy that cuts connections (tests/fault_proxy.py); the nodes reach
the proxy, which listens on this machine's loopback, through a relay per node (TCP on the node's
own loopback to a unix socket).

The faults, at steps drawn from --seed (each twice by default, in an order drawn from the seed):

- kill-rank: SIGKILL to one rank's process; both torchrun agents restart their ranks (the killed
  one's agent spends one of its --max-restarts), which resume from the newest checkpoint;
- sigterm: SIGTERM to both nodes' torchrun, as a scheduler stops a job; the ranks checkpoint the
  step reached and exit 75; then the same command again on both nodes;
- lost-node: every process of node 1 killed at once (agent, rank, loader workers, its relay), as a
  power failure; node 1's relay and torchrun started again, node 0's agent restarts its rank;
- store cuts, throughout: every 0.5-2 s a shard of the set gets its next GET cut after 1-4,000
  response bytes, or its next 24 GETs (none while cuts are pending on it). s3fs tries a GET 5
  times itself, so a single cut never reaches vldist; a reader that meets 6 in a row opens its
  range again (store/reader.py). Neither may restart anything. The reader's retries are counted
  from its debug line, which a sitecustomize the bench puts on the nodes' PYTHONPATH writes to a
  file from every process (the loader workers read the shards).

Measured per fault: the step the run had reached (the last step in metrics.jsonl when the fault
was sent), the checkpoint step the run resumed from (its "resumed from" line), the steps taken
again, and the seconds from the fault to the first step after the resume (metrics.jsonl's time of
that step). At the end, two verdicts against an uninterrupted 2-rank run (torchrun --standalone,
the same job from local disk: the same samples):

- every sample once per epoch: from samples/rank-R.jsonl, each (rank, epoch, step)'s last line
  (a step after the last checkpoint of a killed run is logged twice: the resume takes it again),
  the identities each epoch trained on, against the set's 240; and whether every step's samples
  are those of the uninterrupted run;
- final weights: the last step's checkpoint against the uninterrupted run's, max abs difference.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack, suppress
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
TRAIN_SCRIPT = ROOT / "cluster" / "torchrun" / "train.sh"
FAULTS = ("kill-rank", "sigterm", "lost-node")
TRAIN_SAMPLES, SHARD_SIZE, EPOCHS, SAVE_EVERY = 240, 40, 3, 4
GLOBAL_BATCH = 8  # PREEMPT_JOB's data.batch_size
RENDEZVOUS_PORT, NODE_STORE_PORT = 29400, 8333  # inside the nodes' namespaces: nothing else holds them
BUCKET = "soak"
WAIT_S = 300  # the longest any one phase may take before the soak gives up
# Cuts in a row on one shard. s3fs tries a GET 5 times itself; a reader that meets 6 failures in a
# row opens its range again, and gives up after 8 such (45 in a row: a lost shard). A global batch
# lies in one or two shards, so the 4 loader workers of the 2 ranks read one shard at once and
# share a burst: 24 make at least one of them meet 6.
BURST = 24
# On the nodes' PYTHONPATH: vldist's reader logs each time it opens a range again (its one debug
# message) to a file, from every process (the loader workers read the shards).
SITE_CUSTOMIZE = """import logging, os
if os.environ.get("FAULT_SOAK_READER_LOG"):
    _handler = logging.FileHandler(os.environ["FAULT_SOAK_READER_LOG"])
    _handler.setLevel(logging.DEBUG)
    _handler.addFilter(lambda record: record.levelno == logging.DEBUG)
    _handler.setFormatter(logging.Formatter("%(created).3f %(process)d %(message)s"))
    logging.getLogger("vldist.data").addHandler(_handler)
    logging.getLogger("vldist.data").setLevel(logging.DEBUG)
"""
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")
RESUMED_BY = {
    "kill-rank": "torchrun --max-restarts: both agents restart their ranks (train.resume=auto)",
    "sigterm": "the same command again on both nodes (train.resume=auto)",
    "lost-node": "node1's torchrun started again; node0's agent restarts its rank",
}


def job_overrides(epochs: int, save_every: int) -> list[str]:
    """PREEMPT_JOB (tests/helpers.py) over exact epochs, with the sample log and frequent checkpoints."""
    from helpers import PREEMPT_JOB

    return [
        *PREEMPT_JOB,
        f"train.epochs={epochs}",
        "data.resampled=false",
        "train.sample_log=true",
        f"train.save_every_steps={save_every}",
        "train.keep_last=3",
    ]


# ---------------------------------------------------------------- the plan


@dataclass
class Fault:
    """One fault of the plan, and what the soak saw of it."""

    kind: str
    planned_step: int
    rank: int | None = None  # kill-rank: the rank killed
    what: str = ""
    at_step: int | None = None
    resumed_from: int | None = None
    taken_again: int | None = None
    seconds_to_step: float | None = None
    stopped_after: int | None = None  # sigterm: the step of the "stopped" record the ranks wrote
    sent: float = 0.0


def fault_plan(seed: int, faults: list[str], total_steps: int, margin: int = 5) -> list[Fault]:
    """The faults in an order drawn from the seed, at steps drawn from the seed in [margin, total -
    margin], at least 2 checkpoints apart so that each resumed run progresses; the kill-rank faults
    take the ranks in turn, the first drawn from the seed."""
    rng = random.Random(seed)
    order = list(faults)
    rng.shuffle(order)
    gap = 2 * SAVE_EVERY
    room = total_steps - 2 * margin - gap * (len(order) - 1)
    if room < len(order):
        raise SystemExit(f"{len(order)} faults do not fit in {total_steps} steps")
    offsets = sorted(rng.sample(range(room), len(order)))
    plan, rank = [], rng.randrange(2)
    for i, (offset, kind) in enumerate(zip(offsets, order, strict=True)):
        plan.append(Fault(kind, margin + offset + gap * i, rank=rank if kind == "kill-rank" else None))
        rank = 1 - rank if kind == "kill-rank" else rank
    return plan


# ---------------------------------------------------------------- the store, its cuts, and the relays


def serve_relay(listener: socket.socket, connect) -> None:
    """Each connection accepted on `listener` piped both ways to a new `connect()`, half-closes
    passed on (the proxy's cut reaches the client as an early end), until the listener closes."""
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_relay_one, args=(client, connect), daemon=True).start()


def _relay_one(client: socket.socket, connect) -> None:
    try:
        upstream = connect()
    except OSError:
        client.close()
        return
    back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
    back.start()
    _pipe(client, upstream)
    back.join()
    upstream.close()
    client.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    except OSError:
        pass  # either side closed or reset: the exchange is over
    finally:
        with suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def unix_connector(path: str):
    def connect() -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        return conn

    return connect


def node_relay_main(port: int, unix_path: str) -> None:
    """`--relay PORT PATH`, run on a node: its 127.0.0.1:PORT relayed to the unix socket PATH (a
    file both sides see, whatever their network namespace)."""
    listener = socket.create_server(("127.0.0.1", port))
    print("relay ready", flush=True)
    serve_relay(listener, unix_connector(unix_path))


def recorded_faults():
    """tests/fault_proxy.py's ProxyFaults, also recording when each cut was met and on which shard."""
    from fault_proxy import ProxyFaults

    class RecordedFaults(ProxyFaults):
        def __init__(self):
            super().__init__()
            self.met: list[tuple[float, str, int]] = []

        def take(self, method: str, name: str):
            fault = super().take(method, name)
            if fault and fault[0] == "cut":
                with self.lock:
                    self.met.append((time.time(), name, int(fault[1])))
            return fault

    return RecordedFaults()


def schedule_cuts(faults, names: list[str], rng: random.Random, stop: threading.Event) -> None:
    """Every 0.5-2 s the next GET of a random shard cut after 1-4,000 response bytes, or the next
    BURST of them; never on a shard that still has cuts pending (more in a row than s3fs's and the
    reader's tries together would be a lost shard, which ends an exact run, not a cut)."""
    while not stop.wait(rng.uniform(0.5, 2.0)):
        name, burst = rng.choice(names), rng.choice((1, BURST))
        cuts = [rng.randint(1, 4000) for _ in range(burst)]
        with faults.lock:
            if not faults.cut[name]:
                faults.cut[name].extend(cuts)


class Store:
    """SeaweedFS with the set uploaded, the cutting proxy in front of it, and the unix socket the
    nodes' relays reach the proxy through."""

    def __init__(self, scratch: Path, shards: Path):
        from seaweed import start_s3_store

        (scratch / "store").mkdir()
        self.store = start_s3_store(scratch / "store")
        try:
            self._serve(scratch, shards)
        except BaseException:
            self.store.stop()
            raise

    def _serve(self, scratch: Path, shards: Path) -> None:
        from fault_proxy import FaultProxy

        fs = self.store.filesystem()
        fs.mkdir(BUCKET)
        fs.put(str(shards), f"{BUCKET}/planted", recursive=True)
        self.url = f"s3://{BUCKET}/planted"
        self.proxy = FaultProxy(self.store.endpoint)
        self.proxy.faults = recorded_faults()
        self.proxy.__enter__()
        self.socket_path = str(scratch / "store.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.socket_path)
        self._listener.listen(64)
        host, port = self.proxy.url.removeprefix("http://").split(":")
        threading.Thread(
            target=serve_relay, args=(self._listener, lambda: socket.create_connection((host, int(port)))), daemon=True
        ).start()
        self.shard_names = [p.name for p in sorted(shards.glob("*.tar"))]
        self._stop_cuts = threading.Event()

    def node_environment(self) -> dict[str, str]:
        """A node's view: the credentials, and the store at its relay on the node's own loopback."""
        return {**self.store.environment, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{NODE_STORE_PORT}"}

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start_cuts(self, seed: int) -> None:
        args = (self.proxy.faults, self.shard_names, random.Random(seed), self._stop_cuts)
        threading.Thread(target=schedule_cuts, args=args, daemon=True).start()

    def close(self) -> None:
        self._stop_cuts.set()
        self._listener.close()
        self.proxy.__exit__(None, None, None)
        self.store.stop()


# ---------------------------------------------------------------- the run's records


def train_records(run: Path, event: str = "train") -> list[dict]:
    """The records of `event` (a training step) metrics.jsonl holds, in file order (whole lines
    only: a killed rank 0 may leave half of one)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with suppress(json.JSONDecodeError):
            entry = json.loads(line)
            if entry.get("event") == event:
                out.append(entry)
    return out


def wait_until(predicate, what: str, processes=(), timeout: float = WAIT_S):
    """predicate()'s first truthy value, polled every 50 ms; fails after `timeout` s or when one
    of `processes` has ended."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        ended = [p.args[-1] for p in processes if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            raise RuntimeError(f"gave up waiting for {what}" + (f" (ended: {ended})" if ended else ""))
        time.sleep(0.05)


def resumes(logs: Path) -> list[int]:
    """The step of every "resumed from" line the nodes' logs hold."""
    found = []
    for path in sorted(logs.glob("*.log")):
        found += [int(m.group(2)) for m in RESUMED.finditer(path.read_text(errors="replace"))]
    return found


def deduplicated_sample_log(run: Path) -> dict[tuple[int, int, int], list[int]]:
    """(rank, epoch, step) -> identities, each key's last line (the resume's, where a step was
    logged twice)."""
    steps = {}
    for path in sorted((run / "samples").glob("rank-*.jsonl")):
        rank = int(path.stem.removeprefix("rank-"))
        for line in path.read_text().splitlines():
            with suppress(json.JSONDecodeError):  # a line cut short by SIGKILL counts as not logged
                entry = json.loads(line)
                steps[(rank, entry["epoch"], entry["step"])] = entry["identity"]
    return steps


def logged_lines(run: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in (run / "samples").glob("rank-*.jsonl"))


def epoch_coverage(steps: dict, expected: set[int], epochs: int) -> list[dict]:
    """Per epoch: identities trained on, distinct, of the set's missing, and repeated."""
    out = []
    for epoch in range(epochs):
        counts = Counter(i for (_, e, _), ids in steps.items() if e == epoch for i in ids)
        out.append(
            {
                "epoch": epoch + 1,
                "trained": sum(counts.values()),
                "distinct": len(counts),
                "missing": len(expected - set(counts)),
                "repeated": sum(1 for c in counts.values() if c > 1),
                "foreign": len(set(counts) - expected),
            }
        )
    return out


def set_identities(shards: Path) -> set[int]:
    from helpers import read_shard_set

    from vldist.data.identity import identity_of

    return {identity_of(key) for key, _ in read_shard_set(shards)["train"]}


def weight_gap(a: Path, b: Path) -> tuple[float, int]:
    """The largest absolute difference between two checkpoints' weights, and their tensor count."""
    from helpers import weights

    wa, wb = weights(a), weights(b)
    if wa.keys() != wb.keys():
        return float("inf"), len(wa)
    gaps = [(wa[k].double() - wb[k].double()).abs().max().item() for k in wa if wa[k].numel()]
    return max(gaps, default=0.0), len(wa)


# ---------------------------------------------------------------- the nodes


class SoakNodes:
    """Two namespace nodes, each with its relay to the store and its torchrun through
    cluster/torchrun/train.sh; every start logs to logs/node<i>-<n>.log."""

    def __init__(self, nodes, store: Store, run: Path, logs: Path, overrides: list[str], env: dict[str, str]):
        self.nodes, self.store, self.run, self.logs, self.overrides = nodes, store, run, logs, overrides
        self.env = env
        self.jobs: dict[int, subprocess.Popen] = {}
        self.starts = Counter()

    def boot(self, node: int) -> None:
        """The node's relay, then its job."""
        relay = self.nodes.popen(
            node,
            [sys.executable, str(Path(__file__).resolve()), "--relay", str(NODE_STORE_PORT), self.store.socket_path],
            stdout=subprocess.PIPE,
            text=True,
        )
        if relay.stdout.readline().strip() != "relay ready":
            raise RuntimeError(f"node{node}'s relay did not start")
        self.start_job(node)

    def start_job(self, node: int) -> None:
        host = " --rdzv-conf is_host=1" if node == 0 else ""  # by address: its own name may be loopback
        env = {
            **os.environ,
            **self.store.node_environment(),
            **self.env,
            "NNODES": str(self.nodes.count),
            "RDZV_ENDPOINT": f"{self.nodes.addresses[0]}:{RENDEZVOUS_PORT}",
            "RUN_ID": "fault-soak",
            "PYTHON": sys.executable,
            "TORCHRUN_ARGS": f"--local-addr {self.nodes.addresses[node]}{host}",
        }
        self.starts[node] += 1
        log = open(self.logs / f"node{node}-{self.starts[node]}.log", "w")  # noqa: SIM115 - the process's until it ends
        job = ["vsrn", f"data.shards={self.store.url}", f"output.dir={self.run}", *self.overrides]
        self.jobs[node] = self.nodes.popen(
            node, ["bash", str(TRAIN_SCRIPT), *job], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()

    def agents(self, node: int) -> list:
        """The node's torchrun agents."""
        import psutil

        found = []
        for proc in self._processes(node):
            with suppress(psutil.Error):
                if "torch.distributed.run" in " ".join(proc.cmdline()):
                    found.append(proc)
        return found

    def rank_process(self, rank: int):
        """(node, process) of rank `rank`: a child of an agent (its loader workers are its own children)."""
        import psutil

        for node in range(self.nodes.count):
            for proc in self._processes(node):
                with suppress(psutil.Error):
                    if "torch.distributed.run" in " ".join(proc.parent().cmdline()):
                        if proc.environ().get("RANK") == str(rank):
                            return node, proc
        raise RuntimeError(f"no process of rank {rank}")

    def _processes(self, node: int) -> list:
        import psutil

        found = []
        for pid in self.nodes.pids(node):
            with suppress(psutil.Error):
                found.append(psutil.Process(pid))
        return found

    def wait_ended(self, nodes: list[int]) -> None:
        for node in nodes:
            self.jobs[node].wait(WAIT_S)

    def all_running(self) -> list[subprocess.Popen]:
        return list(self.jobs.values())


def inject(fault: Fault, soak: SoakNodes) -> None:
    """Send the fault and start what resumes it (the kill-rank resume is torchrun's own)."""
    import signal

    if fault.kind == "kill-rank":
        node, proc = soak.rank_process(fault.rank)
        fault.what = f"SIGKILL to rank {fault.rank}'s process (node{node})"
        fault.sent = time.time()
        proc.send_signal(signal.SIGKILL)
    elif fault.kind == "sigterm":
        agents = [p for node in range(2) for p in soak.agents(node)]
        fault.what = "SIGTERM to both nodes' torchrun"
        fault.sent = time.time()
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
        soak.wait_ended([0, 1])
        for node in range(2):
            soak.start_job(node)
    elif fault.kind == "lost-node":
        fault.what = "node1 lost: every process killed at once"
        fault.sent = time.time()
        soak.nodes.power_off(1)
        soak.boot(1)
    else:
        raise ValueError(fault.kind)


def soak_run(args, scratch: Path, shards: Path, overrides: list[str], total_steps: int) -> dict:
    """The interrupted run on the nodes, from the store; its faults and records."""
    from netns import Nodes, unavailable

    why = unavailable()
    if why:
        raise SystemExit(f"no test nodes: {why}")
    run, logs = scratch / "soak", scratch / "logs"
    logs.mkdir()
    faults = fault_plan(args.seed, args.faults, total_steps)
    with ExitStack() as stack:
        store = stack.enter_context(Store(scratch, shards))
        nodes = stack.enter_context(Nodes(2))
        soak = SoakNodes(nodes, store, run, logs, overrides, reader_logging(scratch))
        started = time.time()
        store.start_cuts(args.seed + 2)
        for node in range(2):
            soak.boot(node)
        since = 0.0
        for fault in faults:
            wait_until(
                lambda f=fault, t=since: any(r["step"] >= f.planned_step and r["time"] > t for r in train_records(run)),
                f"step {fault.planned_step}",
                soak.all_running(),
            )
            before = len(resumes(logs))
            inject(fault, soak)
            fault.resumed_from = wait_until(
                lambda n=before: resumes(logs)[n] if len(resumes(logs)) > n else None,
                f"the resume after {fault.kind}",
                soak.all_running(),
            )
            wait_until(
                lambda f=fault: first_step_after(train_records(run), f) is not None,
                f"the first step after the resume from {fault.resumed_from}",
                soak.all_running(),
            )
            since = settle(fault, train_records(run), since)
            stops = [r["step"] for r in train_records(run, "stopped") if r["time"] > fault.sent]
            fault.stopped_after = stops[0] if stops else None
            print(
                f"{fault.kind}: {fault.what} at step {fault.at_step}; resumed from {fault.resumed_from}, "
                f"first step {fault.seconds_to_step:.1f} s after the fault",
                flush=True,
            )
        for node, job in soak.jobs.items():
            if job.wait(WAIT_S) != 0:
                raise RuntimeError(f"node{node}'s last torchrun exited {job.returncode}: see {logs}")
        wall = time.time() - started
        cuts = list(store.proxy.faults.met)
        extra_resumes = len(resumes(logs)) - len(faults)
    records = train_records(run)
    return {
        "faults": [asdict(f) for f in faults],
        "cuts": cut_summary(cuts, records, total_steps),
        "reader_reopened": cut_summary(reader_retries(scratch / "reader.log"), records, total_steps),
        "extra_resumes": extra_resumes,
        "seconds": wall,
    }


def first_step_after(records: list[dict], fault: Fault) -> int | None:
    """The index in `records` of the resumed run's first step: the step after the checkpoint it
    resumed from, sent after the fault; the last such (a rank killed mid-step may have finished
    that same step just before it died)."""
    found = [i for i, r in enumerate(records) if r["step"] == fault.resumed_from + 1 and r["time"] > fault.sent]
    return found[-1] if found else None


def settle(fault: Fault, records: list[dict], since: float) -> float:
    """The fault's step, steps taken again and seconds to the next step, from the records written
    since the previous fault's resume; returns the time of its resumed run's first step."""
    first = first_step_after(records, fault)
    before = [r for r in records[:first] if r["time"] > since]
    fault.at_step = max(r["step"] for r in before if r["time"] <= fault.sent)
    fault.taken_again = max(r["step"] for r in before) - fault.resumed_from  # steps done, lost, done again
    fault.seconds_to_step = records[first]["time"] - fault.sent
    return records[first]["time"]


def reader_logging(scratch: Path) -> dict[str, str]:
    """The environment that makes the nodes' processes log the reader's retries (SITE_CUSTOMIZE)."""
    site = scratch / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE_CUSTOMIZE)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "FAULT_SOAK_READER_LOG": str(scratch / "reader.log")}


def reader_retries(path: Path) -> list[tuple[float, str, int]]:
    """(time, shard, 0) each time vldist's reader opened a range or shard again after a failed
    read (its debug lines: `<time> <pid> reading <url>: <error> at byte N, again in S s`)."""
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        if "again in" in line:
            when, _, message = line.split(" ", 2)
            found.append((float(when), message.removeprefix("reading ").split(":", 2)[1].rsplit("/", 1)[-1], 0))
    return found


def cut_summary(cuts: list[tuple[float, str, int]], records: list[dict], total_steps: int) -> dict:
    """How many cuts were met, on how many shards, and over which steps (the step each fell in:
    one past the last step recorded before it, an epoch's validation counting as the next epoch's
    first step; after the last step: the last validation and the test)."""
    steps = []
    for when, _, _ in cuts:
        before = [r["step"] for r in records if r["time"] <= when]
        steps.append((before[-1] if before else 0) + 1)
    in_training = [s for s in steps if s <= total_steps]
    return {
        "met": len(cuts),
        "shards": len({name for _, name, _ in cuts}),
        "on_train_shards": sum(name.startswith("train-") for _, name, _ in cuts),
        "first_step": min(in_training, default=None),
        "last_step": max(in_training, default=None),
        "after_last_step": len(steps) - len(in_training),
    }


def reference_run(shards: Path, out: Path, overrides: list[str]) -> float:
    """The uninterrupted 2-rank run (torchrun --standalone), from local disk; its seconds."""
    from helpers import TORCHRUN

    start = time.time()
    done = subprocess.run(
        [*TORCHRUN, "-m", "vldist.train", "vsrn", f"data.shards={shards}", f"output.dir={out}", *overrides],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    if done.returncode:
        raise RuntimeError(f"the uninterrupted run failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return time.time() - start


def verdicts(run: Path, reference: Path, shards: Path, epochs: int, total_steps: int) -> dict:
    steps, expected = deduplicated_sample_log(run), set_identities(shards)
    reference_steps = deduplicated_sample_log(reference)
    final = f"step-{total_steps:08d}"
    gap, tensors = weight_gap(run / "checkpoints" / final, reference / "checkpoints" / final)
    coverage = epoch_coverage(steps, expected, epochs)
    metrics = json.loads((run / "metrics.json").read_text())
    return {
        "set_samples": len(expected),
        "epochs": coverage,
        "every_sample_once": all(
            e["distinct"] == e["trained"] == len(expected) and not e["missing"] and not e["foreign"] for e in coverage
        ),
        "log_lines": logged_lines(run),
        "logged_steps": len(steps),
        "same_batches_as_uninterrupted": steps == reference_steps,
        "final_checkpoint": final,
        "weights_equal": gap == 0.0,
        "max_abs_diff": gap,
        "tensors": tensors,
        "restarts": metrics["restarts"],
        "skipped_samples": metrics["skipped_samples"],
        "steps": metrics["steps"],
    }


def machine() -> dict:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    cpu = platform.processor()
    with suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "commit": commit.stdout.strip()}


# ---------------------------------------------------------------- the table


def step_span(summary: dict) -> str:
    """'first-last' of the steps events fell in, and how many came after the last step."""
    span = f"{summary['first_step']}-{summary['last_step']}" if summary["first_step"] else "none"
    return span + (f", {summary['after_last_step']} after the last" if summary["after_last_step"] else "")


def table(results: dict) -> str:
    m, v = results["machine"], results["verdicts"]
    lines = [
        f"**seed {results['seed']}**: {results['steps_per_epoch'] * results['epochs']} steps ({results['epochs']} "
        f"exact epochs of {results['samples']} samples, 2 nodes x 1 rank), a checkpoint every "
        f"{results['save_every']} steps; the run {results['seconds']:.0f} s from its first start to its end, the "
        f"bench {results['bench_seconds']:.0f} s with the uninterrupted run and the store "
        f"({m['cpu']}, {m['cores']} cores, torch {m['torch']}, commit {m['commit']})",
        "",
        "| # | fault | at step | resumed by | from step | steps again | s to the next step |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, f in enumerate(results["faults"], start=1):
        what = f["what"]
        if f["kind"] == "sigterm":
            stop = f["stopped_after"]
            what += f": the ranks checkpoint step {stop} and exit" if stop else ": no stop recorded"
        lines.append(
            f"| {i} | {what} | {f['at_step']} | {RESUMED_BY[f['kind']]} | {f['resumed_from']} "
            f"| {f['taken_again']} | {f['seconds_to_step']:.1f} |"
        )
    c, r = results["cuts"], results["reader_reopened"]
    lines.append(
        f"| {len(results['faults']) + 1} | store connections cut mid-read: {c['met']} GETs on {c['shards']} shards, "
        f"singly or {results['burst']} in a row | {step_span(c)} | s3fs tries a GET again up to 5 times; past that vldist's "
        f"reader opens it again: {r['met']} times ({r['on_train_shards']} a training range, the others a "
        f"validation or test shard), steps {step_span(r)}; no restart | - | 0 | - |"
    )
    epochs = "; ".join(
        f"epoch {e['epoch']}: {e['distinct']} of {v['set_samples']}, {e['repeated']} repeated, {e['missing']} missing"
        for e in v["epochs"]
    )
    lines += [
        "",
        "| verdict | |",
        "|---|---|",
        f"| every sample once per epoch | {'yes' if v['every_sample_once'] else 'no'} ({epochs}) |",
        f"| every step's samples as in the uninterrupted run | {'yes' if v['same_batches_as_uninterrupted'] else 'no'} "
        f"({v['logged_steps']} (rank, step) logged, {v['log_lines']} lines before deduplication) |",
        f"| final weights equal the uninterrupted run's | {'yes' if v['weights_equal'] else 'no'} "
        f"({v['final_checkpoint']}, {v['tensors']} tensors, max abs diff {v['max_abs_diff']:.3g}) |",
        f"| resumes | {v['restarts']} ({results['extra_resumes']} beyond one per fault); {v['steps']} steps, "
        f"{v['skipped_samples']} samples skipped |",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="draws the faults' order and steps, and the cuts")
    parser.add_argument(
        "--faults",
        nargs="+",
        default=[*FAULTS, *FAULTS],
        choices=FAULTS,
        help="one fault per name (default: each twice)",
    )
    parser.add_argument("--keep", type=Path, help="keep the runs, logs and set here (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--from", dest="source", type=Path, help="print the table of a results file; run nothing")
    parser.add_argument("--relay", nargs=2, metavar=("PORT", "SOCKET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.source:
        print(table(json.loads(args.source.read_text())))
        return 0
    sys.path[:0] = [str(ROOT), str(TESTS)]
    if args.relay:
        node_relay_main(int(args.relay[0]), args.relay[1])
        return 0
    from helpers import write_planted_shards

    began = time.time()
    scratch = Path(tempfile.mkdtemp(prefix="fault-soak-", dir=args.keep))
    try:
        shards = write_planted_shards(
            scratch / "shards", {"train": TRAIN_SAMPLES, "val": 40, "test": 40}, shard_size=SHARD_SIZE
        )
        overrides = job_overrides(EPOCHS, SAVE_EVERY)
        steps_per_epoch = TRAIN_SAMPLES // GLOBAL_BATCH
        total = EPOCHS * steps_per_epoch
        reference_seconds = reference_run(shards, scratch / "reference", overrides)
        print(f"uninterrupted run: {reference_seconds:.0f} s", flush=True)
        soaked = soak_run(args, scratch, shards, overrides, total)
        results = {
            "seed": args.seed,
            "epochs": EPOCHS,
            "samples": TRAIN_SAMPLES,
            "steps_per_epoch": steps_per_epoch,
            "save_every": SAVE_EVERY,
            "burst": BURST,
            "machine": machine(),
            "reference_seconds": reference_seconds,
            **soaked,
            "verdicts": verdicts(scratch / "soak", scratch / "reference", shards, EPOCHS, total),
        }
        results["bench_seconds"] = time.time() - began
    finally:
        if args.keep is None:
            shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return 0 if results["verdicts"]["every_sample_once"] and results["verdicts"]["weights_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
