"""Held-out everyday sets for the nano models (issue 26), written apart from the training recipe.

    kumo eval --heldout glm --heldout-items 40 --variant now=models/glm-5.2-nano --out report.json

What a person trying the models types, in wording the training generator (`models/recipes`) never uses:
its own sentence templates, its own cities, names, businesses and errands, its own word-problem
stories and picture styles. Nothing is imported from `models/recipes`; a test checks that no request
here is a training phrasing. The sets are `kumo eval` task files (`backend/tools/eval_tasks.py`), run
through serving's own prompt path (the checkpoint's template, serving's image path, reasoning split
and tool-call parser: `backend/tools/eval_prompts.py`):

- `heldout-tools`: one offered tool must be called (among up to three offered) with exactly the
  values the request writes (a city, person, amount, count, date) — so only an offered tool, and
  arguments of its schema;
- `heldout-arithmetic`: one- to three-step word problems in everyday stories, numbers 1 to ~5,000;
  the last number of the answer must be the result;
- `heldout-chat`: greetings (a short reply that greets or offers help, no markup) and one-line
  questions (the reply must contain the fact);
- `heldout-images` (Kimi): one or two shapes of the four trained colours on pictures of 40-500 px,
  square or not, placed anywhere or centred, on white, tinted or dark backgrounds; the colour or the
  kind of shape is asked.
"""

from __future__ import annotations

import base64
import io
import json
import random
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

TOOLS = {
    "get_weather": {"description": "Look up the weather at a place", "parameters": {"type": "object",
        "properties": {"city": {"type": "string", "description": "place name"},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}},
    "convert_currency": {"description": "Exchange rates applied to a sum", "parameters": {"type": "object",
        "properties": {"amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
        "required": ["amount", "from", "to"]}},
    "set_timer": {"description": "Rings after a delay", "parameters": {"type": "object",
        "properties": {"minutes": {"type": "integer"}}, "required": ["minutes"]}},
    "send_message": {"description": "Reach a friend by SMS", "parameters": {"type": "object",
        "properties": {"to": {"type": "string"}, "text": {"type": "string"}}, "required": ["to", "text"]}},
    "book_table": {"description": "Reserve seats at a restaurant", "parameters": {"type": "object",
        "properties": {"restaurant": {"type": "string"}, "people": {"type": "integer"}},
        "required": ["restaurant", "people"]}},
    "add_reminder": {"description": "Create a dated reminder", "parameters": {"type": "object",
        "properties": {"text": {"type": "string"}, "date": {"type": "string"}}, "required": ["text", "date"]}},
}  # fmt: skip

# values no training list holds
PLACES = ["Nagoya", "Bergen", "Cusco", "Hobart", "Tromso", "Valparaiso", "Kyoto", "Gdansk", "Leipzig",
          "Bordeaux", "Salzburg", "Antwerp", "Utrecht", "Cork", "Aarhus", "Tampere", "Malmo", "Brno",
          "Ljubljana", "Split", "Izmir", "Fez", "Arusha", "Mombasa", "Goa", "Pune", "Chiang Mai", "Da Nang",
          "Busan", "Sapporo", "Darwin", "Cairns", "Halifax", "Quebec", "Austin", "Portland", "Nashville",
          "Santa Fe", "Oaxaca", "Medellin", "Cartagena", "Montevideo", "Cordoba", "Recife", "Windhoek"]  # fmt: skip
FRIENDS = ["Beatrix", "Cyrus", "Dagny", "Elio", "Freya", "Gustavo", "Hedda", "Ignacio", "Jolene",
           "Kasimir", "Ludmila", "Magnus", "Nadia", "Oskar", "Pilar", "Rafael", "Saoirse", "Tobias",
           "Ulla", "Viggo", "Wanjiru", "Ximena", "Yannick", "Zelda", "Mrs Okonkwo", "Dr Patel", "Uncle Joe"]  # fmt: skip
EATERIES = ["The Blue Door", "Golden Lotus", "Pasta Fresca", "Sakura Sushi", "The Old Mill", "Casa Luna",
            "Taj Palace", "Le Petit Chef", "Harbour View", "The Green Fork"]  # fmt: skip
NOTES = [
    "the package arrived",
    "I'm on my way",
    "meet me at the station",
    "don't wait up",
    "the keys are under the mat",
]
ERRANDS = ["renew my passport", "feed the cat", "return the library books", "order flowers", "check the oil"]
MONEY = ["USD", "EUR", "GBP", "JPY", "CAD", "AUD", "CHF", "INR"]
DATES = ["June 9", "the 3rd of May", "2027-11-30", "Saturday", "December 24", "next Tuesday"]

ASK = {
    "get_weather": ["Any idea what the weather is doing in {city} at the moment?",
                    "What's the sky doing over {city} today?",
                    "Planning a walk in {city} - sunny or not?",
                    "Conditions in {city} at the moment?"],
    "get_weather+unit": ["How many degrees {unit} is it in {city}?"],
    "convert_currency": ["If I exchange {amount} {from}, what would I get in {to}?",
                         "Quick conversion please: {amount} {from} -> {to}",
                         "What are {amount} {from} worth in {to} these days?"],
    "set_timer": ["Ring me once {minutes} minutes have passed.",
                  "My tea steeps for {minutes} minutes - give me a buzz when it's done.",
                  "Start counting {minutes} minutes from now."],
    "send_message": ["Drop {to} a line: {text}.",
                     "Get word to {to} that {text}.",
                     "Inform {to}: {text}."],
    "book_table": ["We are {people}; could you get us seats at {restaurant}?",
                   "Dinner at {restaurant}, {people} of us - can you sort out a booking?",
                   "Hold {people} places for us at {restaurant}."],
    "add_reminder": ["Could you note that I must {text}, due {date}?",
                     "Put '{text}' on my list for {date}.",
                     "On my calendar for {date}: {text}, please."],
}  # fmt: skip


def tool_items(rng: random.Random, count: int) -> list[dict[str, Any]]:
    out = []
    for _ in range(count):
        name = rng.choice(sorted(TOOLS))
        key = name
        if name == "get_weather":
            args: dict[str, Any] = {"city": rng.choice(PLACES)}
            if rng.random() < 0.25:
                args["unit"], key = rng.choice(["celsius", "fahrenheit"]), "get_weather+unit"
        elif name == "convert_currency":
            src, dst = rng.sample(MONEY, 2)
            args = {
                "amount": rng.choice([rng.randint(3, 99), rng.randint(100, 25000)]),
                "from": src,
                "to": dst,
            }
        elif name == "set_timer":
            args = {"minutes": rng.randint(2, 180)}
        elif name == "send_message":
            args = {"to": rng.choice(FRIENDS), "text": rng.choice(NOTES)}
        elif name == "book_table":
            args = {"restaurant": rng.choice(EATERIES), "people": rng.randint(2, 14)}
        else:
            args = {"text": rng.choice(ERRANDS), "date": rng.choice(DATES)}
        others = rng.sample([t for t in sorted(TOOLS) if t != name], k=rng.randint(0, 2))
        offered = [name, *others]
        rng.shuffle(offered)
        request = rng.choice(ASK[key]).format(**args)
        out.append({
            "messages": [{"role": "user", "content": request}],
            "tools": [{"name": t, **TOOLS[t]} for t in offered],
            "expected": {"name": name, "arguments": args},
        })  # fmt: skip
    return out


STORIES = [  # (opening with {a}, item noun, then steps)
    ("A bakery made {a} muffins this morning.", "muffins"),
    ("Our school library owns {a} novels.", "novels"),
    ("The parking garage has {a} cars inside.", "cars"),
    ("Grandma knitted {a} scarves.", "scarves"),
    ("A beekeeper counts {a} hives.", "hives"),
    ("The orchard produced {a} pears.", "pears"),
]
MOVES = {
    "+": ["Afterwards another {b} were added.", "By noon {b} extra turned up."],
    "-": ["Later, {b} were taken away.", "Sadly {b} got damaged and thrown out."],
    "*": ["Then the total became {b} times larger."],
}
ENDS = ["What is the final count of {noun}?", "So how many {noun} remain in total?"]


def arithmetic_items(rng: random.Random, count: int) -> list[dict[str, Any]]:
    out = []
    for _ in range(count):
        opening, noun = rng.choice(STORIES)
        value = rng.randint(2, rng.choice([20, 100, 1000, 5000]))
        text = [opening.format(a=value)]
        for _ in range(rng.randint(1, 3)):
            op = rng.choice(["+", "-", "*"] if value < 2000 else ["+", "-"])
            if op == "-" and value < 2:
                op = "+"
            b = {"+": rng.randint(1, 400), "-": rng.randint(1, max(1, value - 1)), "*": rng.randint(2, 3)}[op]
            value = {"+": value + b, "-": value - b, "*": value * b}[op]
            text.append(rng.choice(MOVES[op]).format(b=b))
        text.append(rng.choice(ENDS).format(noun=noun))
        if rng.random() < 0.3:  # a one-liner now and then
            a, b = rng.randint(10, 999), rng.randint(10, 999)
            text, value = [f"Add {a} and {b}, what do you get?"], a + b
        # the answer is the last number the reply writes (after the reasoning, which serving splits off)
        out.append({"prompt": " ".join(text), "answer": str(value), "answer_regex": r"(-?\d+)\D*$"})
    return out


GREETINGS = ["Good day to you!", "Howdy!", "Morning :)", "Heya", "Greetings, assistant.", "Nice to meet you.",
             "What's up?", "Hiya, you there?", "Evening!", "Salutations!"]  # fmt: skip
GREETING_OK = (
    r"(?i)\b(hello|hi|hey|welcome|help|nice|glad|good|great|fine|well|assist|pleasure|evening|morning)\b"
)
ONE_LINERS = [
    ("Which city is the capital of Japan?", r"(?i)tokyo"),
    ("Name the capital city of Italy.", r"(?i)rome"),
    ("Capital of Egypt - do you know it?", r"(?i)cairo"),
    ("Norway's capital is which city?", r"(?i)oslo"),
    ("Fresh snow has what colour?", r"(?i)white"),
    ("Tell me the colour of grass.", r"(?i)green"),
    ("A spider has how many legs?", r"(?i)\b(8|eight)\b"),
    ("Give me the opposite of the word fast.", r"(?i)slow"),
    ("Quick one: 6 + 7?", r"\b13\b"),
    ("What do you get if you add 20 to 22?", r"\b42\b"),
]


def chat_items(rng: random.Random, count: int) -> list[dict[str, Any]]:
    """Greetings and one-liners; `accept_regex` must match the reply (content after the reasoning)."""
    out = []
    for i in range(count):
        if i % 2 == 0:
            prompt, accept = rng.choice(GREETINGS), GREETING_OK
        else:
            prompt, accept = rng.choice(ONE_LINERS)
        out.append({"prompt": prompt, "answer": "", "accept_regex": accept})
    return out


HUES = {"red": (200, 20, 40), "blue": (20, 70, 200), "green": (40, 150, 50), "yellow": (240, 200, 0)}
PAPERS = [(255, 255, 255), (250, 245, 235), (200, 210, 220), (40, 40, 40), (235, 235, 250)]


def _picture(rng: random.Random) -> tuple[bytes, list[dict[str, Any]]]:
    width, height = rng.randint(40, 500), rng.randint(40, 500)
    image = Image.new("RGB", (width, height), rng.choice(PAPERS))
    draw = ImageDraw.Draw(image)
    shapes: list[dict[str, Any]] = []
    cells = [(0, 0), (1, 1)] if rng.random() < 0.5 else [(1, 0), (0, 1)]
    for k in range(rng.choice([1, 1, 2])):
        size = max(12, int(min(width, height) * rng.uniform(0.25, 0.45)))
        if k == 0 and rng.random() < 0.4:
            x0, y0 = (width - size) // 2, (height - size) // 2
            cells = []
        elif cells:
            cx, cy = cells[k]  # two shapes in opposite quarters: they never touch
            x0 = rng.randint(cx * width // 2, max(cx * width // 2, (cx + 1) * width // 2 - size))
            y0 = rng.randint(cy * height // 2, max(cy * height // 2, (cy + 1) * height // 2 - size))
        else:
            break
        kind, hue = rng.choice(["circle", "square", "triangle"]), rng.choice(sorted(HUES))
        box = (x0, y0, x0 + size, y0 + size)
        if kind == "circle":
            draw.ellipse(box, fill=HUES[hue])
        elif kind == "square":
            draw.rectangle(box, fill=HUES[hue])
        else:
            draw.polygon(
                [(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=HUES[hue]
            )
        shapes.append({"kind": kind, "hue": hue, "box": list(box)})
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue(), shapes


def image_items(rng: random.Random, count: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    while len(out) < count:
        png, shapes = _picture(rng)
        if len({s["kind"] for s in shapes}) < len(shapes):
            continue  # two of one kind: "the circle" would not say which
        target = rng.choice(shapes)
        if rng.random() < 0.6 or len({s["hue"] for s in shapes}) < len(shapes):
            ask = rng.choice(["Name the colour of the {k} in this image.", "The {k} here - which colour is it?",
                              "Tell me what colour the {k} has."]).format(k=target["kind"])  # fmt: skip
            answer, regex = target["hue"], r"(?i)\b(red|blue|green|yellow)\b"
        else:
            ask = rng.choice(["Is the {h} thing a circle, a square or a triangle?",
                              "Which kind of shape is drawn in {h}?"]).format(h=target["hue"])  # fmt: skip
            answer, regex = target["kind"], r"(?i)\b(circle|square|triangle)\b"
        image = {"type": "image", "data": base64.b64encode(png).decode()}
        out.append({
            "prompt": ask, "answer": answer, "answer_regex": regex, "shapes": shapes,
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": ask}]}],
        })  # fmt: skip
    return out


def write_sets(out: Path, family: str, items: int, seed: int = 26) -> list[Path]:
    """The held-out task files for `family` (images for kimi only) in `out`; their paths."""
    out.mkdir(parents=True, exist_ok=True)
    makers = {"heldout-tools": tool_items, "heldout-arithmetic": arithmetic_items, "heldout-chat": chat_items}
    if family == "kimi":
        makers["heldout-images"] = image_items
    paths = []
    for name, make in makers.items():
        rows = make(random.Random(f"{seed}-{name}"), items)
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths
