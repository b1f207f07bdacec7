import os
import sys
import pathlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as specsplit/__init__.py does, before torch loads
# Half drafts started by tests time their dtypes afresh, under the tests' load: none of it is kept for later starts.
os.environ["SPECSPLIT_DRAFT_CALIBRATION"] = "off"
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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny target saved where child processes can load it, and the same model in this process."""
    from tiny import tiny_loaded

    path = tmp_path_factory.mktemp("tiny-target")
    loaded = tiny_loaded(seed=0)
    loaded.model.save_pretrained(path)
    loaded.tokenizer.save_pretrained(path)
    return path, loaded
