"""Five varied, true captions per synthetic scene.

Every caption names at least one object as "[size] <colour> <shape>", always before any relation
word, so a caption reads subject-first ("a red circle to the left of a blue square"). Relations,
positions and sizes are computed from the boxes with the predicates below, which the tests use to
check that each caption is true of its image.
"""

from __future__ import annotations

import random

from vldist.shards.synthetic.scenes import Scene, SceneObject, as_random

N_CAPTIONS = 5
# 5-8: the scenes of synth --phrases hard (hard_phrases.py)
NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
GROUP_NOUNS = ("shapes", "objects", "figures")
OPENINGS = (
    "",
    "there is",
    "an image of",
    "a picture of",
    "this picture shows",
    "the image shows",
    "we can see",
    "a drawing of",
    "a scene with",
    "in this image there is",
)
BACKGROUNDS = ("on a plain background", "on a light background", "against a pale background")
RELATION_WORDS = {
    "left of": ("to the left of", "left of", "on the left of"),
    "right of": ("to the right of", "right of", "on the right of"),
    "above": ("above", "over", "higher than"),
    "below": ("below", "under", "beneath", "underneath", "lower than"),
    "next to": ("next to", "beside"),
    "larger than": ("larger than", "bigger than"),
    "smaller than": ("smaller than",),
}
POSITION_WORDS = {
    ("top", "left"): ("in the top left corner", "at the top left", "in the upper left part of the image"),
    ("top", "center"): ("at the top of the image", "near the top", "in the top middle"),
    ("top", "right"): ("in the top right corner", "at the top right", "in the upper right part of the image"),
    ("middle", "left"): ("on the left side", "at the left of the image", "near the left edge"),
    ("middle", "center"): ("in the center of the image", "in the middle", "in the centre of the picture"),
    ("middle", "right"): ("on the right side", "at the right of the image", "near the right edge"),
    ("bottom", "left"): ("in the bottom left corner", "at the bottom left", "in the lower left part of the image"),
    ("bottom", "center"): ("at the bottom of the image", "near the bottom", "in the bottom middle"),
    ("bottom", "right"): ("in the bottom right corner", "at the bottom right", "in the lower right part of the image"),
}


# --- geometry predicates ------------------------------------------------------------------------

ZONE_MARGIN = 0.05  # centres this close (fraction of the side) to a third line get no position words


def _third(value: float, extent: int, names: tuple[str, str, str]) -> str | None:
    t = value / extent
    if min(abs(t - 1 / 3), abs(t - 2 / 3)) < ZONE_MARGIN:
        return None  # e.g. halfway between "left" and "center": neither is clearly true
    return names[0] if t < 1 / 3 else names[2] if t > 2 / 3 else names[1]


def zone(obj: SceneObject, width: int, height: int) -> tuple[str, str] | None:
    """(vertical, horizontal) third of the image holding the object's centre, or None when the
    centre lies near a third line on either axis."""
    cx, cy = obj.center
    vertical = _third(cy, height, ("top", "middle", "bottom"))
    horizontal = _third(cx, width, ("left", "center", "right"))
    return (vertical, horizontal) if vertical and horizontal else None


def true_relations(a: SceneObject, b: SceneObject, width: int, height: int) -> list[str]:
    """Relations r for which "a r b" is true (keys of RELATION_WORDS).

    Left/right need the boxes apart horizontally and the horizontal offset not much smaller than
    the vertical one (a shape far below another is not naturally "to its left"); above/below alike.
    """
    (ax, ay), (bx, by) = a.center, b.center
    dx, dy = bx - ax, by - ay
    found = []
    if a.box[2] <= b.box[0] and abs(dx) >= 0.5 * abs(dy):
        found.append("left of")
    if b.box[2] <= a.box[0] and abs(dx) >= 0.5 * abs(dy):
        found.append("right of")
    if a.box[3] <= b.box[1] and abs(dy) >= 0.5 * abs(dx):
        found.append("above")
    if b.box[3] <= a.box[1] and abs(dy) >= 0.5 * abs(dx):
        found.append("below")
    x_gap = max(b.box[0] - a.box[2], a.box[0] - b.box[2])
    tallest = max(a.box[3] - a.box[1], b.box[3] - b.box[1])
    if 0 <= x_gap <= 0.35 * width and abs(dy) <= 0.5 * tallest:
        found.append("next to")
    if a.size == "large" and b.size == "small":
        found.append("larger than")
    if a.size == "small" and b.size == "large":
        found.append("smaller than")
    return found


# --- phrases -----------------------------------------------------------------------------------


def noun_phrase(obj: SceneObject, rnd: random.Random, size_prob: float = 0.6) -> str:
    """ "a small red circle" or "a red circle": the size is said often but not always."""
    if rnd.random() < size_prob:
        return obj.phrase
    return f"{'an' if obj.color[0] in 'aeiou' else 'a'} {obj.color} {obj.shape}"


def join_list(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _with_opening(text: str, rnd: random.Random) -> str:
    opening = rnd.choice(OPENINGS)
    return f"{opening} {text}" if opening else text


def _position(obj: SceneObject, scene: Scene, rnd: random.Random) -> str:
    return rnd.choice(POSITION_WORDS[zone(obj, scene.width, scene.height)])  # callers check zone()


# --- caption kinds: each returns a caption, or None when the scene does not allow it ----------


def listing_caption(scene: Scene, rnd: random.Random) -> str:
    objs = rnd.sample(scene.objects, len(scene.objects))
    text = join_list([noun_phrase(o, rnd, 0.8) for o in objs])
    if rnd.random() < 0.3:
        text = f"{text} {rnd.choice(BACKGROUNDS)}"
    return _with_opening(text, rnd)


def count_caption(scene: Scene, rnd: random.Random) -> str:
    objs = rnd.sample(scene.objects, len(scene.objects))
    n = len(objs)
    if n == 1:
        template = rnd.choice(
            ("a single {a}", "just one shape, {a}", "only one object: {a}", "one {c} {s} and nothing else")
        )
        return template.format(a=noun_phrase(objs[0], rnd), c=objs[0].color, s=objs[0].shape)
    number, noun = NUMBER_WORDS[n], rnd.choice(GROUP_NOUNS)
    style = rnd.randrange(3)
    if style == 0:
        return f"{number} {noun}: " + join_list([noun_phrase(o, rnd) for o in objs])
    if style == 1:
        return f"there are {number} {noun}, including {noun_phrase(objs[0], rnd)}"
    return f"{number} {noun} {rnd.choice(BACKGROUNDS)}, one of them {noun_phrase(objs[0], rnd)}"


def position_caption(scene: Scene, rnd: random.Random) -> str | None:
    placeable = [o for o in scene.objects if zone(o, scene.width, scene.height)]
    if not placeable:
        return None
    objs = rnd.sample(placeable, min(len(placeable), rnd.choice((1, 1, 2))))
    parts = [f"{noun_phrase(o, rnd)} {_position(o, scene, rnd)}" for o in objs]
    if len(parts) == 1 and rnd.random() < 0.5:
        return _with_opening(parts[0], rnd)
    return " and ".join(parts)


def _pairs_with(scene: Scene, kinds: set[str]) -> list[tuple[SceneObject, SceneObject, str]]:
    return [
        (a, b, r)
        for a in scene.objects
        for b in scene.objects
        if a is not b
        for r in true_relations(a, b, scene.width, scene.height)
        if r in kinds
    ]


def relation_caption(scene: Scene, rnd: random.Random) -> str | None:
    spatial = _pairs_with(scene, {"left of", "right of", "above", "below", "next to"})
    if not spatial:
        return None
    a, b, rel = rnd.choice(spatial)
    words = rnd.choice(RELATION_WORDS[rel])
    text = f"{noun_phrase(a, rnd)} {'is ' if rnd.random() < 0.3 else ''}{words} {noun_phrase(b, rnd)}"
    others = [o for o in scene.objects if o is not a and o is not b and zone(o, scene.width, scene.height)]
    if others and rnd.random() < 0.4:  # say where a third object is, as a clause after both
        c = rnd.choice(others)
        text += f", with {noun_phrase(c, rnd)} {_position(c, scene, rnd)}"
        return text
    return _with_opening(text, rnd) if rnd.random() < 0.4 else text


def size_caption(scene: Scene, rnd: random.Random) -> str | None:
    pairs = _pairs_with(scene, {"larger than", "smaller than"})
    if not pairs:
        return None
    a, b, rel = rnd.choice(pairs)
    # without the size adjectives: the comparison is the information here
    return f"{noun_phrase(a, rnd, 0.0)} {'is ' if rnd.random() < 0.5 else ''}{rnd.choice(RELATION_WORDS[rel])} {noun_phrase(b, rnd, 0.0)}"


CAPTION_KINDS = {
    "listing": listing_caption,
    "count": count_caption,
    "position": position_caption,
    "relation": relation_caption,
    "size": size_caption,
}


def _plan(scene: Scene, rnd: random.Random) -> list[str]:
    """Which kinds of caption to write: a full listing always (it identifies the objects), then
    layout (relations, positions), a count and sometimes a size comparison."""
    if len(scene.objects) <= 1:
        return ["listing", "position", "count", "position", "listing"]
    plan = ["listing", "relation", "relation", "position", "count"]
    if rnd.random() < 0.3:
        plan[rnd.choice((2, 4))] = "size"
    return plan


def make_captions(scene: Scene, rng, n: int = N_CAPTIONS) -> list[str]:
    """`n` distinct captions, each true of the scene, in a shuffled order; deterministic in rng."""
    if not scene.objects:
        raise ValueError("a scene without objects cannot be captioned")
    rnd = as_random(rng)
    captions: list[str] = []
    plan = _plan(scene, rnd)
    fallbacks = ["listing", "position", "count", "relation", "size"]
    for kind in plan + fallbacks * 4:
        if len(captions) == n:
            break
        for _attempt in range(8):
            text = CAPTION_KINDS[kind](scene, rnd)
            text = " ".join(text.split()) if text is not None else None
            if text is not None and text not in captions:
                captions.append(text)
                break
    if len(captions) < n:
        raise RuntimeError(f"could only write {len(captions)} distinct captions for a scene of {scene.objects}")
    rnd.shuffle(captions)
    return captions
