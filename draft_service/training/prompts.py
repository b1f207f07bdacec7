"""A seeded generator of diverse synthetic chat prompts for distilling the target (no hub, no internet).

Prompts are built from task templates x topics x styles: explain, how-to, tips, stories, poems, emails,
letters, comparisons, summaries of paragraphs composed here from templates, questions, rewrites, advice,
descriptions and small coding tasks. The same seed gives the same prompts in the same order.

No prompt may overlap the benchmark (bench/prompts.jsonl): any candidate that shares a run of
``OVERLAP_NGRAM`` words with a bench prompt is dropped (``overlaps_bench``), so the drafts are never
trained on what they are measured on.
"""

from __future__ import annotations

import json
import pathlib
import random
import re

OVERLAP_NGRAM = 8  # a shared run of this many words counts as overlap with a bench prompt
BENCH_PROMPTS = pathlib.Path(__file__).resolve().parents[2] / "bench" / "prompts.jsonl"

# ---------------------------------------------------------------------------------------------------------
# Vocabulary. Hundreds of topics across the kinds of things people ask a small chat model about.

CONCEPTS = [
    "photosynthesis", "the water cycle", "black holes", "inflation", "compound interest", "the immune system",
    "plate tectonics", "how vaccines work", "the greenhouse effect", "supply and demand", "DNA", "gravity",
    "the stock market", "machine learning", "blockchain", "the internet", "electricity", "magnetism",
    "the French Revolution", "the Roman Empire", "democracy", "the Renaissance", "the Industrial Revolution",
    "evolution by natural selection", "the Big Bang", "climate change", "ocean tides", "rainbows",
    "earthquakes", "volcanoes", "the moon's phases", "solar eclipses", "the seasons", "the human heart",
    "the digestive system", "sleep cycles", "memory", "habits", "the placebo effect", "antibiotics",
    "nuclear energy", "solar panels", "wind turbines", "batteries", "recycling", "composting",
    "bread rising", "fermentation", "coffee roasting", "how airplanes fly", "how rockets work",
    "how a refrigerator works", "how a microwave oven works", "GPS", "Wi-Fi", "encryption", "passwords",
    "cloud computing", "operating systems", "computer memory", "recursion", "sorting algorithms",
    "binary numbers", "prime numbers", "probability", "statistics", "averages and medians", "fractions",
    "percentages", "the Pythagorean theorem", "algebra", "geometry", "calculus", "music scales",
    "rhythm in music", "perspective in drawing", "color theory", "poetry meter", "metaphors",
    "the scientific method", "critical thinking", "opportunity cost", "taxes", "budgets", "credit scores",
    "insurance", "interest rates", "exchange rates", "trade", "unemployment", "minimum wage",
    "the food chain", "ecosystems", "biodiversity", "coral reefs", "rainforests", "deserts", "glaciers",
    "bird migration", "hibernation", "how bees make honey", "how spiders spin webs", "photosynthesis in algae",
    "the speed of light", "sound waves", "echoes", "friction", "momentum", "energy conservation",
    "atoms", "molecules", "chemical reactions", "acids and bases", "rust", "salt dissolving in water",
    "boiling points", "clouds", "lightning", "hurricanes", "snowflakes", "fog", "wind",
    "time zones", "leap years", "calendars", "maps", "elections", "the rule of law", "human rights",
    "public libraries", "museums", "archaeology", "fossils", "dinosaurs", "mammoths", "the printing press",
    "the telephone", "the steam engine", "bicycles", "electric cars", "traffic lights", "bridges",
    "skyscrapers", "tunnels", "canals", "lighthouses", "satellites", "the International Space Station",
    "Mars", "Jupiter", "comets", "meteor showers", "the Milky Way", "telescopes", "microscopes",
]

ACTIVITIES = [
    "learning a new language", "growing tomatoes on a balcony", "training a puppy", "running a first 5K",
    "saving money on groceries", "cooking rice on the stove", "baking sourdough bread", "writing a resume",
    "studying for exams", "staying focused while working from home", "making new friends in a new city",
    "keeping houseplants alive", "learning to swim as an adult", "starting a vegetable garden",
    "organizing a small closet", "planning a road trip", "packing light for travel", "learning to draw",
    "practicing the piano", "taking better phone photos", "writing a blog", "public speaking",
    "giving feedback to a coworker", "running a team meeting", "learning to code", "touch typing",
    "reading more books", "keeping a journal", "meditating", "getting up earlier", "drinking more water",
    "reducing screen time", "cleaning a kitchen quickly", "fixing a flat bicycle tire", "changing a light bulb",
    "painting a room", "assembling flat-pack furniture", "brewing tea", "making a smoothie",
    "cooking pasta", "making pancakes", "chopping onions", "hosting a dinner party", "planning a birthday party",
    "choosing a laptop", "backing up photos", "setting up a home network", "writing a cover letter",
    "negotiating a salary", "asking for a raise", "preparing for a presentation", "learning chess",
    "solving a Rubik's cube", "knitting a scarf", "sewing a button", "caring for a cat", "feeding birds in winter",
    "camping for the first time", "hiking safely", "cycling to work", "stretching after exercise",
    "building a morning routine", "managing time", "making a weekly meal plan", "decluttering a desk",
    "teaching a child to read", "helping a friend who is stressed", "writing a thank-you note",
    "learning to juggle", "memorizing a speech", "writing poetry", "starting a podcast", "making a budget",
    "paying off a credit card", "choosing running shoes", "waking up without an alarm", "falling asleep faster",
    "recovering after a long flight", "preparing for a hike in the rain", "caring for a fish tank",
    "making homemade soup", "roasting vegetables", "storing fresh herbs", "reducing food waste",
    "volunteering locally", "learning basic first aid", "preparing an emergency kit", "moving to a new apartment",
    "working with a difficult roommate", "studying with flashcards", "writing an essay", "taking notes in class",
    "learning to skateboard", "building a birdhouse", "starting a book club", "planning a picnic",
]

STORY_SUBJECTS = [
    "a lighthouse keeper who finds a message in a bottle", "a robot that learns to paint",
    "a cat who runs a bakery", "a girl who can talk to trees", "a dragon afraid of heights",
    "an old clockmaker and a broken watch", "two friends lost in a snowstorm", "a village that forgot how to sing",
    "a fox who wants to fly", "a train that never stops", "a librarian who finds a secret door",
    "a boy and a stray dog", "an astronaut alone on the moon", "a tiny mouse with a big dream",
    "a city where it always rains", "a garden that grows overnight", "a pirate who hates the sea",
    "a grandmother's recipe book", "a knight who would rather bake", "a whale that sings to ships",
    "a detective who solves crimes with smell", "a snowman in summer", "a star that falls into a pond",
    "a shy ghost in an old house", "a mail carrier on a windy island", "a musician who lost her voice",
    "a magic umbrella", "the last tree in a desert", "a kid inventor and a helpful machine",
    "an owl who cannot sleep at night", "a teacher on her last day of work", "a painter who sees sounds",
    "a baker's apprentice", "a fisherman and a golden fish", "a chess game in the park",
    "a balloon that escapes a party", "a turtle racing a rabbit again", "a forgotten toy in an attic",
    "a sailor returning home", "a robot dog at a shelter", "a mountain climber's first summit",
]

POEM_SUBJECTS = [
    "autumn leaves", "a quiet morning", "the first snow", "a busy city street", "the desert at noon",
    "a thunderstorm", "old friends", "the smell of coffee", "a river in spring", "the stars over a field",
    "a cat asleep in the sun", "a long train journey", "the end of summer", "a garden after rain",
    "a lighthouse", "mountains at dawn", "a candle", "a full moon", "a walk in the forest", "home",
    "time passing", "a childhood memory", "the wind", "a city at midnight", "a harbor at sunrise",
    "bread baking", "a library", "the color blue", "hope", "a letter never sent", "a bicycle ride",
]

EMAIL_SITUATIONS = [
    "asking my landlord to fix a leaking tap", "telling my team the meeting is moved to Thursday",
    "thanking a colleague for their help on a project", "asking my manager for a day off next week",
    "following up after a job interview", "declining a party invitation politely",
    "asking a professor for an extension on an assignment", "inviting neighbors to a garden party",
    "complaining about a late delivery", "requesting a refund for a broken kettle",
    "introducing myself to a new team", "reminding a friend about money they owe me",
    "confirming a dentist appointment", "asking a client for feedback", "apologizing for missing a call",
    "welcoming a new employee", "announcing that the office will close early on Friday",
    "asking for a recommendation letter", "canceling a gym membership", "booking a table for ten people",
    "asking a coworker to swap shifts", "sharing the notes from yesterday's meeting",
    "asking the school about a field trip", "reporting a broken streetlight to the city",
    "thanking a teacher at the end of the year", "proposing a new schedule for a project",
]

LETTER_SITUATIONS = [
    "to my future self in ten years", "to a grandparent about my first month at university",
    "to a pen pal in another country", "to the editor of a local newspaper about bike lanes",
    "to a favorite author", "to a friend who moved away", "of recommendation for a hardworking student",
    "of resignation from a part-time job", "to a neighbor about a noisy dog", "to my younger self",
    "to a company praising their customer service", "to the mayor about a new park",
]

COMPARE_PAIRS = [
    ("cats", "dogs"), ("tea", "coffee"), ("trains", "planes"), ("renting", "buying a home"),
    ("e-books", "paper books"), ("Python", "JavaScript"), ("running", "swimming"), ("city life", "country life"),
    ("solar power", "wind power"), ("electric cars", "gasoline cars"), ("working from home", "working in an office"),
    ("savings accounts", "index funds"), ("laptops", "desktop computers"), ("weather", "climate"),
    ("viruses", "bacteria"), ("frogs", "toads"), ("alligators", "crocodiles"), ("baking", "frying"),
    ("classical music", "jazz"), ("watercolor", "oil paint"), ("lists", "tuples in Python"),
    ("SQL", "NoSQL databases"), ("RAM", "storage"), ("speed", "velocity"), ("mass", "weight"),
    ("mitosis", "meiosis"), ("a debit card", "a credit card"), ("hiking", "cycling"), ("yoga", "pilates"),
    ("the Arctic", "the Antarctic"), ("rivers", "lakes"), ("stars", "planets"), ("fruits", "vegetables"),
    ("butter", "margarine"), ("public schools", "homeschooling"), ("fiction", "nonfiction"),
    ("a novel", "a short story"), ("chess", "checkers"), ("football", "basketball"), ("violins", "cellos"),
]

QUESTIONS = [
    "Why is the sky blue?", "Why do cats purr?", "How far away is the moon?", "Why do leaves change color in autumn?",
    "What makes a good night's sleep?", "Why do we yawn?", "How do birds know where to migrate?",
    "Why is the ocean salty?", "How do fish breathe underwater?", "What causes hiccups?",
    "Why do onions make people cry?", "How does a compass work?", "Why do we have different blood types?",
    "What is the tallest mountain in the world?", "How many bones are in the human body?",
    "Why do stars twinkle?", "How do plants drink water?", "Why is ice slippery?", "What is a light year?",
    "Why do we dream?", "How does soap clean things?", "Why does bread go stale?", "What is a calorie?",
    "Why do some animals hibernate?", "How do bats find their way in the dark?", "Why do we get goosebumps?",
    "How are rainbows formed?", "What is the difference between a lake and a pond?", "Why do dogs wag their tails?",
    "How does a thermometer work?", "Why are flamingos pink?", "How do airplanes stay in the air?",
    "Why does metal feel colder than wood?", "How do noise-canceling headphones work?", "What is an API?",
    "What is a good way to start learning math again as an adult?", "How much water should I drink in a day?",
    "Is it better to study in the morning or at night?", "What should I look for when buying a used car?",
    "How can I tell if an egg is still fresh?", "Why does my phone battery drain so fast?",
    "What does a product manager do?", "How do I know if a website is safe?", "What is a haiku?",
    "Who invented the printing press?", "What is the capital of Australia?", "Why do we have leap years?",
]

PLACES = [
    "a busy train station", "a quiet beach at sunrise", "a small mountain village", "a night market",
    "an old library", "a bakery early in the morning", "a snowy forest", "a crowded football stadium",
    "a farm in summer", "a space station", "a coral reef", "a rainy city street", "a desert oasis",
    "an abandoned amusement park", "a flower market", "a school playground after class", "a fishing harbor",
    "a hospital waiting room", "a cozy cafe", "a science museum", "a rooftop garden", "a lighthouse on a cliff",
]

OBJECTS = [
    "an old wooden chair", "a smartphone", "a bicycle", "a teapot", "a pair of running shoes", "a violin",
    "a backpack", "a wristwatch", "a candle", "a map", "a kite", "a sewing machine", "a camera", "a telescope",
    "an umbrella", "a guitar", "a bookshelf", "a coffee mug", "a lamp", "a houseplant",
]

# Small coding tasks: (language, task). Kept well away from the bench's code-edit prompts.
CODE_TASKS = [
    "checks whether a string is a palindrome", "returns the factorial of a number",
    "counts the vowels in a string", "returns the n-th Fibonacci number", "reverses the words in a sentence",
    "finds the largest number in a list", "removes duplicates from a list while keeping order",
    "converts Celsius to Fahrenheit", "checks whether a number is prime", "merges two sorted lists",
    "counts how often each word appears in a text", "flattens a nested list", "returns the median of a list",
    "checks whether two strings are anagrams", "capitalizes the first letter of every word",
    "computes the greatest common divisor of two numbers", "reads a text file and counts its lines",
    "returns the second largest number in a list", "converts a number to Roman numerals",
    "validates a simple email address", "splits a list into chunks of size n", "sums the digits of a number",
    "finds the longest word in a sentence", "rotates a list by k positions", "checks for balanced parentheses",
    "converts a binary string to an integer", "returns all even numbers from a list",
    "computes the average of a list of numbers", "transposes a matrix", "counts the characters in a string",
]
CODE_LANGUAGES = ["Python", "Python", "Python", "JavaScript", "Java", "C", "Go", "Rust", "TypeScript"]
CODE_CONCEPTS = [
    "a for loop", "a while loop", "a dictionary in Python", "a class", "inheritance", "a closure",
    "list comprehensions", "exceptions", "recursion", "a hash map", "a linked list", "a stack", "a queue",
    "a binary search", "big-O notation", "unit tests", "version control with git", "a REST API",
    "async and await", "a lambda function", "string formatting in Python", "type hints in Python",
    "a SQL JOIN", "a variable's scope", "immutability", "a decorator in Python", "a generator in Python",
]

# Sentences to rewrite, composed from a few frames.
REWRITE_SENTENCES = [
    "me and him goes to the store yesterday and buyed some apples",
    "the meeting which was scheduled for today has been moved to a later date that is not yet decided",
    "our product is very good and many people like it a lot because it is good",
    "due to the fact that it was raining we made the decision to stay inside the house",
    "i think maybe we should possibly consider looking at other options at some point",
    "the report was written by the team and it was sent by the manager to the client",
    "hey can u send me the file asap thx",
    "the new park is nice it has trees and a pond and many benches people like it",
    "in my opinion I personally believe that the plan is not a very good plan",
    "the cat sat on the mat and then the cat slept on the mat for a long time",
]
REWRITE_STYLES = [
    "more formal", "more friendly", "shorter", "clearer", "in the passive voice", "in the active voice",
    "with correct grammar", "for a ten-year-old", "more polite", "more exciting",
]

AUDIENCES = [
    "", "", "", " in simple terms", " to a beginner", " to a ten-year-old", " in one paragraph",
    " in three sentences", " step by step", " using an everyday analogy", " for a high school student",
    " briefly", " with an example",
]
COUNTS = ["three", "four", "five", "six", "seven", "a few", "some"]

# ---------------------------------------------------------------------------------------------------------
# Paragraphs to summarize, composed from frames with slots so each is new text.

NAMES = ["Maria", "Tom", "Aisha", "Kenji", "Lena", "Carlos", "Priya", "Jonas", "Fatima", "Oliver", "Mei", "Samuel"]
TOWNS = ["Riverton", "Oakfield", "Maplewood", "Port Ellis", "Greenhill", "Stonebridge", "Lakeside", "Westbury"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
ITEMS = ["a community garden", "a new bus route", "a weekend farmers market", "a free coding class",
         "a repair cafe", "a summer reading program", "a bike sharing scheme", "an outdoor cinema"]
PRODUCTS = ["blender", "pair of headphones", "desk lamp", "electric kettle", "backpack", "robot vacuum",
            "fitness tracker", "coffee grinder"]


def _paragraph(rng: random.Random) -> str:
    """A short made-up text (news note, review, diary, report or notice) to be summarized."""
    name, other = rng.sample(NAMES, 2)
    town = rng.choice(TOWNS)
    day = rng.choice(WEEKDAYS)
    item = rng.choice(ITEMS)
    n = rng.randint(12, 400)
    frame = rng.randrange(5)
    if frame == 0:
        return (f"Residents of {town} gathered on {day} evening to discuss plans for {item}. {name}, who organized "
                f"the meeting, said that {n} people had signed a petition in support. Some neighbors worried about "
                f"the cost and about noise, while others argued that the project would bring people together. "
                f"The council will review the proposal next month and publish a decision after a short public "
                f"consultation.")
    if frame == 1:
        product = rng.choice(PRODUCTS)
        return (f"I bought this {product} {rng.randint(2, 11)} weeks ago after reading several reviews. Setting it "
                f"up took only a few minutes and the instructions were clear. It works well most of the time, "
                f"although it is louder than I expected and the cable is rather short. Customer support answered "
                f"my question within a day. For the price of {n} dollars I think it is a fair deal, but I would "
                f"not call it perfect.")
    if frame == 2:
        return (f"Day {rng.randint(2, 9)} of our trip. {name} and I left {town} early and walked along the coast "
                f"for about {rng.randint(8, 25)} kilometers. The weather changed three times: sun, then fog, then a "
                f"light rain that lasted until lunch. We stopped at a small cafe where {other} recommended the fish "
                f"soup, which was excellent. In the afternoon our legs were tired, so we took the bus back and spent "
                f"the evening planning tomorrow's route.")
    if frame == 3:
        pct = rng.randint(3, 40)
        return (f"The quarterly report shows that sales rose by {pct} percent compared with the same period last "
                f"year. Most of the growth came from online orders, while shop sales stayed flat. Costs also "
                f"increased, mainly because of higher shipping prices. {name}, the head of finance, recommends "
                f"keeping the current budget but moving {n} thousand dollars from advertising to customer support, "
                f"where complaints have grown.")
    return (f"Please note that the {town} sports center will be closed from {day} for {rng.randint(2, 6)} weeks "
            f"while the pool is repaired. During the closure, members can use the gym at the school on Park Road "
            f"at no extra cost. Classes will continue there on a reduced timetable, and {name} will send the new "
            f"schedule by email. Members who cannot attend may pause their membership without a fee.")


# ---------------------------------------------------------------------------------------------------------
# One function per kind of prompt; each draws what it needs from rng.

def _explain(rng: random.Random) -> str:
    topic = rng.choice(CONCEPTS)
    frame = rng.choice(["Explain {t}{a}.", "Can you explain {t}{a}?", "What is {t}? Explain it{a}.",
                        "Help me understand {t}{a}.", "Give me a short explanation of {t}.",
                        "I never understood {t}. Can you explain it{a}?", "Teach me the basics of {t}."])
    return frame.format(t=topic, a=rng.choice(AUDIENCES))


def _how_to(rng: random.Random) -> str:
    act = rng.choice(ACTIVITIES)
    frame = rng.choice(["How do I get started with {x}?", "What is the best way to approach {x}?",
                        "Give me a step-by-step guide to {x}.", "I want to try {x}. Where should I begin?",
                        "What are the steps for {x}?", "Walk me through {x}."])
    return frame.format(x=act)


def _tips(rng: random.Random) -> str:
    act = rng.choice(ACTIVITIES)
    frame = rng.choice(["List {n} tips for {x}.", "What are {n} common mistakes people make when {x}?",
                        "Share {n} practical tips for {x}.", "Give me {n} pieces of advice about {x}.",
                        "What should a beginner know about {x}? List {n} points."])
    return frame.format(n=rng.choice(COUNTS), x=act)


def _story(rng: random.Random) -> str:
    subject = rng.choice(STORY_SUBJECTS)
    frame = rng.choice(["Write a short story about {s}.", "Tell me a bedtime story about {s}.",
                        "Write a very short story, under 150 words, about {s}.",
                        "Write the opening paragraph of a story about {s}.",
                        "Write a funny short story about {s}.", "Write a sad short story about {s}."])
    return frame.format(s=subject)


def _poem(rng: random.Random) -> str:
    subject = rng.choice(POEM_SUBJECTS)
    frame = rng.choice(["Write a poem about {s}.", "Write a haiku about {s}.", "Write a four-line poem about {s}.",
                        "Write a limerick about {s}.", "Compose a short rhyming poem about {s}.",
                        "Write a free-verse poem about {s}."])
    return frame.format(s=subject)


def _email(rng: random.Random) -> str:
    situation = rng.choice(EMAIL_SITUATIONS)
    frame = rng.choice(["Write an email {s}.", "Write a short, polite email {s}.", "Draft a friendly email {s}.",
                        "Help me write a professional email {s}."])
    return frame.format(s=situation)


def _letter(rng: random.Random) -> str:
    return rng.choice(["Write a letter {s}.", "Write a short letter {s}.", "Draft a heartfelt letter {s}."]).format(
        s=rng.choice(LETTER_SITUATIONS))


def _compare(rng: random.Random) -> str:
    a, b = rng.choice(COMPARE_PAIRS)
    if rng.random() < 0.5:
        a, b = b, a
    frame = rng.choice(["Compare {a} and {b}.", "What are the differences between {a} and {b}?",
                        "What are the pros and cons of {a} versus {b}?", "Which is better, {a} or {b}? Explain.",
                        "How are {a} and {b} similar, and how are they different?"])
    return frame.format(a=a, b=b)


def _summarize(rng: random.Random) -> str:
    ask = rng.choice(["Summarize this in one sentence:", "Give a brief summary of the following paragraph.",
                      "What is the main idea of this passage?", "Summarize the key facts below as a short list.",
                      "Condense this paragraph into two sentences:", "TL;DR this for me:"])
    return f"{ask}\n\n{_paragraph(rng)}"


def _question(rng: random.Random) -> str:
    return rng.choice(QUESTIONS)


def _rewrite(rng: random.Random) -> str:
    sentence = rng.choice(REWRITE_SENTENCES)
    style = rng.choice(REWRITE_STYLES)
    return rng.choice(["Rewrite this sentence to be {s}: \"{x}\"", "Make this {s}: {x}",
                       "Please rewrite the following so it is {s}.\n\n{x}"]).format(s=style, x=sentence)


def _advice(rng: random.Random) -> str:
    frame = rng.choice([
        "I feel overwhelmed by {x}. Any advice?", "My friend is struggling with {x}. How can I help?",
        "I keep failing at {x}. What am I doing wrong?", "What advice would you give someone who is {x}?",
        "I have one month to get better at {x}. What should I do?",
    ])
    return frame.format(x=rng.choice(ACTIVITIES))


def _describe(rng: random.Random) -> str:
    if rng.random() < 0.6:
        return rng.choice(["Describe {p}.", "Describe {p} using all five senses.", "Paint a picture in words of {p}.",
                           "Write a short description of {p} for a travel guide."]).format(p=rng.choice(PLACES))
    return rng.choice(["Describe {o} to someone who has never seen one.", "Write a product description for {o}.",
                       "Describe {o} in three sentences.", "What is the history of {o}? Keep it short."]).format(
        o=rng.choice(OBJECTS))


def _code(rng: random.Random) -> str:
    if rng.random() < 0.7:
        lang = rng.choice(CODE_LANGUAGES)
        task = rng.choice(CODE_TASKS)
        return rng.choice(["Write a {l} function that {t}.", "How do I write a {l} function that {t}?",
                           "Show me {l} code that {t}, with a short explanation.",
                           "Write a short {l} program that {t}."]).format(l=lang, t=task)
    concept = rng.choice(CODE_CONCEPTS)
    return rng.choice(["Explain {c} with a small code example.", "What is {c} in programming?",
                       "When should I use {c}? Give an example.", "Show a simple example of {c}."]).format(c=concept)


KINDS = {  # kind -> (builder, weight)
    "explain": (_explain, 12), "how_to": (_how_to, 9), "tips": (_tips, 9), "story": (_story, 7),
    "poem": (_poem, 5), "email": (_email, 6), "letter": (_letter, 3), "compare": (_compare, 7),
    "summarize": (_summarize, 9), "question": (_question, 5), "rewrite": (_rewrite, 5), "advice": (_advice, 6),
    "describe": (_describe, 6), "code": (_code, 11),
}


# ---------------------------------------------------------------------------------------------------------
# Overlap with the benchmark.

def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(text: str, n: int = OVERLAP_NGRAM) -> set[tuple[str, ...]]:
    """All runs of n consecutive words (lowercase, punctuation dropped); a shorter text is its own single run."""
    words = _words(text)
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def load_bench_prompts(path: pathlib.Path = BENCH_PROMPTS) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def overlaps_bench(prompt: str, bench_ngrams: set[tuple[str, ...]], bench_texts: list[str]) -> bool:
    """True when the prompt shares an OVERLAP_NGRAM-word run with a bench prompt, or either contains the other."""
    if ngrams(prompt) & bench_ngrams:
        return True
    p = " ".join(_words(prompt))
    return any(p and (p in b or b in p) for b in bench_texts)


def generate_prompts(count: int = 4000, seed: int = 0, bench_path: pathlib.Path = BENCH_PROMPTS) -> list[dict]:
    """``count`` distinct prompts as ``{"index", "kind", "prompt"}``, in a seeded order with kinds mixed.

    Duplicates and anything overlapping the bench are skipped; raises if the templates run out of new
    prompts before ``count`` (about 10x the attempts).
    """
    rng = random.Random(seed)
    bench = load_bench_prompts(bench_path)
    bench_ngrams = set().union(*(ngrams(b) for b in bench))
    bench_texts = [" ".join(_words(b)) for b in bench]
    names = list(KINDS)
    weights = [KINDS[k][1] for k in names]
    seen: set[str] = set()
    out: list[dict] = []
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > 20 * count + 1000:
            raise RuntimeError(f"templates exhausted: {len(out)} distinct prompts after {attempts} attempts")
        kind = rng.choices(names, weights)[0]
        prompt = KINDS[kind][0](rng).replace("  ", " ")
        if prompt in seen or overlaps_bench(prompt, bench_ngrams, bench_texts):
            continue
        seen.add(prompt)
        out.append({"index": len(out), "kind": kind, "prompt": prompt})
    return out


if __name__ == "__main__":
    import sys

    for p in generate_prompts(int(sys.argv[1]) if len(sys.argv) > 1 else 20):
        print(json.dumps(p))
