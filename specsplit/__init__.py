"""specsplit: speculative decoding split across machines.

The client SDK is importable from the top level: ``specsplit.Client`` and ``specsplit.AsyncClient``.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy so that importing specsplit's core does not pull grpc into every process.
    if name in ("Client", "AsyncClient", "GenerateChunk"):
        from specsplit import client

        return getattr(client, name)
    raise AttributeError(name)
