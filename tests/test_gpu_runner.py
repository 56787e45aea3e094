"""The Triton runner (kernels, static buffers, packed inputs) against the PyTorch reference runner.

On a CPU-only machine the kernels run under TRITON_INTERPRET=1 (no CUDA graphs);
on a GPU this also exercises graph capture and replay of decode steps.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from ouro_fast.engine.engine import Engine, EngineConfig  # noqa: E402
from ouro_fast.engine.sampling import SamplingParams  # noqa: E402
from ouro_fast.model.checkpoints import make_checkpoint  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(10, 30))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(
        make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=1, dtype="float32", progress=False)
    )


def generate(engine, params):
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.request
    assert engine.bt.num_free_blocks == engine.bt.num_blocks
    return [(done[str(i)].output_ids, done[str(i)].exit_loops) for i in range(len(PROMPTS))]


@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_triton_runner_matches_torch_runner(model_dir, threshold):
    params = SamplingParams(max_tokens=6, temperature=0, exit_threshold=threshold, ignore_eos=True)
    opts = dict(model=model_dir, dtype="float32", max_num_batched_tokens=16)
    want = generate(Engine(EngineConfig(runner="torch", **opts)), params)
    engine = Engine(EngineConfig(runner="triton", **opts))
    assert type(engine.runner).__name__ == "GpuModelRunner"
    got = generate(engine, params)
    assert got == want
    if threshold < 1.0:
        assert len({loop for _, loops in got for loop in loops}) > 1
