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
from ouro_fast.model.reference import DenseReference  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(10, 30))]


def generate(engine, params):
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.request
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks
    return [(done[str(i)].output_ids, done[str(i)].exit_loops) for i in range(len(PROMPTS))]


@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_triton_runner_matches_torch_runner(model_dir, threshold):
    params = SamplingParams(max_tokens=6, temperature=0, exit_threshold=threshold, ignore_eos=True)
    opts = dict(model=model_dir, dtype="float32", max_num_batched_tokens=16)
    # The reference runs on the CPU; on a GPU machine the Triton runner runs on the GPU.
    want = generate(Engine(EngineConfig(runner="torch", device="cpu", **opts)), params)
    engine = Engine(EngineConfig(runner="triton", **opts))
    assert type(engine.runner).__name__ == "GpuRunner"
    got = generate(engine, params)
    assert got == want
    if threshold < 1.0:
        assert len({loop for _, loops in got for loop in loops}) > 1


def test_a_request_joining_mid_decode_matches_torch_runner(model_dir):
    # Its prefill chunk shares a step with rows carried from the last step (a mixed step shape).
    params = SamplingParams(max_tokens=6, temperature=0, exit_threshold=0.5, ignore_eos=True)
    opts = dict(model=model_dir, dtype="float32", max_num_batched_tokens=16, num_kv_blocks=256)

    def run(engine):
        engine.add_request("a", PROMPTS[0], params)
        engine.add_request("b", PROMPTS[1], params)
        done, steps = {}, 0
        while engine.has_unfinished_requests():
            if steps == 6:
                engine.add_request("late", PROMPTS[2], params)
            done.update({o.request_id: o.request.output_ids for o in engine.step() if o.finished})
            steps += 1
        return done

    want = run(Engine(EngineConfig(runner="torch", device="cpu", **opts)))
    got = run(Engine(EngineConfig(runner="triton", run_ahead=False, **opts)))
    assert got == want and len(got) == 3


# bf16 against the fp32 dense reference: per output token, the largest logit error relative to the
# largest reference logit. Measured on the tiny preset: 0.8%-1.8% for this runner and the same for
# eager PyTorch in bf16 (both round activations to bf16 at the same points); bound at twice that.
BF16_REL_TOL = 0.04


def test_bf16_engine_matches_fp32_dense_reference_within_tolerance(model_dir):
    fp32 = Engine(EngineConfig(model=model_dir, dtype="float32", runner="torch", device="cpu"))
    ref = DenseReference(dict(fp32.model.state_dict()), fp32.model_config, 128, fp32.vocab_limit)
    engine = Engine(EngineConfig(model=model_dir, dtype="bfloat16", runner="triton", keep_logits=True,
                                 max_num_batched_tokens=16))  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0, exit_threshold=1.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.request for o in engine.step() if o.finished})
    v = engine.vocab_limit
    for i, prompt in enumerate(PROMPTS):
        want, got = ref.generate(prompt, 6, threshold=1.0), done[str(i)]
        assert got.output_ids[0] == want.tokens[0]
        # Compare while the two token streams agree (after a divergence the contexts differ).
        for k, (a, b) in enumerate(zip(got.logits, want.logits)):
            err = float((a[:v].float().cpu() - b[:v]).abs().max() / b[:v].abs().max())
            assert err <= BF16_REL_TOL, (i, k, err)
            if got.output_ids[k] != want.tokens[k]:
                break


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_every_step_replays_a_graph_captured_at_start_up(model_dir, monkeypatch):
    # Prefill, mixed and decode steps all find their shape captured: none runs eagerly, and no
    # graph is captured while requests wait.
    opts = dict(model=model_dir, dtype="float32", runner="triton", max_num_batched_tokens=16)
    engine = Engine(EngineConfig(**opts))
    runner = engine.runner
    captured = set(runner.graphs)
    eager = []
    monkeypatch.setattr(runner, "_forward", lambda *shape: eager.append(shape))
    params = SamplingParams(max_tokens=6, temperature=0, exit_threshold=0.5, ignore_eos=True)
    generate(engine, params)
    assert eager == [] and set(runner.graphs) == captured


def test_propagation_pairs_keep_one_aligned_layout(model_dir):
    # The dst half starts 16-byte aligned for every pair count (one compiled kernel variant), and
    # the pairs copy K/V as the indexed reference does. A small pool: the test clones it.
    opts = dict(model=model_dir, dtype="float32", runner="triton", max_num_batched_tokens=16)
    opts["num_kv_blocks"] = 64
    engine = Engine(EngineConfig(**opts))
    runner = engine.runner
    kv = runner.kv_cache
    kv.copy_(torch.randn_like(kv))
    for k in (1, 2, 3, 7):
        src = torch.arange(k, dtype=torch.int64) * 2
        dst = src + 1 + 2 * k
        want = kv.clone()
        want[:, :, dst] = want[:, :, src]
        with torch.inference_mode():  # as in a step: the staging was made at start-up, in this mode
            runner._propagate_pairs(src.numpy(), dst.numpy(), k)
        h = runner.prop_half
        assert h % 2 == 0 and runner.prop.dev["pairs"][h:].data_ptr() % 16 == 0
        assert torch.equal(kv.cpu(), want.cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton compiles kernels only on a GPU")
def test_no_kernel_compiles_after_start_up(model_dir, monkeypatch):
    # A compile on first use stalls every request of that step (0.1-0.4 s on the H200): early exits
    # (propagation), temperature sampling, prompts riding in a run-ahead batch, prompts of several
    # lengths all run on kernels compiled at start-up.
    from triton.runtime.jit import JITFunction

    opts = dict(model=model_dir, dtype="float32", runner="triton", max_num_batched_tokens=16)
    engine = Engine(EngineConfig(**opts))
    compiled = []
    inner = JITFunction._do_compile

    def record(self, *args, **kwargs):
        compiled.append(self.fn.__name__)
        return inner(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", record)
    for temperature in (0.0, 0.8):
        params = SamplingParams(max_tokens=8, temperature=temperature, exit_threshold=0.5, ignore_eos=True)
        engine.add_request(f"a{temperature}", PROMPTS[0], params)
        for _ in range(12):  # until the decode runs ahead, so that the next prompts ride in it
            if engine.ahead.active:
                break
            engine.step()
        assert engine.ahead.active
        engine.add_request(f"b{temperature}", PROMPTS[1], params)  # these two ride in the lanes
        engine.add_request(f"c{temperature}", PROMPTS[0], params)
        while engine.has_unfinished_requests():
            engine.step()
        engine.add_request(f"d{temperature}", PROMPTS[2], params)  # longer than a step: chunked
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.ahead.total_launches > 0 and sum(engine.stats.exit_depth_histogram[:-1]) > 0
    assert engine.ahead.total_riders == 4
    assert compiled == []
