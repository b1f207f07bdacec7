"""Incremental detokenization with stop strings (orchestrator.detok.TextStream)."""

from tiny import tiny_tokenizer

from orchestrator.detok import TextStream


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]  # (byte-level: a token a byte)


def run(rounds: list[str], stop: list[str]) -> tuple[list[int], str]:
    """The tokens kept and the text streamed when ``rounds`` arrive one after the other."""
    tokenizer = tiny_tokenizer()
    stream, kept, text = TextStream(tokenizer, stop), [], ""
    for piece in rounds:
        got, delta, hit = stream.add(ids(tokenizer, piece))
        kept, text = kept + got, text + delta
        if hit:
            return kept, text
    return kept, text + stream.finish()


def test_overlapping_stop_strings_cut_the_same_text_however_the_rounds_group_the_tokens():
    """"abcdef gh" starts first but "cd" completes first: the text ends before "cd", whether the tokens come one at a
    time or in one round (in one round the text was cut before "abcdef gh", which the kept tokens never complete)."""
    stop = ["abcdef gh", "cd"]
    one_by_one = run(list("abcdef gh"), stop)
    together = run(["abcdef gh"], stop)
    assert one_by_one == together
    assert together[1] == "ab" and tiny_tokenizer().decode(together[0]) == "abcd"


def test_rewind_forgets_a_round_and_finish_flushes_what_was_held_back():
    tokenizer = tiny_tokenizer()
    stream = TextStream(tokenizer, ["xyz"])
    _, text, _ = stream.add(ids(tokenizer, "hello x"))  # "x" held back: it may start "xyz"
    assert text == "hello "
    mark = stream.mark()
    stream.add(ids(tokenizer, "q more"))  # a round whose tokens are not sent after all
    stream.rewind(mark)
    assert stream.finish() == "x"
