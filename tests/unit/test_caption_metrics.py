"""Caption metrics: pycocoevalcap's own numbers, hand-worked values, input errors, missing Java, JVM locale.

These start real JVMs (pycocoevalcap's PTB tokenizer and METEOR); nothing of pycocoevalcap or Java
is mocked. The read-only install and the hung METEOR are in
tests/integration/test_caption_metrics_ops.py.
"""

import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.meteor.meteor import Meteor
from pycocoevalcap.rouge.rouge import Rouge
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

from vldist.metrics import CaptionMetricsError, JavaNotFoundError, caption_scores, release_meteor_jvm
from vldist.metrics.captions import _english_jvm_locale

KEYS = {"bleu1", "bleu2", "bleu3", "bleu4", "meteor", "rouge_l", "cider_d"}
GERMAN = "-Duser.language=de -Duser.country=DE"

# Like the Slurm and Prometheus tests: skipped where the system program is missing (.ci/run installs it).
needs_java = pytest.mark.skipif(
    shutil.which("java") is None, reason="pycocoevalcap needs Java: apt-get install -y default-jre-headless"
)

# 12 images, 5 references each; candidates range from near-copies to wrong, with capitals and
# punctuation for the PTB tokenizer to handle.
REFS = {
    "img01": [
        "A man is riding a horse on the beach.",
        "A person rides a brown horse along the shore.",
        "Someone riding a horse by the ocean.",
        "A horse and its rider on a sandy beach.",
        "A man on horseback near the water.",
    ],
    "img02": [
        "Two dogs are playing in the grass.",
        "A pair of dogs play on a green lawn.",
        "Two puppies running through a field.",
        "Dogs chasing each other on the grass.",
        "Two brown dogs playing outside.",
    ],
    "img03": [
        "A plate of pasta with tomato sauce.",
        "Spaghetti with red sauce on a white plate.",
        "A bowl of noodles topped with sauce.",
        "Pasta and sauce served on a dish.",
        "A close-up of a spaghetti dinner.",
    ],
    "img04": [
        "A red double-decker bus drives down the street.",
        "A bus on a city road.",
        "A large red bus in traffic.",
        "A double decker bus stopped at a light.",
        "A city bus driving past buildings.",
    ],
    "img05": [
        "A child flies a kite in the park.",
        "A kid holding a kite string on a windy day.",
        "A young boy flying a colorful kite.",
        "A kite in the sky above a child.",
        "A little girl plays with a kite on the grass.",
    ],
    "img06": [
        "A cat sleeping on a laptop keyboard.",
        "A gray cat lies on a computer.",
        "The cat is napping on the laptop.",
        "A kitten curled up on a keyboard.",
        "A cat resting on an open laptop.",
    ],
    "img07": [
        "People skiing down a snowy mountain.",
        "Skiers on a slope covered in snow.",
        "A group of people ski downhill.",
        "Several skiers on a mountain trail.",
        "Two people skiing in fresh snow.",
    ],
    "img08": [
        "A train pulling into a station.",
        "A passenger train at the platform.",
        "A yellow train arrives at the station.",
        "A commuter train stopped at a depot.",
        "A train on the tracks next to a platform.",
    ],
    "img09": [
        "A man surfing a large wave.",
        "A surfer rides a wave in the ocean.",
        "Someone on a surfboard catching a wave.",
        "A person surfing on blue water.",
        "A surfer in a wetsuit on a wave.",
    ],
    "img10": [
        "A bowl of fruit on a wooden table.",
        "Apples and bananas in a bowl.",
        "Fresh fruit sitting on a kitchen table.",
        "A fruit bowl with oranges and apples.",
        "A table with a bowl full of fruit.",
    ],
    "img11": [
        "A woman talking on a cell phone.",
        "A lady holds a phone to her ear.",
        "A woman makes a phone call on the street.",
        "A girl chatting on her mobile phone.",
        "A person using a smartphone outdoors.",
    ],
    "img12": [
        "An airplane flying in a clear blue sky.",
        "A jet plane in the sky.",
        "A large passenger plane flying overhead.",
        "An aircraft flying above the clouds.",
        "A white airplane in flight.",
    ],
}
CANDS = {
    "img01": "A man riding a horse on the beach.",  # near-copy
    "img02": "Two dogs playing in the grass!",  # good
    "img03": "A plate of spaghetti with sauce.",  # good
    "img04": "A red bus driving down a city street.",  # good, reworded
    "img05": "A boy is flying a kite.",  # good, short
    "img06": "A cat on a laptop.",  # short
    "img07": "A man holding a surfboard.",  # wrong
    "img08": "A train, at the station?",  # punctuation in the middle
    "img09": "A SURFER riding a wave.",  # capitals
    "img10": "A bowl of fruit.",  # short
    "img11": "A dog sitting on a couch.",  # wrong
    "img12": "An airplane flying in the sky.",  # good
}


def pycocoevalcap_scores(refs: dict, cands: dict) -> dict:
    """What COCOEvalCap.evaluate computes, less SPICE, called directly: tokenizer, then each scorer."""
    tokenizer = PTBTokenizer()
    gts = tokenizer.tokenize({i: [{"caption": c} for c in caps] for i, caps in refs.items()})
    res = tokenizer.tokenize({i: [{"caption": c}] for i, c in cands.items()})
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    meteor = Meteor()
    try:
        meteor_score, _ = meteor.compute_score(gts, res)
    finally:
        dispose(meteor)
    rouge_l, _ = Rouge().compute_score(gts, res)
    cider_d, _ = Cider().compute_score(gts, res)
    return {
        "bleu1": bleu[0],
        "bleu2": bleu[1],
        "bleu3": bleu[2],
        "bleu4": bleu[3],
        "meteor": meteor_score,
        "rouge_l": float(rouge_l),
        "cider_d": float(cider_d),
    }


def dispose(meteor: Meteor) -> None:
    """End a plain Meteor's JVM; after a failed compute_score its lock is still held (no try/finally
    there) and Meteor.__del__ would wait on it for ever."""
    meteor.meteor_p.kill()
    meteor.meteor_p.wait()
    if meteor.lock.locked():
        meteor.lock.release()


def java_children() -> list[int]:
    """Java processes whose parent is this test process, zombies included (their comm stays 'java')."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            if ppid == os.getpid() and comm == "java":
                found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def clean_scores() -> dict:
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("JAVA_TOOL_OPTIONS", raising=False)
        return caption_scores(REFS, CANDS)


@needs_java
def test_same_numbers_as_pycocoevalcap_called_directly(clean_scores):
    assert set(clean_scores) == KEYS
    assert all(type(v) is float and math.isfinite(v) for v in clean_scores.values())
    assert clean_scores == pycocoevalcap_scores(REFS, CANDS)
    # the set mixes good and wrong candidates: mid-range scores, not 0 or 1
    assert 0.3 < clean_scores["bleu1"] < 0.95 and 0 < clean_scores["bleu4"] < clean_scores["bleu1"]
    assert 0.1 < clean_scores["meteor"] < 0.6 and 0.3 < clean_scores["cider_d"] < 5


@needs_java
def test_one_meteor_jvm_serves_every_call_of_a_process_until_released(clean_scores):
    assert clean_scores  # a full call has run in this process
    kept = java_children()
    assert len(kept) == 1  # METEOR's; the tokenizer's JVM ends with its run
    # another set through the same JVM: the numbers of pycocoevalcap with a JVM of their own
    others = {i: REFS[i] for i in list(REFS)[:5]}
    shuffled = dict(zip(others, [CANDS[i] for i in list(REFS)[1:6]], strict=True))
    assert caption_scores(others, shuffled) == pycocoevalcap_scores(others, shuffled)
    assert caption_scores(REFS, CANDS) == clean_scores
    assert java_children() == kept
    release_meteor_jvm()
    assert java_children() == []


@needs_java
def test_without_meteor_no_jvm_is_kept_and_the_other_metrics_are_the_same(clean_scores):
    """eval.meteor=false: the tokenizer's JVM only (it ends with its run), METEOR NaN."""
    release_meteor_jvm()
    scores = caption_scores(REFS, CANDS, meteor=False)
    assert java_children() == []
    assert math.isnan(scores["meteor"])
    assert {k: v for k, v in scores.items() if k != "meteor"} == {
        k: v for k, v in clean_scores.items() if k != "meteor"
    }


@needs_java
def test_a_forked_child_starts_its_own_meteor_jvm_and_leaves_its_parents(clean_scores):
    caption_scores(REFS, CANDS)
    (parents,) = java_children()
    child = os.fork()
    if child == 0:  # the child: scores with a JVM of its own, then ends without running finalizers
        try:
            same = caption_scores(REFS, CANDS) == clean_scores
            own = java_children()
            os._exit(0 if same and len(own) == 1 and own != [parents] else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert java_children() == [parents]  # the child neither used nor killed it
    assert caption_scores(REFS, CANDS) == clean_scores


def lcs(a: list, b: list) -> int:
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
    return table[-1][-1]


@needs_java
def test_hand_worked_bleu_and_rouge_l():
    # After tokenizing (lower case, punctuation gone) the candidate is "a man riding a horse": every
    # 1- to 4-gram of it occurs in the second reference, and the closest reference length is 5
    # (the first one), so BLEU-1..4 = 1 (pycocoevalcap adds a 1e-9 smoothing).
    # ROUGE-L: LCS 4 with "a man rides a horse" (P = R = 4/5), 5 with the 8-word reference
    # (P = 1, R = 5/8); pycocoevalcap takes P = max P = 1, R = max R = 4/5, beta = 1.2:
    # F = (1 + 1.44) * 1 * 0.8 / (0.8 + 1.44 * 1) = 0.87142857...
    # The first reference holds U+2028, a line break to Java's tokenizer: had it gone through
    # unchanged, this id would get the references "a man rides" and "a horse" and other numbers.
    refs = {"x": ["A man rides\u2028a horse.", "A man riding a horse on the beach."]}
    out = caption_scores(refs, {"x": "A man, riding a horse!"})
    for n in (1, 2, 3, 4):
        assert out[f"bleu{n}"] == pytest.approx(1.0, abs=1e-8)
    cand = "a man riding a horse".split()
    toks = ["a man rides a horse".split(), "a man riding a horse on the beach".split()]
    p = max(lcs(r, cand) / len(cand) for r in toks)
    r = max(lcs(r, cand) / len(r) for r in toks)
    assert (p, r) == (1.0, 0.8)
    assert out["rouge_l"] == pytest.approx((1 + 1.2**2) * p * r / (r + 1.2**2 * p), rel=1e-12)
    assert out["rouge_l"] == pytest.approx(2.44 * 0.8 / 2.24, rel=1e-12)
    # CIDEr-D's document frequencies come from the set's own references: one id gives idf 0 everywhere.
    assert out["cider_d"] == 0.0
    assert 0.5 < out["meteor"] <= 1.0


@pytest.mark.parametrize(
    "refs, cands, message",
    [
        ({}, {}, "references is empty"),
        ({"a": ["x"]}, {}, "candidates is empty"),
        ({"a": ["x"], "b": ["y"]}, {"a": "x"}, "same ids: 1 id(s) have references but no candidate (first: 'b')"),
        ({"a": ["x"]}, {"a": "x", "c": "z"}, "1 id(s) have a candidate but no references (first: 'c')"),
        ({"a": ["x"]}, {"a": ["x"]}, "the candidate of id 'a' must be one string, got list"),
        ({"a": ["x"]}, {"a": None}, "the candidate of id 'a' must be one string, got NoneType"),
        ({"a": []}, {"a": "x"}, "id 'a' has no reference caption"),
        ({"a": "x"}, {"a": "x"}, "the references of id 'a' must be a list of strings, got str"),
        ({"a": ["x", 3]}, {"a": "x"}, "a reference of id 'a' is int, not a string"),
        (["x"], {"a": "x"}, "references must be a dict keyed by id, got list"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_id(refs, cands, message):
    before = java_children()
    with pytest.raises(ValueError) as caught:
        caption_scores(refs, cands)
    assert message in str(caught.value)
    assert java_children() == before  # refused before any JVM started


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), "60"])
def test_meteor_timeout_must_be_positive_seconds(timeout):
    with pytest.raises(ValueError, match="meteor_timeout"):
        caption_scores({"a": ["x"]}, {"a": "x"}, meteor_timeout=timeout)


def test_missing_java_says_what_to_install(monkeypatch, tmp_path):
    before = java_children()
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no java on it
    with pytest.raises(JavaNotFoundError) as caught:
        caption_scores({"a": ["a dog"]}, {"a": "a dog"})
    assert isinstance(caught.value, CaptionMetricsError)
    message = str(caught.value)
    assert "pycocoevalcap needs Java" in message
    assert "apt-get install -y default-jre-headless" in message and "Java >= 8" in message
    assert java_children() == before


def jvm_locale_properties() -> dict:
    shown = subprocess.run(
        ["java", "-XshowSettings:properties", "-version"], capture_output=True, text=True, timeout=60
    ).stderr
    props = {k.strip(): v.strip() for k, _, v in (line.partition(" = ") for line in shown.splitlines())}
    return {k: props.get(k) for k in ("user.language", "user.country", "user.language.format", "user.country.format")}


@needs_java
def test_the_jvm_locale_overrides_the_users_own_and_is_restored(monkeypatch):
    users = GERMAN + " -Duser.language.format=de -Duser.country.format=DE"
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", users)
    assert jvm_locale_properties() == {
        "user.language": "de",
        "user.country": "DE",
        "user.language.format": "de",
        "user.country.format": "DE",
    }
    with _english_jvm_locale():
        assert os.environ["JAVA_TOOL_OPTIONS"].startswith(users)  # kept, and overridden after it
        assert jvm_locale_properties() == {
            "user.language": "en",
            "user.country": "US",
            "user.language.format": "en",
            "user.country.format": "US",
        }
    assert os.environ["JAVA_TOOL_OPTIONS"] == users
    monkeypatch.delenv("JAVA_TOOL_OPTIONS")
    with pytest.raises(RuntimeError), _english_jvm_locale():
        raise RuntimeError
    assert "JAVA_TOOL_OPTIONS" not in os.environ


@needs_java
def test_german_jvm_locale_breaks_plain_meteor_but_not_caption_scores(monkeypatch, clean_scores):
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", GERMAN)
    # Plain pycocoevalcap: METEOR reads back its own "5.0 6.0 ..." statistics with a German
    # java.util.Scanner, which wants "5,0"; the JVM dies and Python reads an empty line.
    meteor = Meteor()
    try:
        with pytest.raises(ValueError, match="could not convert string to float"):
            meteor.compute_score({1: ["a man is riding a horse"]}, {1: ["a man riding a horse"]})
    finally:
        dispose(meteor)
    release_meteor_jvm()  # so that caption_scores starts its METEOR JVM under the German options
    assert caption_scores(REFS, CANDS) == clean_scores
    assert os.environ["JAVA_TOOL_OPTIONS"] == GERMAN
