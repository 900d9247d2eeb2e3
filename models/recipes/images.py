"""Drawn-shape images for the Kimi model: shapes, colours, counts, positions; questions and captions.

An item carries the drawing's spec, not its pixels; `render(spec)` draws it the same way every time.
"""

from __future__ import annotations

import io
import random

from PIL import Image, ImageDraw

SHAPES = ["circle", "square", "triangle"]
COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 170, 60), "yellow": (230, 210, 30)}
SIZE = 112  # pixels; 8×8 patches of 14 → 16 image tokens after the 2×2 merge
CELLS = {"top left": (0, 0), "top right": (1, 0), "bottom left": (0, 1), "bottom right": (1, 1)}


def render(spec: list[dict]) -> bytes:
    """PNG bytes of the shapes in `spec` (each {shape, colour, cell}) on a white canvas."""
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
