"""A generation request as the orchestrator takes it: the prompt's tokens (from text, chat messages or ids) and the
checks that refuse a bad request with INVALID_ARGUMENT before any session exists."""

from __future__ import annotations

from dataclasses import dataclass, field

from specsplit.errors import InvalidArgument
from specsplit.rpc import VerifierInfo
from specsplit.sampling import SamplingParams


@dataclass
class GenerationRequest:
    prompt_token_ids: list[int]
    max_new_tokens: int
    stop: list[str] = field(default_factory=list)
    draft: str = "auto"
    session_id: str = ""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    resumable: bool = False  # a dropped stream detaches the session (resumable) instead of cancelling it
    resume_session_id: str = ""  # continue this stored session instead of starting one
    resume_from_token: int = 0  # generated tokens the resuming client already has


def tokenize_prompt(tokenizer, prompt: str = "", messages: list[dict] | None = None, token_ids: list[int] | None = None,
                    chat_template: bool = True) -> list[int]:
    """Exactly one of prompt, messages and token_ids; a prompt goes through the chat template unless told not to."""
    given = sum(bool(x) for x in (prompt, messages, token_ids))
    if given == 0:
        raise InvalidArgument("prompt is empty: give a prompt, chat messages or prompt token ids")
    if given > 1:
        raise InvalidArgument("give exactly one of prompt, messages and prompt_token_ids")
    if token_ids:
        return list(token_ids)
    if prompt and not chat_template:
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if tokenizer.chat_template is None:
        if messages:
            raise InvalidArgument("this model's tokenizer has no chat template; send a plain prompt")
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    messages = messages or [{"role": "user", "content": prompt}]
    try:  # which roles exist is the template's business; one it refuses is the caller's error
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as err:  # jinja2's TemplateError and raise_exception() calls in templates
        raise InvalidArgument(f"the chat template refused these messages: {err}") from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def check_request(request: GenerationRequest, info: VerifierInfo, max_new_tokens_limit: int) -> None:
    """The request against the target (vocabulary, context) and this server's limits."""
    if not request.prompt_token_ids:
        raise InvalidArgument("prompt is empty: it tokenized to no tokens")
    bad = [t for t in request.prompt_token_ids if not 0 <= t < info.vocab_size]
    if bad:
        raise InvalidArgument(f"prompt token id {bad[0]} is outside the vocabulary [0, {info.vocab_size})")
    if len(request.prompt_token_ids) >= info.max_context:
        raise InvalidArgument(f"prompt has {len(request.prompt_token_ids)} tokens; the model's context holds "
                              f"{info.max_context} (prompt + generated): shorten the prompt")
    if request.max_new_tokens <= 0:
        raise InvalidArgument(f"max_new_tokens must be > 0, got {request.max_new_tokens}")
    if request.max_new_tokens > max_new_tokens_limit:
        raise InvalidArgument(f"max_new_tokens {request.max_new_tokens} is over this server's limit of "
                              f"{max_new_tokens_limit}")
    request.sampling.validate()
