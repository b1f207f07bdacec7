import pytest

from draft_service.ngram import NgramProposer
from specsplit.config import DraftConfig, OrchestratorConfig, VerifierConfig
from specsplit.launch import start_stack
from tiny import tiny_loaded


@pytest.fixture(scope="module")
def target():
    return tiny_loaded(seed=0)


@pytest.fixture(scope="module")
def stack(target):
    stack = start_stack(target, [NgramProposer(DraftConfig())],
                        verifier_config=VerifierConfig(max_tree_nodes=16, max_sessions=4, max_context=256),
                        orchestrator_config=OrchestratorConfig(max_new_tokens_limit=100))
    yield stack
    stack.close()
