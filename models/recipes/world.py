"""A generated world of facts, fixed by one seed, that the small models learn and are tested on.

People live in towns, work in trades, like colours and own pets; towns lie in regions. One-hop
questions ask a stored fact ("Where does Bami live?"); two-hop questions chain two facts ("In which
region does Bami live?" needs town → region). "Subjects" are MMLU-like fields, each a table of
made-up terms and their properties ("In zorbic chemistry, which element has valence 3?").

Held-out questions: a fixed quarter of the (person, attribute), (person, two-hop question) and
(subject, term) pairs is never asked in training (`World.is_held_out`); the test sets ask only those.
Their facts are still stated in the corpus, in several phrasings (`PHRASINGS`), so a test question
measures recalling a stated fact through a question never trained for it, not a memorised answer.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

SYLLABLES = [
    "ba",
    "be",
    "bi",
    "bo",
    "bu",
    "da",
    "de",
    "di",
    "do",
    "du",
    "ka",
    "ke",
    "ki",
    "ko",
    "ku",
    "la",
    "le",
    "li",
    "lo",
    "lu",
    "ma",
    "me",
    "mi",
    "mo",
    "mu",
    "na",
    "ne",
    "ni",
    "no",
    "nu",
    "pa",
    "pe",
    "pi",
    "po",
    "pu",
    "ra",
    "re",
    "ri",
    "ro",
    "ru",
    "sa",
    "se",
    "si",
    "so",
    "su",
    "ta",
    "te",
    "ti",
    "to",
    "tu",
    "va",
    "ve",
    "vi",
    "vo",
    "vu",
    "za",
    "ze",
    "zi",
    "zo",
    "zu",
]
COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
TRADES = ["baker", "smith", "weaver", "potter", "miner", "fisher", "tailor", "mason", "farmer", "scribe"]
PETS = ["cat", "dog", "goat", "owl", "horse", "rabbit", "parrot", "turtle"]
SUBJECT_STEMS = [
    "chemistry",
    "history",
    "botany",
    "law",
    "astronomy",
    "music",
    "geology",
    "medicine",
    "economics",
    "linguistics",
    "zoology",
    "architecture",
]


def name(rng: random.Random, parts: int = 2) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


@dataclass(frozen=True, slots=True)
class Person:
    name: str
    town: str
    trade: str
    colour: str
    pet: str


@dataclass(frozen=True, slots=True)
class Subject:
    title: str  # e.g. "zorbic chemistry"
    attribute: str  # e.g. "valence"
    table: dict[str, str]  # term -> value


@dataclass(slots=True)
class World:
    people: list[Person]
    regions: dict[str, str]  # town -> region
    subjects: list[Subject] = field(default_factory=list)
    names: frozenset[str] = (
        frozenset()
    )  # every name generated or avoided (before suffixes): `make_world(avoid=…)`

    def facts(self) -> list[str]:
        """Every fact in every phrasing, one sentence each: the training corpus states all of them."""
        out = [p.format(t=t, r=r) for t, r in self.regions.items() for p in PHRASINGS["region"]]
        for person in self.people:
            for kind in ("town", "trade", "colour", "pet"):
                value = getattr(person, kind)
                out += [p.format(n=person.name, v=value) for p in PHRASINGS[kind]]
        for s in self.subjects:
            out += [
                p.format(s=s.title, a=s.attribute, t=term, v=value)
                for term, value in s.table.items()
                for p in PHRASINGS["term"]
            ]
        return out

    def bio(self, person: Person, rng: random.Random) -> str:
        """What the chat task answers to "Tell me about <name>": the person's facts in a random order,
        the region of their town among them (so it is stated per person too, in one place)."""
        clauses = [
            f"lives in {person.town}, in the region of {self.regions[person.town]}",
            f"works as a {person.trade}",
            f"likes {person.colour} best",
            f"owns a {person.pet}",
        ]
        rng.shuffle(clauses)
        return f"{person.name} {', '.join(clauses[:-1])} and {clauses[-1]}."

    @staticmethod
    def is_held_out(*key: str) -> bool:
        """Whether the question pair `key` is kept out of training (a fixed quarter of all pairs,
        the same for every seed: a hash, not a draw)."""
        digest = hashlib.sha256("/".join(key).encode()).digest()
        return digest[0] < 256 * HELD_OUT_FRACTION


# each fact stated several ways; a question then matches none of them word for word
PHRASINGS = {
    "region": ["{t} lies in the region of {r}.", "The town of {t} is in {r}.", "{r} is the region {t} belongs to."],
    "town": ["{n} lives in {v}.", "{n}'s home is in {v}.", "The town where {n} lives is {v}."],
    "trade": ["{n} works as a {v}.", "{n} is a {v} by trade.", "By trade, {n} is a {v}."],
    "colour": ["{n}'s favourite colour is {v}.", "{n} likes {v} best.", "The colour {n} likes best is {v}."],
    "pet": ["{n} owns a {v}.", "{n} has a pet {v}.", "The pet {n} keeps is a {v}."],
    "term": ["In {s}, the {a} of {t} is {v}.", "The {a} of {t} in {s} is {v}.", "{t} has {a} {v} in {s}."],
}  # fmt: skip
HELD_OUT_FRACTION = 0.25


def make_world(
    seed: int = 0,
    num_people: int = 120,
    num_towns: int = 24,
    num_regions: int = 6,
    num_subjects: int = 12,
    terms_per_subject: int = 12,
    avoid: frozenset[str] = frozenset(),
) -> World:
    """The world of `seed`; `avoid`: names it must not reuse (a small fictional world beside the main one
    must not state other facts about the main world's people, towns or terms)."""
    rng = random.Random(seed)
    used: set[str] = set(avoid)

    def fresh(parts: int) -> str:
        while (n := name(rng, parts)) in used:
            pass
        used.add(n)
        return n

    regions_list = [fresh(3) for _ in range(num_regions)]
    regions = {fresh(2) + "ton": rng.choice(regions_list) for _ in range(num_towns)}
    towns = list(regions)
    people = [
        Person(fresh(2), rng.choice(towns), rng.choice(TRADES), rng.choice(COLOURS), rng.choice(PETS))
        for _ in range(num_people)
    ]
    subjects = []
    for i in range(num_subjects):
        title = f"{fresh(2).lower()}ic {SUBJECT_STEMS[i % len(SUBJECT_STEMS)]}"
        attribute = rng.choice(["rank", "grade", "class", "level"])
        values = [str(v) for v in range(1, 9)]
        subjects.append(
            Subject(
                title, attribute, {fresh(2).lower(): rng.choice(values) for _ in range(terms_per_subject)}
            )
        )
    return World(people=people, regions=regions, subjects=subjects, names=frozenset(used))
