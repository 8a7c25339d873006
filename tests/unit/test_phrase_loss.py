"""The two-branch phrase-localisation loss as the paper's Algorithm 1 defines it.

A reference written here loop by loop from the paper's text (§4.1, Algorithm 1), from the raw
samples' boxes and entities only, not from the recipe's masks:

    3.a  (x, y, y'): region anchor x (the phrase's positive region), its phrase y positive, y' a
         phrase "from this mini-batch not in the same coreference chain as y (i.e., phrases y and
         y' are not both associated with the same ground truth region)"
    3.b  (y, x, x'): phrase anchor y, its region x positive, x' "a region from the same image with
         IoU < 0.3 with the ground truth"
    each: "keep at most K = 30 with highest nonnegative loss"; Eq. 3: lambda_1 (region anchors),
    lambda_2 (phrase anchors), hinges summed.

Then a Flickr30K Entities miniature converted and collated by the recipe: the phrases of one
chain are never each other's negatives, nor their regions; the similarity network's drawn
negatives keep the same rule.
"""

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import read_shard_set

from vldist.data.identity import sample_identity
from vldist.data.job_shards import JobShards
from vldist.data.shardset import ShardSet
from vldist.data.vocab import Vocab
from vldist.losses.two_branch import cross_rank_two_branch_ranking_loss, phrase_ranking_loss
from vldist.recipes.jobs import load_config
from vldist.recipes.two_branch import TwoBranchEmbedRecipe, TwoBranchSimRecipe


def iou(a, b) -> float:
    """IoU of two [x0, y0, x1, y1] boxes, continuous coordinates."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


# --------------------------------------------------------------------------- scenes, raw samples

# (phrase, box, entity): image 0 as Flickr30K Entities has it (a chain of three phrases with one
# box; two entities annotated with one box), image 1 as the synthetic scenes (no entity: each
# object its own chain), image 2 one entity boxed in two places (one chain, two boxes).
SCENES = [
    [
        ("a child", [4, 2, 24, 40], "18"),
        ("a pink dress", [29, 9, 64, 45], "19"),
        ("the little girl", [4, 2, 24, 40], "18"),
        ("the stairs", [0, 40, 64, 48], "21"),
        ("the steps", [0, 40, 64, 48], "22"),
        ("the kid", [4, 2, 24, 40], "18"),
    ],
    [
        ("a red circle", [0, 0, 10, 10], None),
        ("a blue square", [20, 20, 30, 30], None),
        ("a green star", [35, 5, 50, 20], None),
    ],
    [("a man", [0, 0, 20, 30], "5"), ("he", [30, 0, 50, 30], "5"), ("a ball", [20, 35, 30, 45], "6")],
]
WORDS = sorted({w for scene in SCENES for phrase, _, _ in scene for w in phrase.split()})
DIM, EMBED = 5, 8


def scene_raw(index: int, scene: list, seed: int = 0) -> dict:
    """A raw tar sample of the scene: region rows (the whole image, then each distinct box),
    proposals jittered around each box at several overlaps and random ones, none within 1e-3 of
    the 0.3 and 0.7 thresholds (float32 IoU could fall either side)."""
    rng = np.random.default_rng(100 * seed + index)
    boxes = list(dict.fromkeys(tuple(box) for _, box, _ in scene))
    objects = []
    for phrase, box, entity in scene:
        obj = {"phrase": phrase, "box": box, "region": 1 + boxes.index(tuple(box))}
        if entity is not None:
            obj["entity"] = entity
        objects.append(obj)
    proposals = []
    for x0, y0, x1, y1 in boxes:
        w, h = x1 - x0, y1 - y0
        for cut in (0.0, 0.05, 0.3, 0.5):
            proposals.append([x0, y0, x1, y1 - cut * h])
        proposals.append([x0 + 0.5 * w, y0, x1 + 0.5 * w, y1])
    for _ in range(8):
        x0, y0 = rng.uniform(0, 50, 2)
        proposals.append([x0, y0, x0 + rng.uniform(3, 20), y0 + rng.uniform(3, 20)])
    proposals = [p for p in proposals if all(min(abs(iou(p, b) - t) for t in (0.3, 0.7)) > 1e-3 for b in boxes)]
    meta = {
        "captions": [" ".join(phrase for phrase, _, _ in scene)],
        "objects": objects,
        "proposal_boxes": [[float(v) for v in p] for p in proposals],
    }
    return {
        "__key__": f"scene-{index}",
        "json": json.dumps(meta).encode(),
        "regions.npy": npy(rng.standard_normal((1 + len(boxes), DIM))),
        "proposals.npy": npy(rng.standard_normal((len(proposals), DIM))),
    }


def npy(array) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, np.asarray(array, dtype=np.float32))
    return buf.getvalue()


def unpacked(raw: dict) -> dict:
    import io

    meta = json.loads(raw["json"])
    return {
        "objects": meta["objects"],
        "proposal_boxes": meta["proposal_boxes"],
        "regions": np.load(io.BytesIO(raw["regions.npy"])),
        "proposals": np.load(io.BytesIO(raw["proposals.npy"])),
    }


# ----------------------------------------------------------------------------- the reference


def same_chain(objects: list[dict], o: int, k: int) -> bool:
    a, b = objects[o], objects[k]
    return o == k or (a.get("entity") is not None and a.get("entity") == b.get("entity"))


def chain_boxes(objects: list[dict], o: int) -> list:
    return [objects[k]["box"] for k in range(len(objects)) if same_chain(objects, o, k)]


def own_negatives(image: dict, o: int) -> list[int]:
    """3.b: the proposals of the image with IoU < 0.3 with the ground truth, that of every phrase
    of the chain (one box in Flickr30K Entities; two here in image 2)."""
    return [
        p
        for p, box in enumerate(image["proposal_boxes"])
        if all(iou(box, gt) < 0.3 for gt in chain_boxes(image["objects"], o))
    ]


def algorithm_1(images, identity, region_embed, phrase_embed, margin, top_k, lambda_1, lambda_2, negatives_from):
    """The loss of the batch, loop by loop. Positives: each phrase's ground-truth region (single
    positive); negatives "all": every proposal that qualifies. "batch" also takes every region row
    of another image: each of its phrases' positive, then each proposal that is a negative of one
    of its phrases."""

    def d(a, b):
        return torch.linalg.vector_norm(a - b)

    def top_k_sum(hinges):
        hinges = sorted(hinges, key=lambda h: float(h.detach()), reverse=True)[:top_k]
        return sum((h.clamp(min=0) for h in hinges), torch.zeros((), dtype=torch.float64))

    phrases = [(i, o) for i, image in enumerate(images) for o in range(len(image["objects"]))]
    total = torch.zeros((), dtype=torch.float64)
    for i, o in phrases:
        image = images[i]
        obj = image["objects"][o]
        y, x = phrase_embed(obj["phrase"]), region_embed(image["regions"][obj["region"]])
        # 3.a: phrases of other images (a copy of this one is this one), and of this image those
        # of another chain and another ground-truth region than x's
        negatives = []
        for j, k in phrases:
            other = images[j]["objects"][k]
            if identity[j] != identity[i] or (
                j == i and not same_chain(image["objects"], o, k) and iou(obj["box"], other["box"]) < 0.7
            ):
                negatives.append(phrase_embed(other["phrase"]))
        total = total + lambda_1 * top_k_sum([margin + d(x, y) - d(x, n) for n in negatives])
        # 3.b
        regions = [region_embed(image["proposals"][p]) for p in own_negatives(image, o)]
        if negatives_from == "batch":
            for j, other in enumerate(images):
                if identity[j] == identity[i]:
                    continue
                regions += [region_embed(other["regions"][ob["region"]]) for ob in other["objects"]]
                pool = sorted({p for k in range(len(other["objects"])) for p in own_negatives(other, k)})
                regions += [region_embed(other["proposals"][p]) for p in pool]
        total = total + lambda_2 * top_k_sum([margin + d(y, x) - d(y, n) for n in regions])
    return total


# ------------------------------------------------------------------------------ the recipe's


def embed_recipe(vocab, dim, *overrides):
    config = load_config(
        "two_branch_embed", ["model.tasks=[phrases]", "model.hidden=16", "model.embed=8", "model.dropout=0", *overrides]
    )
    return TwoBranchEmbedRecipe(config, vocab, dim)


class Embeddings:
    """Regions: normalise(features @ W); phrases: normalise(the sum of their token vectors)."""

    def __init__(self, vocab: Vocab, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.w = torch.randn(DIM, EMBED, generator=g, dtype=torch.float64, requires_grad=True)
        self.e = torch.randn(len(vocab), EMBED, generator=g, dtype=torch.float64, requires_grad=True)

    def regions(self, features) -> torch.Tensor:
        return F.normalize(torch.as_tensor(np.asarray(features), dtype=torch.float64) @ self.w, dim=-1)

    def phrase(self, text: str) -> torch.Tensor:
        return F.normalize(self.e[self.vocab.encode(text)].sum(0), dim=0)

    def tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.normalize((self.e[tokens] * (tokens != 0)[..., None]).sum(1), dim=1)


def batch_of(recipe, raws, seed=0):
    rng = random.Random(seed)
    batch = recipe.collate_phrases([recipe.phrase_sample(raw, rng) for raw in raws])
    batch["identity"] = torch.tensor([sample_identity(raw) for raw in raws])
    return batch


# The scenes, and image 1 again (shards are drawn with replacement): a copy is never a negative.
RAWS = [scene_raw(i, scene) for i, scene in enumerate(SCENES)]
BATCH = [*RAWS, RAWS[1]]


@pytest.mark.parametrize("negatives_from", ["image", "batch"])
@pytest.mark.parametrize("lambdas", [(1.0, 4.0), (0.0, 1.0), (1.0, 0.0)])
@pytest.mark.parametrize("top_k", [2, 30])
def test_loss_and_gradients_equal_algorithm_1(negatives_from, lambdas, top_k):
    vocab = Vocab(WORDS)
    recipe = embed_recipe(
        vocab,
        DIM,
        "model.augmented_positives=false",
        "model.phrase_negatives=all",
        f"model.phrase_top_k={top_k}",
        "model.margin=0.5",
        f"model.phrase_lambda_image={lambdas[0]}",
        f"model.phrase_lambda_text={lambdas[1]}",
        f"model.phrase_negatives_from={negatives_from}",
    )
    batch = batch_of(recipe, BATCH)
    ours, theirs = Embeddings(vocab), Embeddings(vocab)
    out = {"image": ours.regions(batch["images"]), "text": ours.tokens(batch["tokens"])}
    loss = recipe.phrase_loss(None, out, batch)
    expected = algorithm_1(
        [unpacked(r) for r in BATCH],
        batch["identity"].tolist(),
        theirs.regions,
        theirs.phrase,
        0.5,
        top_k,
        *lambdas,
        negatives_from,
    )
    assert float(expected.detach()) > 1
    # rtol 1e-6: the loss keeps 1e-8 under each square root, the reference takes the exact norm
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    loss.backward()
    expected.backward()
    for a, b in ((ours.w, theirs.w), (ours.e, theirs.e)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_the_paper_settings_are_the_defaults():
    cfg = TwoBranchEmbedRecipe.ModelConfig()  # the keys' defaults (a job file may set others)
    assert (cfg.phrase_negatives, cfg.phrase_negatives_from, cfg.phrase_top_k, cfg.margin) == ("all", "image", 30, 0.1)
    assert (cfg.phrase_lambda_image, cfg.phrase_lambda_text) == (1.0, 4.0)
    assert TwoBranchSimRecipe.ModelConfig().phrase_negatives == 1  # Algorithm 1: one negative pair per positive


@pytest.mark.parametrize("negatives", [1, 2])
def test_drawn_negatives_are_the_phrase_own_and_each_phrase_ranks_every_one_of_its_image_in_the_pool(negatives):
    """With a few drawn per phrase and random positives, the batch's listed negatives of a phrase
    are exactly the pool rows of its image (its draws and its image's other phrases') that
    qualify by Algorithm 1; its positive qualifies as a positive."""
    vocab = Vocab(WORDS)
    recipe = embed_recipe(vocab, DIM, f"model.phrase_negatives={negatives}")
    images = [unpacked(r) for r in BATCH]
    for seed in range(5):
        batch = batch_of(recipe, BATCH, seed)
        phrases = [(i, o) for i, image in enumerate(images) for o in range(len(image["objects"]))]
        assert batch["phrase_sample"].tolist() == [i for i, _ in phrases]
        pool = batch["negative_rows"].tolist()
        listed = {tuple(p) for p in batch["region_negatives"].T.tolist()}
        drawn = {tuple(p) for p in batch["drawn_negatives"].T.tolist()}
        assert drawn <= listed
        for m, (i, o) in enumerate(phrases):
            image = images[i]
            row = int(batch["text_image"][m])
            assert iou(batch["region_box"][row].tolist(), image["objects"][o]["box"]) >= 0.7
            mine = [r for r in pool if int(batch["region_sample"][r]) == i]
            qualify = {
                r
                for r in mine
                if all(iou(batch["region_box"][r].tolist(), gt) < 0.3 for gt in chain_boxes(image["objects"], o))
            }
            assert {r for (p, r) in listed if p == m} == qualify
            assert len({r for (p, r) in drawn if p == m}) == min(negatives, len(own_negatives(image, o)))


def test_bad_pairs_are_named():
    region, phrase = torch.randn(4, 3), torch.randn(2, 3)
    args = (torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([0, 1, 0, 1]))
    with pytest.raises(ValueError, match="region_negatives pairs a phrase with a candidate of another image"):
        phrase_ranking_loss(region, phrase, *args, torch.tensor([[0], [3]]), torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must be a \(2, Q\) long tensor"):
        phrase_ranking_loss(region, phrase, *args, torch.tensor([[0, 2]]), torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="negatives_from"):
        phrase_ranking_loss(
            region,
            phrase,
            *args,
            torch.tensor([[0], [2]]),
            torch.zeros(2, 0, dtype=torch.long),
            negatives_from="images",
        )


# ------------------------------------------------------------ a Flickr30K Entities miniature

FIXTURE = Path(__file__).parents[1] / "fixtures" / "flickr30k_entities"
# One more image beside the fixture's: "A man" and "He" are one entity (a two-phrase chain), as are
# "a red frisbee" and "The frisbee"; the hat is another entity on the man.
EXTRA_ID = "2000000001"
EXTRA_SENTENCES = [
    "[/EN#31/people A man] throws [/EN#32/other a red frisbee] .",
    "[/EN#31/people He] wears [/EN#33/clothing a hat] .",
    "[/EN#32/other The frisbee] flies .",
]
EXTRA_BOXES = {"31": (11, 11, 40, 58), "32": (51, 6, 70, 20), "33": (16, 11, 30, 20)}  # 1-based, inclusive
EXTRA_SIZE = (80, 60)


def _annotation(size, boxes) -> str:
    objects = "".join(
        f"<object><name>{name}</name><bndbox><xmin>{b[0]}</xmin><ymin>{b[1]}</ymin><xmax>{b[2]}</xmax>"
        f"<ymax>{b[3]}</ymax></bndbox></object>"
        for name, b in boxes.items()
    )
    return f"<annotation><size><width>{size[0]}</width><height>{size[1]}</height></size>{objects}</annotation>"


def _proposals_around(boxes, width, height) -> list[list[float]]:
    """Each box, a near copy (IoU > 0.7), a half (IoU 0.5), then background boxes."""
    out = []
    for x0, y0, x1, y1 in boxes:
        out += [[x0, y0, x1, y1], [x0, y0, x1, y1 - 0.05 * (y1 - y0)], [x0, y0, x1, (y0 + y1) / 2]]
    middle = [width / 2 - 3, height / 2 - 3, width / 2 + 3, height / 2 + 3]
    return out + [[0, 0, 6, 6], [width - 8, 0, width, 6], middle]


@pytest.fixture(scope="module")
def flickr(tmp_path_factory) -> Path:
    """The fixture plus the extra image, converted with proposals around every object box."""
    import xml.etree.ElementTree as ET

    from PIL import Image

    from vldist.shards.__main__ import main
    from vldist.shards.convert.flickr30k_entities import read_annotation, union

    root = tmp_path_factory.mktemp("f30k") / "flickr30k_entities"
    shutil.copytree(FIXTURE, root)
    (root / "Sentences" / f"{EXTRA_ID}.txt").write_text("\n".join(EXTRA_SENTENCES) + "\n")
    (root / "Annotations" / f"{EXTRA_ID}.xml").write_text(_annotation(EXTRA_SIZE, EXTRA_BOXES))
    (root / "train.txt").write_text((root / "train.txt").read_text() + f"{EXTRA_ID}\n")
    (root / "flickr30k-images").mkdir()
    proposals = {}
    for seed, xml in enumerate(sorted((root / "Annotations").glob("*.xml"))):
        size = ET.parse(xml).getroot()
        width, height = int(size.findtext("size/width")), int(size.findtext("size/height"))
        pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "flickr30k-images" / f"{xml.stem}.jpg", quality=90)
        boxes = list(dict.fromkeys(tuple(union(b)) for b in read_annotation(xml).boxes.values()))
        proposals[xml.stem] = _proposals_around(boxes, width, height)
    (root / "proposals.json").write_text(json.dumps(proposals))
    out = root.parent / "shards"
    assert (
        main(
            [
                "convert",
                "flickr30k_entities",
                "--src",
                str(root),
                "--out",
                str(out),
                "--quiet",
                "--workers",
                "1",
                "--backbone",
                "resnet18",
                "--feature-size",
                "32",
                "--region-grid",
                "2",
                "--proposals",
                str(root / "proposals.json"),
            ]
        )
        == 0
    )
    return out


def flickr_raws(shards: Path) -> list[dict]:
    return [{"__key__": key, **members} for key, members in read_shard_set(shards)["train"]]


def flickr_recipe(cls, shards: Path, *overrides):
    set_ = ShardSet.open(shards)
    job = "two_branch_embed" if cls is TwoBranchEmbedRecipe else "two_branch_sim"
    config = load_config(
        job,
        [
            f"data.shards={shards}",
            "model.tasks=[phrases]",
            "model.hidden=16",
            "model.embed=8",
            "model.dropout=0",
            *overrides,
        ],
    )
    return cls(config, set_.vocab(shards), set_.feature_dim())


def phrase_rows(recipe, batch, raws) -> dict[tuple[str, str], int]:
    """(image id, phrase text) -> the phrase's row in the batch."""
    ids = [json.loads(r["json"])["image_id"] for r in raws]
    return {
        (ids[int(s)], recipe.vocab.decode(t)): m
        for m, (s, t) in enumerate(zip(batch["phrase_sample"], batch["tokens"].tolist(), strict=True))
    }


def perfect_embeddings(batch, raws, seed=0) -> dict:
    """Each image's ground-truth boxes a unit vector of their own (copies of an image: the same);
    each phrase its box's, each region the box's it overlaps with IoU >= 0.7, a random one if none.
    Every positive is at distance 0 and every true negative at about sqrt(2): the loss is 0 unless
    a pair of one box (a chain, two entities of one box, an image and its copy) is a negative."""
    g = torch.Generator().manual_seed(seed)
    vectors: dict = {}

    def vector(key):
        if key not in vectors:
            vectors[key] = F.normalize(torch.randn(64, generator=g, dtype=torch.float64), dim=0)
        return vectors[key]

    metas = [json.loads(r["json"]) for r in raws]
    identity = batch["identity"].tolist()
    text = torch.stack(
        [
            vector((identity[s], tuple(batch["phrase_box"][m].tolist())))
            for m, s in enumerate(batch["phrase_sample"].tolist())
        ]
    )
    rows = []
    for r, s in enumerate(batch["region_sample"].tolist()):
        box = batch["region_box"][r].tolist()
        best = max((o["box"] for o in metas[s]["objects"]), key=lambda gt: iou(box, gt))
        rows.append(vector((identity[s], tuple(map(float, best)))) if iou(box, best) >= 0.7 else vector(("row", r)))
    return {"image": torch.stack(rows), "text": text}


def test_a_chain_phrases_and_their_regions_are_never_each_other_negatives(flickr):
    raws = flickr_raws(flickr)
    raws = [*raws, raws[0]]  # and one image twice
    recipe = flickr_recipe(TwoBranchEmbedRecipe, flickr, "model.phrase_negatives=all")  # the key's default
    batch = batch_of(recipe, raws)
    rows = phrase_rows(recipe, batch, raws)
    man, he = rows[(EXTRA_ID, "a man")], rows[(EXTRA_ID, "he")]
    hat, frisbee = rows[(EXTRA_ID, "a hat")], rows[(EXTRA_ID, "a red frisbee")]
    assert batch["phrase_entity"][man] == batch["phrase_entity"][he] != batch["phrase_entity"][hat]
    phrase_pairs = {tuple(p) for p in batch["phrase_negatives"].T.tolist()}
    region_pairs = {tuple(p) for p in batch["region_negatives"].T.tolist()}
    # 3.a: neither phrase of the chain is a negative of the other's region; other entities are
    assert (man, he) not in phrase_pairs and (he, man) not in phrase_pairs
    assert {(man, hat), (man, frisbee), (he, hat), (hat, man)} <= phrase_pairs
    # 3.b: no region on the man (positive-quality or half of him) is a negative of either phrase;
    # the frisbee's and the background's are, and the hat's (IoU 0.1 with the man)
    man_box = [10, 10, 40, 58]
    for phrase in (man, he):
        listed = [r for p, r in region_pairs if p == phrase]
        assert listed and all(iou(batch["region_box"][r].tolist(), man_box) < 0.3 for r in listed)
        assert any(batch["region_box"][r].tolist() == [50, 5, 70, 20] for r in listed)  # the frisbee
        assert any(batch["region_box"][r].tolist() == [15, 10, 30, 20] for r in listed)  # the hat
    # the fixture's four-phrase chain, and the two entities of one box ("the stairs", "the steps")
    child = [rows[("1000092795", p)] for p in ("a child", "a little girl", "the child", "a girl")]
    stairs = [rows[("1000092795", p)] for p in ("the stairs", "the steps")]
    for group in (child, stairs):
        assert not {(a, b) for a in group for b in group} & phrase_pairs
    assert (stairs[0], child[0]) in phrase_pairs

    # through the loss: zero on embeddings where only such pairs could violate the margin ...
    out = perfect_embeddings(batch, raws)
    for negatives_from in ("image", "batch"):
        scored = flickr_recipe(
            TwoBranchEmbedRecipe, flickr, "model.phrase_negatives=all", f"model.phrase_negatives_from={negatives_from}"
        )
        assert float(scored.phrase_loss(None, out, batch)) == pytest.approx(0.0, abs=1e-12), negatives_from
    # ... where the former loss (every region and phrase of the batch but a phrase's own) is not
    former = cross_rank_two_branch_ranking_loss(out["image"], out["text"], batch["text_image"], 0.1, 30, 1.0, 4.0, 0.0)
    assert float(former) > 0.1

    # and the recipe trains on it: the model's loss is finite and reaches both branches
    torch.manual_seed(0)
    model = recipe.build_model()
    recipe.initialize(model, None, JobShards(ShardSet.open(recipe.config.data.shards)))
    loss = recipe.training_losses(model, {**batch, "stream": "phrases"})["loss"]
    loss.backward()
    assert torch.isfinite(loss) and float(loss.detach()) > 0
    for branch in (model.image, model.text):
        assert sum(float(p.grad.abs().sum()) for p in branch.parameters()) > 0


def object_of(batch: dict, m: int, objects: list[dict]) -> int:
    """The object phrase entry m stands for: the similarity network makes a pair of each positive
    proposal (Algorithm 1, pair sampling, step 2), so a phrase is an entry per positive; its
    phrase_box is the object's ground-truth box."""
    box = batch["phrase_box"][m].tolist()
    return next(k for k, o in enumerate(objects) if np.allclose(o["box"], box))


def test_the_similarity_network_draws_negatives_by_algorithm_1_and_sums_their_logistic_loss(flickr):
    """Pair sampling, step 2: every proposal of IoU >= 0.7 with a phrase's box is a positive pair
    of its own; step 3: one region of the phrase's image with IoU < 0.3 with its ground truth per
    positive pair; a region of the chain's other boxes never (none differs in Flickr30K Entities,
    whose entities have one union box: image 2 of SCENES has two)."""
    raws = flickr_raws(flickr)
    recipe = flickr_recipe(TwoBranchSimRecipe, flickr)
    metas = [json.loads(r["json"]) for r in raws]
    torch.manual_seed(0)
    model = recipe.build_model()
    recipe.initialize(model, None, JobShards(ShardSet.open(recipe.config.data.shards)))
    for seed in range(3):
        batch = batch_of(recipe, raws, seed)
        drawn = batch["drawn_negatives"]
        assert torch.equal(
            torch.bincount(drawn[0], minlength=len(batch["tokens"])), torch.ones(len(batch["tokens"]), dtype=torch.long)
        )  # one each
        entries = {}
        for m, s in enumerate(batch["phrase_sample"].tolist()):
            entries.setdefault((s, object_of(batch, m, metas[s]["objects"])), []).append(m)
        for (s, k), ms in entries.items():  # an entry per phrase of the box and positive proposal
            box = metas[s]["objects"][k]["box"]
            phrases = sum(1 for o in metas[s]["objects"] if o.get("phrase") and np.allclose(o["box"], box))
            positives = [p for p in metas[s]["proposal_boxes"] if iou(p, box) >= 0.7]
            assert len(ms) == phrases * len(positives) and len(positives) > 0
            shown = sorted(batch["region_box"][int(batch["text_image"][m])].tolist() for m in ms)
            assert np.allclose(shown, sorted(positives * phrases))
        for m, r in drawn.T.tolist():
            s = int(batch["phrase_sample"][m])
            assert int(batch["region_sample"][r]) == s
            objects = metas[s]["objects"]  # every object has a proposal on its box, so a phrase each
            entity = objects[object_of(batch, m, objects)]["entity"]
            chain = [o["box"] for o in objects if o["entity"] == entity]
            assert all(iou(batch["region_box"][r].tolist(), gt) < 0.3 for gt in chain), (m, r, entity)
        out = model(batch["images"], batch["tokens"])
        loss = recipe.phrase_loss(model, out, batch)
        with torch.no_grad():
            expected = sum(
                F.softplus(-model.fusion(out["image"][int(batch["text_image"][m])] * out["text"][m])).sum()
                for m in range(len(batch["tokens"]))
            )
            expected += sum(
                F.softplus(model.fusion(out["image"][r] * out["text"][m])).sum() for m, r in drawn.T.tolist()
            )
        assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-5)

    # a chain with two boxes: the draws avoid both
    sim = TwoBranchSimRecipe(load_config("two_branch_sim", ["model.tasks=[phrases]"]), Vocab(WORDS), DIM)
    image = unpacked(RAWS[2])
    for seed in range(20):
        batch = batch_of(sim, [RAWS[2]], seed)
        for m, r in batch["drawn_negatives"].T.tolist():
            chain = chain_boxes(image["objects"], object_of(batch, m, image["objects"]))
            assert all(iou(batch["region_box"][r].tolist(), gt) < 0.3 for gt in chain)
