"""specsplit: speculative decoding split across machines.

The client SDK is importable from the top level: ``specsplit.Client`` and ``specsplit.AsyncClient``
(``specsplit.TLS`` for an orchestrator serving TLS).
"""

import os

# Before torch loads libgomp: idle OpenMP threads must sleep, not spin. specsplit runs a model's forwards
# on its own thread while other threads (the one that loaded the model, gRPC workers) stay idle; spinning
# idle teams on a 2-core machine made each SmolLM2 step take ~1.9 s instead of ~77 ms (measured with
# the embedded CLI and the verifier engine). Set OMP_WAIT_POLICY yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy so that importing specsplit's core does not pull grpc into every process.
    if name in ("Client", "AsyncClient", "GenerateChunk"):
        from specsplit import client

        return getattr(client, name)
    if name == "TLS":
        from specsplit.tls import TLS

        return TLS
    raise AttributeError(name)
