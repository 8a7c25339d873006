"""The harder phrase variant of synth (`python -m vldist.shards synth --phrases hard`): crowded
scenes whose phrases cannot be told apart by their shape and colour alone.

A scene holds HARD_MIN_OBJECTS to HARD_MAX_OBJECTS objects drawn from a palette of
PALETTE_COLORS colours and PALETTE_SHAPES shapes of its own, two of them near in hue (red and
orange, blue and purple, ...) and two near in outline (circle and hexagon, square and diamond,
triangle and star), so most objects share their shape or their colour with another, or nearly
do; one or two kinds (shape and colour) appear two or three times each (about half the objects),
and at least two kinds once. Objects may overlap (each pair's common area at most MAX_OVERLAP of
the smaller box; the later one is drawn on top). Each object's phrase (its `expression`, the
JSON's `phrase`) names it alone in its scene:

- an object whose kind is alone in the scene: "the red circle";
- one of several of a kind: "the red circle left of the blue square", where the landmark (the
  blue square) is alone of its kind and the relation (captions.true_relations: left of, right
  of, above, below) holds for this red circle and for none of the others. Without the relation
  words such a phrase names two or three objects.

Proposals (`make_hard_proposals`) are of synth's count and kinds: jittered copies of every
object's box, taken one scale at a time over all objects (so every object, the phrase's
same-kind distractors included, has its tight boxes before any object has its loose ones), then
the whole image and the 2 x 2 grid, then random boxes. A phrase's region features are thus
ranked against tight boxes around objects that look exactly like it.

A scene that cannot name every object is placed again (SCENE_ATTEMPTS times); after that, the
objects that still cannot be named are left out of it before it is rendered.
"""

from __future__ import annotations

import random

from vldist.shards.synthetic.captions import RELATION_WORDS, true_relations
from vldist.shards.synthetic.proposals import make_proposals
from vldist.shards.synthetic.scenes import (
    COLORS,
    SHAPES,
    SIZES,
    Scene,
    SceneObject,
    as_random,
    bounding_box,
    render,
    shape_outline,
)

HARD_STREAM_NAME = "vldist-synth-hard"  # the hard variant's random streams, apart from synth's
HARD_MIN_OBJECTS, HARD_MAX_OBJECTS = 5, 8
PALETTE_COLORS, PALETTE_SHAPES = 3, 3  # a scene's objects come from 3 x 3 kinds
# A scene's palette holds one of these pairs of near colours and one of near shapes, and one more of each.
SIMILAR_COLORS = (("red", "orange"), ("red", "pink"), ("pink", "purple"), ("blue", "purple"), ("orange", "yellow"))
SIMILAR_SHAPES = (("circle", "hexagon"), ("square", "diamond"), ("triangle", "star"))
MAX_OVERLAP = 0.3  # the common area of two object boxes, as a fraction of the smaller one's
SCENE_ATTEMPTS = 30
SPATIAL = ("left of", "right of", "above", "below")  # the relations a phrase picks its object with
# Jitter scales of the hard proposals, relative to the object's side: 0.05 keeps IoU >= 0.7
# (a positive), 0.15 mostly partial, 0.35 mostly a miss.
HARD_JITTERS = (0.05, 0.15, 0.35)


class ReferredObject(SceneObject):
    """A scene object with its referring expression in the scene (`expression`, set by
    `name_objects`): the sample's phrase. Its `phrase` stays synth's ("a small red circle"), which
    the captions say."""

    expression: str = ""


def kind(obj: SceneObject) -> tuple[str, str]:
    return obj.shape, obj.color


def overlap_ok(a: list[int], b: list[int]) -> bool:
    """Whether two boxes' common area is at most MAX_OVERLAP of the smaller box's area."""
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    if w <= 0 or h <= 0:
        return True
    smaller = min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]))
    return w * h <= MAX_OVERLAP * smaller


def scene_kinds(rnd: random.Random) -> list[tuple[str, str]]:
    """The (shape, colour) of each object to place, shuffled, all from the scene's 3 x 3 palette
    (two near colours and two near shapes among them: SIMILAR_COLORS, SIMILAR_SHAPES): one kind
    (scenes of 5) or two repeated, 2 or 3 copies each, and at least two kinds alone (the
    landmarks relations need)."""
    n = rnd.randint(HARD_MIN_OBJECTS, HARD_MAX_OBJECTS)
    shapes = list(rnd.choice(SIMILAR_SHAPES))
    shapes += rnd.sample([s for s in SHAPES if s not in shapes], PALETTE_SHAPES - 2)
    colors = list(rnd.choice(SIMILAR_COLORS))
    colors += rnd.sample([c for c in COLORS if c not in colors], PALETTE_COLORS - 2)
    palette = [(s, c) for s in shapes for c in colors]
    rnd.shuffle(palette)
    kinds: list[tuple[str, str]] = []
    budget, repeated = n - 2, 0
    for k in palette[:2]:
        copies = min(rnd.choice((2, 2, 3)), budget)
        if copies < 2:
            break
        kinds += [k] * copies
        budget, repeated = budget - copies, repeated + 1
    kinds += palette[repeated : repeated + n - len(kinds)]
    rnd.shuffle(kinds)
    return kinds


def place_hard(rnd: random.Random, kinds: list[tuple[str, str]], width: int, height: int) -> list[ReferredObject]:
    """One object per kind, in order, where its box overlaps every earlier one by at most
    MAX_OVERLAP (rejection sampling; one that finds no place is left out)."""
    objects: list[ReferredObject] = []
    side_of_image = min(width, height)
    for shape, color in kinds:
        for _attempt in range(50):
            size = rnd.choice(list(SIZES))
            side = side_of_image * rnd.uniform(*SIZES[size])
            margin = 2 + side / 2
            cx, cy = rnd.uniform(margin, width - margin), rnd.uniform(margin, height - margin)
            points = shape_outline(shape, cx, cy, side)
            box = bounding_box(points, width, height)
            if all(overlap_ok(box, o.box) for o in objects):
                objects.append(ReferredObject(shape, color, size, box, points))
                break
    return objects


def distinguishing_relations(
    obj: SceneObject, objects: list[SceneObject], width: int, height: int
) -> list[tuple[str, SceneObject]]:
    """(relation, landmark) pairs that pick `obj` out among the objects of its kind: the landmark
    is alone of its kind, and "obj <relation> landmark" is true of obj and of no other object of
    obj's kind."""
    same = [o for o in objects if o is not obj and kind(o) == kind(obj)]
    found = []
    for landmark in objects:
        if landmark is obj or sum(kind(o) == kind(landmark) for o in objects) != 1:
            continue
        holds = set(true_relations(obj, landmark, width, height))
        for relation in SPATIAL:
            if relation in holds and not any(relation in true_relations(o, landmark, width, height) for o in same):
                found.append((relation, landmark))
    return found


def name_objects(objects: list[ReferredObject], rnd: random.Random, width: int, height: int) -> list[ReferredObject]:
    """Set each object's referring expression; returns the objects that cannot be named (an
    object of a repeated kind with no distinguishing relation)."""
    unnamed = []
    for obj in objects:
        text = f"the {obj.color} {obj.shape}"
        if sum(kind(o) == kind(obj) for o in objects) > 1:
            options = distinguishing_relations(obj, objects, width, height)
            if not options:
                unnamed.append(obj)
                continue
            relation, landmark = rnd.choice(options)
            text += f" {rnd.choice(RELATION_WORDS[relation])} the {landmark.color} {landmark.shape}"
        obj.expression = text
    return unnamed


def generate_hard_scene(rng, image_size: int = 128) -> Scene:
    """A crowded scene whose every object has a phrase naming it alone (`ReferredObject.expression`),
    and its rendered image, fully determined by `rng`'s state."""
    if image_size < 32:
        raise ValueError(f"image_size must be at least 32 pixels, got {image_size}")
    rnd = as_random(rng)
    for _attempt in range(SCENE_ATTEMPTS):
        objects = place_hard(rnd, scene_kinds(rnd), image_size, image_size)
        if not name_objects(objects, rnd, image_size, image_size):
            break
    else:  # leave out what cannot be named, one at a time: a kind left with one object needs no relation
        while unnamed := name_objects(objects, rnd, image_size, image_size):
            objects = [o for o in objects if o is not unnamed[-1]]
    image = render(objects, image_size, image_size, rnd)
    return Scene(image_size, image_size, objects, image)


def make_hard_proposals(
    width: int, height: int, object_boxes: list[list[int]], count: int, rng: random.Random
) -> list[list[int]]:
    """`count` distinct pixel boxes: jitters of every object's box, one scale of HARD_JITTERS at a
    time over all objects (every object gets its tightest before any gets a looser one), then the
    whole image and the grid cells, then random boxes of at least 1/8 of each side."""
    return make_proposals(width, height, object_boxes, count, rng, jitters=HARD_JITTERS, scale_first=True)
