"""The fast GPU path: everything the GPU runner owns, behind two public classes.

- GpuRunner (runner.py): executes a StepPlan on the Triton kernels from static
  buffers (staging.py), at padded shapes captured as CUDA graphs (shapes.py).
- RunAhead (runahead.py): while a batch is decode-only, the device drives it in
  decode lanes (lanes.py, lane_kernels.py) and launches run ahead of the host, which
  replays each launch's records into the scheduler and hands the engine a
  StepResult per launch; newcomers' prompts ride in free lanes (riders.py).

Importing this package imports triton.
"""

from .runahead import RunAhead
from .runner import GpuRunner

__all__ = ["GpuRunner", "RunAhead"]
