import os
import sys
import pathlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(pathlib.Path(__file__).parent))  # tests/tiny.py

import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def redis_server():
    """A private redis-server (no persistence) on a free port for the whole test session."""
    from redis_server import RedisServer

    server = RedisServer().start()
    yield server
    server.stop()
