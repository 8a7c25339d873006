import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import write_planted_shards  # noqa: E402


@pytest.fixture(scope="session")
def planted_shards(tmp_path_factory) -> Path:
    return write_planted_shards(tmp_path_factory.mktemp("planted") / "shards")
