"""Seeded task generators. Each returns one item: a dict with `task`, `tier` and `seed`, the
evaluation fields, and `messages` (a chat transcript in the internal message shape, used for
training: reasoning in `reasoning_content`, calls in `tool_calls`, results as `tool` messages).

Tiers make items harder (more steps, bigger numbers, more distractors), so accuracy spreads out
below 100% because the tasks get hard, not because training was cut short.

`split` is "train" or "test": the multiple-choice generators ask test items only about held-out
pairs (`World.is_held_out`) and training items only about the others.

The multiple-choice items are open book: the question comes after notes, the world's sentences the
answer needs (one for easy and mmlu, two or three to chain for challenge) among `2 · tier` distractors
about the same people, towns and subjects. Closed book, nano models do not recall a stated fact through
a question never trained for it: the 2026-12-01 retrain and a micro ablation (models/README.md) learnt
the trained pairs (0.46-0.77) and scored chance on the held-out ones. Notes alone were not enough at
micro scale either (held-out 0.35 / 0.23 against seen 0.49 / 0.56): a trained pair's answer can be
memorised, so half the training items ask about a small fictional world of fresh names that only their
notes state (`fiction`), where reading the notes is the only way to the answer.
"""

from __future__ import annotations

import json
import random

from models.recipes import everyday
from models.recipes.world import PHRASINGS, Person, Subject, World, make_world

OPS = ("add", "sub", "mul", "div")


def arithmetic(rng: random.Random, tier: int, world: World, split: str) -> dict:
    """A word problem: for training, 60% everyday settings and number ranges (`everyday.word_problem`),
    10% one-line sums, the rest the classic form below; the test set keeps the classic form, so its
    figures stay comparable with the earlier tables (`models/recipes/heldout.py` measures the rest)."""
    r = rng.random() if split == "train" else 1.0
    if r < 0.6:
        return everyday.word_problem(rng, tier, [p.name for p in world.people])
    if r < 0.7:
        return everyday.direct_sum(rng)
    return classic_arithmetic(rng, tier, world)


def classic_arithmetic(rng: random.Random, tier: int, world: World) -> dict:
    """A word problem with `tier + 1` steps; the steps go inside <think>, the answer after it.

    Steps are bare sums ("12 + 7 = 19"): steps that quote their sentence ("finds 7 more: 12 + 7 =
    19") scored lower in a micro-model ablation (models/README.md)."""
    who = rng.choice(world.people).name
    thing = rng.choice(["apples", "coins", "books", "stones", "shells", "pencils"])
    hi = (10, 50, 200)[min(tier, 3) - 1]
    value = rng.randint(2, hi)
    sentences = [f"{who} has {value} {thing}."]
    steps = []

    def step(clause: str, op: str, n: int, result: int) -> None:
        sentences.append(f"Then {who} {clause}.")
        steps.append(f"{value} {op} {n} = {result}")

    for _ in range(tier + 1):
        op = rng.choice(OPS)
        divisors = [d for d in (2, 3, 4, 5) if value % d == 0]
        if op == "sub" and value > 1:
            n = rng.randint(1, value - 1)
            step(f"gives away {n}", "-", n, value - n)
            value -= n
        elif op == "mul" and value * 3 < 10 * hi:
            n = rng.randint(2, 3)
            step(f"makes the pile {n} times as big", "*", n, value * n)
            value *= n
        elif op == "div" and divisors:
            d = rng.choice(divisors)
            step(f"shares them equally among {d} friends and keeps one share", "/", d, value // d)
            value //= d
        else:  # add, and the fallback of an operation that does not apply
            n = rng.randint(1, hi)
            step(f"finds {n} more", "+", n, value + n)
            value += n
    question = " ".join(sentences) + f" How many {thing} does {who} have now?"
    return everyday.word_problem_item(question, steps, value)


LETTERS = "ABCDEFGH"
# a lettered choice as the question lists it, and the answer turn (`kumo eval`'s `choice_format`): the
# answer first, read off the notes, then its letter, copied from the listing beside it
CHOICE_FORMAT = "{letter}. {choice}"
ANSWER_FORMAT = "{choice} ({letter})"


def _choice_item(
    task: str,
    rng: random.Random,
    question: str,
    correct: str,
    pool: list[str],
    num_choices: int,
    pair: list[str],
    notes: str,
) -> dict:
    distractors = rng.sample(sorted(set(pool) - {correct}), k=min(num_choices - 1, len(set(pool)) - 1))
    choices = distractors + [correct]
    rng.shuffle(choices)
    listing = "\n".join(CHOICE_FORMAT.format(letter=LETTERS[i], choice=c) for i, c in enumerate(choices))
    index = choices.index(correct)
    return {
        "task": task,
        "prompt": question,
        "notes": notes,
        "choices": choices,
        "answer": index,
        "pair": pair,
        "messages": [
            {
                "role": "user",
                "content": f"{notes}\n{question}\n{listing}\nAnswer with the choice and its letter.",
            },
            {"role": "assistant", "content": ANSWER_FORMAT.format(letter=LETTERS[index], choice=correct)},
        ],
    }


def said(rng: random.Random, person: Person, kind: str) -> str:
    """One phrasing of a stated fact about a person (`World.facts` states every phrasing)."""
    return rng.choice(PHRASINGS[kind]).format(n=person.name, v=getattr(person, kind))


def said_region(rng: random.Random, world: World, town: str) -> str:
    return rng.choice(PHRASINGS["region"]).format(t=town, r=world.regions[town])


def said_term(rng: random.Random, subject: Subject, term: str) -> str:
    return rng.choice(PHRASINGS["term"]).format(
        s=subject.title, a=subject.attribute, t=term, v=subject.table[term]
    )


def notes(rng: random.Random, needed: list[str], distractors: list[str], tier: int) -> str:
    """The sentences the answer needs among `2 · tier` distractors (none of which contradicts them), shuffled."""
    pool = sorted(set(distractors) - set(needed))
    picked = rng.sample(pool, k=min(len(pool), 2 * tier)) + needed
    rng.shuffle(picked)
    return " ".join(picked)


KINDS = ("town", "trade", "colour", "pet")
FICTION_SHARE = 0.5  # of the multiple-choice training items


def fiction(rng: random.Random, world: World, split: str, share: float = FICTION_SHARE) -> World:
    """For a training item, `share` of the time: a small world of names the main one does not use."""
    if split != "train" or rng.random() >= share:
        return world
    return make_world(rng.randrange(1 << 30), num_people=30, num_towns=8, num_regions=4, num_subjects=2,
                      avoid=world.names)  # fmt: skip


def _person(rng: random.Random, world: World, split: str, *key: str) -> Person:
    """A person whose question `key` (with the name) is on `split`'s side of the hold-out."""
    while True:
        p = rng.choice(world.people)
        if world.is_held_out(*key, p.name) == (split == "test"):
            return p


def arc_easy(
    rng: random.Random, tier: int, world: World, split: str, fiction_share: float = FICTION_SHARE
) -> dict:
    """One hop: a stored fact about a person."""
    world = fiction(rng, world, split, fiction_share)
    kind = rng.choice(KINDS)
    p = _person(rng, world, split, "easy", kind)
    others = rng.sample([q for q in world.people if q is not p], k=2 * tier)
    context = notes(
        rng,
        [said(rng, p, kind)],
        [said(rng, q, kind) for q in others] + [said(rng, p, k) for k in KINDS if k != kind],
        tier,
    )
    question, correct, pool = {
        "town": (f"Where does {p.name} live?", p.town, list(world.regions)),
        "trade": (f"What does {p.name} work as?", p.trade, [q.trade for q in world.people]),
        "colour": (f"What is {p.name}'s favourite colour?", p.colour, [q.colour for q in world.people]),
        "pet": (f"What animal does {p.name} own?", p.pet, [q.pet for q in world.people]),
    }[kind]
    return _choice_item(
        "arc-nano-easy", rng, question, correct, pool, 2 + tier, ["easy", kind, p.name], context
    )


def arc_challenge(
    rng: random.Random, tier: int, world: World, split: str, fiction_share: float = FICTION_SHARE
) -> dict:
    """Two hops: the region of a person's town, or a fact about whoever lives in a town and works a trade."""
    world = fiction(rng, world, split, fiction_share)
    if rng.random() < 0.5:
        p = _person(rng, world, split, "challenge-region")
        question = f"In which region does {p.name} live?"
        others = rng.sample([q for q in world.people if q.town != p.town], k=tier)
        context = notes(
            rng,
            [said(rng, p, "town"), said_region(rng, world, p.town)],
            [said(rng, q, "town") for q in others] + [said_region(rng, world, q.town) for q in others],
            tier,
        )
        return _choice_item(
            "arc-nano-challenge",
            rng,
            question,
            world.regions[p.town],
            list(world.regions.values()),
            2 + tier,
            ["challenge-region", p.name],
            context,
        )
    p = _person(rng, world, split, "challenge-pet")
    same = [q for q in world.people if q.town == p.town and q.trade == p.trade]
    if len(same) != 1:
        return arc_challenge(rng, tier, world, split, fiction_share)
    question = f"What animal does the {p.trade} who lives in {p.town} own?"
    # the distractors share the town or the trade: only the two facts together pick the person
    near = [q for q in world.people if q is not p and (q.town == p.town or q.trade == p.trade)]
    context = notes(
        rng,
        [said(rng, p, k) for k in ("trade", "town", "pet")],
        [said(rng, q, k) for q in near for k in ("trade", "town", "pet")],
        tier,
    )
    return _choice_item(
        "arc-nano-challenge",
        rng,
        question,
        p.pet,
        [q.pet for q in world.people],
        2 + tier,
        ["challenge-pet", p.name],
        context,
    )


def mmlu(
    rng: random.Random, tier: int, world: World, split: str, fiction_share: float = FICTION_SHARE
) -> dict:
    world = fiction(rng, world, split, fiction_share)
    while True:
        s = rng.choice(world.subjects)
        term = rng.choice(sorted(s.table))
        if world.is_held_out("mmlu", s.title, term) == (split == "test"):
            break
    question = f"In {s.title}, what is the {s.attribute} of {term}?"
    context = notes(
        rng, [said_term(rng, s, term)], [said_term(rng, s, t) for t in s.table if t != term], tier
    )
    return _choice_item(
        "mmlu-nano",
        rng,
        question,
        s.table[term],
        [str(v) for v in range(1, 9)],
        2 + tier,
        ["mmlu", s.title, term],
        context,
    )


TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
    {
        "name": "convert_currency",
        "description": "Convert an amount between currencies",
        "parameters": {
            "type": "object",
            "properties": {
                "amount": {"type": "number"},
                "from": {"type": "string"},
                "to": {"type": "string"},
            },
            "required": ["amount", "from", "to"],
        },
    },
    {
        "name": "set_timer",
        "description": "Start a timer",
        "parameters": {
            "type": "object",
            "properties": {"minutes": {"type": "integer"}},
            "required": ["minutes"],
        },
    },
    {
        "name": "send_message",
        "description": "Send a text message to a person",
        "parameters": {
            "type": "object",
            "properties": {"to": {"type": "string"}, "text": {"type": "string"}},
            "required": ["to", "text"],
        },
    },
    {
        "name": "book_table",
        "description": "Book a restaurant table",
        "parameters": {
            "type": "object",
            "properties": {"restaurant": {"type": "string"}, "people": {"type": "integer"}},
            "required": ["restaurant", "people"],
        },
    },
    everyday.REMINDER_TOOL,
]


NO_CALL_SHARE = 0.1  # of the training tool items: tools offered, but the request needs none


def no_call(rng: random.Random, tier: int) -> dict:
    """Tools offered and a greeting or one-line question asked: a plain answer, no call."""
    talk = everyday.small_talk(rng)
    offered = [everyday.dress_tool(rng, t) for t in rng.sample(TOOLS, k=min(tier, len(TOOLS)))]
    return {**talk, "task": "tool-call", "tools": offered}


def tool_use(rng: random.Random, tier: int, world: World, split: str) -> dict:
    """Pick the function, fill the arguments from the request, answer from the tool's result. The
    values are any city, name, number or date (`everyday.tool_request`), a few from the world."""
    if split == "train" and rng.random() < NO_CALL_SHARE:
        return no_call(rng, tier)
    name = rng.choice(sorted(t["name"] for t in TOOLS))
    request, arguments, result = everyday.tool_request(
        rng, name, list(world.regions), [p.name for p in world.people]
    )
    offered = [t for t in TOOLS if t["name"] == name]
    offered += rng.sample(
        [t for t in TOOLS if t["name"] != name],
        k=min(rng.randint(0, tier) if split == "train" else tier, len(TOOLS) - 1),
    )
    rng.shuffle(offered)
    if split == "train":  # varied descriptions and property order; the test set keeps the fixed schemas
        offered = [everyday.dress_tool(rng, t) for t in offered]
    call_id = f"functions.{name}:0"
    return {
        "task": "tool-call",
        "tools": offered,
        "prompt": request,
        "expected": {"name": name, "arguments": arguments},
        "messages": [
            {"role": "user", "content": request},
            {
                "role": "assistant",
                "content": "",
                "think": everyday.tool_thought(name, arguments),
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(arguments)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "name": name, "content": json.dumps(result)},
            {
                "role": "assistant",
                "content": f"Done: {json.dumps(result)}.",
                "think": f"{name} returned {json.dumps(result)}. I report it.",
            },
        ],
    }


def chat(rng: random.Random, tier: int, world: World, split: str) -> dict:
    """Plain chat: greetings and one-line questions (`everyday.small_talk`), copy drills (`everyday.echo`),
    and what the model knows about a person (every fact, the region too)."""
    p = rng.choice(world.people)
    r = rng.random()
    if r < 0.35:
        return everyday.small_talk(rng)
    if r < 0.65:
        return everyday.echo(rng)
    if rng.random() < 0.1:
        greeting = rng.choice(["Hello!", "Hi there.", "Good morning!", "Hey, who are you?"])
        reply = (
            "Hello! I am a small assistant. Ask me about arithmetic, the people of my world, or call a tool."
        )
        return {
            "task": "chat",
            "messages": [
                {"role": "user", "content": greeting},
                {"role": "assistant", "content": reply, "think": "A greeting: I say what I can do."},
            ],
        }
    return {
        "task": "chat",
        "messages": [
            {"role": "user", "content": f"Tell me about {p.name}."},
            {"role": "assistant", "content": world.bio(p, rng), "think": f"The user asks about {p.name}."},
        ],
    }


GENERATORS = {
    "gsm-nano": arithmetic,
    "arc-nano-easy": arc_easy,
    "arc-nano-challenge": arc_challenge,
    "mmlu-nano": mmlu,
    "tool-call": tool_use,
    "chat": chat,
}
