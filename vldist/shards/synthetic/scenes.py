"""Deterministic synthetic scenes: 1-4 coloured shapes on a plain, slightly noisy background.

Objects never overlap (boxes keep a gap of GAP pixels), and no two objects of a scene share both
shape and colour, so "the red circle" always names one object and spatial relations between
named objects are well defined.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle", "star", "diamond", "hexagon")
COLORS = {  # clearly distinct hues and brightness on a light background
    "red": (215, 30, 35),
    "green": (30, 150, 50),
    "blue": (35, 75, 215),
    "yellow": (235, 195, 20),
    "purple": (130, 45, 175),
    "orange": (245, 125, 20),
    "pink": (240, 110, 185),
    "black": (35, 35, 35),
}
# Object side as a fraction of the image side: the ranges are far apart so "small" and "large"
# are unambiguous by eye.
SIZES = {"small": (0.14, 0.19), "large": (0.30, 0.38)}
GAP = 3  # minimum free pixels between two object boxes
MAX_OBJECTS = 4


@dataclass
class SceneObject:
    shape: str
    color: str
    size: str
    box: list[int]  # [x0, y0, x1, y1] in pixels, x1/y1 exclusive
    points: list[tuple[float, float]] = field(repr=False, default_factory=list)  # polygon outline

    @property
    def phrase(self) -> str:
        return f"a {self.size} {self.color} {self.shape}"

    @property
    def center(self) -> tuple[float, float]:
        x0, y0, x1, y1 = self.box
        return (x0 + x1) / 2, (y0 + y1) / 2

    @property
    def area(self) -> int:
        x0, y0, x1, y1 = self.box
        return (x1 - x0) * (y1 - y0)


@dataclass
class Scene:
    width: int
    height: int
    objects: list[SceneObject]
    image: Image.Image = field(repr=False)


def as_random(rng) -> random.Random:
    """Accept a random.Random or a numpy Generator; numpy seeds a Random once, deterministically."""
    if isinstance(rng, random.Random):
        return rng
    if isinstance(rng, np.random.Generator):
        return random.Random(int(rng.integers(0, 2**63)))
    raise TypeError(f"rng must be random.Random or numpy.random.Generator, got {type(rng).__name__}")


def shape_outline(shape: str, cx: float, cy: float, side: float) -> list[tuple[float, float]]:
    """Polygon of a shape fitting a `side` x `side` square centred at (cx, cy)."""
    r = side / 2
    if shape == "square":
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "triangle":
        return [(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)]
    if shape == "hexagon":
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in (math.pi / 3 * k for k in range(6))]
    if shape == "star":
        pts = []
        for k in range(10):
            rad = r if k % 2 == 0 else r * 0.45
            a = -math.pi / 2 + k * math.pi / 5
            pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
        return pts
    if shape == "circle":
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in (2 * math.pi * k / 32 for k in range(32))]
    raise ValueError(f"unknown shape {shape!r}; choose from {SHAPES}")


def bounding_box(points, width: int, height: int) -> list[int]:
    """Pixel box [x0, y0, x1, y1] (x1/y1 exclusive) around an outline, clipped to the image."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    return [
        max(0, math.floor(min(xs))),
        max(0, math.floor(min(ys))),
        min(width, math.ceil(max(xs)) + 1),
        min(height, math.ceil(max(ys)) + 1),
    ]


def boxes_apart(a: list[int], b: list[int]) -> bool:
    """Whether two boxes leave at least GAP free pixels between them (objects never overlap)."""
    return a[2] + GAP <= b[0] or b[2] + GAP <= a[0] or a[3] + GAP <= b[1] or b[3] + GAP <= a[1]


def place_objects(rnd: random.Random, n: int, width: int, height: int) -> list[SceneObject]:
    """Up to `n` objects, each apart from the others and with a (shape, colour) of its own."""
    objects: list[SceneObject] = []
    used: set[tuple[str, str]] = set()
    side_of_image = min(width, height)
    for _ in range(n):
        for _attempt in range(50):  # rejection sampling; a crowded scene just keeps fewer objects
            shape, color = rnd.choice(SHAPES), rnd.choice(list(COLORS))
            if (shape, color) in used:
                continue
            size = rnd.choice(list(SIZES))
            lo, hi = SIZES[size]
            side = side_of_image * rnd.uniform(lo, hi)
            margin = 2 + side / 2
            cx = rnd.uniform(margin, width - margin)
            cy = rnd.uniform(margin, height - margin)
            points = shape_outline(shape, cx, cy, side)
            box = bounding_box(points, width, height)
            if all(boxes_apart(box, o.box) for o in objects):
                objects.append(SceneObject(shape, color, size, box, points))
                used.add((shape, color))
                break
    return objects


def render(objects: list[SceneObject], width: int, height: int, rnd: random.Random) -> Image.Image:
    """Light background of a random tint plus mild pixel noise (so JPEGs are not trivial)."""
    base = np.array([rnd.randint(225, 250) for _ in range(3)], dtype=np.int16)
    noise = np.random.default_rng(rnd.getrandbits(64)).integers(-6, 7, size=(height, width, 3), dtype=np.int16)
    image = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for obj in objects:
        draw_object(draw, obj, COLORS[obj.color])
    return image


def draw_object(draw: ImageDraw.ImageDraw, obj: SceneObject, fill) -> None:
    """The one way an object is drawn: render() paints it in colour, pairs.foreground_mask with 1,
    so a mask covers exactly the pixels of its image's objects."""
    if obj.shape == "circle":
        x0, y0, x1, y1 = obj.box
        draw.ellipse([x0, y0, x1 - 1, y1 - 1], fill=fill)
    else:
        draw.polygon(obj.points, fill=fill)


def generate_scene(rng, image_size: int = 128) -> Scene:
    """A scene of 1-4 objects and its rendered RGB image, fully determined by `rng`'s state."""
    if image_size < 32:
        raise ValueError(f"image_size must be at least 32 pixels, got {image_size}")
    rnd = as_random(rng)
    n = rnd.randint(1, MAX_OBJECTS)
    objects = place_objects(rnd, n, image_size, image_size)
    image = render(objects, image_size, image_size, rnd)
    return Scene(image_size, image_size, objects, image)
