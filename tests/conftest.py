import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# One torch thread per test process under xdist (its children inherit it; torchrun and Ray set one
# per rank themselves). Two workers on two cores, each running torch with a thread per core, put
# four busy threads on two cores, and OpenMP's threads spin while they wait for each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)

from helpers import PREEMPT_JOB, SMALL_VSRN, TORCHRUN, write_planted_shards, write_scene_images  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _data_home(tmp_path_factory):
    """No test builds an embedded set (a shrunk one, for some) into the user's data home."""
    os.environ["VLDIST_DATA_HOME"] = str(tmp_path_factory.mktemp("data_home"))


@pytest.fixture(scope="session")
def planted_shards(tmp_path_factory) -> Path:
    return write_planted_shards(tmp_path_factory.mktemp("planted") / "shards")


@pytest.fixture(scope="session")
def other_planted_shards(tmp_path_factory) -> Path:
    """A second planted set, other images (keys other-train-...), 120 train samples: a weighted source."""
    return write_planted_shards(
        tmp_path_factory.mktemp("other_planted") / "shards",
        {"train": 120, "val": 8, "test": 8},
        seed=1,
        key_prefix="other-",
    )


@pytest.fixture(scope="session")
def unindexed_shards(planted_shards, tmp_path_factory) -> Path:
    """The planted set as sets written before sample indexes were: no <shard>.idx.json."""
    import shutil

    out = tmp_path_factory.mktemp("unindexed") / "shards"
    shutil.copytree(planted_shards, out, ignore=shutil.ignore_patterns("*.idx.json"))
    return out


@pytest.fixture(scope="session")
def pair_shards(tmp_path_factory) -> Path:
    """A miniature of the embedded image-pair set (L2C): 64 / 16 / 16 pairs of 64-pixel scenes."""
    from vldist.shards.synthetic.pairs import build_synth_pairs

    out = tmp_path_factory.mktemp("pairs") / "shards"
    build_synth_pairs(out, n_train=64, n_val=16, n_test=16, shard_size=16, image_size=64, progress=False)
    return out


@pytest.fixture(scope="session")
def scene_images(tmp_path_factory) -> Path:
    """Single-image captions of rendered scenes (L2C's second stream), 64-pixel, no features."""
    return write_scene_images(tmp_path_factory.mktemp("singles") / "shards", {"train": 64})


@pytest.fixture(scope="session")
def scene_splits(tmp_path_factory) -> Path:
    """Rendered scenes with captions and objects in train / val / test (LAViTeR's images, in miniature)."""
    return write_scene_images(tmp_path_factory.mktemp("scene_splits") / "shards", {"train": 128, "val": 16, "test": 32})


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml): two workers at most. Serially the suite used 46 of 98 core-minutes
    on 2 cores (`time` of .ci/run: 39.7 min user + 6.3 min sys over 49 min). Three workers were no
    faster (2026-11-26, `python -m pytest -n 3`: 1,921 s against 1,911 s with two, the same tests)
    and two timing-bound tests failed under the extra load."""
    return min(2, os.cpu_count() or 1)


# The longest test files (estimated from the slowest tests of the 2026-11-27 suite on 2 workers:
# test_ray_nodes.py and test_ray.py over 300 s each, test_deepspeed.py, test_two_branch_train.py and
# test_slurm.py 120-190 s, test_multinode.py and test_replicas_every_recipe.py about 100 s). They are
# handed out first and every other file after them in collection order (integration, then the many
# short unit files), so that the suite does not end with one worker on a long file while the other
# has nothing left: xdist's loadfile otherwise hands files out by their number of tests, most first,
# which leaves these few-test long files to the end. The two Ray files are kept apart in the list so
# that the workers seldom run both Ray clusters at once. A file missing here, or gone, changes
# nothing but the order.
LONGEST_FIRST = (
    "integration/test_compile_equivalence.py",
    "integration/test_ray_nodes.py",
    "integration/test_two_branch_train.py",
    "integration/test_deepspeed.py",
    "integration/test_slurm.py",
    "integration/test_ray.py",
    "integration/test_multinode.py",
    "integration/test_replicas_every_recipe.py",
)


def pytest_configure(config):
    # xdist's --dist loadfile would sort the files by their number of tests (its default
    # --loadscope-reorder): keep the order pytest_collection_modifyitems gives them
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    tests = Path(__file__).parent
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def place(item) -> int:
        try:
            return rank.get(Path(item.path).relative_to(tests).as_posix(), len(rank))
        except ValueError:  # a test outside tests/
            return len(rank)

    items.sort(key=place)  # stable: every other file keeps its place, and every file its tests' order


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The directory `build(path)` fills, built once per test session and read by every xdist
    worker (a session fixture is otherwise built again in each worker). Read-only for tests."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' common parent
    out, done = root / name, root / f"{name}.built"
    with FileLock(f"{out}.lock"):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            build(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def two_rank_reference(planted_shards, tmp_path_factory) -> Path:
    """The uninterrupted 2-rank run (torchrun) that stopped-and-resumed runs must end equal to,
    whatever launched them: torchrun and srun ranks compute the same (one thread each). One run
    for the whole session: tests compare against its files and never write there."""
    import subprocess

    def train(out: Path) -> None:
        proc = subprocess.run(
            [
                *TORCHRUN,
                "-m",
                "vldist.train",
                "vsrn",
                f"data.shards={planted_shards}",
                f"output.dir={out}",
                *PREEMPT_JOB,
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]

    return built_once(tmp_path_factory, "two-rank-reference", train)


@pytest.fixture(scope="session")
def trained_vsrn(planted_shards, tmp_path_factory) -> Path:
    """A finished run of one epoch (SMALL_VSRN) on planted_shards; tests that resume copy it first."""
    from vldist.train import main as train_main

    out = tmp_path_factory.mktemp("trained")
    args = [f"data.shards={planted_shards}", f"output.dir={out}", "train.epochs=1", *SMALL_VSRN]
    assert train_main(["vsrn", *args]) == 0
    return out


@pytest.fixture(scope="session")
def s3_store(tmp_path_factory):
    """A real S3-compatible store on 127.0.0.1 (tests/seaweed.py), once per session. Its
    credentials (store.environment, the AWS_* variables) are handed to what needs them: a test's
    subprocess environment, a Ray job's runtime_env, tests/integration/test_s3_shards.py's own
    environment during each of its tests; never left in the session's environment."""
    pytest.importorskip("s3fs", reason='S3 support is an extra: pip install "vldist[s3]"')
    from seaweed import start_s3_store

    try:
        store = start_s3_store(tmp_path_factory.mktemp("seaweedfs"))
    except FileNotFoundError as missing:
        pytest.skip(f"no SeaweedFS: {missing}")
    yield store
    store.stop()


# What vldist.launch.environment fills in for a process that was started without a launcher.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def launcher_environment_restored():
    """An engine built in the test process (DeepSpeed, FSDP2) makes it a world of one by setting
    RANK, WORLD_SIZE, ... in os.environ; left there, every later subprocess of this worker
    inherits them, and an srun task that finds RANK set does not read its rank from Slurm."""
    before = {name: os.environ.get(name) for name in LAUNCHER_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def sigint_handler_restored():
    """A run stopped by SIGINT leaves SIGINT ignored (training/stopping.py); left so in this worker,
    every later subprocess inherits the ignored disposition (exec keeps it) and a Ctrl-C test's run
    never sees its SIGINT."""
    before = signal.getsignal(signal.SIGINT)
    yield
    if signal.getsignal(signal.SIGINT) is not before and before is not None:
        signal.signal(signal.SIGINT, before)


@pytest.fixture
def no_accelerate_state():
    """Accelerate keeps one state a process and refuses another precision in it: the test starts
    from none and leaves none, for the in-process runs of the suite's other tests."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(autouse=True)
def fresh_skip_counter():
    """Each test starts with the process's skip counter as a new process has it: its warnings are
    rate-limited over the process's life, so skips counted by an earlier test would silence a
    later test's first warnings."""
    from vldist.data.skips import SkipCounter, skipped

    fresh = SkipCounter()
    skipped.__dict__.update(fresh.__dict__)
    yield
