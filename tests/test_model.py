"""The native model against the dense reference, RoPE against its formula, and the exit rule."""

import math

import pytest
import torch

from ouro_fast.model.attention import ContiguousAttention
from ouro_fast.model.config import OuroConfig
from ouro_fast.model.exit_rule import exit_loop, exit_mask, first_exit, log_one_minus, update_log_survival
from ouro_fast.model.ouro import OuroForCausalLM, apply_rope, rope_cos_sin
from ouro_fast.model.reference import DenseReference

CFG = OuroConfig(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    total_ut_steps=4,
    rope_theta=10000.0,
)


def make_model(cfg=CFG, seed=0):
    torch.manual_seed(seed)
    model = OuroForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("_2.weight") or name == "model.norm.weight":
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def run_prefill(model, ids, loops):
    cfg = model.config
    attn = ContiguousAttention(
        cfg.total_ut_steps,
        cfg.num_hidden_layers,
        64,
        cfg.num_key_value_heads,
        cfg.head_dim,
        torch.float32,
        "cpu",
    )
    h = model.embed(torch.tensor(ids))
    pos = torch.arange(len(ids))
    logits, gates = [], []
    for t in range(loops):
        attn.loop = t
        h = model.run_loop(h, pos, attn)
        logits.append(model.logits(h))
        gates.append(model.gate_logits(h))
    return torch.stack(logits), torch.stack(gates)


@pytest.mark.parametrize("ids", [[5], [1, 2, 3, 4, 5, 6, 7], [96, 0, 13, 13, 42, 7, 8, 9, 10, 11, 12]])
def test_model_matches_dense_reference_at_every_loop_count(ids):
    model = make_model()
    ref = DenseReference(dict(model.state_dict()), CFG, max_len=64)
    ref_logits, ref_gates = ref.prefill(ids)
    with torch.no_grad():
        for loops in range(1, 5):
            logits, gates = run_prefill(model, ids, loops)
            torch.testing.assert_close(logits[-1], ref_logits[loops - 1], atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(gates[-1], ref_gates[loops - 1], atol=2e-5, rtol=1e-5)


def test_model_state_dict_keys_are_checkpoint_keys():
    from ouro_fast.model.keys import expected_shapes

    with torch.device("meta"):
        model = OuroForCausalLM(CFG)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == expected_shapes(CFG)


def test_incremental_decode_equals_full_prefill():
    # Token-by-token at full depth must reproduce the one-shot prefill's logits.
    model = make_model()
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    cfg = model.config
    with torch.no_grad():
        full, _ = run_prefill(model, ids, 4)
        attn = ContiguousAttention(
            4, cfg.num_hidden_layers, 64, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu"
        )
        for i, tok in enumerate(ids):
            h = model.embed(torch.tensor([tok]))
            attn.start = i
            for t in range(4):
                attn.loop = t
                h = model.run_loop(h, torch.tensor([i]), attn)
            torch.testing.assert_close(model.logits(h)[0], full[3, i], atol=2e-5, rtol=1e-5)


def test_rope_matches_formula():
    d, theta = 8, 10000.0
    positions = torch.tensor([0, 1, 7, 300])
    x = torch.randn(4, 3, d)
    cos, sin = rope_cos_sin(positions, d, theta)
    got = apply_rope(x, cos, sin)
    for n, p in enumerate(positions.tolist()):
        for h in range(3):
            for i in range(d // 2):
                a = p * theta ** (-2 * i / d)
                x1, x2 = float(x[n, h, i]), float(x[n, h, i + d // 2])
                assert math.isclose(got[n, h, i], x1 * math.cos(a) - x2 * math.sin(a), abs_tol=1e-5)
                assert math.isclose(got[n, h, i + d // 2], x2 * math.cos(a) + x1 * math.sin(a), abs_tol=1e-5)


def _logit(p):
    return math.log(p / (1 - p))


@pytest.mark.parametrize(
    "lambdas, threshold, min_loops, max_loops, expected",
    [
        # CDF: 0.3, 0.3+0.7*0.4=0.58, 0.58+0.42*0.5=0.79, ...
        ([0.3, 0.4, 0.5, 0.5], 0.5, 1, 4, 1),
        ([0.3, 0.4, 0.5, 0.5], 0.9, 1, 4, 3),  # 0.895 at loop 3 < 0.9: runs to the last loop
        ([0.3, 0.4, 0.5, 0.9], 0.9, 1, 4, 3),
        ([0.3, 0.4, 0.5, 0.5], 0.78, 1, 4, 2),
        ([0.95, 0.1, 0.1, 0.1], 0.9, 1, 4, 0),
        ([0.95, 0.1, 0.1, 0.1], 0.9, 3, 4, 2),  # min_loops clamps the early exit up
        ([0.01, 0.01, 0.01, 0.01], 0.5, 1, 2, 1),  # max_loops forces the exit
        ([0.999999, 0.999999, 0.999999, 0.999999], 1.0, 1, 4, 3),  # q = 1.0 never exits early
        ([0.5, 0.5, 0.5, 0.5], 0.0, 2, 4, 1),  # q = 0 exits as soon as allowed
    ],
)
def test_exit_rule_hand_computed(lambdas, threshold, min_loops, max_loops, expected):
    gates = [_logit(p) for p in lambdas]
    assert exit_loop(gates, threshold, min_loops, max_loops) == expected


def test_exit_rule_threshold_one_survives_saturated_gates():
    # sigmoid(40) rounds to 1.0 in float32: a naive CDF would hit 1.0 after one loop.
    assert exit_loop([40.0, 40.0, 40.0, 40.0], 1.0, 1, 4) == 3
    assert first_exit([40.0], 1.0, 1, 4) is None


def test_exit_mask_batched_matches_scalar():
    torch.manual_seed(1)
    gates = torch.randn(64, 4) * 2
    for q in (0.3, 0.5, 0.9, 1.0):
        for lo, hi in ((1, 4), (2, 3), (1, 1)):
            log_surv = torch.zeros(64)
            decided = torch.full((64,), -1)
            for t in range(4):
                log_surv = update_log_survival(log_surv, gates[:, t])
                m = exit_mask(
                    torch.full((64,), t),
                    log_surv,
                    torch.full((64,), log_one_minus(q)),
                    torch.full((64,), lo),
                    torch.full((64,), hi),
                )
                decided = torch.where((decided < 0) & m, torch.full_like(decided, t), decided)
            decided = torch.where(decided < 0, torch.full_like(decided, 3), decided)
            expect = [exit_loop(gates[i].tolist(), q, lo, hi) for i in range(64)]
            assert decided.tolist() == expect


def test_reference_generation_exits_and_propagates():
    model = make_model()
    with torch.no_grad():
        model.model.early_exit_gate.bias.fill_(-1.0)
    ref = DenseReference(dict(model.state_dict()), CFG, max_len=64)
    gen = ref.generate([1, 2, 3, 4], 12, threshold=0.5)
    assert len(gen.tokens) == 12
    assert len(set(gen.exit_loops)) > 1, gen.exit_loops
    pos = 4 + len(gen.tokens) - 2  # the last token fed through the loops
    e = gen.exit_loops[-1]
    for t in range(e + 1, 4):
        assert torch.equal(ref.k[t, :, pos], ref.k[e, :, pos])


def test_fused_weights_give_the_same_loop():
    model = make_model()
    ids = [1, 2, 3, 4, 5, 6]
    with torch.no_grad():
        before, _ = run_prefill(model, ids, 4)
        model.fuse()
        after, _ = run_prefill(model, ids, 4)
    assert not hasattr(model.model.layers[0].self_attn, "q_proj")
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
