import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import PREEMPT_JOB, TORCHRUN, write_planted_shards  # noqa: E402


@pytest.fixture(scope="session")
def planted_shards(tmp_path_factory) -> Path:
    return write_planted_shards(tmp_path_factory.mktemp("planted") / "shards")


@pytest.fixture(scope="session")
def two_rank_reference(planted_shards, tmp_path_factory) -> Path:
    """The uninterrupted 2-rank run (torchrun) that stopped-and-resumed runs must end equal to,
    whatever launched them: torchrun and srun ranks compute the same (one thread each)."""
    import subprocess

    out = tmp_path_factory.mktemp("reference")
    proc = subprocess.run([*TORCHRUN, "-m", "vldist.train", "vsrn", f"data.shards={planted_shards}",
                           f"output.dir={out}", *PREEMPT_JOB], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out
