"""A generated world of facts, fixed by one seed, that the small models learn and are tested on.

People live in towns, work in trades, like colours and own pets; towns lie in regions. One-hop
questions ask a stored fact ("Where does Bami live?"); two-hop questions chain two facts ("In which
region does Bami live?" needs town → region). "Subjects" are MMLU-like fields, each a table of
made-up terms and their properties ("In zorbic chemistry, which element has valence 3?").
"""

from __future__ import annotations

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

    def facts(self) -> list[str]:
        """Every fact as one sentence: the training corpus states each of them."""
        out = [f"{t} lies in the region of {r}." for t, r in self.regions.items()]
        for p in self.people:
            out += [
                f"{p.name} lives in {p.town}.",
                f"{p.name} works as a {p.trade}.",
                f"{p.name}'s favourite colour is {p.colour}.",
                f"{p.name} owns a {p.pet}.",
            ]
        for s in self.subjects:
            out += [
                f"In {s.title}, the {s.attribute} of {term} is {value}." for term, value in s.table.items()
            ]
        return out


def make_world(
    seed: int = 0,
    num_people: int = 120,
    num_towns: int = 24,
    num_regions: int = 6,
    num_subjects: int = 12,
    terms_per_subject: int = 12,
) -> World:
    rng = random.Random(seed)
    used: set[str] = set()

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
    return World(people=people, regions=regions, subjects=subjects)
