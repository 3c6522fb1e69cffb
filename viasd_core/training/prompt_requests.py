"""Prompts written by the target itself: what the campaign asks it for, and how a reply becomes a prompt.

A `Request` is a meta-prompt to the target ("Write one question a nurse might ask about sleep.",
"Write a short news report about ...", "Write a short Python function that ...") and a template that
wraps the reply into a training prompt in the shape of a task kind ("Summarize: {text}", "Translate
German to English: {text}", "{text}\\n\\nExplain what this code does."). Requests without a
meta-prompt are plain templates over topics and random numbers (math, reasoning). `build_requests` is
a pure function of (count, seed): a resumed campaign asks for exactly the same things.

The kinds follow the task kinds of chat benchmarks (writing, roleplay, reasoning, math,
math_reasoning, coding, extraction, stem, humanities, translation, summarization, qa, rag); no text
here comes from an evaluation set.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass
from typing import Optional

TOPICS = [
    "volcanoes", "bees", "the history of coffee", "public libraries", "renewable energy", "sleep", "chess",
    "space telescopes", "street food", "the printing press", "online privacy", "marathon training", "jazz",
    "ancient Rome", "recycling", "first aid", "mountain hiking", "personal budgeting", "video games",
    "bird migration", "3D printing", "photography", "volunteering", "the water cycle", "tea", "trains",
    "learning languages", "composting", "electric cars", "the Moon", "earthquakes", "vaccines", "the Internet",
    "smartphones", "climate change", "rainforests", "the Olympic Games", "football", "cooking pasta", "bread",
    "chocolate", "the human heart", "dinosaurs", "pyramids of Egypt", "the Vikings", "the Silk Road",
    "the Renaissance", "democracy", "taxes", "inflation", "the stock market", "small businesses", "job interviews",
    "remote work", "time management", "meditation", "nutrition", "dogs", "cats", "horses", "whales", "sharks",
    "coral reefs", "deserts", "glaciers", "hurricanes", "solar panels", "batteries", "robots",
    "artificial intelligence", "databases", "cybersecurity", "web browsers", "operating systems", "music theory",
    "the violin", "painting", "poetry", "theatre", "film making", "architecture", "bridges", "airports",
    "shipping containers", "farming", "honey", "wine making", "fashion", "recycling plastic", "water filters",
    "public health", "hospitals", "nursing", "dentists", "exercise", "yoga", "cycling", "swimming", "camping",
    "national parks", "museums", "city planning", "public transport", "housing", "friendship", "parenting",
    "school exams", "universities", "scholarships", "the French Revolution", "the Industrial Revolution",
    "world wars", "the Cold War", "ancient Greece", "philosophy", "ethics", "psychology", "economics",
    "mathematics", "prime numbers", "probability", "geometry", "chemistry", "atoms", "DNA", "evolution",
    "black holes", "Mars", "satellites", "GPS", "the weather", "rivers", "oceans", "forests", "mushrooms",
]
ASKERS = ["a curious student", "a nurse", "a software engineer", "a history teacher", "a traveller", "a parent",
          "a farmer", "a small business owner", "a journalist", "a retired engineer", "a chef", "a scientist",
          "a high school student", "a librarian", "a taxi driver", "an athlete"]
PEOPLE = ["a pirate captain", "a medieval knight", "a detective", "a friendly robot", "a park ranger",
          "a time traveller", "a grumpy chef", "a famous scientist", "a startup founder", "a lighthouse keeper",
          "an astronaut", "a kindergarten teacher", "a travel guide", "a wizard", "a sports coach", "a news anchor"]
LANGS = ["German", "French", "Spanish", "Italian", "Portuguese", "Dutch"]
FORMS = ["a short blog post", "a persuasive paragraph", "a short poem", "a haiku", "a friendly email",
         "a formal letter", "a product description", "the opening of a short story", "a short speech",
         "an outline for an article", "a limerick", "a slogan and a tagline", "a short dialogue",
         "a list of tips", "a short advertisement", "a diary entry"]
CODE_LANGS = ["Python", "JavaScript", "Java", "C++", "Go", "Rust", "SQL", "Bash"]
CODE_JOBS = ["reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
             "counts the words in a text", "merges two sorted lists", "removes duplicates from a list",
             "finds the largest number in a list", "computes a factorial", "validates an email address",
             "implements binary search", "converts Celsius to Fahrenheit", "flattens a nested list",
             "finds the most frequent element", "checks for a palindrome", "reads a CSV file and sums a column",
             "sorts a list of names", "computes the average of numbers", "counts vowels in a string",
             "finds the second largest number", "checks whether brackets are balanced", "rotates a matrix",
             "computes the greatest common divisor", "groups words by their first letter", "parses a date"]
NAMES = ["Ana", "Ben", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Julia", "Kofi", "Lena",
         "Mateo", "Nina", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara"]
ITEMS = ["apples", "books", "pencils", "stickers", "cookies", "marbles", "tickets", "plants", "shirts", "cupcakes"]


@dataclass(frozen=True)
class Request:
    """One thing asked of the target: `meta` (None: no generation) and the template its reply fills."""

    category: str
    template: str  # "{text}" is the parsed reply
    meta: Optional[str] = None
    parse: str = "text"  # question | sentence | passage | code | text
    max_new_tokens: int = 96


def _writing(r: random.Random) -> Request:
    topic, form = r.choice(TOPICS), r.choice(FORMS)
    return Request("writing", f"Write {form} about {topic}.")


def _roleplay(r: random.Random) -> Request:
    return Request("roleplay", f"Pretend you are {r.choice(PEOPLE)}. {{text}}", parse="question",
                   meta=f"Write one question that {r.choice(ASKERS)} might ask about {r.choice(TOPICS)}. "
                        "Reply with the question only.")


def _question(category: str, r: random.Random) -> Request:
    asker = r.choice(ASKERS)
    return Request(category, "{text}", parse="question",
                   meta=f"Write one question that {asker} might ask about {r.choice(TOPICS)}. Reply with the question only.")


def _qa(r: random.Random) -> Request:
    return Request("qa", "{text}", parse="question",
                   meta=f"Write one short trivia question about {r.choice(TOPICS)}. Reply with the question only.")


def _math(r: random.Random) -> Request:
    a, b, c = r.randint(2, 90), r.randint(2, 60), r.randint(2, 12)
    x, y = r.sample(NAMES, 2)
    item = r.choice(ITEMS)
    problems = [
        f"{x} has {a} {item}. {y} has {c} times as many. How many {item} do they have together?",
        f"A shop sells {item} for ${c} each. {x} buys {b} of them and pays with ${c * b + a}. How much change does {x} get?",
        f"Solve for x: {c}x + {a} = {c * b + a}. Explain each step.",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"What is {c * 5}% of {b * 20}?",
        f"{x} reads {c} pages a day. The book has {a * c + b} pages. How many days does {x} need to finish it?",
        f"A train travels {a + 40} km/h for {c} hours. How far does it go?",
        f"{x} saves ${c} every week. After {b} weeks, {x} spends ${a}. How much money is left?",
        f"The sum of two numbers is {a + b} and their difference is {abs(a - b)}. What are the numbers?",
        f"{x} bakes {a} {item} and gives {b % a if a > 1 else 1} to {y}. Then {x} bakes {c} more. How many are left?",
    ]
    return Request("math_reasoning" if r.random() < 0.6 else "math", r.choice(problems))


def _self_math(r: random.Random) -> Request:
    return Request("math_reasoning", "{text}", parse="text", max_new_tokens=96,
                   meta=f"Write a math word problem for a school student about {r.choice(ITEMS)}. End with the question.")


def _reasoning(r: random.Random) -> Request:
    x, y, z = r.sample(NAMES, 3)
    n = r.randint(3, 12)
    puzzles = [
        f"{x} is older than {y}, and {y} is older than {z}. Who is the youngest? Explain your reasoning.",
        f"There are {n} people in a room and each shakes hands with every other person once. How many handshakes are there?",
        f"If it takes {n} machines {n} minutes to make {n} widgets, how long do {n * 10} machines need for {n * 10} widgets?",
        f"{x}, {y} and {z} each have a different pet: a cat, a dog and a fish. {x} is allergic to fur and {y} does not have the dog. Who has which pet?",
        f"A farmer has {n * 3} sheep and all but {n} run away. How many are left? Explain.",
        f"{x} is facing north and turns right {n} times. Which way is {x} facing now?",
    ]
    return Request("reasoning", r.choice(puzzles))


def _self_writing(r: random.Random) -> Request:
    return Request("writing", "{text}", parse="text", max_new_tokens=64,
                   meta=f"Write one creative writing task that {r.choice(ASKERS)} might give about {r.choice(TOPICS)}, "
                        f"asking for {r.choice(FORMS)}. Reply with the task only.")


def _self_reasoning(r: random.Random) -> Request:
    return Request("reasoning", "{text}\nExplain your reasoning.", parse="text", max_new_tokens=96,
                   meta=f"Write a short logic puzzle about {r.choice(NAMES)} and {r.choice(ITEMS)}. End with the question.")


def _coding(r: random.Random) -> Request:
    lang, job = r.choice(CODE_LANGS), r.choice(CODE_JOBS)
    if r.random() < 0.5:
        return Request("coding", f"Write a {lang} function that {job}. Explain how it works.")
    follow = r.choice(["Explain what this code does.", "Find and fix any bugs in this code.",
                       "Add comments to this code.", "How could this code be made faster?", "Write tests for this code."])
    return Request("coding", f"{{text}}\n\n{follow}", parse="code", max_new_tokens=160,
                   meta=f"Write a short {lang} function that {job}. Reply with the code only.")


def _passage(category: str, r: random.Random) -> Request:
    topic = r.choice(TOPICS)
    kind = r.choice(["a short news report about", "a short encyclopedia article about", "a short story about",
                     "a customer review of a product related to", "a short report about"])
    if category == "summarization":
        template = r.choice(["Summarize: {text}", "Summarize the following text in three sentences:\n\n{text}",
                             "{text}\n\nWrite a one-paragraph summary of the text above."])
    elif category == "rag":
        question = r.choice([f"What does the text say about {topic}?", "What is the main point of the text?",
                             "Who is mentioned in the text and what did they do?", "Why is this important?",
                             "When and where did this happen?", f"Describe the uses of {topic} given in the text."])
        template = "{text}\n" + question
    else:
        template = r.choice([
            "Extract all names, places and dates from the following text and return them as a JSON object:\n\n{text}",
            "List every number in the text below and say what it refers to.\n\n{text}",
            "Rate the following review on a scale of 1 to 5 and explain your rating:\n\n{text}",
            "Read the text and answer in the format \"topic, main person, place\":\n\n{text}",
        ])
    return Request(category, template, parse="passage", max_new_tokens=256, meta=f"Write {kind} {topic}.")


def _translation(r: random.Random) -> Request:
    lang = r.choice(LANGS)
    if r.random() < 0.5:
        return Request("translation", f"Translate {lang} to English: {{text}}", parse="sentence", max_new_tokens=64,
                       meta=f"Write one sentence in {lang} about {r.choice(TOPICS)}. Reply with the {lang} sentence only.")
    return Request("translation", f"Translate the following sentence into {lang}: {{text}}", parse="sentence",
                   max_new_tokens=64, meta=f"Write one English sentence about {r.choice(TOPICS)}.")


def _humanities(r: random.Random) -> Request:
    if r.random() < 0.5:
        return _question("humanities", r)
    return Request("humanities", f"Explain the main ideas of {r.choice(TOPICS)} and why they matter today.")


def _stem(r: random.Random) -> Request:
    if r.random() < 0.5:
        return _question("stem", r)
    return Request("stem", f"Explain how {r.choice(TOPICS)} works, step by step, for a beginner.")


KINDS = [  # (weight, maker): the long-context and translation kinds, where the shipped head is weakest, weigh most
    (3, lambda r: _writing(r)), (2, lambda r: _roleplay(r)), (2, lambda r: _reasoning(r)), (3, lambda r: _math(r)),
    (2, lambda r: _self_math(r)), (3, lambda r: _coding(r)), (3, lambda r: _passage("extraction", r)),
    (2, lambda r: _stem(r)), (2, lambda r: _humanities(r)), (4, lambda r: _translation(r)),
    (4, lambda r: _passage("summarization", r)), (4, lambda r: _qa(r)), (4, lambda r: _passage("rag", r)),
    (2, lambda r: _question("qa", r)),
]


THIN = [  # a later round for the categories the first one left thin (its templates collapse as near-duplicates)
    (4, lambda r: _self_writing(r)), (3, lambda r: _self_reasoning(r)), (1, lambda r: _writing(r)),
    (1, lambda r: _reasoning(r)), (1, lambda r: _roleplay(r)),
]
MIXES = {"all": KINDS, "thin": THIN}


def build_requests(count: int, seed: int = 0, mix: str = "all") -> list[Request]:
    """`count` requests drawn by weight from the kinds of `mix`; the same arguments give the same list."""
    kinds = MIXES[mix]
    r = random.Random(seed)
    weights = [w for w, _ in kinds]
    return [r.choices(kinds, weights)[0][1](r) for _ in range(count)]


# ---------------------------------------------------------------------- replies into prompts
_QUOTED = re.compile(r"[\"“]([^\"”]{10,400}\?)[\"”]")
_QUESTION = re.compile(r"([A-Z][^.!?\n]{8,300}\?)")


def degenerate(text: str) -> bool:
    """A reply that loops ("amixamixamix...", the same sentence again and again) compresses too well."""
    data = text.encode("utf-8")
    return len(data) > 80 and len(zlib.compress(data)) < 0.35 * len(data)


def _complete_sentences(text: str) -> str:
    """`text` up to its last sentence end (a reply cut by the token budget ends mid-sentence)."""
    cut = max(text.rfind(". "), text.rfind(".\n"), text.rfind("!"), text.rfind("?"))
    end = text.rstrip()
    if end.endswith((".", "!", "?", "\"", "”")):
        return end
    return text[: cut + 1].rstrip() if cut > 0 else ""


def parse_reply(request: Request, reply: str) -> Optional[str]:
    """The prompt made from the target's `reply` to `request`, or None when the reply is unusable."""
    text = reply.strip()
    if degenerate(text):
        return None
    if request.parse == "question":
        m = _QUOTED.search(text) or _QUESTION.search(text)
        if not m:
            return None
        text = m.group(1).strip()
        words = len(text.split())
        if not 4 <= words <= 60:
            return None
    elif request.parse == "sentence":
        text = text.split("\n")[0].strip().strip("\"“”'")
        if not 4 <= len(text.split()) <= 60:
            return None
    elif request.parse == "passage":
        text = _complete_sentences(text)
        if len(text.split()) < 40:
            return None
    elif request.parse == "code":
        block = re.search(r"```[\w+-]*\n(.*?)```", text, re.S)
        text = block.group(1).rstrip() if block else ""
        if len(text.splitlines()) < 2:
            return None
    elif not 5 <= len(text.split()) <= 200:
        return None
    return request.template.replace("{text}", text)
