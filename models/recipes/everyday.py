"""Everyday requests for the training mixture (issue 26): what a person trying the nano models types.

The first recipes drew every value from the training world (its towns and people, `EUR` to `USD`, one
phrasing per tool), so the models learnt those values, not copying: asked about Tokyo, GLM named a
town of its world. Here a tool call's arguments are whatever the request says (a real city, a name
from many languages, coined words and free text from generators too large to learn by heart, a number
of any size, a date in a dozen forms: `models/recipes/values.py`), under many phrasings, some built
from a frame and a verb phrase (`FRAMES`, `CORES`); word problems come in everyday settings and number ranges; chat covers greetings and
one-line questions with short answers. Each assistant turn carries a `think` draft: the family's
thinking trace (`build.for_family` makes it GLM's `reasoning_content` and drops it for Kimi).

The held-out evaluation (`backend/tools/eval_heldout.py`) is written separately, with its own phrasings and
values; nothing here is imported there.
"""

from __future__ import annotations

import json
import random

from models.recipes import values

CITIES = ["Tokyo", "Paris", "London", "Berlin", "Madrid", "Rome", "Lisbon", "Dublin", "Oslo", "Stockholm", "Helsinki", "Warsaw", "Prague", "Vienna", "Budapest", "Athens", "Istanbul", "Cairo", "Lagos", "Nairobi", "Accra", "Casablanca", "Johannesburg", "Dubai", "Riyadh", "Tehran", "Karachi", "Delhi", "Mumbai", "Chennai", "Dhaka", "Bangkok", "Hanoi", "Manila", "Jakarta", "Singapore", "Seoul", "Beijing", "Shanghai", "Osaka", "Sydney", "Melbourne", "Auckland", "Toronto", "Montreal", "Vancouver", "Chicago", "Boston", "Seattle", "Denver", "Houston", "Miami", "Atlanta", "Phoenix", "Mexico", "Lima", "Bogota", "Santiago", "Quito", "Caracas", "Havana", "Reykjavik", "Zurich", "Geneva", "Munich", "Hamburg", "Lyon", "Marseille", "Porto", "Seville", "Naples", "Milan", "Krakow", "Kyiv", "Minsk", "Riga", "Tallinn", "Vilnius", "Sofia", "Belgrade", "Zagreb", "Tunis", "Algiers", "Dakar", "Kampala", "Kigali", "Lusaka", "Harare", "Perth", "Brisbane", "Adelaide", "Wellington", "Honolulu", "Anchorage"] + ["New York", "Los Angeles", "San Francisco", "Buenos Aires", "Rio de Janeiro", "Sao Paulo",
             "Hong Kong", "Kuala Lumpur", "Cape Town", "Mexico City", "Tel Aviv", "Las Vegas"]  # fmt: skip
NAMES = [
    "Alice",
    "Bob",
    "Carol",
    "David",
    "Emma",
    "Frank",
    "Grace",
    "Henry",
    "Isla",
    "Jack",
    "Kate",
    "Liam",
    "Mia",
    "Noah",
    "Olivia",
    "Paul",
    "Quinn",
    "Rosa",
    "Sam",
    "Tara",
    "Umar",
    "Vera",
    "Will",
    "Xena",
    "Yusuf",
    "Zoe",
    "Aiko",
    "Hiro",
    "Yuki",
    "Chen",
    "Wei",
    "Mei",
    "Raj",
    "Priya",
    "Arjun",
    "Anika",
    "Omar",
    "Fatima",
    "Layla",
    "Ali",
    "Sofia",
    "Mateo",
    "Lucia",
    "Diego",
    "Carmen",
    "Pierre",
    "Amelie",
    "Hans",
    "Greta",
    "Lars",
    "Ingrid",
    "Sven",
    "Olga",
    "Ivan",
    "Dmitri",
    "Katya",
    "Kwame",
    "Amara",
    "Chidi",
    "Zanele",
    "Thabo",
    "Nia",
    "Kofi",
    "Ana",
    "Joao",
    "Marta",
    "Piotr",
    "Agnieszka",
    "Eszter",
    "Lukas",
    "Nora",
    "Erik",
    "Leila",
    "Tomas",
    "Elena",
    "Marco",
    "Giulia",
    "Sean",
    "Aoife",
    "Ravi",
    "Deepa",
    "Min",
    "Jisoo",
    "Tuan",
    "Linh",
    "Ayse",
    "Mehmet",
    "Noor",
    "Hana",
    "Ben",
    "Lily",
]
SURNAMES = [
    "Smith",
    "Garcia",
    "Tanaka",
    "Kim",
    "Novak",
    "Muller",
    "Rossi",
    "Silva",
    "Okafor",
    "Nguyen",
    "Haddad",
    "Larsen",
    "Kowalski",
    "Dubois",
]
RESTAURANT_KINDS = ["Grill", "Bistro", "Cafe", "Kitchen", "Diner", "House", "Garden", "Table", "Trattoria"]


def city(rng: random.Random, world_towns: list[str]) -> str:
    return values.place(rng, CITIES, world_towns)


def person(rng: random.Random, world_people: list[str]) -> str:
    return values.person(rng, NAMES, SURNAMES, world_people)


def number(rng: random.Random) -> int:
    """A positive integer over several magnitudes (1 to ~10^5), small ones most often."""
    return rng.randint(1, rng.choice((9, 30, 120, 1000, 10000, 99999)))


MESSAGES = ["I am late", "see you soon", "call me back", "dinner is at eight", "happy birthday",
            "the meeting moved", "I landed safely", "thanks for the help", "running ten minutes late"]  # fmt: skip
FIXED_TEXT_SHARE = 0.2  # the rest is free text (values.free_text): 8 fixed reminders were learnt by heart
REMINDERS = ["buy milk", "call the dentist", "water the plants", "pay the rent", "pick up the kids",
             "send the report", "book the flights", "walk the dog"]  # fmt: skip

# (tool, phrasings): each phrasing formats with the call's arguments; the call's arguments are exactly
# the values written in the request
PHRASINGS: dict[str, list[str]] = {
    "get_weather": [
        "What's the weather in {city}?",
        "What is the weather like in {city} today?",
        "How's the weather in {city}?",
        "Is it raining in {city}?",
        "weather {city}",
        "Can you check the weather for {city}?",
        "I'm flying to {city} tomorrow. What's the weather there?",
        "Tell me the current weather in {city}, please.",
        "Do I need an umbrella in {city}?",
        "How hot is it in {city} right now?",
    ],
    "get_weather+unit": [
        "What's the temperature in {city} in {unit}?",
        "Weather in {city}, in {unit} please.",
        "How warm is it in {city}? Give it in {unit}.",
    ],
    "convert_currency": [
        "How much is {amount} {from} in {to}?",
        "Convert {amount} {from} to {to}.",
        "What is {amount} {from} in {to}?",
        "I have {amount} {from}. How many {to} is that?",
        "convert {amount} {from} into {to}",
        "Please change {amount} {from} to {to}.",
    ],
    "set_timer": [
        "Set a timer for {minutes} minutes.",
        "Start a {minutes} minute timer.",
        "Timer for {minutes} minutes please.",
        "Can you set a timer for {minutes} minutes?",
        "Remind me in {minutes} minutes with a timer.",
        "{minutes} minute timer",
    ],
    "send_message": [
        "Tell {to} that {text}.",
        "Send a message to {to}: {text}.",
        "Text {to} saying {text}.",
        "Message {to}: {text}",
        "Can you let {to} know that {text}?",
        "Please send {to} a text that says {text}.",
    ],
    "book_table": [
        "Book a table for {people} at {restaurant}.",
        "Reserve a table at {restaurant} for {people} people.",
        "Can you book {restaurant} for {people}?",
        "I need a table for {people} at {restaurant}.",
        "Get us a table at {restaurant}, {people} people.",
    ],
    "add_reminder": [
        "Remind me to {text} on {date}.",
        "Add a reminder for {date}: {text}.",
        "Set a reminder to {text} on {date}.",
        "On {date}, remind me to {text}.",
        "Don't let me forget to {text} on {date}.",
    ],
}
# more phrasings in other registers (questions, requests, fragments, chatty ones); added 2026-12-04 for
# the second everyday retrain: the first one's 3-10 phrasings per tool did not carry to other wordings
PHRASINGS["get_weather"] += [
    "Will it be sunny in {city}?",
    "What's it like outside in {city}?",
    "Is it cold in {city} today?",
    "forecast for {city}",
    "Should I take a jacket in {city}?",
    "Check {city} weather.",
    "I'm heading to {city}. Is the weather nice?",
    "What temperature is it in {city}?",
    "Look up the weather in {city} for me.",
    "Weather report for {city}, please.",
    "My mum lives in {city}. How's the weather over there?",
    "Is it windy in {city}?",
]
PHRASINGS["get_weather+unit"] += [
    "Tell me the {city} temperature in {unit}.",
    "{city} weather in {unit}",
    "Use {unit}: how hot is it in {city}?",
]
PHRASINGS["convert_currency"] += [
    "{amount} {from} to {to}?",
    "Exchange {amount} {from} into {to}.",
    "What do {amount} {from} come to in {to}?",
    "How many {to} do I get for {amount} {from}?",
    "Turn {amount} {from} into {to} for me.",
    "I need {amount} {from} converted to {to}.",
    "{amount} {from} in {to} please",
    "What's the value of {amount} {from} in {to}?",
]
PHRASINGS["set_timer"] += [
    "Count down from {minutes} minutes.",
    "Time {minutes} minutes for me.",
    "timer {minutes} min",
    "Let me know when {minutes} minutes are up.",
    "Put on a timer: {minutes} minutes.",
    "The pasta needs {minutes} minutes. Set a timer.",
    "I need a {minutes}-minute countdown.",
    "Alert me after {minutes} minutes.",
]
PHRASINGS["send_message"] += [
    "Write a message to {to}: {text}.",
    "Let {to} know {text}.",
    "Send {to} this: {text}.",
    "Ping {to} with: {text}.",
    "Can you text {to}? Say {text}.",
    "Tell {to}: {text}",
    "Please message {to} that {text}.",
    "Shoot {to} a note saying {text}.",
]
PHRASINGS["book_table"] += [
    "Reserve {restaurant} for {people}.",
    "A table for {people} at {restaurant}, please.",
    "Book {restaurant}, {people} people.",
    "We are {people} people. Book us a table at {restaurant}.",
    "Can I get a reservation at {restaurant} for {people}?",
    "Make a booking at {restaurant} for {people} guests.",
    "Dinner for {people} at {restaurant} tonight, please book it.",
    "Find us seats for {people} at {restaurant}.",
]
PHRASINGS["add_reminder"] += [
    "Reminder: {text} on {date}.",
    "Make a note to {text} on {date}.",
    "I have to {text} on {date}. Remind me.",
    "Add to my list: {text}, {date}.",
    "Please remind me on {date} to {text}.",
    "Schedule a reminder for {date} to {text}.",
    "{date}: {text}. Add it as a reminder.",
]
# phrasings built from a frame and a verb phrase: the same request in several registers
FRAMES = ["{vp}.", "Please {vp}.", "Can you {vp}?", "Could you {vp}, please?", "I'd like you to {vp}.",
          "Would you {vp}?", "Help me {vp}.", "{vp} for me.", "Go ahead and {vp}.", "I want you to {vp} now."]  # fmt: skip
CORES = {
    "get_weather": ["check the weather in {city}", "get the forecast for {city}",
                    "find out how the weather is in {city}", "look up today's weather for {city}"],
    "get_weather+unit": ["give me the temperature in {city} in {unit}", "check the {city} temperature in {unit}"],
    "convert_currency": ["convert {amount} {from} to {to}", "change {amount} {from} into {to}",
                         "work out {amount} {from} in {to}", "tell me what {amount} {from} is in {to}"],
    "set_timer": ["set a timer for {minutes} minutes", "start a {minutes} minute timer",
                  "time {minutes} minutes", "start a countdown of {minutes} minutes"],
    "send_message": ["send {to} a message saying {text}", "text {to}: {text}", "tell {to} that {text}",
                     "message {to} with this: {text}"],
    "book_table": ["book a table for {people} at {restaurant}", "reserve a table at {restaurant} for {people}",
                   "get a table for {people} people at {restaurant}"],
    "add_reminder": ["remind me to {text} on {date}", "add a reminder for {date}: {text}",
                     "set a reminder on {date} to {text}", "save a reminder to {text} for {date}"],
}  # fmt: skip


def _framed(frame: str, core: str) -> str:
    text = frame.replace("{vp}", core)
    return text[0].upper() + text[1:] if text[0].isalpha() else text


for _key, _cores in CORES.items():
    PHRASINGS[_key] += [_framed(f, c) for c in _cores for f in FRAMES if _framed(f, c) not in PHRASINGS[_key]]
OPENERS = [
    "Hi! ",
    "Hello. ",
    "Hey, ",
    "Quick question. ",
    "Please help. ",
    "Thanks in advance. ",
    "Um, ",
    "OK, ",
]
CLOSERS = [" Thanks!", " Thank you.", " Cheers.", " Please.", " Thanks a lot.", " ASAP."]

# descriptions of the offered tools, drawn per item, so a call does not hang on one fixed schema text
TOOL_DESCRIPTIONS = {
    "get_weather": ["Current weather for a city", "Get the weather for a location", "Weather lookup",
                    "Returns today's weather in a city", "Fetch weather conditions", ""],
    "convert_currency": ["Convert an amount between currencies", "Currency converter",
                         "Exchange money from one currency to another", "Convert money", ""],
    "set_timer": ["Start a timer", "Set a countdown timer", "Timer", "Starts a timer for some minutes", ""],
    "send_message": ["Send a text message to a person", "Message someone", "Send an SMS",
                     "Deliver a short text to a contact", ""],
    "book_table": ["Book a restaurant table", "Restaurant reservations", "Reserve a table",
                   "Make a booking at a restaurant", ""],
    "add_reminder": ["Add a reminder for a date", "Save a reminder", "Reminders", "Remember a task for a day", ""],
}  # fmt: skip
PARAM_DESCRIPTIONS = {
    "city": ["city name", "the city", "a city or town", "location"], "unit": ["temperature unit", "units"],
    "amount": ["how much", "amount of money", "the amount"], "from": ["source currency", "currency code to convert from"],
    "to": ["target currency", "recipient", "who gets it", "currency code to convert to"],
    "minutes": ["length in minutes", "duration (minutes)"], "text": ["message text", "what to say", "the task"],
    "restaurant": ["restaurant name", "where"], "people": ["party size", "number of guests"],
    "date": ["when", "the day"],
}  # fmt: skip


def dress_tool(rng: random.Random, tool: dict) -> dict:
    """`tool` as one request offers it: a description drawn from several (or none), parameter
    descriptions now and then, properties in any order; names, types, enums and `required` unchanged."""
    params = tool["parameters"]
    props = list(params["properties"].items())
    rng.shuffle(props)
    described = rng.random() < 0.4
    properties = {}
    for key, schema in props:
        schema = dict(schema)
        if described and key in PARAM_DESCRIPTIONS:
            schema["description"] = rng.choice(PARAM_DESCRIPTIONS[key])
        properties[key] = schema
    out: dict = {"name": tool["name"]}
    description = rng.choice(TOOL_DESCRIPTIONS.get(tool["name"], [tool.get("description", "")]))
    if description:
        out["description"] = description
    out["parameters"] = {**params, "properties": properties}
    return out


REMINDER_TOOL = {
    "name": "add_reminder",
    "description": "Add a reminder for a date",
    "parameters": {
        "type": "object",
        "properties": {"text": {"type": "string"}, "date": {"type": "string"}},
        "required": ["text", "date"],
    },
}


def tool_request(
    rng: random.Random, name: str, towns: list[str], people: list[str]
) -> tuple[str, dict, dict]:
    """(request, arguments, result) for tool `name`: the arguments are the values the request writes."""
    if name == "get_weather":
        args: dict = {"city": city(rng, towns)}
        key = "get_weather"
        if rng.random() < 0.25:
            args["unit"] = rng.choice(["celsius", "fahrenheit"])
            key = "get_weather+unit"
        result = {
            "temperature": rng.randint(-15, 42),
            "sky": rng.choice(["sunny", "cloudy", "rainy", "snowy"]),
        }
    elif name == "convert_currency":
        src, dst = values.currency(rng), values.currency(rng)
        while dst == src:
            dst = values.currency(rng)
        args, key = {"amount": number(rng), "from": src, "to": dst}, name
        result = {"result": round(args["amount"] * rng.uniform(0.2, 3), 2)}
    elif name == "set_timer":
        args, key, result = {"minutes": rng.randint(1, rng.choice((10, 60, 240)))}, name, {"ok": True}
    elif name == "send_message":
        text = rng.choice(MESSAGES) if rng.random() < FIXED_TEXT_SHARE else values.free_text(rng)
        args, key, result = {"to": person(rng, people), "text": text}, name, {"sent": True}
    elif name == "book_table":
        place = values.restaurant(rng, CITIES, RESTAURANT_KINDS)
        args, key, result = {"restaurant": place, "people": rng.randint(1, 20)}, name, {"confirmed": True}
    else:
        text = rng.choice(REMINDERS) if rng.random() < FIXED_TEXT_SHARE else values.free_text(rng)
        args, key, result = {"text": text, "date": values.date(rng)}, name, {"saved": True}
    request = rng.choice(PHRASINGS[key]).format(**args)
    if rng.random() < 0.2:
        request = rng.choice(OPENERS) + request
    if rng.random() < 0.15:
        request += rng.choice(CLOSERS)
    if rng.random() < 0.1:
        request = request.lower()
    return request, args, result


def tool_thought(name: str, args: dict) -> str:
    said = ", ".join(f"{k} {json.dumps(v)}" for k, v in args.items())
    return f"The user asks for {name.replace('_', ' ')}. I call {name} with {said}, copied from the request."


# word problems: (setting, start sentence, step sentences per operation, question); {w} who, {t} thing
SETTINGS = [
    ("apples", "{w} has {v} apples."),
    ("dollars", "{w} has {v} dollars in a wallet."),
    ("stickers", "{w} collects stickers and has {v} of them."),
    ("books", "A shelf holds {v} books."),
    ("eggs", "A farm collects {v} eggs in the morning."),
    ("people", "There are {v} people on a bus."),
    ("cookies", "{w} bakes {v} cookies."),
    ("pages", "{w} reads {v} pages on Monday."),
    ("marbles", "{w} owns {v} marbles."),
    ("tickets", "A cinema sells {v} tickets."),
]
STEPS = {
    "+": ["Then {w} gets {n} more.", "{w} buys {n} more.", "Later {n} more arrive.", "After that {w} adds {n}.",
          "A friend gives {w} {n} more."],
    "-": ["Then {w} gives away {n}.", "{w} uses {n} of them.", "Later {n} are lost.", "{n} of them are sold.",
          "{w} eats {n}."],
    "*": ["Then the amount grows {n} times.", "{w} ends up with {n} times as many.", "The number is multiplied by {n}."],
    "/": ["{w} splits them into {n} equal groups and keeps one group.", "They are shared equally by {n} people; count one share."],
}  # fmt: skip
QUESTIONS = ["How many {t} are there now?", "How many {t} does {w} have now?", "What is the number of {t} now?",
             "How many {t} are left?", "How many {t} in the end?"]  # fmt: skip
# step sentences built from a lead and a clause, the number at the start, middle or end of the clause
# (the held-out problems' operation words were mapped to the wrong operation in 42 of GLM's 71 steps)
LEADS = ["", "", "Then ", "Later ", "Next, ", "After lunch ", "In the evening ", "On Sunday ", "Soon after, ",
         "The next day "]  # fmt: skip
CLAUSES = {
    "+": ["{w} gets {n} more", "{n} more arrive", "{w} picks up another {n}", "{n} new ones come in",
          "the number goes up by {n}", "{w} receives {n} extra", "another {n} join them", "{w} finds {n} more"],
    "-": ["{w} gives away {n}", "{n} are lost", "{n} of them break", "{w} throws {n} away", "{n} go missing",
          "the number drops by {n}", "{w} removes {n}", "{w} sells {n} of them"],
    "*": ["the amount grows {n} times", "{w} ends up with {n} times as many", "the number is multiplied by {n}",
          "it becomes {n} times bigger"],
    "/": ["{w} splits them into {n} equal groups and keeps one group", "they are shared equally by {n} people "
          "and {w} keeps one share"],
}  # fmt: skip
STARTS = ["{w} has {v} {t}.", "There are {v} {t} in the {p}.", "A box holds {v} {t}.", "{w} counts {v} {t}.",
          "{w} starts the day with {v} {t}."]  # fmt: skip
MORE_QUESTIONS = ["How many {t} does that make?", "Count the {t} now.", "How many {t} are there at the end?",
                  "What is the number of {t} at the end?"]  # fmt: skip


def plural(noun: str) -> str:
    return noun[:-1] + "ies" if noun.endswith("y") and noun[-2] not in "aeiou" else (
        noun + "es" if noun.endswith(("s", "x", "ch", "sh")) else noun + "s")  # fmt: skip


def step_sentence(rng: random.Random, op: str, w: str, n: int) -> str:
    """One step of a word problem: a fixed sentence (`STEPS`) or a lead and a clause (`CLAUSES`)."""
    if rng.random() < 0.3:
        return rng.choice(STEPS[op]).format(w=w, n=n)
    text = rng.choice(LEADS) + rng.choice(CLAUSES[op]).format(w=w, n=n) + "."
    return text[0].upper() + text[1:]


def word_problem(rng: random.Random, tier: int, people: list[str]) -> dict:
    """A word problem with `tier` steps in an everyday setting; numbers from single digits to thousands."""
    w = person(rng, people)
    thing, start = rng.choice(SETTINGS)
    if rng.random() < 0.4:  # any countable thing of the word pool
        thing = plural(rng.choice(values.NOUNS))
        start = rng.choice(STARTS).replace("{t}", thing).replace("{p}", rng.choice(values.NOUNS))
    hi = rng.choice((10, 20, 50, 100, 500, 1000, 5000))
    value = rng.randint(2, hi)
    sentences, steps = [start.format(w=w, v=value)], []
    for _ in range(tier):
        divisors = [d for d in (2, 3, 4, 5, 10) if value % d == 0 and value > d]
        op = rng.choice(["+", "-", "*", "/"] if divisors else ["+", "-", "*"])
        if op == "-" and value < 2:
            op = "+"
        if op == "*" and value > 20000:
            op = "-"
        n = {"+": rng.randint(1, hi), "-": rng.randint(1, max(1, value - 1)), "*": rng.randint(2, 4),
             "/": rng.choice(divisors) if divisors else 1}[op]  # fmt: skip
        result = {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]
        sentences.append(step_sentence(rng, op, w, n))
        steps.append(f"{value} {op} {n} = {result}")
        value = result
    sentences.append(rng.choice(QUESTIONS + MORE_QUESTIONS).format(t=thing, w=w))
    question = " ".join(sentences)
    return word_problem_item(question, steps, value)


def word_problem_item(question: str, steps: list[str], value: int) -> dict:
    """A gsm-nano item: the question, the steps as the reasoning, "The answer is N." after it."""
    answer = str(value)
    return {
        "task": "gsm-nano",
        "prompt": question,
        "answer": answer,
        "messages": [
            {"role": "user", "content": question},
            {
                "role": "assistant",
                "reasoning_content": ". ".join(steps) + ".",
                "content": f"The answer is {answer}.",
            },
        ],
    }


# one-line sums in words, the numbers anywhere ("Subtract {b} from {a}": the step still reads a - b)
SUMS_IN_WORDS = {
    "+": ["What is the sum of {a} and {b}?", "Sum {a} and {b}.", "Take {a}, add {b}.", "{a} and {b} together make what?",
          "Find {a} plus {b}.", "Put {b} on top of {a}. How much is that?"],
    "-": ["Subtract {b} from {a}.", "Take {b} away from {a}.", "What is {a} take away {b}?", "{a} less {b}?",
          "How much is left when {b} is taken from {a}?"],
    "*": ["Multiply {a} by {b}.", "What is the product of {a} and {b}?", "{b} lots of {a} make what?"],
}  # fmt: skip


def direct_sum(rng: random.Random) -> dict:
    """A one-line sum ("What is 17 + 25?") with its answer."""
    a, b = rng.randint(0, rng.choice((10, 100, 1000))), rng.randint(0, rng.choice((10, 100, 1000)))
    op = rng.choice(["+", "-", "*"])
    if op == "*":
        a, b = a % 50, b % 13
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    word = {"+": "plus", "-": "minus", "*": "times"}[op]
    question = rng.choice([f"What is {a} {op} {b}?", f"{a} {op} {b} = ?", f"What's {a} {word} {b}?",
                           f"Calculate {a} {op} {b}.", f"{a} {word} {b}", *SUMS_IN_WORDS[op]]).format(a=a, b=b)  # fmt: skip
    return {
        "task": "gsm-nano",
        "prompt": question,
        "answer": str(value),
        "messages": [
            {"role": "user", "content": question},
            {
                "role": "assistant",
                "reasoning_content": f"{a} {op} {b} = {value}.",
                "content": f"The answer is {value}.",
            },
        ],
    }


GREETINGS = {
    "hello": ["Hello!", "Hi!", "Hi there.", "Hey!", "hello", "hi", "Good morning!", "Good evening!",
              "Good afternoon.", "Hey there, how's it going?", "Hello, anyone there?", "Yo!"],
    "how": ["How are you?", "How are you doing today?", "How's it going?", "Are you OK?"],
    "name": ["What's your name?", "Who are you?", "What are you?", "Are you a robot?"],
    "can": ["What can you do?", "How can you help me?", "What are you good at?"],
    "thanks": ["Thanks!", "Thank you.", "Thank you so much!", "thx", "Great, thanks."],
    "bye": ["Bye!", "Goodbye.", "See you later.", "Good night!"],
}  # fmt: skip
REPLIES = {
    "hello": ["Hello! How can I help you today?", "Hi! What can I do for you?", "Hello! Nice to meet you."],
    "how": [
        "I'm doing well, thank you! How can I help?",
        "I'm fine, thanks for asking. What can I do for you?",
    ],
    "name": ["I'm a small assistant model. I can chat, do arithmetic and call tools."],
    "can": [
        "I can answer simple questions, solve small word problems, and call tools like weather or timers."
    ],
    "thanks": ["You're welcome!", "Happy to help!", "Any time!"],
    "bye": ["Goodbye! Have a nice day.", "Bye! Take care."],
}
THOUGHTS = {"hello": "The user greets me. I greet them back and offer help.",
            "how": "The user asks how I am. I answer politely and offer help.",
            "name": "The user asks who I am. I say what I am.",
            "can": "The user asks what I can do. I list it briefly.",
            "thanks": "The user thanks me. I reply kindly.",
            "bye": "The user says goodbye. I say goodbye too."}  # fmt: skip
# one-line questions with short, fixed answers
FACTS = {
    "capital": {"France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin",
                "Egypt": "Cairo", "Kenya": "Nairobi", "Canada": "Ottawa", "Peru": "Lima", "Norway": "Oslo",
                "Greece": "Athens", "Ireland": "Dublin", "Portugal": "Lisbon", "Russia": "Moscow",
                "China": "Beijing", "India": "New Delhi", "Brazil": "Brasilia", "Australia": "Canberra"},
    "opposite": {"hot": "cold", "big": "small", "up": "down", "fast": "slow", "day": "night", "open": "closed",
                 "happy": "sad", "light": "dark", "early": "late", "full": "empty"},
    "colour": {"the sky": "blue", "grass": "green", "snow": "white", "a banana": "yellow", "coal": "black",
               "a strawberry": "red", "an orange": "orange", "a lemon": "yellow"},
    "legs": {"a dog": 4, "a cat": 4, "a bird": 2, "a spider": 8, "an ant": 6, "a horse": 4, "a person": 2},
}  # fmt: skip
FACT_ASK = {
    "capital": ["What is the capital of {k}?", "What's the capital of {k}?", "capital of {k}?"],
    "opposite": ["What is the opposite of {k}?", 'What\'s the opposite of "{k}"?'],
    "colour": ["What colour is {k}?", "What color is {k}?"],
    "legs": ["How many legs does {k} have?", "How many legs has {k} got?"],
}
FACT_SAY = {"capital": "The capital of {k} is {v}.", "opposite": "The opposite of {k} is {v}.",
            "colour": "{K} is {v}.", "legs": "{K} has {v} legs."}  # fmt: skip


def small_talk(rng: random.Random) -> dict:
    """A greeting or a one-line question, and a short sensible answer (with a `think` draft)."""
    if rng.random() < 0.55:
        kind = rng.choice(sorted(GREETINGS))
        ask, reply, thought = rng.choice(GREETINGS[kind]), rng.choice(REPLIES[kind]), THOUGHTS[kind]
    else:
        kind = rng.choice(sorted(FACTS))
        k = rng.choice(sorted(FACTS[kind]))
        v = FACTS[kind][k]
        ask = rng.choice(FACT_ASK[kind]).format(k=k)
        reply = FACT_SAY[kind].format(k=k, K=k[0].upper() + k[1:], v=v)
        thought = f"A short factual question: the answer is {v}."
    return {
        "task": "chat",
        "messages": [
            {"role": "user", "content": ask},
            {"role": "assistant", "content": reply, "think": thought},
        ],
    }


# Copy drills: the request states a value (coined, from the generators of `values`) and the answer repeats
# it. The held-out replies showed the nano models copy a string's first piece and then guess from memory;
# these items ask for nothing but the continuation ("the token that followed this one in the request").
ECHO = [
    ("Repeat after me: {v}", "{v}", "text", "The user wants the words back exactly."),
    ('Say "{v}" back to me.', "{v}", "text", "The user wants the words back exactly."),
    ("Please write this down: {v}", "Noted: {v}", "text", "I repeat the note."),
    ("My name is {v}. What's my name?", "Your name is {v}.", "name", "The user said their name is {v}."),
    ("I'm {v}. Do you remember my name?", "Yes, you are {v}.", "name", "The user is {v}."),
    ("I live in {v}. Where do I live?", "You live in {v}.", "place", "The user lives in {v}."),
    (
        "I'm flying to {v} tomorrow. Where am I going?",
        "You are going to {v}.",
        "place",
        "The trip is to {v}.",
    ),
    ("The password is {v}. What is the password?", "The password is {v}.", "word", "The password was {v}."),
    ("Remember the code word {v}. What was the code word?", "The code word was {v}.", "word", "It was {v}."),
    ("My cat is called {v}. What is my cat's name?", "Your cat is called {v}.", "name", "The cat is {v}."),
]


def echo(rng: random.Random) -> dict:
    """A copy drill: a coined name, place, word or free text said once and asked back."""
    ask, say, kind, thought = rng.choice(ECHO)
    if kind == "text":
        value = values.free_text(rng) if rng.random() < 0.5 else values.coined_name(rng, rng.randint(1, 5))
    elif kind == "name":
        value = values.coined_name(rng, rng.choice((1, 1, 2, 3)))
    elif kind == "place":
        value = values.coined_name(rng, rng.choice((1, 1, 2)))
    else:
        value = values.coined(rng)
    return {
        "task": "chat",
        "messages": [
            {"role": "user", "content": ask.format(v=value)},
            {"role": "assistant", "content": say.format(v=value), "think": thought.format(v=value)},
        ],
    }
