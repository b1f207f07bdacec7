"""A generation request as the orchestrator takes it: the prompt's tokens (from text, chat messages or ids) and the
checks that refuse a bad request with INVALID_ARGUMENT before any session exists."""

from __future__ import annotations

import functools
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


# What one request may carry (past it: INVALID_ARGUMENT), so that no client holds an orchestrator's memory or its
# interpreter lock: each round scans the text for every stop string, and a Cancel for an id not yet started is kept a
# minute (a review's runs before these bounds, tiny model: 20,000 stop strings of 200 characters took one generation from 0.3 to 11.7 s
# and another client's 40 tokens from 0.1 to 4-5 s; 30 MB ids in Cancels held 240 MB).
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256
MAX_ID_CHARS = 256  # a session id (it names Redis keys and goes to every service) or a draft's name


def check_id(what: str, value: str) -> None:
    if len(value) > MAX_ID_CHARS or not value.isprintable():
        raise InvalidArgument(f"{what} must be at most {MAX_ID_CHARS} printable characters, got {len(value)} "
                              f"starting {value[:32]!r}")


@functools.lru_cache(maxsize=8)
def longest_token(tokenizer) -> int:
    """Characters in the vocabulary's longest token (special ones included): a text of n characters is at least
    n / this many tokens."""
    return max(1, max((len(token) for token in tokenizer.get_vocab()), default=1))


def tokenize_prompt(tokenizer, prompt: str = "", messages: list[dict] | None = None, token_ids: list[int] | None = None,
                    chat_template: bool = True, max_context: int | None = None) -> list[int]:
    """Exactly one of prompt, messages and token_ids; a prompt goes through the chat template unless told not to.
    max_context: refuse, before tokenizing it, a text that cannot fit in that many tokens (in a review's run, before
    this check and the 4 MB message cap, a 60 MB prompt took the orchestrator to 12 GB while it tokenized)."""
    given = sum(bool(x) for x in (prompt, messages, token_ids))
    if given == 0:
        raise InvalidArgument("prompt is empty: give a prompt, chat messages or prompt token ids")
    if given > 1:
        raise InvalidArgument("give exactly one of prompt, messages and prompt_token_ids")
    chars = len(prompt) + sum(len(m["content"]) for m in messages or ())
    if max_context is not None and (chars > max_context * longest_token(tokenizer)
                                    or len(messages or ()) >= max_context):
        raise InvalidArgument(f"prompt of {chars} characters in {len(messages or ()) or 1} message(s) cannot fit the "
                              f"model's context of {max_context} tokens: shorten the prompt")
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
    if len(request.stop) > MAX_STOP_STRINGS or any(len(stop) > MAX_STOP_CHARS for stop in request.stop):
        raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters, got "
                              f"{len(request.stop)} (the longest {max(map(len, request.stop))} characters)")
    check_id("session_id", request.session_id)
    check_id("draft", request.draft)
    request.sampling.validate()
