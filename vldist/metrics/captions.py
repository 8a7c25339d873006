"""Caption metrics as the captioning field reports them: pycocoevalcap's own code, run safely.

Everything is computed by pycocoevalcap (1.2); no metric is reimplemented here. As
``COCOEvalCap.evaluate`` does, references and candidates first go through its ``PTBTokenizer``
(Stanford CoreNLP 3.4.1, Java: lower-cased, punctuation removed), then through its scorers:

* ``Bleu(4)``  -> ``bleu1`` .. ``bleu4`` (corpus BLEU, brevity penalty from the closest reference);
* ``Meteor()`` -> ``meteor`` (METEOR 1.5, a Java process, ``-l en -norm``);
* ``Rouge()``  -> ``rouge_l`` (LCS F-measure with beta = 1.2, averaged over ids);
* ``Cider()``  -> ``cider_d``. pycocoevalcap's ``Cider`` is the CIDEr-D formula: clipped n-gram
  counts, a Gaussian length penalty with sigma = 6, times 10. Its document frequencies come from
  the references of the evaluated set itself, so a subset of ids scores differently from the same
  ids inside a larger set (and a set of one id always scores 0).

SPICE is not reported: pycocoevalcap's ``Spice()`` constructor downloads Stanford CoreNLP
(stanford-corenlp-full-2015-12-09.zip, ~385 MB), which offline machines and clusters without
network cannot do.

What this module adds around pycocoevalcap (docs/caption-metrics.md):

* clear ``ValueError``s for bad input and a ``JavaNotFoundError`` that says what to install;
* every JVM runs in an English locale: METEOR parses its own numbers with the JVM's locale and dies
  under e.g. German (``could not convert string to float: b''`` in Python);
* one METEOR JVM per process, started by the first call and reused by the next ones (its start
  is ~6 s of CPU whatever the set; a training run scores every validation); it ends with the
  process, after any failure, or on ``release_meteor_jvm()``;
* METEOR scoring runs under a timeout; a hung METEOR gives ``meteor = nan`` and a warning, and that
  JVM is killed before the call returns;
* the PTB tokenizer runs from a private writable copy, so a read-only site-packages works;
* what the JVMs print (the JVM's "Picked up JAVA_TOOL_OPTIONS: ..." for the locale above, the
  tokenizer's "PTBTokenizer tokenized N tokens at ...") never reaches the console: it is kept,
  and shown in the error when the tokenizer or METEOR fails.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Hashable, Iterator, Mapping
from contextlib import contextmanager, suppress
from types import SimpleNamespace

from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.meteor.meteor import Meteor
from pycocoevalcap.rouge.rouge import Rouge

from vldist.errors import CaptionMetricsError, JavaNotFoundError

__all__ = ["caption_scores", "release_meteor_jvm", "CaptionMetricsError", "JavaNotFoundError"]

log = logging.getLogger("vldist.metrics")

METEOR_TIMEOUT_S = 600.0

# Appended to JAVA_TOOL_OPTIONS: a later -D wins, so these override a user's own locale settings.
# The .format pair matters too: a user's -Duser.language.format=de alone still breaks METEOR.
ENGLISH_JVM_LOCALE = (
    "-Duser.language=en",
    "-Duser.country=US",
    "-Duser.language.format=en",
    "-Duser.country.format=US",
)

# Characters Java's PTBTokenizer (-preserveLines) takes as line ends besides "\n". pycocoevalcap
# replaces only "\n" by a space; any of these would split a caption into two lines and shift every
# later caption onto the wrong id without an error, so they get the same treatment as "\n".
_JAVA_LINE_BREAKS = re.compile("[\r\x0b\x0c\u2028\u2029]")

_PTB_MODULE = "pycocoevalcap.tokenizer.ptbtokenizer"

# One call at a time per process: a call edits os.environ (JAVA_TOOL_OPTIONS) for its JVMs, and each
# METEOR JVM takes a 2 GB heap.
_ONE_CALL_AT_A_TIME = threading.Lock()


def caption_scores(
    references: Mapping[Hashable, list[str]],
    candidates: Mapping[Hashable, str],
    *,
    meteor_timeout: float = METEOR_TIMEOUT_S,
    meteor: bool = True,
) -> dict[str, float]:
    """BLEU-1..4, METEOR, ROUGE-L and CIDEr-D of ``candidates`` against ``references``, by pycocoevalcap.

    ``references`` maps an id to its reference captions, ``candidates`` maps the same ids to one
    generated caption each. Returns ``bleu1``, ``bleu2``, ``bleu3``, ``bleu4``, ``meteor``,
    ``rouge_l`` and ``cider_d`` as floats on pycocoevalcap's scale (0-1; CIDEr-D ~0-10).

    ``meteor_timeout``: seconds METEOR may take to score the set, counted once tokenising is done
    (what is left of its JVM's start then counts in it). Past it the METEOR JVM is killed, a
    warning is logged and ``meteor`` is NaN; the other metrics are still computed.

    ``meteor=False``: no METEOR JVM (its start takes ~6 s of CPU and a 2 GB heap); ``meteor`` is NaN.
    """
    refs, cands = _validated(references, candidates)
    if isinstance(meteor_timeout, bool) or not isinstance(meteor_timeout, (int, float)) or not meteor_timeout > 0:
        raise ValueError(f"meteor_timeout must be a positive number of seconds, got {meteor_timeout!r}")
    require_java()
    if not meteor:
        with _ONE_CALL_AT_A_TIME, _english_jvm_locale(), _private_ptb_tokenizer() as tokenizer:
            gts, res = _tokenized(tokenizer, refs, cands)
        return _scores(gts, res, math.nan)
    with _ONE_CALL_AT_A_TIME, _english_jvm_locale():
        # Asked for before tokenising: a new METEOR JVM needs ~6 s to load, and this overlaps it.
        jvm = _shared_meteor()
        scoring = None
        try:
            with _private_ptb_tokenizer() as tokenizer:
                gts, res = _tokenized(tokenizer, refs, cands)
            scoring = _MeteorScoring(jvm, gts, res, meteor_timeout)
            scores = _scores(gts, res, math.nan)
            scoring.wait()
        finally:
            # A JVM that failed, hung or was interrupted mid-answer cannot be trusted with the next set.
            java_report = "" if scoring is not None and scoring.answered() else _release(jvm, scoring)
        return {**scores, "meteor": scoring.score(java_report)}


def _scores(gts: dict, res: dict, meteor: float) -> dict[str, float]:
    """pycocoevalcap's BLEU-1..4, ROUGE-L and CIDEr-D of tokenised captions, with ``meteor`` as given."""
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    rouge_l, _ = Rouge().compute_score(gts, res)
    cider_d, _ = Cider().compute_score(gts, res)
    return {
        "bleu1": float(bleu[0]),
        "bleu2": float(bleu[1]),
        "bleu3": float(bleu[2]),
        "bleu4": float(bleu[3]),
        "meteor": meteor,
        "rouge_l": float(rouge_l),
        "cider_d": float(cider_d),
    }


def _validated(references, candidates) -> tuple[dict, dict]:
    """Both inputs as ``{id: [caption, ...]}``, the shape pycocoevalcap's tokenizer takes, or a ValueError."""
    for name, value in (("references", references), ("candidates", candidates)):
        if not isinstance(value, Mapping):
            raise ValueError(f"{name} must be a dict keyed by id, got {type(value).__name__}")
        if not value:
            raise ValueError(f"{name} is empty: there is nothing to score")
    no_candidate = [i for i in references if i not in candidates]
    no_references = [i for i in candidates if i not in references]
    if no_candidate or no_references:
        parts = []
        if no_candidate:
            parts.append(f"{len(no_candidate)} id(s) have references but no candidate (first: {_first(no_candidate)})")
        if no_references:
            parts.append(
                f"{len(no_references)} id(s) have a candidate but no references (first: {_first(no_references)})"
            )
        raise ValueError("references and candidates must have the same ids: " + "; ".join(parts))
    cands = {}
    for i, candidate in candidates.items():
        if not isinstance(candidate, str):
            raise ValueError(
                f"the candidate of id {i!r} must be one string, got {type(candidate).__name__}"
                " (pycocoevalcap scores one generated caption per id)"
            )
        cands[i] = [candidate]
    refs = {}
    for i in candidates:  # the candidates' order, so both dicts iterate alike
        captions = references[i]
        if isinstance(captions, str) or not isinstance(captions, (list, tuple)):
            raise ValueError(f"the references of id {i!r} must be a list of strings, got {type(captions).__name__}")
        if not captions:
            raise ValueError(f"id {i!r} has no reference caption (each id needs at least one)")
        for caption in captions:
            if not isinstance(caption, str):
                raise ValueError(f"a reference of id {i!r} is {type(caption).__name__}, not a string")
        refs[i] = list(captions)
    return refs, cands


def _first(ids: list, shown: int = 3) -> str:
    return ", ".join(repr(i) for i in ids[:shown]) + (", ..." if len(ids) > shown else "")


def require_java() -> None:
    """Raise JavaNotFoundError, saying what to install, when no `java` is on PATH."""
    # Checked before any JVM starts: without it pycocoevalcap fails deep inside subprocess.
    if shutil.which("java") is None:
        raise JavaNotFoundError(
            "pycocoevalcap needs Java (its PTB tokenizer and METEOR are Java programs), and no "
            "`java` is on PATH. Install a Java runtime: `apt-get install -y default-jre-headless` "
            "on Debian/Ubuntu, or put any Java >= 8 on PATH."
        )


@contextmanager
def _english_jvm_locale() -> Iterator[None]:
    """JVMs started inside run in en_US; the previous JAVA_TOOL_OPTIONS comes back afterwards.

    pycocoevalcap starts its JVMs with the inherited environment, and JAVA_TOOL_OPTIONS is read by
    every JVM (Java >= 5), so this reaches them without editing pycocoevalcap."""
    previous = os.environ.get("JAVA_TOOL_OPTIONS")
    os.environ["JAVA_TOOL_OPTIONS"] = " ".join(filter(None, (previous, *ENGLISH_JVM_LOCALE)))
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("JAVA_TOOL_OPTIONS", None)
        else:
            os.environ["JAVA_TOOL_OPTIONS"] = previous


@contextmanager
def _private_ptb_tokenizer():
    """pycocoevalcap's own PTBTokenizer, loaded from a private, writable copy of its directory.

    The original writes its input to a temporary file in its package directory and runs java there,
    which fails on a read-only site-packages (cluster images). The copy holds its unchanged
    ptbtokenizer.py and a link to its CoreNLP jar, so tokenisation is exactly pycocoevalcap's. It
    is used always, not only when the package is read-only: one code path, tested everywhere, and
    a run killed mid-tokenisation leaves no stray file in site-packages (the original's file is
    removed only after java returns). It costs a 3 kB copy per call.

    Its java runs with stderr captured (the copy's `subprocess` is _captured_java's), so that its
    chatter stays off the console between the training progress lines; _tokenized shows it when
    the tokenizer fails.
    """
    spec = importlib.util.find_spec(_PTB_MODULE)
    if spec is None or spec.origin is None:
        raise CaptionMetricsError(f"pycocoevalcap is not installed completely: {_PTB_MODULE} not found")
    package_dir = os.path.dirname(spec.origin)
    with tempfile.TemporaryDirectory(prefix="vldist-ptb-") as mirror:
        source = os.path.join(mirror, os.path.basename(spec.origin))
        shutil.copyfile(spec.origin, source)
        private = importlib.util.spec_from_file_location("_vldist_private_ptbtokenizer", source)
        module = importlib.util.module_from_spec(private)
        private.loader.exec_module(module)
        module.subprocess = _captured_java()
        jar = module.STANFORD_CORENLP_3_4_1_JAR
        os.symlink(os.path.join(package_dir, jar), os.path.join(mirror, jar))
        tokenizer = module.PTBTokenizer()
        tokenizer.java = module.subprocess  # its runs, for _tokenized's checks
        yield tokenizer


def _captured_java() -> SimpleNamespace:
    """A stand-in for the `subprocess` module of the private tokenizer: its Popen is subprocess's with
    stderr piped, and remembers each process (`runs`) with what it printed (`said`)."""
    runs: list[subprocess.Popen] = []

    class Popen(subprocess.Popen):
        said = b""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "stderr": subprocess.PIPE})
            runs.append(self)

        def communicate(self, *args, **kwargs):
            out, self.said = super().communicate(*args, **kwargs)
            return out, self.said

    return SimpleNamespace(Popen=Popen, PIPE=subprocess.PIPE, runs=runs)


def _java_said(stderr: bytes) -> str:
    """The last lines a JVM printed on stderr, for an error message (less the JVM's own "Picked up
    JAVA_TOOL_OPTIONS" line, which this module's locale causes)."""
    lines = [
        line
        for line in stderr.decode(errors="replace").splitlines()
        if line.strip() and not line.startswith("Picked up JAVA_TOOL_OPTIONS")
    ]
    return "Java said:\n" + "\n".join(lines[-15:]) if lines else "Java printed nothing."


def _tokenized(
    tokenizer, refs: dict[Hashable, list[str]], cands: dict[Hashable, list[str]]
) -> tuple[dict[Hashable, list[str]], dict[Hashable, list[str]]]:
    """References and candidates through one tokenizer JVM (it tokenises line by line, so one run
    gives what pycocoevalcap's two runs give)."""
    both = {(side, i): texts for side, captions in enumerate((refs, cands)) for i, texts in captions.items()}
    sent = {key: [{"caption": _JAVA_LINE_BREAKS.sub(" ", c)} for c in texts] for key, texts in both.items()}
    tokenized = tokenizer.tokenize(sent)
    java = tokenizer.java.runs[-1]  # the run tokenize() just made
    # pycocoevalcap checks neither java's exit status nor its output: a failed JVM shows up here.
    if java.returncode:
        code = java.returncode
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
        raise CaptionMetricsError(f"pycocoevalcap's PTB tokenizer (java) {how}. {_java_said(java.said)}")
    short = [key[1] for key, texts in both.items() if len(tokenized.get(key, ())) != len(texts)]
    if short:
        raise CaptionMetricsError(
            f"pycocoevalcap's PTB tokenizer (java) returned the wrong number of lines for {len(short)} "
            f"id(s) (first: {_first(short)}). {_java_said(java.said)}"
        )
    return ({i: tokenized[(0, i)] for i in refs}, {i: tokenized[(1, i)] for i in cands})


class _MeteorScoring:
    """``Meteor.compute_score`` in a worker thread, so that a hung METEOR JVM cannot hang the caller."""

    def __init__(self, meteor: Meteor, gts: dict, res: dict, timeout: float):
        self.timeout = timeout
        self._deadline = time.monotonic() + timeout
        self._score: float | None = None
        self._error: BaseException | None = None
        self.timed_out = False
        self.thread = threading.Thread(target=self._run, args=(meteor, gts, res), name="vldist-meteor", daemon=True)
        self.thread.start()

    def _run(self, meteor: Meteor, gts: dict, res: dict) -> None:
        try:
            self._score = float(meteor.compute_score(gts, res)[0])
        except BaseException as error:  # reported in the caller's thread by score()
            self._error = error

    def answered(self) -> bool:
        """METEOR gave its score in time (its JVM is then fit for the next call)."""
        return not self.thread.is_alive() and self._error is None and self._score is not None

    def wait(self) -> None:
        """Until METEOR has answered or the timeout (counted from the start of scoring) has passed."""
        left = self._deadline - time.monotonic()
        self.thread.join(None if math.isinf(left) else max(0.0, left))
        self.timed_out = self.thread.is_alive()

    def score(self, java_report: str) -> float:
        """METEOR's score; NaN and a warning past the timeout; CaptionMetricsError if METEOR failed."""
        if self.timed_out:
            log.warning(
                "METEOR gave no score within meteor_timeout=%gs; its Java process was ended and "
                "meteor is reported as NaN (the other metrics are computed). Raise "
                "meteor_timeout if the set is large or the machine busy.",
                self.timeout,
            )
            return math.nan
        if self._error is not None:
            raise CaptionMetricsError(
                f"METEOR failed ({type(self._error).__name__}: {self._error}). " + java_report
            ) from None
        return self._score


# This process's METEOR JVM, kept between calls, and the pid that started it: a forked child (a data
# loader worker) inherits the object but must neither use nor kill its parent's JVM.
_meteor: Meteor | None = None
_meteor_owner: int | None = None
_inherited: list[Meteor] = []  # a parent's Meteor objects, never collected (Meteor.__del__ kills the JVM)


def _shared_meteor() -> Meteor:
    """This process's running METEOR JVM, started if there is none (or the last one has exited)."""
    global _meteor, _meteor_owner
    if _meteor is not None and _meteor_owner != os.getpid():
        _inherited.append(_meteor)
        _meteor = None
    if _meteor is not None and _meteor.meteor_p.poll() is not None:
        _release(_meteor, None)
    if _meteor is None:
        _meteor, _meteor_owner = Meteor(), os.getpid()
    return _meteor


def release_meteor_jvm() -> None:
    """End this process's METEOR JVM now (its ~1 GB comes back); the next caption_scores call
    starts a new one. It also ends by itself when the process exits."""
    with _ONE_CALL_AT_A_TIME:
        if _meteor is not None and _meteor_owner == os.getpid():
            _release(_meteor, None)


@atexit.register
def _end_at_exit() -> None:
    # Not waiting for a call still running in a daemon thread: its JVM is killed under it instead.
    if _ONE_CALL_AT_A_TIME.acquire(blocking=False):
        _ONE_CALL_AT_A_TIME.release()
        release_meteor_jvm()
    elif _meteor is not None and _meteor_owner == os.getpid():
        _meteor.meteor_p.kill()


def _release(meteor: Meteor, scoring: _MeteorScoring | None) -> str:
    """End ``meteor``'s JVM and forget it as this process's shared one; see _end_meteor_jvm."""
    global _meteor
    if meteor is _meteor:
        _meteor = None
    return _end_meteor_jvm(meteor, scoring)


def _end_meteor_jvm(meteor: Meteor, scoring: _MeteorScoring | None) -> str:
    """Kill and reap the METEOR JVM and leave the Meteor object safe to collect; says how the JVM
    had ended by itself, if it had, and its last stderr lines."""
    process = meteor.meteor_p
    own_end = process.poll()  # before our kill: an exit or signal of the JVM's own
    process.kill()  # first: a worker blocked on the JVM's pipes returns only once the JVM is gone
    process.wait()
    if scoring is not None:
        scoring.thread.join(10)
    stderr = b""
    with suppress(OSError, ValueError):
        stderr = process.stderr.read()
    for stream in (process.stdin, process.stdout, process.stderr):
        with suppress(OSError, ValueError):
            stream.close()
    # Meteor.compute_score takes meteor.lock without try/finally, so after a failure or a kill it
    # stays held and Meteor.__del__ (which takes it) would block whichever thread collects the
    # object, for ever. A threading.Lock may be released by any thread.
    if (scoring is None or not scoring.thread.is_alive()) and meteor.lock.locked():
        meteor.lock.release()
    report = []
    if own_end is not None:
        how = f"was killed by {_signal_name(-own_end)}" if own_end < 0 else f"exited with status {own_end}"
        report.append(f"Its Java process {how} before it was done.")
    report.append(_java_said(stderr))
    return " ".join(report)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
