"""Memory estimates checked against hand counts from the config fields (not against the code's own output)."""

import pytest

from beamrl.models.beam import preset
from beamrl.recipe import apply_override, load_recipe, validate_recipe
from beamrl.recipe.layout import plan_layout
from beamrl.recipe.memory import GPU_CAPACITY_BYTES, engine_memory, memory_problems, trainer_memory


def _recipe(raw, *overrides):
    for o in overrides:
        apply_override(raw, o)
    return validate_recipe(raw)


def test_stages_partition_all_parameters(base_raw):
    c = preset("tiny")
    r = _recipe(base_raw, "trainer.tp=1", "trainer.sp=false", "trainer.ep=1", "trainer.pp=2",
                "trainer.global_batch_size=32")
    mem = trainer_memory(r, c, plan_layout(r, c))
    buffers = len(c.moe_layers) * c.num_experts  # e_score_correction_bias: not a trainable parameter
    assert sum(m.params_dense + m.params_expert for m in mem) == c.num_parameters() - buffers
    assert mem[0].params_dense != mem[1].params_dense  # embedding on stage 0, head on stage 1


def _hand_counts_501b(tp, ep, etp):
    c = preset("beam-501b")
    H, V, L, I, Ie, E = c.hidden_size, c.vocab_size, 52, c.intermediate_size, c.moe_intermediate_size, c.num_experts
    q, kv, moe = 48 * 128, 8 * 128, 49
    dense = (2 * V * H + L * (3 * q * H + 2 * kv * H + 48) + 3 * 3 * I * H) / tp
    dense += L * (4 * H + 2 * 128) + H + moe * E * H  # replicated norms and routers
    expert = moe * E * 3 * Ie * H / (ep * etp)
    return dense, expert, moe * E * H  # router params (FP32)


def test_501b_per_rank_counts_and_bytes():
    r = load_recipe("grpo_dapo_math")
    c = preset("beam-501b")
    lay = plan_layout(r, c)
    (m,) = trainer_memory(r, c, lay)
    dense, expert, router = _hand_counts_501b(8, 8, 8)
    assert m.params_dense == pytest.approx(dense, rel=1e-9)
    assert m.params_expert == pytest.approx(expert, rel=1e-9)
    bf16 = dense + expert - router
    buffers = 49 * 256 * 4
    assert m.weights == pytest.approx(2 * bf16 + 4 * router + buffers, rel=1e-9)
    assert m.grads == pytest.approx(4 * (bf16 + router), rel=1e-9)  # main_grads_dtype fp32
    on_gpu = 1 - r.trainer.optimizer_offload_fraction
    expected_opt = ((dense - router) * 12 + router * 8) / 8 + expert * 12 / 1  # dense over dp 8, experts over edp 1
    assert m.optimizer == pytest.approx(expected_opt * on_gpu, rel=1e-9)


def test_grad_dtype_and_distributed_optimizer_change_bytes(base_raw):
    c = preset("tiny")
    r32 = _recipe(dict(base_raw))
    lay = plan_layout(r32, c)
    (m32,) = trainer_memory(r32, c, lay)
    r16 = r32.model_copy(deep=True)
    r16.trainer.main_grads_dtype = "bf16"
    (m16,) = trainer_memory(r16, c, lay)
    router = len(c.moe_layers) * c.num_experts * c.hidden_size
    assert m32.grads - m16.grads == pytest.approx(2 * (m32.params_dense + m32.params_expert - router))
    rnd = r32.model_copy(deep=True)
    rnd.trainer.distributed_optimizer = False
    (mnd,) = trainer_memory(rnd, c, lay)
    assert mnd.optimizer > m32.optimizer


def test_recompute_full_saves_activations(base_raw):
    c = preset("beam-501b")
    r = load_recipe("grpo_dapo_math")
    lay = plan_layout(r, c)
    full = trainer_memory(r, c, lay)[0].activations
    r.trainer.recompute = "none"
    none = trainer_memory(r, c, lay)[0].activations
    assert none > 5 * full  # 52 layers of saved activations vs inputs + one recomputed layer


def test_hybrid_swa_kv_bytes_match_sglang_note():
    # sglang-integration.md §9: 9 full + 0.8 x 43 SWA layers at 4 KiB/layer/token (TP1) = ~174 KiB/token
    r = load_recipe("grpo_dapo_math", ["rollout.swa_full_tokens_ratio=0.8"])
    lay = plan_layout(r, preset("beam-501b"))
    e1 = engine_memory(r, preset("beam-501b"), lay.__class__(**{**lay.__dict__, "engine_tp": 1}))
    assert e1.bytes_per_token / 1024 == pytest.approx(174, abs=0.5)
    e16 = engine_memory(r, preset("beam-501b"), lay)  # TP16: one KV head of 8 per rank (replicated beyond 8)
    assert e16.bytes_per_token == pytest.approx(e1.bytes_per_token / 8)
    assert e16.weights == pytest.approx(2 * preset("beam-501b").num_parameters() / 16, rel=0.01)


def test_shipped_501b_recipe_fits_h200():
    r = load_recipe("grpo_dapo_math")
    c = preset("beam-501b")
    lay = plan_layout(r, c)
    tm, em = trainer_memory(r, c, lay), engine_memory(r, c, lay)
    assert memory_problems(r, lay, tm, em) == []
    assert max(m.total for m in tm) < GPU_CAPACITY_BYTES["h200"]


def test_over_memory_is_flagged():
    c = preset("beam-501b")
    r = load_recipe("grpo_dapo_math", ["trainer.optimizer_offload_fraction=0"])
    lay = plan_layout(r, c)
    problems = memory_problems(r, lay, trainer_memory(r, c, lay), engine_memory(r, c, lay))
    assert len(problems) == 1 and problems[0].startswith("trainer:") and "optimizer_offload_fraction" in problems[0]
    r = load_recipe("grpo_dapo_math", ["rollout.mem_fraction=0.3"])
    problems = memory_problems(r, lay, trainer_memory(r, c, lay), engine_memory(r, c, lay))
    assert len(problems) == 1 and "rollout.mem_fraction" in problems[0]


def test_kv_pool_too_small_for_one_request():
    c = preset("beam-501b")
    # weights of a TP16 rank are 62.98e9 B; mem_fraction 0.447 leaves ~50 MB of KV: not one 5K-token request
    r = load_recipe("grpo_dapo_math", ["rollout.mem_fraction=0.447"])
    lay = plan_layout(r, c)
    e = engine_memory(r, c, lay)
    assert 0 < e.kv_tokens < e.request_tokens
    problems = memory_problems(r, lay, trainer_memory(r, c, lay), e)
    assert len(problems) == 1 and "cannot hold one request" in problems[0]


def test_capacity_follows_gpu_type():
    c = preset("beam-501b")
    over = ["trainer.optimizer_offload_fraction=0"]  # 143.8 GiB: over an H200's 141 GB, under a B200's 180 GB
    for gpu, n_problems in (("h200", 1), ("b200", 0)):
        r = load_recipe("grpo_dapo_math", [*over, f"cluster.gpu_type={gpu}"])
        lay = plan_layout(r, c)
        assert len(memory_problems(r, lay, trainer_memory(r, c, lay), engine_memory(r, c, lay))) == n_problems


def test_colocated_peak_is_the_larger_side(base_raw):
    from beamrl.recipe.memory import colocated_peak

    c = preset("tiny")
    r = _recipe(base_raw, "placement.mode=colocated", "sync.transport=colocated", "trainer.num_gpus=16",
                "rollout.num_engines=4", "trainer.global_batch_size=32")
    lay = plan_layout(r, c)
    tm, em = trainer_memory(r, c, lay), engine_memory(r, c, lay)
    assert colocated_peak(tm, em) == max(tm[0].total, em.static_budget) == em.static_budget  # tiny: KV dominates
    # a trainer that does not sleep keeps its state (not its activations) next to the engine during rollout
    awake = colocated_peak(tm, em, trainer_sleeps=False)
    assert awake == tm[0].total - tm[0].activations + em.static_budget > colocated_peak(tm, em)
