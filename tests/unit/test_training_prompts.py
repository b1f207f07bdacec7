"""The synthetic training prompts: seeded, diverse, and never overlapping the benchmark prompts."""

import collections

from draft_service.training.prompts import (KINDS, OVERLAP_NGRAM, generate_prompts, load_bench_prompts, ngrams,
                                            overlaps_bench)


def test_deterministic_when_seeded():
    assert generate_prompts(300, seed=3) == generate_prompts(300, seed=3)
    assert generate_prompts(300, seed=3) != generate_prompts(300, seed=4)


def test_no_prompt_shares_an_8_word_run_with_a_bench_prompt():
    bench = load_bench_prompts()
    bench_ngrams = set().union(*(ngrams(b) for b in bench))
    prompts = [p["prompt"] for p in generate_prompts(4000)]
    assert OVERLAP_NGRAM == 8
    assert not set(prompts) & set(bench)
    shared = [p for p in prompts if ngrams(p) & bench_ngrams]
    assert shared == []


def test_overlap_check_catches_a_bench_prompt_and_a_paraphrase_sharing_8_words():
    bench = load_bench_prompts()
    bench_ngrams = set().union(*(ngrams(b) for b in bench))
    assert overlaps_bench(bench[0], bench_ngrams, [])
    # "give me three tips for learning to play the" is an 8-word run of a bench prompt
    assert overlaps_bench("Please, give me three tips for learning to play the violin!", bench_ngrams, [])
    assert not overlaps_bench("Give me three tips for learning the violin.", bench_ngrams, [])


def test_prompts_are_distinct_and_cover_every_kind():
    prompts = generate_prompts(4000)
    texts = [p["prompt"] for p in prompts]
    assert len(set(texts)) == len(texts) == 4000
    assert [p["index"] for p in prompts] == list(range(4000))
    kinds = collections.Counter(p["kind"] for p in prompts)
    assert set(kinds) == set(KINDS)
    assert max(kinds.values()) < 0.25 * len(prompts)
    assert len(set(t.split()[0] for t in texts)) > 30  # many different openings, not one template
