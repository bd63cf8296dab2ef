"""An independent float64 oracle for the algorithm math, written from the formulas in docs/algorithms.md.

The oracle uses Python floats and the `math` module only (no torch), one token at a time, so it shares no
code (and no vectorisation shortcut) with `beamrl.algorithms`. Scores are deliberately not exact in binary
(0.1, 0.7, weighted sums of reward components): that is what a real reward manager produces.
"""

import math

import pytest
import torch

from beamrl.algorithms import (
    ADVANTAGES,
    AlgorithmConfig,
    ImportanceConfig,
    KLConfig,
    LossInputs,
    filter_groups,
    importance_weights,
    ppo_clip_loss,
)

D = torch.float64

# ---------------------------------------------------------------- oracle


def oracle_grpo(groups: list[list[float]], eps: float, scale_by_std: bool, unbiased: bool) -> list[list[float]]:
    out = []
    for g in groups:
        if min(g) == max(g):  # a constant group carries no signal: exactly 0
            out.append([0.0] * len(g))
            continue
        mean = math.fsum(g) / len(g)
        if not scale_by_std:
            out.append([x - mean for x in g])
            continue
        dof = max(len(g) - 1, 1) if unbiased else len(g)
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in g) / dof)
        out.append([(x - mean) / (std + eps) for x in g])
    return out


def oracle_k3(log_r: float) -> float:
    """k3 with r = q(x)/p(x) at x ~ p estimates KL(p || q)."""
    return (math.exp(log_r) - 1.0) - log_r


def oracle_importance(old, rollout, mask, seq, cfg: ImportanceConfig):
    """(weights, kept) per token; TIS min(ratio, cap), MIS ratio inside [lo, hi] (token or sequence geo-mean)."""
    ratio = [math.exp(o - r) for o, r in zip(old, rollout)]
    if cfg.mode == "tis":
        return [min(x, cfg.cap) if m else 0.0 for x, m in zip(ratio, mask)], list(mask)
    if cfg.level == "token":
        test = ratio
    else:
        geo = {}
        for s in set(seq):
            logs = [o - r for o, r, m, t in zip(old, rollout, mask, seq) if m and t == s]
            geo[s] = math.exp(math.fsum(logs) / len(logs)) if logs else 1.0
        test = [geo[s] for s in seq]
    kept = [bool(m and cfg.lo <= t <= cfg.hi) for m, t in zip(mask, test)]
    return [x if k else 0.0 for x, k in zip(ratio, kept)], kept


def oracle_loss(lp, old, rollout, ref, adv, mask, seq, cfg: AlgorithmConfig):
    """Loss value and d loss / d logprob_t, from l_t = max(-A r, -A clip(r)) w + c kl_t and the aggregation."""
    w = oracle_importance(old, rollout, mask, seq, cfg.importance)[0] if cfg.importance.mode != "none" \
        else [1.0] * len(lp)
    tok, dtok = [], []
    for t in range(len(lp)):
        r = math.exp(lp[t] - old[t])
        lo, hi = 1 - cfg.eps_clip_low, 1 + cfg.eps_clip_high
        unclipped, clipped = -adv[t] * r, -adv[t] * min(max(r, lo), hi)
        # The gradient flows through whichever branch is larger; the clipped one is flat outside [lo, hi].
        grad = -adv[t] * r if unclipped >= clipped else 0.0
        value, grad = max(unclipped, clipped) * w[t], grad * w[t]
        if cfg.kl.coef > 0:  # k3 of KL(policy || ref), tokens from the policy: log r = ref - logprob
            log_r = ref[t] - lp[t]
            value += cfg.kl.coef * oracle_k3(log_r)
            grad += cfg.kl.coef * (1.0 - math.exp(log_r))
        tok.append(value)
        dtok.append(grad)
    live = [t for t in range(len(lp)) if mask[t]]
    if cfg.loss_agg == "token-mean":
        grad = [dtok[t] / len(live) if mask[t] else 0.0 for t in range(len(lp))]
        return math.fsum(tok[t] for t in live) / len(live), grad
    seqs = sorted({seq[t] for t in live})
    n_tok = {s: sum(1 for t in live if seq[t] == s) for s in seqs}
    per = (lambda s: n_tok[s]) if cfg.loss_agg == "seq-mean-token-mean" else (lambda s: 1)
    value = math.fsum(math.fsum(tok[t] for t in live if seq[t] == s) / per(s) for s in seqs) / len(seqs)
    grad = [dtok[t] / per(seq[t]) / len(seqs) if mask[t] else 0.0 for t in range(len(lp))]
    return value, grad


def masked_mean_of(values, mask):
    live = [v for v, m in zip(values, mask) if m]
    return math.fsum(live) / len(live)


# ---------------------------------------------------------------- GRPO

# Rewards as a reward manager makes them: fractions and weighted sums of components (0.3 * format + 0.7 * answer).
WEIGHTED = 0.3 * 0.1 + 0.7 * 0.7
GROUPS = [
    [0.1] * 8,  # constant, not exact in binary
    [0.7] * 8,
    [WEIGHTED] * 5,  # constant weighted sum
    [0.1, 0.7, 0.7, 0.1, 0.7, 0.1],
    [WEIGHTED, 0.3 * 0.1, WEIGHTED, 0.7 * 0.7],
    [0.7],  # a group of one
]


def flat(groups):
    scores = [x for g in groups for x in g]
    ids = [i for i, g in enumerate(groups) for _ in g]
    return scores, torch.tensor(ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("eps", [0.0, 1e-6])
@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("unbiased", [True, False])
def test_grpo_matches_oracle_with_non_binary_scores(dtype, eps, scale_by_std, unbiased):
    scores, ids = flat(GROUPS)
    adv = ADVANTAGES.get("grpo")(torch.tensor(scores, dtype=dtype), ids, AlgorithmConfig(normalize_std=scale_by_std),
                                 eps=eps, unbiased_std=unbiased)
    expected = [x for g in oracle_grpo(GROUPS, eps, scale_by_std, unbiased) for x in g]
    # Constant groups (and the group of one) are exactly 0 in any dtype, not a rounding residue over a tiny std.
    n_const = sum(len(g) for g in GROUPS[:3])
    assert adv[:n_const].tolist() == [0.0] * n_const
    assert adv[-1].item() == 0.0
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(adv.double(), torch.tensor(expected, dtype=D), rtol=tol, atol=tol)


def test_grpo_2d_layout_constant_rows_are_zero_in_float32():
    """The loop's layout and dtype: [n_prompts, n_samples] float32 with the default eps."""
    rows = torch.tensor([[0.1] * 16, [0.7] * 16, [WEIGHTED] * 16], dtype=torch.float32)
    assert ADVANTAGES.get("grpo")(rows).abs().max().item() == 0.0


# ---------------------------------------------------------------- DAPO dynamic sampling


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # the loop filters float64 scores
def test_dynamic_sampling_counts_all_max_and_all_min_exactly(dtype):
    # Groups of 6 (and 3, 7, 9, ...) at 0.1 or 0.7 have a float64 mean that is not 0.1 / 0.7.
    groups = [[0.7] * 6, [0.1] * 6, [0.7] * 6, [0.1, 0.7, 0.4, 0.4, 0.1, 0.7], [0.4] * 6, [0.1] * 3]
    scores, ids = flat(groups)
    scores = torch.tensor(scores, dtype=dtype).tolist()  # the values the filter sees
    groups = [[scores[i] for i in range(len(scores)) if ids[i] == k] for k in range(len(groups))]
    res = filter_groups(raw_scores=torch.tensor(scores, dtype=dtype), group_ids=ids, target_num_groups=5)
    top, bottom = max(scores), min(scores)
    dropped = [g for g in groups if min(g) == max(g)]
    assert res.dropped_groups.tolist() == [i for i, g in enumerate(groups) if min(g) == max(g)]
    assert res.metrics["dynamic_sampling/dropped_all_max"] == sum(1 for g in dropped if g[0] == top) == 2
    assert res.metrics["dynamic_sampling/dropped_all_min"] == sum(1 for g in dropped if g[0] == bottom) == 2


# ---------------------------------------------------------------- KL metrics: direction of k3


def sample_by_counts(probs_counts):
    """A token sample whose empirical distribution is exactly p: token i appears counts[i] times, so a plain
    token mean over it is the exact expectation under p."""
    return [i for i, c in enumerate(probs_counts) for _ in range(c)]


P_COUNTS = [4, 2, 1, 1]  # p = (1/2, 1/4, 1/8, 1/8)
P = [c / 8 for c in P_COUNTS]
Q = [0.1, 0.2, 0.3, 0.4]


def kl(p, q):
    return math.fsum(a * math.log(a / b) for a, b in zip(p, q))


def test_train_rollout_kl_is_kl_rollout_to_old_under_rollout_samples():
    """is/train_rollout_kl: tokens come from the rollout policy, so its k3 estimates KL(rollout || old)."""
    toks = sample_by_counts(P_COUNTS)  # sampled by the rollout policy p
    rollout = torch.tensor([math.log(P[i]) for i in toks], dtype=D)
    old = torch.tensor([math.log(Q[i]) for i in toks], dtype=D)
    mask = torch.ones(len(toks), dtype=torch.bool)
    res = importance_weights(old, rollout, mask, torch.zeros(len(toks), dtype=torch.long),
                             ImportanceConfig(mode="tis", cap=2.0))
    oracle = masked_mean_of([oracle_k3(o - r) for o, r in zip(old.tolist(), rollout.tolist())], mask.tolist())
    assert oracle == pytest.approx(kl(P, Q), rel=1e-12)  # the oracle's k3 is unbiased for KL(rollout || old)
    assert float(res.metrics["train_rollout_kl"]) == pytest.approx(oracle, rel=1e-6)


def test_loss_approx_kl_is_kl_old_to_new_under_old_samples():
    """approx_kl: tokens come from pi_old, so its k3 estimates KL(old || new); ppo_kl is k1 of the same."""
    toks = sample_by_counts(P_COUNTS)  # sampled by pi_old = p
    old = torch.tensor([math.log(P[i]) for i in toks], dtype=D)
    new = torch.tensor([math.log(Q[i]) for i in toks], dtype=D)
    n = len(toks)
    inputs = LossInputs(logprobs=new, old_logprobs=old, advantages=torch.zeros(n, dtype=D),
                        loss_mask=torch.ones(n, dtype=torch.bool), seq_ids=torch.zeros(n, dtype=torch.long))
    out = ppo_clip_loss(inputs, AlgorithmConfig())
    assert float(out.metrics["approx_kl"]) == pytest.approx(kl(P, Q), rel=1e-12)
    assert float(out.metrics["ppo_kl"]) == pytest.approx(kl(P, Q), rel=1e-12)


# ---------------------------------------------------------------- TIS / MIS weights and the loss


def loss_case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    n = 13
    old = (torch.rand(n, generator=gen, dtype=D) * -3.0).tolist()
    lp = [o + d for o, d in zip(old, (torch.randn(n, generator=gen, dtype=D) * 0.3).tolist())]
    rollout = [o + d for o, d in zip(old, (torch.randn(n, generator=gen, dtype=D) * 0.6).tolist())]
    ref = [o + d for o, d in zip(old, (torch.randn(n, generator=gen, dtype=D) * 0.2).tolist())]
    adv = [0.1, -0.7, WEIGHTED, 0.7, -0.1, 0.4, -0.4, 0.1, 0.7, -WEIGHTED, 0.3, -0.3, 0.2]
    mask = [True] * 4 + [False] + [True] * 6 + [False, True]
    seq = [0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3]
    return lp, old, rollout, ref, adv, mask, seq


IMPORTANCE = [
    None,
    ImportanceConfig(mode="tis", cap=1.5),
    ImportanceConfig(mode="mis", lo=0.6, hi=1.6, level="token"),
    ImportanceConfig(mode="mis", lo=0.8, hi=1.25, level="sequence"),
]


@pytest.mark.parametrize("importance", IMPORTANCE, ids=["none", "tis", "mis-token", "mis-seq"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_ppo_clip_loss_value_and_gradient_match_oracle(importance, aggregation, kl_coef):
    lp, old, rollout, ref, adv, mask, seq = loss_case(7)
    cfg = AlgorithmConfig(eps_clip_low=0.2, eps_clip_high=0.28, loss_agg=aggregation,
                          importance=importance or ImportanceConfig(), kl=KLConfig(coef=kl_coef, estimator="k3",
                                                                                    reference=kl_coef > 0, clamp=None))
    lp_t = torch.tensor(lp, dtype=D, requires_grad=True)
    out = ppo_clip_loss(LossInputs(logprobs=lp_t, old_logprobs=torch.tensor(old, dtype=D),
                                   advantages=torch.tensor(adv, dtype=D), loss_mask=torch.tensor(mask),
                                   seq_ids=torch.tensor(seq), rollout_logprobs=torch.tensor(rollout, dtype=D),
                                   ref_logprobs=torch.tensor(ref, dtype=D)), cfg)
    out.loss.backward()
    value, grad = oracle_loss(lp, old, rollout, ref, adv, mask, seq, cfg)
    tol = 1e-12 if importance is None else 1e-6  # the importance weights are float32 by design
    assert out.loss.item() == pytest.approx(value, rel=tol, abs=1e-15)
    torch.testing.assert_close(lp_t.grad, torch.tensor(grad, dtype=D), rtol=tol, atol=1e-15)


@pytest.mark.parametrize("importance", IMPORTANCE[1:], ids=["tis", "mis-token", "mis-seq"])
def test_importance_weights_and_metrics_match_oracle(importance):
    _, old, rollout, _, _, mask, seq = loss_case(11)
    res = importance_weights(torch.tensor(old, dtype=D), torch.tensor(rollout, dtype=D), torch.tensor(mask),
                             torch.tensor(seq), importance)
    weights, kept = oracle_importance(old, rollout, mask, seq, importance)
    assert 0 < sum(kept) < sum(mask) or importance.mode == "tis"  # the MIS cases reject some tokens
    assert res.kept.tolist() == kept
    # The weights are computed in float32 (the loop's dtype); the oracle in float64.
    torch.testing.assert_close(res.weights.double(), torch.tensor(weights, dtype=D), rtol=1e-6, atol=0)
    lr = [o - r for o, r in zip(old, rollout)]
    expected = {
        "train_rollout_logprob_abs_diff": masked_mean_of([abs(x) for x in lr], mask),
        "ratio_mean": masked_mean_of([math.exp(x) for x in lr], mask),
        "train_rollout_kl": masked_mean_of([oracle_k3(x) for x in lr], mask),
    }
    for key, want in expected.items():
        assert float(res.metrics[key]) == pytest.approx(want, rel=1e-5), key
