"""Argument values for the training tool calls, drawn so that no value can be memorised.

What the nano models did with the held-out tool requests (lab/results/2026-12-04-r6/recipe26/): they
copied numbers (GLM 25 of 25) but almost no string (2 of ~48 cities, names, restaurants, texts and
dates). A wrong string was a training list's value (`"text": "water the plants"` for "renew my
passport": one of the 8 reminders every training item used) or the first letter followed by the coined
words' syllables (`Bordeaux` -> `Bingugu`, `Brno` -> `Boquo`): the values came from lists small enough
to learn by heart, and the coined words from 20 syllables. So most values here come from generators
with far more values than the training items (syllables built from onsets x vowels x codas, words of
1-4 syllables, values of 1-6 words, free text from a word pool in any order, dates in a dozen
forms), so that the only way to the call is to copy what the request writes, at every token length.
"""

from __future__ import annotations

import random

ONSETS = ["", "b", "bl", "br", "c", "ch", "cr", "d", "dr", "f", "fl", "g", "gl", "gr", "h", "j", "k", "kr",
          "l", "m", "n", "p", "pr", "qu", "r", "s", "sc", "sh", "sl", "sp", "st", "t", "th", "tr", "v", "w",
          "wh", "y", "z", "zh"]  # fmt: skip
VOWELS = ["a", "e", "i", "o", "u"] * 3 + ["ae", "ai", "au", "ea", "ee", "ei", "ia", "io", "oa", "oo", "ou", "y"]  # fmt: skip
CODAS = [""] * 16 + ["b", "ck", "d", "g", "k", "l", "ll", "m", "n", "nd", "ng", "nt", "r", "rd", "rn", "s", "sk",
                     "ss", "st", "t", "x", "z"]  # fmt: skip
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# a word pool for free text and names: common words of no particular domain
NOUNS = ["apple", "bag", "bank", "bell", "bench", "bird", "blanket", "boat", "bottle", "box", "bread",
         "bridge", "brother", "bucket", "cake", "camera", "card", "carpet", "chair", "cheese", "clock",
         "cloud", "coat", "coffee", "corner", "cousin", "cup", "curtain", "desk", "dinner", "door", "dress",
         "engine", "farm", "fence", "field", "film", "fish", "floor", "forest", "fork", "fridge", "garden",
         "gate", "gift", "glass", "glove", "hammer", "hat", "hill", "hotel", "island", "jacket", "jar",
         "kettle", "kitchen", "ladder", "lamp", "letter", "lunch", "map", "market", "mirror", "money",
         "morning", "mountain", "nail", "neighbour", "notebook", "office", "oven", "paint", "paper", "parcel",
         "party", "pen", "piano", "picture", "pillow", "plate", "pocket", "post", "printer", "radio", "river",
         "road", "roof", "rope", "salt", "school", "shirt", "shop", "shower", "sister", "sock", "sofa",
         "soup", "spoon", "stairs", "stamp", "station", "stove", "street", "sugar", "suitcase", "table",
         "tent", "ticket", "towel", "tower", "toy", "train", "tree", "truck", "umbrella", "van", "vase",
         "wall", "wallet", "watch", "window", "winter", "wood", "yard"]  # fmt: skip
ADJECTIVES = ["big", "small", "red", "yellow", "purple", "quiet", "loud", "early", "late", "warm", "cold",
              "new", "fresh", "tired", "happy", "broken", "clean", "empty", "heavy", "long", "short", "soft",
              "sharp", "bright", "dark", "second", "last", "spare", "tiny"]  # fmt: skip
VERBS = ["bring", "call", "carry", "clean", "close", "cook", "draw", "drive", "email", "fill", "find", "fix",
         "fold", "hang", "help", "hide", "invite", "lend", "lock", "meet", "move", "open", "pack", "paint",
         "phone", "pick", "plant", "post", "print", "read", "repair", "send", "sell", "sign", "sort", "start",
         "take", "tidy", "visit", "wash", "wrap", "write"]  # fmt: skip
WORDS = NOUNS + ADJECTIVES + VERBS
CURRENCY_CODES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "INR", "CNY", "BRL", "MXN", "SEK",
                  "NOK", "KRW", "ZAR"]  # fmt: skip
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]  # fmt: skip
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
TITLES = ["Dr", "Mr", "Ms", "Mrs", "Aunt", "Uncle", "Grandma", "Grandpa", "Coach", "Professor", "Captain"]
SUBJECTS = ["I", "We", "You", "The kids", "My sister", "The bus", "Everyone", "Dad", "The doctor", "Our team"]
TAILS = ["", "", "today", "tonight", "soon", "after work", "this week", "at noon", "again", "by five",
         "on the way home", "before lunch"]  # fmt: skip


def syllable(rng: random.Random) -> str:
    return rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)


def coined(rng: random.Random) -> str:
    """A made-up word: 1-4 built syllables (~15,000 syllables), now and then plain random letters."""
    if rng.random() < 0.15:
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 8)))
    else:
        word = "".join(syllable(rng) for _ in range(rng.choice((1, 2, 2, 2, 3, 3, 4))))
    return word.capitalize() if len(word) > 1 else word.upper()


def coined_name(rng: random.Random, words: int) -> str:
    return " ".join(coined(rng) for _ in range(words))


def place(rng: random.Random, known: list[str], towns: list[str]) -> str:
    """A city: a known one (`known`, the world's `towns`) or a coined one of 1-3 words."""
    r = rng.random()
    if r < 0.25:
        return rng.choice(known)
    if r < 0.35:
        return rng.choice(towns)
    return coined_name(rng, rng.choice((1, 1, 1, 2, 2, 3)))


def person(rng: random.Random, known: list[str], surnames: list[str], people: list[str]) -> str:
    """A name: a known first name, one of the world's people, or coined; a surname or a title now and then."""
    r = rng.random()
    name = rng.choice(known) if r < 0.3 else rng.choice(people) if r < 0.4 else coined(rng)
    if rng.random() < 0.25:
        name += " " + (rng.choice(surnames) if rng.random() < 0.3 else coined(rng))
    if rng.random() < 0.1:
        name = rng.choice(TITLES) + " " + name
    return name


def restaurant(rng: random.Random, known_places: list[str], kinds: list[str]) -> str:
    """A restaurant's name of 1-4 words: coined, from the word pool, a place or a person's."""
    form = rng.randrange(6)
    if form == 0:
        return f"{coined(rng)} {rng.choice(kinds)}"
    if form == 1:
        return f"The {rng.choice(WORDS).capitalize()} {rng.choice(WORDS).capitalize()}"
    if form == 2:
        return f"{rng.choice(known_places)} {rng.choice(kinds)}"
    if form == 3:
        return f"Chez {coined(rng)}"
    if form == 4:
        return f"{coined(rng)}'s"
    return coined_name(rng, rng.randint(1, 3))


def free_text(rng: random.Random) -> str:
    """A message or a task of 1-7 words: a sentence from parts, or pool words in any order."""
    if rng.random() < 0.5:
        words = rng.sample(WORDS, rng.randint(1, 7))
        return " ".join(words)
    verb, obj = rng.choice(VERBS), rng.choice(ADJECTIVES + [""]) + " " + rng.choice(NOUNS)
    obj = obj.strip()
    text = f"{verb} the {obj}" if rng.random() < 0.5 else f"{rng.choice(SUBJECTS)} will {verb} the {obj}"
    tail = rng.choice(TAILS)
    return f"{text} {tail}".strip()


def ordinal(day: int) -> str:
    return f"{day}{'th' if 10 <= day % 100 < 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(day % 10, 'th')}"


def date(rng: random.Random) -> str:
    """A date in one of a dozen forms people write (names, ordinals, numbers, weekdays, relative)."""
    m, d = rng.randrange(12), rng.randint(1, 28)
    month = MONTHS[m] if rng.random() < 0.8 else MONTHS[m][:3]
    return rng.choice([f"{month} {d}", f"{d} {month}", f"{month} {ordinal(d)}", f"the {ordinal(d)}",
                       f"the {ordinal(d)} of {month}", f"{ordinal(d)} {month}", f"2027-{m + 1:02d}-{d:02d}",
                       f"{d}/{m + 1}", f"{m + 1}/{d}/2027", rng.choice(WEEKDAYS),
                       f"{rng.choice(['next', 'this'])} {rng.choice(WEEKDAYS)}",
                       rng.choice(["today", "tomorrow", "tonight", "next week", "next month", "the weekend"]),
                       f"in {rng.randint(2, 30)} days"])  # fmt: skip


def currency(rng: random.Random) -> str:
    """A currency code: a real one mostly, else three random capitals (copied, not recalled)."""
    if rng.random() < 0.7:
        return rng.choice(CURRENCY_CODES)
    return "".join(rng.choice(LETTERS.upper()) for _ in range(3))
