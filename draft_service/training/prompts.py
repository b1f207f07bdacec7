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
# Vocabulary (vocabulary.json): hundreds of topics across the kinds of things people ask a small chat model
# about, task and style lists (small coding tasks kept well away from the bench's code-edit prompts), and the
# names, towns and items the paragraphs to summarize are composed from.
_VOCABULARY = json.loads(pathlib.Path(__file__).with_name("vocabulary.json").read_text())
(CONCEPTS, ACTIVITIES, STORY_SUBJECTS, POEM_SUBJECTS, EMAIL_SITUATIONS, LETTER_SITUATIONS, COMPARE_PAIRS, QUESTIONS,
 PLACES, OBJECTS, CODE_TASKS, CODE_LANGUAGES, CODE_CONCEPTS, REWRITE_SENTENCES, REWRITE_STYLES, AUDIENCES, COUNTS,
 NAMES, TOWNS, WEEKDAYS, ITEMS, PRODUCTS) = (_VOCABULARY[name] for name in (
    "concepts", "activities", "story_subjects", "poem_subjects", "email_situations", "letter_situations",
    "compare_pairs", "questions", "places", "objects", "code_tasks", "code_languages", "code_concepts",
    "rewrite_sentences", "rewrite_styles", "audiences", "counts", "names", "towns", "weekdays", "items", "products"))


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
