"""Correctness at every batch size: the engine agrees with the fp32 dense reference as well with every
prompt in one batch as one row at a time (bench/batch_fidelity.py; on a GPU the Triton runner in bf16)."""

import pytest
import torch

from bench.batch_fidelity import TOLERANCE, measure, random_prompts, vocab_limit


@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_batching_keeps_agreement_with_the_fp32_reference(model_dir, threshold):
    prompts = random_prompts(12, 9, vocab_limit(model_dir), seed=3)
    engine = {"dtype": "bfloat16"} if torch.cuda.is_available() else {"dtype": "bfloat16", "runner": "torch"}
    result = measure(model_dir, prompts, 8, threshold, **engine)
    one, batched = result["one_row"], result["batched"]
    assert one["positions"] == batched["positions"] == 12 * 8
    # bf16 against fp32: mostly the same tokens, and the gate rule's exits.
    assert one["top1_agreement"] >= 0.9 and one["exit_agreement"] >= 0.9, result
    assert batched["top1_agreement"] >= one["top1_agreement"] - TOLERANCE, result
    assert batched["exit_agreement"] >= one["exit_agreement"] - TOLERANCE, result
    assert result["within_tolerance"]


def test_the_measure_sees_a_wrong_token(model_dir):
    # A stream that is not the argmax lowers top-1 agreement: the measure can fail.
    from bench.batch_fidelity import agreement, fp32_weights
    from ouro_fast.model.reference import DenseReference
    from ouro_fast.model.weights import load_config

    prompt = random_prompts(1, 6, vocab_limit(model_dir), seed=4)[0]
    ref = DenseReference(fp32_weights(model_dir), load_config(model_dir), 32, vocab_limit(model_dir))
    right = ref.generate(prompt, 5, threshold=1.0)
    wrong = [
        (right.tokens[:2] + [(t + 1) % vocab_limit(model_dir) for t in right.tokens[2:]], right.exit_loops)
    ]
    assert agreement(ref, [prompt], [(right.tokens, right.exit_loops)], 1.0)["top1_agreement"] == 1.0
    assert agreement(ref, [prompt], wrong, 1.0)["top1_agreement"] < 1.0
