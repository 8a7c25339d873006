"""The embedded image-pair set of L2C: two scenes that differ by one controlled change, described.

A pair is a scene of scenes.generate_scene and a copy of it with one change (an object's colour,
its size, its place, or one object more or fewer), rendered again. Which of the two becomes
image1 is drawn, so that "image1 has a larger ..." and "image2 has a larger ..." both occur.
About five descriptions per pair, each true of it, name the images with the tokens `image1` and
`image2` (Birds-to-Words says `animal1`/`animal2`); swap_image_tokens rewrites them when a
trainer flips a pair. Each image also gets its foreground mask, which L2C's mask head learns.

Like synth, the set is written into `<out>.partial/` and renamed to `<out>` when complete; the
same arguments give the same bytes (there are no float features here).
"""

from __future__ import annotations

import dataclasses
import io
import math
import random
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from vldist.data.vocab import Vocab, tokenize
from vldist.shards.format.layout import VOCAB_NAME
from vldist.shards.format.writer import ShardSetWriter
from vldist.shards.synthetic.captions import NUMBER_WORDS, make_captions, zone
from vldist.shards.synthetic.embedded_set import SPLITS, building, check_counts, jpeg_bytes, sample_key, split_rng
from vldist.shards.synthetic.scenes import (
    COLORS,
    MAX_OBJECTS,
    SIZES,
    Scene,
    SceneObject,
    as_random,
    bounding_box,
    boxes_apart,
    draw_object,
    generate_scene,
    place_objects,
    render,
    shape_outline,
)

STREAM_NAME = "vldist-synth-pairs"  # each split its own stream, apart from synth's (same seed, other pictures)
IMAGE_TOKENS = ("image1", "image2")
CHANGE_KINDS = ("color", "size", "position", "count")
N_DESCRIPTIONS = 5
MAX_TOKENS = 18
MIN_SHIFT = 0.25  # a moved object's centre travels at least this fraction of the image side
CLEAR_SHIFT = 0.12  # "further left" and the like only along an axis where it moved this much
GROUP_NOUNS = (("shape", "shapes"), ("object", "objects"), ("figure", "figures"))
OPENINGS = ("", "", "", "the difference is that", "one difference is that", "the change is that")
DIRECTION_WORDS = {  # how an object sits in one image compared with the other
    "left": ("further left", "more to the left", "further to the left"),
    "right": ("further right", "more to the right", "further to the right"),
    "up": ("higher", "higher up", "nearer the top"),
    "down": ("lower", "lower down", "nearer the bottom"),
}
POSITION_WORDS = {  # shorter than captions.POSITION_WORDS: a pair sentence names two places
    ("top", "left"): ("at the top left", "in the top left corner"),
    ("top", "center"): ("at the top", "near the top"),
    ("top", "right"): ("at the top right", "in the top right corner"),
    ("middle", "left"): ("on the left", "near the left edge"),
    ("middle", "center"): ("in the middle", "in the center"),
    ("middle", "right"): ("on the right", "near the right edge"),
    ("bottom", "left"): ("at the bottom left", "in the bottom left corner"),
    ("bottom", "center"): ("at the bottom", "near the bottom"),
    ("bottom", "right"): ("at the bottom right", "in the bottom right corner"),
}
_IMAGE_TOKEN = re.compile(r"\b(image|animal)([12])\b", re.IGNORECASE)


@dataclass
class Pair:
    first: Scene  # image1
    second: Scene  # image2
    change: dict  # JSON-able: {"kind": ..., what changed, as image1 and image2 show it}
    descriptions: list[str]


def swap_image_tokens(text: str) -> str:
    """image1 <-> image2 and animal1 <-> animal2, whole words only ("image10" stays): the
    descriptions of a pair whose images were swapped."""
    return _IMAGE_TOKEN.sub(lambda m: m.group(1) + ("2" if m.group(2) == "1" else "1"), text)


def foreground_mask(scene: Scene) -> np.ndarray:
    """(H, W) uint8, 1 on the pixels of the scene's objects, 0 on the background: drawn with the
    same primitive as the image (scenes.draw_object), so the two agree pixel for pixel."""
    mask = Image.new("L", (scene.width, scene.height), 0)
    draw = ImageDraw.Draw(mask)
    for obj in scene.objects:
        draw_object(draw, obj, 1)
    return np.array(mask, dtype=np.uint8)


def mask_png(mask: np.ndarray) -> bytes:
    """A 0/1 mask as an 8-bit PNG of 0/255 (visible in any viewer; readers threshold at 127)."""
    buf = io.BytesIO()
    Image.fromarray((mask * 255).astype(np.uint8), "L").save(buf, format="PNG")
    return buf.getvalue()


# --- one controlled change ------------------------------------------------------------------


@dataclass
class _Change:
    kind: str
    before: SceneObject | None  # the object in the generated scene (None: it was added)
    after: SceneObject | None  # the object in the changed scene (None: it was removed)


def _geometry(obj: SceneObject) -> tuple[float, float, float]:
    """Centre and side of the outline the object was drawn from (its box is rounded and clipped)."""
    unit = shape_outline(obj.shape, 0.0, 0.0, 1.0)
    xs, unit_xs = [p[0] for p in obj.points], [p[0] for p in unit]
    side = (max(xs) - min(xs)) / (max(unit_xs) - min(unit_xs))
    return obj.points[0][0] - side * unit[0][0], obj.points[0][1] - side * unit[0][1], side


def _fits(obj: SceneObject, others: list[SceneObject]) -> bool:
    return all(boxes_apart(obj.box, o.box) for o in others)


def _recolor(objects: list[SceneObject], rnd: random.Random, size: int) -> _Change | None:
    obj = rnd.choice(objects)
    used = {(o.shape, o.color) for o in objects}
    colors = [c for c in COLORS if (obj.shape, c) not in used]  # keeps "the <colour> <shape>" unique
    return _Change("color", obj, dataclasses.replace(obj, color=rnd.choice(colors))) if colors else None


def _resize(objects: list[SceneObject], rnd: random.Random, size: int) -> _Change | None:
    for obj in rnd.sample(objects, len(objects)):
        others = [o for o in objects if o is not obj]
        new_size = "large" if obj.size == "small" else "small"
        cx, cy, _ = _geometry(obj)
        for attempt in range(20):  # grow in place if there is room, else a little aside
            side = size * rnd.uniform(*SIZES[new_size])
            margin = 2 + side / 2  # as scenes.place_objects keeps objects off the border
            jitter = 0 if attempt == 0 else 0.15 * size
            x = min(max(cx + rnd.uniform(-jitter, jitter), margin), size - margin)
            y = min(max(cy + rnd.uniform(-jitter, jitter), margin), size - margin)
            points = shape_outline(obj.shape, x, y, side)
            new = SceneObject(obj.shape, obj.color, new_size, bounding_box(points, size, size), points)
            if _fits(new, others):
                return _Change("size", obj, new)
    return None


def _move(objects: list[SceneObject], rnd: random.Random, size: int) -> _Change | None:
    for obj in rnd.sample(objects, len(objects)):
        others = [o for o in objects if o is not obj]
        cx, cy, side = _geometry(obj)
        margin = 2 + side / 2
        for _attempt in range(60):
            # whole-pixel steps: the moved shape is drawn exactly as before, only elsewhere
            dx = round(rnd.uniform(margin, size - margin) - cx)
            dy = round(rnd.uniform(margin, size - margin) - cy)
            if math.hypot(dx, dy) < MIN_SHIFT * size or not (
                margin <= cx + dx <= size - margin and margin <= cy + dy <= size - margin
            ):
                continue
            points = [(x + dx, y + dy) for x, y in obj.points]
            new = SceneObject(obj.shape, obj.color, obj.size, bounding_box(points, size, size), points)
            if _fits(new, others):
                return _Change("position", obj, new)
    return None


def _add_or_remove(objects: list[SceneObject], rnd: random.Random, size: int) -> _Change | None:
    if len(objects) >= 2 and (len(objects) == MAX_OBJECTS or rnd.random() < 0.5):
        return _Change("count", rnd.choice(objects), None)
    used = {(o.shape, o.color) for o in objects}
    for _attempt in range(50):
        new = place_objects(rnd, 1, size, size)[0]  # one object alone always fits: then check the rest
        if (new.shape, new.color) not in used and _fits(new, objects):
            return _Change("count", None, new)
    return None


_CHANGES = {"color": _recolor, "size": _resize, "position": _move, "count": _add_or_remove}


def _changed(objects: list[SceneObject], change: _Change) -> list[SceneObject]:
    if change.before is None:
        return objects + [change.after]
    if change.after is None:
        return [o for o in objects if o is not change.before]
    return [change.after if o is change.before else o for o in objects]


def make_pair(rng, image_size: int = 128) -> Pair:
    """A scene, the same scene with one change of a random kind, in a random order, described."""
    rnd = as_random(rng)
    scene = generate_scene(rnd, image_size)
    for kind in rnd.sample(CHANGE_KINDS, len(CHANGE_KINDS)):  # the drawn kind, else another that fits
        change = _CHANGES[kind](scene.objects, rnd, image_size)
        if change is not None:
            break
    else:  # a recolouring always fits (8 colours, at most 4 objects)
        raise RuntimeError(f"no change fits the scene {scene.objects}")
    objects = _changed(scene.objects, change)
    other = Scene(image_size, image_size, objects, render(objects, image_size, image_size, rnd))
    shown = (change.before, change.after)
    if rnd.random() < 0.5:
        scene, other, shown = other, scene, shown[::-1]
    diff = _Difference(change.kind, {"image1": scene, "image2": other}, dict(zip(IMAGE_TOKENS, shown, strict=True)))
    return Pair(scene, other, diff.record(), describe(diff, rnd))


# --- descriptions ---------------------------------------------------------------------------


@dataclass
class _Difference:
    kind: str
    scenes: dict[str, Scene]  # "image1"/"image2" -> scene
    objects: dict[str, SceneObject | None]  # the changed object as each image shows it (None: absent)

    def record(self) -> dict:
        """The JSON `change`: the kind, the object, and the changed attribute per image."""
        one, two = self.objects["image1"], self.objects["image2"]
        if self.kind == "color":
            return {"kind": "color", "shape": one.shape, "image1": one.color, "image2": two.color}
        if self.kind == "size":
            return {"kind": "size", "shape": one.shape, "color": one.color, "image1": one.size, "image2": two.size}
        if self.kind == "position":
            return {
                "kind": "position",
                "shape": one.shape,
                "color": one.color,
                "image1": list(one.center),
                "image2": list(two.center),
            }
        present = one or two
        return {
            "kind": "count",
            "shape": present.shape,
            "color": present.color,
            "only_in": "image1" if one else "image2",
            "image1": len(self.scenes["image1"].objects),
            "image2": len(self.scenes["image2"].objects),
        }

    def unchanged(self) -> list[SceneObject]:
        """Objects drawn identically in both images."""
        second = self.scenes["image2"].objects
        return [o for o in self.scenes["image1"].objects if o in second]


def _a(words: str) -> str:
    return f"{'an' if words[0] in 'aeiou' else 'a'} {words}"


def _name(obj: SceneObject) -> str:
    return f"{obj.color} {obj.shape}"


def _named(obj: SceneObject, rnd: random.Random, size_prob: float = 0.5) -> str:
    """ "red circle" or, sometimes, "small red circle"."""
    return f"{obj.size} {_name(obj)}" if rnd.random() < size_prob else _name(obj)


def _order(rnd: random.Random) -> tuple[str, str]:
    """Which image a sentence speaks of first: both orders occur for every kind of sentence."""
    return ("image1", "image2") if rnd.random() < 0.5 else ("image2", "image1")


def _shape_is_unique(d: _Difference, shape: str) -> bool:
    return all(sum(o.shape == shape for o in s.objects) == 1 for s in d.scenes.values())


def _color_description(d: _Difference, rnd: random.Random) -> str:
    x, y = _order(rnd)
    a, b = d.objects[x], d.objects[y]
    s = a.shape
    options = [
        f"{x} shows {_a(a.color)} {s} where {y} shows {_a(b.color)} {s}",
        f"{x} has {_a(a.color)} {s} but {y} has {_a(b.color)} one",
        f"{x} has {_a(a.color)} {s} instead of the {b.color} {s} in {y}",
        f"the {a.color} {s} of {x} is {b.color} in {y}",
        f"the {_named(a, rnd)} in {x} is {b.color} in {y}",
    ]
    if _shape_is_unique(d, s):  # "the triangle" names one object only if no other triangle is there
        options += [
            f"the {s} is {a.color} in {x} and {b.color} in {y}",
            f"the {s} has a different colour in {x} and {y}",
        ]
    return rnd.choice(options)


def _size_description(d: _Difference, rnd: random.Random) -> str:
    x, y = _order(rnd)
    a, b = d.objects[x], d.objects[y]
    n = _name(a)
    more = rnd.choice(("larger", "bigger")) if a.size == "large" else "smaller"
    return rnd.choice(
        [
            f"{x} has a {more} {n} than {y}",
            f"the {n} is {more} in {x} than in {y}",
            f"the {n} in {x} is {more} than the one in {y}",
            f"the {n} is {a.size} in {x} and {b.size} in {y}",
            f"the {n} is {a.size} in {x} but {b.size} in {y}",
            f"{x} shows the {n} {more} than {y} does",
            f"{x} has {_a(a.size)} {n} where {y} has {_a(b.size)} one",
        ]
    )


def _directions(a: SceneObject, b: SceneObject, size: int) -> list[str]:
    """Where `a` lies compared with `b` (keys of DIRECTION_WORDS), along clearly moved axes only."""
    (ax, ay), (bx, by) = a.center, b.center
    found = []
    if abs(bx - ax) >= CLEAR_SHIFT * size:
        found.append("left" if ax < bx else "right")
    if abs(by - ay) >= CLEAR_SHIFT * size:
        found.append("up" if ay < by else "down")
    return found


def _position_description(d: _Difference, rnd: random.Random) -> str:
    x, y = _order(rnd)
    a, b = d.objects[x], d.objects[y]
    n, size = _name(a), d.scenes[x].width
    options = [f"the {n} is in a different place in {x} and {y}", f"{x} and {y} show the {n} in different places"]
    for where in _directions(a, b, size):
        words = rnd.choice(DIRECTION_WORDS[where])
        moved = {"left": "right", "right": "left", "up": "down", "down": "up"}[where]  # from x to y
        options += [
            f"the {n} is {words} in {x} than in {y}",
            f"the {n} is {words} in {x}",
            f"in {x} the {n} is {words} than in {y}",
            f"the {n} moves {moved} from {x} to {y}",
        ]
    za, zb = zone(a, size, size), zone(b, size, size)
    if za and zb and za != zb:
        here, there = rnd.choice(POSITION_WORDS[za]), rnd.choice(POSITION_WORDS[zb])
        options.append(f"the {n} is {here} in {x} and {there} in {y}")
    return rnd.choice(options)


def _count_words(n: int, rnd: random.Random) -> tuple[str, str]:
    singular, plural = rnd.choice(GROUP_NOUNS)
    return NUMBER_WORDS[n], singular if n == 1 else plural


def _count_description(d: _Difference, rnd: random.Random) -> str:
    x = "image1" if d.objects["image1"] else "image2"  # the image that has the object
    y = "image2" if x == "image1" else "image1"
    obj, n = d.objects[x], _named(d.objects[x], rnd)
    singular, plural = rnd.choice(GROUP_NOUNS)
    first, second = _order(rnd)
    number, noun = _count_words(len(d.scenes[first].objects), rnd)
    return rnd.choice(
        [
            f"{x} has {_a(n)} that {y} does not have",
            f"there is {_a(n)} in {x} but not in {y}",
            f"the {n} of {x} is missing from {y}",
            f"{y} does not have the {_name(obj)} that {x} has",
            f"only {x} contains {_a(n)}",
            f"{y} lacks the {n} of {x}",
            f"{first} has {number} {noun} and {second} has {NUMBER_WORDS[len(d.scenes[second].objects)]}",
            f"{x} has one more {singular} than {y}",
            f"{y} has one {singular} fewer than {x}",
            f"{first} has {'more' if first == x else 'fewer'} {plural} than {second}",
        ]
    )


def _shared_description(d: _Difference, rnd: random.Random) -> str | None:
    """What both images have: an unchanged object, or (when the count did not change) the count."""
    options = []
    for obj in d.unchanged():
        n = _named(obj, rnd)
        x, y = _order(rnd)
        options += [
            f"both images have {_a(n)}",
            f"both images show {_a(n)}",
            f"{x} and {y} both have {_a(n)}",
            f"there is {_a(n)} in both images",
            f"the {_name(obj)} is the same in both images",
        ]
    if d.kind != "count":
        number, noun = _count_words(len(d.scenes["image1"].objects), rnd)
        options.append(f"both images have {number} {noun}")
    return rnd.choice(options) if options else None


_DESCRIBE = {
    "color": _color_description,
    "size": _size_description,
    "position": _position_description,
    "count": _count_description,
}


def describe(d: _Difference, rnd: random.Random, n: int = N_DESCRIPTIONS) -> list[str]:
    """`n` distinct sentences of at most MAX_TOKENS words, each true of the pair, shuffled: mostly
    the difference in several wordings, sometimes one about what both images share."""
    plan = [d.kind] * n
    if rnd.random() < 0.6:
        plan[-1] = "shared"
    found: list[str] = []
    # a sentence again with another opening, or with "image1 and image2" for "image2 and image1",
    # is no new wording: compare them without either
    said: set[str] = set()
    for kind in plan + [d.kind] * (4 * n):
        if len(found) == n:
            break
        for _attempt in range(8):
            text = _shared_description(d, rnd) if kind == "shared" else _DESCRIBE[kind](d, rnd)
            wording = _IMAGE_TOKEN.sub("image", text) if text else None
            if text is None or wording in said or len(tokenize(text)) > MAX_TOKENS:
                continue
            said.add(wording)
            opening = rnd.choice(OPENINGS) if kind != "shared" else ""
            found.append(
                f"{opening} {text}" if opening and len(tokenize(text)) + len(opening.split()) <= MAX_TOKENS else text
            )
            break
    if len(found) < n:
        raise RuntimeError(f"could only write {len(found)} distinct descriptions of a {d.kind} change")
    rnd.shuffle(found)
    return found


# --- the shard set --------------------------------------------------------------------------


def _image_metadata(scene: Scene) -> dict:
    return {
        "width": scene.width,
        "height": scene.height,
        "objects": [
            {"box": list(o.box), "phrase": o.phrase, "shape": o.shape, "color": o.color, "size": o.size}
            for o in scene.objects
        ],
    }


def pair_sample(key: str, split: str, pair: Pair) -> dict:
    """The sample of a pair in the pair schema of shards/README.md."""
    meta = {
        "id": key,
        "split": split,
        "captions": pair.descriptions,
        "change": pair.change,
        "img1": _image_metadata(pair.first),
        "img2": _image_metadata(pair.second),
    }
    return {
        "__key__": key,
        "json": meta,
        "img1.jpg": jpeg_bytes(pair.first),
        "img2.jpg": jpeg_bytes(pair.second),
        "img1.mask.png": mask_png(foreground_mask(pair.first)),
        "img2.mask.png": mask_png(foreground_mask(pair.second)),
    }


def build_synth_pairs(
    out_dir,
    n_train: int = 2000,
    n_val: int = 250,
    n_test: int = 500,
    seed: int = 0,
    shard_size: int = 500,
    image_size: int = 128,
    progress: bool = True,
    overwrite: bool = False,
) -> dict:
    """Render and describe the synthetic image pairs into a shard set at `out_dir`; returns the
    manifest. vocab.json covers the train descriptions and the single-image captions of the same
    scenes, since L2C trains on both with one vocabulary."""
    counts = {"train": n_train, "val": n_val, "test": n_test}
    check_counts(counts)
    if image_size < 32:
        raise ValueError(f"image_size must be at least 32 pixels, got {image_size}")
    config = {
        "n_train": n_train,
        "n_val": n_val,
        "n_test": n_test,
        "seed": seed,
        "shard_size": shard_size,
        "image_size": image_size,
    }
    caption_rng = random.Random(f"vldist-synth-pairs-captions:{seed}")  # apart: pairs stay as they are
    vocab_texts: list[str] = []
    with (
        building(out_dir, overwrite) as partial,
        tqdm(total=sum(counts.values()), unit="pair", desc="synth-pairs", disable=not progress) as bar,
        ShardSetWriter(partial, shard_size=shard_size, source="synth-pairs") as writer,
    ):
        for split in SPLITS:
            rng = split_rng(STREAM_NAME, seed, split)
            for index in range(counts[split]):
                pair = make_pair(rng, image_size)
                if split == "train":
                    vocab_texts += pair.descriptions
                    vocab_texts += make_captions(pair.first, caption_rng) + make_captions(pair.second, caption_rng)
                writer.write(split, pair_sample(sample_key(split, index), split, pair))
                bar.update()
        Vocab.build(vocab_texts).save(partial / VOCAB_NAME)
        manifest = writer.close(extra={"config": config, "pairs": {"masks": True, "image_tokens": list(IMAGE_TOKENS)}})
    return manifest
