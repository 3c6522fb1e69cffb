"""Write viasd_core/data/distill_prompts.jsonl: our own Spec-Bench-style prompts for draft distillation.

Task templates x topics, per category, sampled with a fixed seed (reproducible). All text here is
original to viasd (Apache-2.0). It deliberately does not reuse the Spec-Bench prompts, which are
the evaluation set.

    python recipes/distill_make_prompts.py [--per-category 36] [--out viasd_core/data/distill_prompts.jsonl]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

TOPICS = [
    "urban gardening", "electric bicycles", "remote work", "ocean plastic", "the history of coffee",
    "public libraries", "volcanoes", "sleep hygiene", "renewable energy", "board games", "bees",
    "space telescopes", "minimalism", "street food", "the printing press", "climate adaptation",
    "online privacy", "marathon training", "jazz music", "ancient Rome", "machine translation",
    "recycling", "first aid", "mountain hiking", "personal budgeting", "video game design",
    "bird migration", "3D printing", "photography", "volunteering", "the water cycle", "chess",
    "tea ceremonies", "public transport", "learning a new language", "home composting",
]
PEOPLE = [
    "a pirate captain", "a medieval blacksmith", "a detective in 1920s London", "a friendly robot",
    "a park ranger", "a time traveler from 2300", "a grumpy chef", "a museum guide",
    "a startup founder", "a lighthouse keeper", "an astronaut on Mars", "a kindergarten teacher",
]
LANGS = ["French", "Spanish", "German", "Italian", "Portuguese", "Chinese", "Japanese"]
SENTENCES = [
    "The weather is lovely today, so we are going to the beach.",
    "Please send me the report before Friday afternoon.",
    "My grandmother grows tomatoes and basil in her small garden.",
    "The train to the airport leaves every twenty minutes.",
    "Reading before bed helps me relax after a long day.",
    "We need more volunteers for the charity run next month.",
    "The museum is closed on Mondays but open late on Thursdays.",
    "I forgot my umbrella at the cafe near the station.",
]
PASSAGES = [
    "The city council met on Tuesday to discuss a new plan for bike lanes downtown. Supporters said the "
    "lanes would reduce traffic and pollution, while some shop owners worried about losing parking spaces. "
    "The council agreed to run a six-month trial on two streets and to publish monthly traffic data.",
    "Honeybees communicate the location of food through a 'waggle dance'. The angle of the dance relative "
    "to vertical shows the direction of the food compared to the sun, and the length of the waggle run "
    "shows the distance. Researchers decoded this behaviour in the twentieth century.",
    "Lena opened a small bakery in 2019. In the first year she sold about 200 loaves a week. After adding "
    "a delivery service in 2021, sales rose to 650 loaves a week, and she hired three new employees, "
    "including a pastry chef named Omar who joined in March 2022.",
    "The new smartphone has a 6.1-inch screen, a battery that lasts about 20 hours, and two rear cameras. "
    "It costs $799 and comes in black, white and green. Reviewers praised the camera but criticised the "
    "slow charging speed of 20 watts.",
    "Photosynthesis takes place in the chloroplasts of plant cells. Using energy from sunlight, plants turn "
    "carbon dioxide and water into glucose and oxygen. The glucose stores energy, and the oxygen is "
    "released into the air through small pores called stomata.",
    "The conference will take place from 12 to 14 June in Lisbon. Registration costs 350 euros before "
    "1 May and 450 euros afterwards. Speakers include Dr. Aiko Tanaka on robotics and Prof. Mark Ellis on "
    "energy storage. Lunch is included on all three days.",
]
CODE_TASKS = [
    "reverses a string without using slicing", "checks whether a number is prime",
    "returns the n-th Fibonacci number iteratively", "counts the words in a text file",
    "merges two sorted lists into one sorted list", "removes duplicates from a list while keeping order",
    "finds the longest common prefix of a list of strings", "computes the factorial of n recursively",
    "validates an email address with a regular expression", "implements binary search on a sorted array",
    "converts Celsius to Fahrenheit for a list of values", "flattens a nested list",
    "finds the most frequent element in a list", "checks whether a string is a palindrome",
    "implements a simple stack class with push and pop", "parses a CSV line into fields",
]
CODE_LANGS = ["Python", "JavaScript", "C++", "Java", "Rust", "Go"]
STEM_TOPICS = [
    "how vaccines train the immune system", "why the sky is blue", "how a transistor works",
    "what entropy means in thermodynamics", "how GPS determines position", "the difference between mitosis and meiosis",
    "how neural networks learn", "why ice floats on water", "how black holes form", "what causes ocean tides",
    "how batteries store energy", "the greenhouse effect", "how DNA is copied", "Newton's three laws of motion",
    "how compilers turn code into machine instructions", "the structure of an atom",
]
HUM_TOPICS = [
    "the causes of the French Revolution", "the influence of the Renaissance on art",
    "Stoic philosophy and modern life", "the role of the Silk Road in cultural exchange",
    "the impact of the industrial revolution on cities", "the main ideas of utilitarianism",
    "the importance of the Magna Carta", "how mythology shaped ancient Greek society",
    "the legacy of the Roman Empire in law", "the role of storytelling in oral cultures",
    "the history of women's suffrage", "the ethics of artificial intelligence",
]


def _math_prompts(rng: random.Random) -> list[str]:
    out = []
    for _ in range(60):
        a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 12)
        out += [
            f"If a shop sells {a} apples on Monday and {b} more each day than the day before, how many apples does it sell in total over {c % 5 + 3} days? Show your steps.",
            f"Solve for x: {c}x + {a} = {b + a * 2}. Explain each step.",
            f"A rectangle has a length of {a} cm and a width of {b} cm. What are its area and perimeter?",
            f"What is {a}% of {b * 25}? Then add {c} to the result.",
            f"A train travels at {a + 40} km/h for {c} hours and then at {b + 30} km/h for {c % 4 + 1} hours. How far does it travel in total?",
            f"Find the greatest common divisor and the least common multiple of {a * 2} and {b * 3}.",
            f"The sum of three consecutive integers is {3 * a + 3}. What are the integers?",
            f"A recipe needs {c} eggs for {b % 6 + 2} people. How many eggs are needed for {a % 20 + 5} people?",
        ]
    return out


def _reasoning_prompts(rng: random.Random) -> list[str]:
    names = ["Alice", "Ben", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana"]
    out = []
    for _ in range(40):
        x, y, z = rng.sample(names, 3)
        n = rng.randint(2, 9)
        out += [
            f"{x} is taller than {y}, and {y} is taller than {z}. Who is the shortest? Explain your reasoning.",
            f"{x} has {n} more books than {y}. Together they have {2 * n + 10} books. How many books does each have?",
            f"If all bloops are razzies and some razzies are lazzies, can we conclude that some bloops are lazzies? Explain.",
            f"{x}, {y} and {z} each own a different pet: a cat, a dog and a fish. {x} is allergic to fur and {y} does not own the dog. Who owns which pet?",
            f"A clock shows 3:15. What is the angle between the hour and minute hands? Think step by step.",
            f"There are {n + 3} people in a room and each shakes hands with every other person once. How many handshakes are there?",
            f"{x} says: 'I always lie.' Is this statement consistent? Explain the paradox in simple terms.",
            f"You have two ropes that each take one hour to burn unevenly. How can you measure 45 minutes?",
        ]
    return out


def build_prompts(per_category: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    cats: dict[str, list[str]] = {}
    cats["writing"] = [
        t.format(topic=topic)
        for t, topic in itertools.product(
            [
                "Write a short blog post about {topic} for beginners.",
                "Write a persuasive paragraph arguing that schools should teach {topic}.",
                "Compose a short poem inspired by {topic}.",
                "Write a friendly email inviting colleagues to a workshop on {topic}.",
                "Draft a product description for a new gadget related to {topic}.",
                "Write a short story opening that involves {topic}.",
                "Write a speech for a community event celebrating {topic}.",
                "Create an outline for an article about the future of {topic}.",
            ],
            TOPICS,
        )
    ]
    cats["roleplay"] = [
        t.format(person=p, topic=topic)
        for t, p, topic in itertools.product(
            [
                "Pretend you are {person}. Describe your typical day and mention {topic}.",
                "You are {person}. A visitor asks you for advice about {topic}. Answer in character.",
                "Act as {person} and give a short motivational talk about {topic}.",
                "Stay in character as {person} and explain what you think of {topic}.",
            ],
            PEOPLE,
            TOPICS[:12],
        )
    ]
    cats["reasoning"] = _reasoning_prompts(rng)
    cats["math"] = _math_prompts(rng)
    cats["coding"] = [
        t.format(task=task, lang=lang)
        for t, task, lang in itertools.product(
            [
                "Write a {lang} function that {task}. Include a short explanation.",
                "Implement a {lang} program that {task}, and add a test case.",
                "Explain how you would write code in {lang} that {task}, then show the code.",
            ],
            CODE_TASKS,
            CODE_LANGS,
        )
    ]
    cats["extraction"] = [
        t.format(passage=p)
        for t, p in itertools.product(
            [
                "Extract all names, dates and numbers from the following text and list them:\n{passage}",
                "Read the text and return a JSON object with the key facts:\n{passage}",
                "From the passage below, list the main entities and what each one did:\n{passage}",
                "Identify the main claim and the supporting evidence in this text:\n{passage}",
            ],
            PASSAGES,
        )
    ]
    cats["stem"] = [
        t.format(topic=topic)
        for t, topic in itertools.product(
            [
                "Explain {topic} to a high school student.",
                "Give a clear, step-by-step explanation of {topic}.",
                "What are common misconceptions about {topic}? Correct them.",
                "Describe {topic} and give a real-world example.",
            ],
            STEM_TOPICS,
        )
    ]
    cats["humanities"] = [
        t.format(topic=topic)
        for t, topic in itertools.product(
            [
                "Discuss {topic} in a few paragraphs.",
                "Summarize the key arguments about {topic}.",
                "Write a short essay on {topic} with an introduction and a conclusion.",
                "Explain {topic} and why it still matters today.",
            ],
            HUM_TOPICS,
        )
    ]
    cats["translation"] = [
        t.format(lang=lang, s=s)
        for t, lang, s in itertools.product(
            [
                "Translate the following sentence into {lang}: \"{s}\"",
                "How would you say this in {lang}? \"{s}\" Explain any tricky words.",
            ],
            LANGS,
            SENTENCES,
        )
    ]
    cats["summarization"] = [
        t.format(passage=p)
        for t, p in itertools.product(
            [
                "Summarize the following text in two sentences:\n{passage}",
                "Give a one-line summary and three bullet points for this text:\n{passage}",
                "Summarize this for a ten-year-old:\n{passage}",
                "Write a headline and a short summary of:\n{passage}",
            ],
            PASSAGES,
        )
    ] + [f"Summarize what is generally known about {t} in a short paragraph." for t in TOPICS]
    cats["qa"] = [
        t.format(topic=topic)
        for t, topic in itertools.product(
            [
                "What are the main benefits and drawbacks of {topic}?",
                "Can you give me five tips about {topic}?",
                "What is the history of {topic} in brief?",
                "How do I get started with {topic}?",
                "What are some interesting facts about {topic}?",
            ],
            TOPICS,
        )
    ]
    cats["rag"] = [
        t.format(passage=p, topic=topic)
        for t, p, topic in itertools.product(
            [
                "Use only the context below to answer: what is the most important point?\nContext: {passage}",
                "Context: {passage}\nQuestion: Based on the context, what could happen next? Answer briefly.",
                "Here is a document:\n{passage}\nAnswer using the document: how does it relate to {topic}, if at all?",
            ],
            PASSAGES,
            TOPICS[:6],
        )
    ]
    rows = []
    for cat, prompts in cats.items():
        prompts = sorted(set(prompts))
        rng.shuffle(prompts)
        rows += [{"category": cat, "prompt": p} for p in prompts[:per_category]]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-category", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "viasd_core/data/distill_prompts.jsonl"))
    args = ap.parse_args()
    rows = build_prompts(args.per_category, args.seed)
    with open(args.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{len(rows)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
