"""Suite-wide settings: tiny models on a 2-core machine run fastest single-threaded.

The repository root goes at the END of sys.path: `tests.*` and `bench.*` import
from it, while `ouro_fast` still comes from the installed package (the source
tree alone lacks the compiled core).
"""

import os
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The tiny preset in float32 with seed 1: the engine tests' shared checkpoint."""
    from ouro_fast.model.checkpoints import make_checkpoint

    return str(
        make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=1, dtype="float32", progress=False)
    )


if torch.cuda.is_available():
    import gc

    @pytest.fixture(autouse=True)
    def _release_gpu_memory():
        """An engine takes most free GPU memory for its KV pool: free the last test's engines (the
        first one of a process sits in a reference cycle) and hand their cached blocks back."""
        yield
        gc.collect()
        torch.cuda.empty_cache()
