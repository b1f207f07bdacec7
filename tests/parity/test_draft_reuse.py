"""A draft session that continues the latest ended one (a conversation's next turn) starts from its cache: only
the new tokens are computed, and it drafts what a fresh session would."""

import pytest

from draft_service.drafter import Drafter, GrowthControl
from draft_service.proposers import REUSE_MIN_TOKENS, ModelProposer
from specsplit import kvcache
from specsplit.config import DraftConfig
from tiny import hf_greedy, tiny_loaded

PROMPT = [258, 72, 101, 108, 108, 111, 32, 116, 104, 101, 114, 101]


@pytest.fixture(scope="module")
def model():
    return tiny_loaded(seed=0, layers=2, eos=False)


def counted(proposer) -> list[int]:
    """Record the tokens of each of the proposer's catch-up forwards (a prompt, the tokens a round brings)."""
    sizes: list[int] = []
    real = proposer._catch_up

    def catch_up(session, token_ids):
        sizes.append(len(token_ids) - min(len(token_ids) - 1, kvcache.common_length(session.cached, token_ids)))
        return real(session, token_ids)

    proposer._catch_up = catch_up
    return sizes


def first_round(drafter: Drafter, session_id: str, token_ids: list[int], max_nodes: int = 4) -> list[int]:
    """A round's whole tree (verified at once): its token ids."""
    control, tree = GrowthControl(), []
    for step in drafter.grow(session_id, [], len(token_ids), max_nodes, control):
        tree += step.token_ids
        if step.done:
            control.verify(len(tree))
    return tree


def test_the_next_turn_of_a_conversation_computes_only_its_new_tokens(model):
    proposer = ModelProposer(model, DraftConfig(branch_threshold=1.0))
    drafter = Drafter(proposer)
    sizes = counted(proposer)
    drafter.start("turn1", PROMPT, model.fingerprint)
    first_round(drafter, "turn1", PROMPT)
    drafter.end("turn1")  # no round running: its cache is kept
    answer = hf_greedy(model.model, PROMPT, 6)
    turn2 = PROMPT + answer + [10, 85, 115, 101, 114]
    sizes.clear()
    drafter.start("turn2", turn2, model.fingerprint)
    reused = first_round(drafter, "turn2", turn2)
    assert sizes[0] <= len(turn2) - len(PROMPT)  # at most the answer and the new message, not the whole prompt

    fresh = Drafter(ModelProposer(model, DraftConfig(branch_threshold=1.0)))
    fresh.start("turn2", turn2, model.fingerprint)
    assert reused == first_round(fresh, "turn2", turn2)  # the same draft as from scratch


def test_an_unrelated_prompt_or_one_after_a_session_ended_mid_round_starts_from_scratch(model):
    proposer = ModelProposer(model, DraftConfig(branch_threshold=1.0))
    drafter = Drafter(proposer)
    sizes = counted(proposer)
    drafter.start("a", PROMPT, model.fingerprint)
    first_round(drafter, "a", PROMPT)
    drafter.end("a")
    other = [258] + list(range(40, 40 + REUSE_MIN_TOKENS + 4))  # shares only the first token
    sizes.clear()
    drafter.start("b", other, model.fingerprint)
    first_round(drafter, "b", other)
    assert sizes[0] == len(other)

    running = drafter.grow("b", [], len(other), 4, GrowthControl())
    next(running)  # a round suspended mid-way holds the session: its cache may still change
    drafter.end("b")  # (reusable only once the round lets go of it)
    sizes.clear()
    drafter.start("c", other + [50, 51], model.fingerprint)
    first_round(drafter, "c", other + [50, 51])
    assert sizes[0] == len(other) + 2  # (after waiting REUSE_WAIT_S for b's round)
    running.close()
