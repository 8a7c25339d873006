"""Caption metrics keep Java's chatter off the console, and show it when Java fails.

Every JVM prints "Picked up JAVA_TOOL_OPTIONS: ..." on its stderr (fd 2, not Python's sys.stderr)
while that variable is set, as caption_scores sets it for an English locale, and pycocoevalcap's
tokenizer prints "PTBTokenizer tokenized N tokens at ..." there: between a run's progress lines.
Real JVMs; capfd reads the file descriptors the JVMs inherit.
"""

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from vldist.metrics import CaptionMetricsError, caption_scores, release_meteor_jvm

pytestmark = pytest.mark.skipif(
    shutil.which("java") is None, reason="pycocoevalcap needs Java: apt-get install -y default-jre-headless"
)

REFS = {
    "x": ["A man rides a horse.", "A man riding a horse on the beach."],
    "y": ["Two dogs play in the grass.", "A pair of dogs on a lawn."],
}
CANDS = {"x": "A man, riding a horse!", "y": "Two dogs playing in the grass."}
CHATTER = ("Picked up", "PTBTokenizer", "tokenized")


@pytest.fixture(autouse=True)
def own_meteor_jvm(monkeypatch):
    """A METEOR JVM started by the call under test (inside capfd), none left after it."""
    monkeypatch.delenv("JAVA_TOOL_OPTIONS", raising=False)
    release_meteor_jvm()
    yield
    release_meteor_jvm()


def test_nothing_java_prints_reaches_the_console_and_the_scores_are_computed(capfd):
    scores = caption_scores(REFS, CANDS)
    out, err = capfd.readouterr()
    assert not [word for word in CHATTER if word in out or word in err], (out, err)
    # "a man riding a horse" once tokenised: every n-gram of it is in the second reference of "x"
    one = caption_scores({"x": REFS["x"]}, {"x": CANDS["x"]}, meteor=False)
    assert one["bleu4"] == pytest.approx(1.0, abs=1e-8)
    assert 0.5 < scores["bleu1"] <= 1 and 0.3 < scores["meteor"] <= 1 and scores["rouge_l"] > 0.5
    out, err = capfd.readouterr()
    assert not [word for word in CHATTER if word in out or word in err], (out, err)


def test_a_tokenizer_jvm_that_cannot_start_names_what_java_said(monkeypatch, capfd):
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", "-XX:+NoSuchVldistOption")  # a user's broken JVM option
    with pytest.raises(CaptionMetricsError) as caught:
        caption_scores(REFS, CANDS, meteor=False)
    said = str(caught.value)
    assert said.startswith("pycocoevalcap's PTB tokenizer (java) exited with status 1. Java said:\n"), said
    assert "Unrecognized VM option 'NoSuchVldistOption'" in said
    assert "Picked up" not in said
    out, err = capfd.readouterr()
    assert "NoSuchVldistOption" not in out + err  # in the error, not printed besides


def java_children(cmdline_has: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == os.getpid() and cmdline_has in cmdline:
                found.append(int(entry.name))
    return found


def test_a_tokenizer_jvm_killed_mid_run_is_an_error_naming_the_signal(capfd):
    killed = []

    def kill_the_tokenizer():
        deadline = time.monotonic() + 60
        while not killed and time.monotonic() < deadline:
            for pid in java_children("edu.stanford.nlp.process.PTBTokenizer"):
                os.kill(pid, 9)
                killed.append(pid)
            time.sleep(0.005)

    killer = threading.Thread(target=kill_the_tokenizer, daemon=True)
    killer.start()
    with pytest.raises(CaptionMetricsError) as caught:
        caption_scores(REFS, CANDS, meteor=False)
    killer.join()
    assert killed
    assert str(caught.value).startswith("pycocoevalcap's PTB tokenizer (java) was killed by SIGKILL."), caught.value
    out, err = capfd.readouterr()
    assert not [word for word in CHATTER if word in out or word in err], (out, err)
