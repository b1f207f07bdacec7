import os
import sys
import pathlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(pathlib.Path(__file__).parent))  # tests/tiny.py

import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))
