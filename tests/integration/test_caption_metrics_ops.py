"""Caption metrics under operational trouble: a hung or killed METEOR JVM, a read-only pycocoevalcap.

Real JVMs, real signals, a real read-only bind mount (root only; skipped where mount is refused).
"""

import gc
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vldist.metrics import CaptionMetricsError, caption_scores, release_meteor_jvm

pytestmark = pytest.mark.skipif(
    shutil.which("java") is None, reason="pycocoevalcap needs Java: apt-get install -y default-jre-headless"
)

REFS = {
    "beach": [
        "A man is riding a horse on the beach.",
        "A person rides a horse along the shore.",
        "Someone riding a horse by the ocean.",
        "A horse and rider on a sandy beach.",
        "A man on horseback near the water.",
    ],
    "dogs": [
        "Two dogs are playing in the grass.",
        "A pair of dogs play on a green lawn.",
        "Two puppies running through a field.",
        "Dogs chasing each other on the grass.",
        "Two brown dogs playing outside.",
    ],
    "bus": [
        "A red double-decker bus drives down the street.",
        "A bus on a city road.",
        "A large red bus in traffic.",
        "A double decker bus stopped at a light.",
        "A city bus driving past buildings.",
    ],
}
CANDS = {
    "beach": "A man riding a horse on the beach.",
    "dogs": "Two dogs playing in the grass!",
    "bus": "A cat on a sofa.",
}


@pytest.fixture(autouse=True)
def no_meteor_jvm_kept():
    """Each test starts with no METEOR JVM in this process, so the call under test starts its own."""
    release_meteor_jvm()


def children(*, cmdline_has: str = "") -> list[int]:
    """Processes whose parent is this test process (zombies included), optionally by command line."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == os.getpid() and cmdline_has in cmdline:
            found.append(int(entry.name))
    return found


def meteor_jvm(wait_s: float = 60.0) -> int:
    """The METEOR JVM a caption_scores call in another thread has started."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        found = children(cmdline_has="meteor-1.5.jar")
        if found:
            return found[0]
        time.sleep(0.02)
    raise AssertionError("no METEOR JVM appeared")


def gone(pid: int) -> bool:
    """Exited and reaped: not even a zombie left."""
    return not Path(f"/proc/{pid}").exists()


class InThread:
    """caption_scores in a thread, so the test can act on its JVM meanwhile. Keeps no exception
    object: its traceback would keep the Meteor object alive past the thread."""

    def __init__(self, **options):
        self.result, self.error, self.elapsed = None, None, None
        self.thread = threading.Thread(target=self._run, kwargs=options, daemon=True)
        self.started = time.monotonic()
        self.thread.start()

    def _run(self, **options):
        try:
            self.result = caption_scores(REFS, CANDS, **options)
        except Exception as error:  # noqa: BLE001 - the test inspects it
            self.error = (type(error), str(error))
        self.elapsed = time.monotonic() - self.started
        gc.collect()  # Meteor.__del__ of this call runs here: it must not block on Meteor's lock


def test_a_stopped_meteor_jvm_gives_nan_within_the_timeout_and_is_killed(caplog):
    caplog.set_level(logging.WARNING, logger="vldist.metrics")
    timeout = 3.0
    call = InThread(meteor_timeout=timeout)
    pid = meteor_jvm()
    os.kill(pid, signal.SIGSTOP)  # a real hang: the JVM is alive and never answers
    call.thread.join(timeout + 60)
    assert not call.thread.is_alive(), "caption_scores (or Meteor.__del__ after it) hung"
    assert call.error is None, call.error
    # tokenising (a JVM start) comes before METEOR's clock starts, hence the margin
    assert timeout <= call.elapsed < timeout + 30
    assert math.isnan(call.result["meteor"])
    others = {k: v for k, v in call.result.items() if k != "meteor"}
    assert all(math.isfinite(v) for v in others.values()) and others["bleu1"] > 0.3
    assert gone(pid)
    assert any("meteor_timeout=3s" in r.getMessage() and "NaN" in r.getMessage() for r in caplog.records)


def test_a_meteor_jvm_that_dies_is_a_clear_error_and_leaves_nothing_behind():
    call = InThread(meteor_timeout=120.0)
    pid = meteor_jvm()
    os.kill(pid, signal.SIGKILL)  # what the kernel's OOM killer does to a 2 GB JVM
    call.thread.join(120)
    assert not call.thread.is_alive(), "caption_scores (or Meteor.__del__ after it) hung"
    assert call.error is not None and call.error[0] is CaptionMetricsError
    assert call.error[1].startswith("METEOR failed ("), call.error[1]
    assert "Its Java process was killed by SIGKILL" in call.error[1]
    assert gone(pid)
    assert children(cmdline_has="java") == []


PLAIN_TOKENIZER = """
import pycocoevalcap.tokenizer.ptbtokenizer as t
assert t.__file__.startswith({ro!r}), t.__file__
try:
    t.PTBTokenizer().tokenize({{1: [{{"caption": "A dog."}}]}})
except OSError as error:
    print("FAILED:", error)
else:
    print("WORKED")
"""

VLDIST_SCORES = """
import json, sys
import pycocoevalcap.meteor.meteor as m, pycocoevalcap.tokenizer.ptbtokenizer as t
assert m.__file__.startswith({ro!r}) and t.__file__.startswith({ro!r}), (m.__file__, t.__file__)
from vldist.metrics import caption_scores
print(json.dumps(caption_scores(json.loads(sys.argv[1]), json.loads(sys.argv[2]))))
"""


@pytest.fixture
def read_only_pycocoevalcap(tmp_path):
    """A copy of the installed pycocoevalcap on a read-only bind mount; yields the directory to put on PYTHONPATH."""
    import pycocoevalcap.meteor.meteor as installed

    package = Path(installed.__file__).parents[1]
    src, ro = tmp_path / "src", tmp_path / "ro"
    shutil.copytree(package, src / "pycocoevalcap", ignore=shutil.ignore_patterns("spice", "__pycache__"))
    ro.mkdir()
    bind = subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True, text=True)
    if bind.returncode != 0:
        pytest.skip(f"cannot bind-mount here (needs root and mount rights): {bind.stderr.strip()}")
    try:
        remount = subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True, text=True)
        if remount.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {remount.stderr.strip()}")
        assert not os.access(ro / "pycocoevalcap" / "tokenizer", os.W_OK)
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def run_python(code: str, pythonpath: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    env.pop("JAVA_TOOL_OPTIONS", None)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300)


def test_read_only_pycocoevalcap_breaks_its_tokenizer_but_not_caption_scores(read_only_pycocoevalcap):
    ro = str(read_only_pycocoevalcap)
    plain = run_python(PLAIN_TOKENIZER.format(ro=ro), read_only_pycocoevalcap)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert "FAILED:" in plain.stdout and "Read-only file system" in plain.stdout

    ours = run_python(VLDIST_SCORES.format(ro=ro), read_only_pycocoevalcap, json.dumps(REFS), json.dumps(CANDS))
    assert ours.returncode == 0, ours.stderr[-2000:]
    normal = caption_scores(REFS, CANDS)
    assert len(children(cmdline_has="meteor-1.5.jar")) == 1  # kept for the next call, and only it
    release_meteor_jvm()
    assert children(cmdline_has="java") == []
    assert normal["meteor"] > 0
    assert json.loads(ours.stdout.strip().splitlines()[-1]) == normal
