"""bench/gpu/stream_bench.py's kernels read every element exactly once, whatever the grid.

The benchmark's TB/s figures are bytes / time: they hold only if each CTA's share
covers the buffer without gaps or overlaps. Checked under the Triton interpreter
on the CPU (the resident kernels' barriers need a GPU; they call the same shares).
The continuous mode is the resident kernels with SYNC=False, run whole here; so is the prefetch kernel,
with shares both longer and shorter than its PREF prefetched blocks.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed")

from bench.gpu import stream_bench  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("grid", [1, 3, 7])
def test_pointer_shares_cover_the_buffer_once(grid):
    n = 5 * 2048
    w = torch.randn(n, generator=torch.Generator().manual_seed(grid)).to(DEV, torch.bfloat16)
    out = torch.zeros(grid, device=DEV)
    stream_bench._stream_kernel[(grid,)](w, n, out, BLOCK=2048)
    assert out.sum().item() == pytest.approx(w.float().sum().item(), abs=1e-2)


@pytest.mark.parametrize("grid", [1, 3, 7])
def test_tma_shares_cover_one_layer_once(grid):
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415

    layers, rows, bc = 3, 5 * 32, 256
    m = torch.randn(layers, rows * bc, generator=torch.Generator().manual_seed(grid)).to(DEV, torch.bfloat16)
    desc = TensorDescriptor.from_tensor(m.view(-1, bc), [32, bc])
    out = torch.zeros(grid, device=DEV)
    stream_bench._stream_tma_kernel[(grid,)](desc, 1 * rows, rows, out, BR=32, BC=bc, STAGES=2)
    assert out.sum().item() == pytest.approx(m[1].float().sum().item(), abs=1e-2)


def _layered(layers, ns, seed):
    # Each matrix a [layers, n] view of a wider buffer, so a layer stride other than n is exercised.
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(layers, n + 1024, generator=g).to(DEV, torch.bfloat16)[:, :n] for n in ns]


@pytest.mark.parametrize("grid", [1, 3, 7])
def test_continuous_kernel_reads_every_layer_once(grid):
    layers, block = 3, 1024
    ns = [n * block for n in (3, 1, 5, 2)]
    mats = _layered(layers, ns, grid)
    out, bar = torch.zeros(grid, device=DEV), torch.zeros(2, dtype=torch.int32, device=DEV)
    strides = [m.stride(0) for m in mats]
    stream_bench._resident_kernel[(grid,)](*mats, *ns, *strides, layers, out, bar, BLOCK=block, SYNC=False)
    assert out.sum().item() == pytest.approx(sum(m.float().sum().item() for m in mats), abs=1e-2)


@pytest.mark.parametrize("grid", [1, 3, 7])
def test_continuous_tma_kernel_reads_every_layer_once(grid):
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415

    layers, br, bc = 3, 32, 256
    rows = [r * br for r in (3, 1, 5, 2)]
    g = torch.Generator().manual_seed(grid)
    mats = [torch.randn(layers, r * bc, generator=g).to(DEV, torch.bfloat16) for r in rows]
    descs = [TensorDescriptor.from_tensor(m.view(-1, bc), [br, bc]) for m in mats]
    out, bar = torch.zeros(grid, device=DEV), torch.zeros(2, dtype=torch.int32, device=DEV)
    stream_bench._resident_tma_kernel[(grid,)](*descs, *rows, layers, out, bar, BR=br, BC=bc, STAGES=2,
                                               SYNC=False)  # fmt: skip
    assert out.sum().item() == pytest.approx(sum(m.float().sum().item() for m in mats), abs=1e-2)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("pref", [1, 2, 4])
@pytest.mark.parametrize("grid", [1, 3, 7])
def test_prefetch_kernel_reads_every_layer_once(grid, pref, split):
    # Shares of 0..5 blocks: at grid 7 every share is shorter than 2 blocks, at grid 1 some are longer than 4.
    layers, block = 3, 1024
    ns = [n * block for n in (3, 1, 5, 2)]
    mats = _layered(layers, ns, grid)
    out, bar = torch.zeros(grid, device=DEV), torch.zeros(2, dtype=torch.int32, device=DEV)
    strides = [m.stride(0) for m in mats]
    stream_bench._prefetch_kernel[(grid,)](*mats, *ns, *strides, layers, out, bar, BLOCK=block, PREF=pref,
                                           SYNC=False, SPLIT=split)  # fmt: skip
    assert out.sum().item() == pytest.approx(sum(m.float().sum().item() for m in mats), abs=1e-2)
