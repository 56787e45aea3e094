"""Suite-wide settings: tiny models on a 2-core machine run fastest single-threaded."""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)
