"""Drawn-shape images for the Kimi model: shapes, colours, counts, positions; questions and captions.

An item carries the drawing's spec, not its pixels; `render(spec)` draws it the same way every time.
Two kinds of spec: the classic list of shapes, one per quadrant of a white 112 px square (the test set
`image-qa.test.jsonl` keeps it, so its figures stay comparable), and a scene (`scene`): any common size
(48-512 px, square or not), a plain, tinted, dark or two-tone background, one to three shapes of any
size placed anywhere, centred included, named by the ninth of the picture they sit in (`place`).
Training items are mostly scenes (issue 26: a centred red circle at 64 px was "yellow").
"""

from __future__ import annotations

import io
import random

from PIL import Image, ImageDraw

SHAPES = ["circle", "square", "triangle"]
COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 170, 60), "yellow": (230, 210, 30)}
SIZE = 112  # pixels; 8×8 patches of 14 → 16 image tokens after the 2×2 merge
CELLS = {"top left": (0, 0), "top right": (1, 0), "bottom left": (0, 1), "bottom right": (1, 1)}


def render(spec: list[dict] | dict) -> bytes:
    """PNG bytes of `spec`: a scene (a dict, `scene`) or the classic shapes (each {shape, colour, cell})
    on a white canvas."""
    if isinstance(spec, dict):
        return _render_scene(spec)
    image = Image.new("RGB", (SIZE, SIZE), "white")
    draw = ImageDraw.Draw(image)
    half = SIZE // 2
    for s in spec:
        cx, cy = CELLS[s["cell"]]
        box = (cx * half + 8, cy * half + 8, cx * half + half - 8, cy * half + half - 8)
        fill = COLOURS[s["colour"]]
        if s["shape"] == "circle":
            draw.ellipse(box, fill=fill)
        elif s["shape"] == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=fill)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _spec(rng: random.Random, tier: int) -> list[dict]:
    """Tier t draws t shapes (up to 4), one per cell."""
    cells = rng.sample(list(CELLS), k=min(tier, 4))
    return [{"shape": rng.choice(SHAPES), "colour": rng.choice(sorted(COLOURS)), "cell": c} for c in cells]


def _caption(spec: list[dict]) -> str:
    return "; ".join(f"a {s['colour']} {s['shape']} at the {s['cell']}" for s in spec)


def image_caption(rng: random.Random, tier: int) -> dict:
    """Training only: "Describe the picture." answered with every shape's colour, kind and cell (the
    dense signal that binds colours to shapes; the questions then ask one of them)."""
    spec = _spec(rng, tier)
    return {
        "task": "image-caption",
        "image_spec": spec,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "Describe the picture."}],
            },
            {"role": "assistant", "content": f"{_caption(spec).capitalize()}."},
        ],
    }


def image_question(rng: random.Random, tier: int) -> dict:
    """Tier t draws t shapes (up to 4, one per cell) and asks about colour, count or position."""
    spec = _spec(rng, tier)
    target = rng.choice(spec)
    same_shape = [s for s in spec if s["shape"] == target["shape"]]
    kind = rng.choice(["colour", "count", "position"] if len(same_shape) == 1 else ["count", "position"])
    if kind == "colour":
        question, answer = f"What colour is the {target['shape']}?", target["colour"]
    elif kind == "count":
        question, answer = "How many shapes are in the picture?", str(len(spec))
    else:
        question, answer = f"Where is the {target['colour']} {target['shape']}?", target["cell"]
    return {
        "task": "image-qa",
        "image_spec": spec,
        "prompt": question,
        "answer": answer,
        "caption": _caption(spec),
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": f"{answer}."},
        ],
    }


PLACES = [
    ["top left", "top", "top right"],
    ["left", "centre", "right"],
    ["bottom left", "bottom", "bottom right"],
]


def place_of(box: list[int], width: int, height: int) -> str:
    """The ninth of the picture the box's centre lies in ("centre", "top left", "bottom", ...)."""
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    return PLACES[min(2, int(3 * cy / height))][min(2, int(3 * cx / width))]


def _fill(colour: str, jitter: list[int]) -> tuple[int, int, int]:
    return tuple(max(0, min(255, c + j)) for c, j in zip(COLOURS[colour], jitter, strict=True))  # type: ignore[return-value]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: list[int], fill: tuple[int, int, int]) -> None:
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=fill)


def _render_scene(spec: dict) -> bytes:
    width, height = spec["size"]
    image = Image.new("RGB", (width, height), tuple(spec["background"]))
    draw = ImageDraw.Draw(image)
    if "band" in spec:  # a two-tone background: a band of a second plain colour behind everything
        draw.rectangle(spec["band"]["box"], fill=tuple(spec["band"]["colour"]))
    for s in spec["shapes"]:
        _draw_shape(draw, s["shape"], s["box"], _fill(s["colour"], s.get("jitter", [0, 0, 0])))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


BACKGROUNDS = {"white": (255, 255, 255), "light grey": (225, 225, 225), "cream": (245, 238, 220),
               "pale blue": (215, 230, 245), "dark grey": (60, 60, 64), "black": (15, 15, 15),
               "pale green": (220, 240, 220)}  # fmt: skip


def scene(rng: random.Random, count: int) -> dict:
    """A picture of any common size with `count` (1-3) non-overlapping shapes anywhere; a lone shape
    is centred a third of the time."""
    side = lambda: int(round(48 * (512 / 48) ** rng.random()))  # noqa: E731 - log-uniform 48..512
    width = side()
    height = width if rng.random() < 0.5 else max(48, min(512, int(width * rng.uniform(0.5, 2.0))))
    background = BACKGROUNDS[rng.choice(sorted(BACKGROUNDS))] if rng.random() < 0.6 else (255, 255, 255)
    spec: dict = {"size": [width, height], "background": list(background), "shapes": []}
    if rng.random() < 0.15:  # two-tone: a neutral band behind the shapes
        y = rng.randrange(height // 2)
        spec["band"] = {
            "box": [0, y, width, y + height // 3],
            "colour": list(BACKGROUNDS[rng.choice(["light grey", "cream", "dark grey"])]),
        }
    placed: list[list[int]] = []
    short = min(width, height)
    for n in range(count):
        for _ in range(50):
            size = int(short * rng.uniform(0.2, 0.6 if count == 1 else 0.35))
            size = max(size, 10)
            if count == 1 and n == 0 and rng.random() < 0.35:
                x0, y0 = (width - size) // 2, (height - size) // 2
            else:
                x0, y0 = rng.randint(0, width - size), rng.randint(0, height - size)
            box = [x0, y0, x0 + size, y0 + size]
            if all(box[2] <= b[0] or b[2] <= box[0] or box[3] <= b[1] or b[3] <= box[1] for b in placed):
                break
        else:
            break
        placed.append(box)
        spec["shapes"].append({"shape": rng.choice(SHAPES), "colour": rng.choice(sorted(COLOURS)), "box": box,
                               "place": place_of(box, width, height),
                               "jitter": [rng.randint(-15, 15) for _ in range(3)]})  # fmt: skip
    return spec


SCENE_QUESTIONS = {
    "colour": ["What colour is the {shape}?", "What color is the {shape}?", "Which colour is the {shape}?",
               "What colour is the shape?", "What color is it?"],
    "shape": ["What shape is this?", "What shape is in the picture?", "Which shape do you see?",
              "What is the {colour} shape?"],
    "count": ["How many shapes are in the picture?", "How many shapes are there?", "Count the shapes."],
    "place": ["Where is the {colour} {shape}?", "Where is the {shape}?", "Where in the picture is the {colour} shape?"],
}  # fmt: skip


def scene_question(rng: random.Random, tier: int) -> dict:
    """A scene of 1-3 shapes and a question about the colour, kind, count or place of one of them."""
    spec = scene(rng, rng.choice([1, 1, 2, 3]) if tier > 1 else 1)
    shapes = spec["shapes"]
    target = rng.choice(shapes)
    unique_shape = sum(s["shape"] == target["shape"] for s in shapes) == 1
    unique_colour = sum(s["colour"] == target["colour"] for s in shapes) == 1
    kinds = ["count"] + (["colour", "place"] if unique_shape else []) + (["shape"] if unique_colour else [])
    kind = rng.choice(kinds)
    # with several shapes a question names its target by what is unique to it
    options = [
        q
        for q in SCENE_QUESTIONS[kind]
        if len(shapes) == 1
        or kind == "count"
        or ("{shape}" in q and unique_shape)
        or ("{colour}" in q and "{shape}" not in q and unique_colour)
    ]
    question = rng.choice(options).format(shape=target["shape"], colour=target["colour"])
    answer = {
        "colour": target["colour"],
        "shape": target["shape"],
        "count": str(len(shapes)),
        "place": target["place"],
    }[kind]
    caption = "; ".join(f"a {s['colour']} {s['shape']} at the {s['place']}" for s in shapes)
    return {
        "task": "image-qa",
        "image_spec": spec,
        "prompt": question,
        "answer": answer,
        "caption": caption,
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": f"{answer}."},
        ],
    }


def scene_caption(rng: random.Random, tier: int) -> dict:
    spec = scene(rng, rng.choice([1, 2, 3]))
    caption = "; ".join(f"a {s['colour']} {s['shape']} at the {s['place']}" for s in spec["shapes"])
    ask = rng.choice(["Describe the picture.", "What do you see?", "Describe this image."])
    return {
        "task": "image-caption",
        "image_spec": spec,
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ask}]},
            {"role": "assistant", "content": f"{caption.capitalize()}."},
        ],
    }
