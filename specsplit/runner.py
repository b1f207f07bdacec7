"""One thread per model that runs all of its forwards.

Torch's OpenMP pool is per calling thread: forwards issued from many gRPC worker threads each bring up
a team of OpenMP threads, and idle teams spin against the busy one (measured on 2 cores: 52 ms per
SmolLM2 step from one thread, ~80 ms when steps hop between gRPC threads). Funnelling every forward
of a model through one long-lived thread keeps a single team and serialises use of the model.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


class ModelRunner:
    def __init__(self, name: str, threads: int = 0):
        """threads: torch CPU threads of this model's forwards (0: the process's). OpenMP's thread count is
        per calling thread, so a draft and a verifier in one process can each keep to their own cores."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"specsplit-{name}",
                                            initializer=torch.set_num_threads if threads > 0 else None,
                                            initargs=(threads,) if threads > 0 else ())

    def __call__(self, fn, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` on the model thread under inference mode and return its result."""
        return self._executor.submit(_inference, fn, args, kwargs).result()

    def close(self) -> None:
        self._executor.shutdown(wait=False)


def _inference(fn, args, kwargs):
    with torch.inference_mode():
        return fn(*args, **kwargs)
