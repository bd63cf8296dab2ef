"""Pure parts of benchmarks/trl_vs_beamrl.py: arguments, recipe -> settings, parameter matching, summary math and
the table. TRL itself never runs here (it lives in its own venv; the benchmark is a script, not a test)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import trl_vs_beamrl as bench


def test_parse_args_defaults_and_skips(tmp_path):
    a = bench.parse_args(["--steps", "12", "--sft-steps", "0", "--out", str(tmp_path), "--skip-trl"])
    assert (a.steps, a.sft_steps, a.out, a.skip_trl, a.skip_beamrl) == (12, 0, tmp_path, True, False)
    assert a.trl_worker is None


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--sft-steps", "-1"], ["--skip-trl", "--skip-beamrl"]])
def test_parse_args_rejects_bad_values(argv, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert "--" in capsys.readouterr().err  # the message names the option


def test_beamrl_set_takes_loop_modes_and_refuses_the_shared_budget(capsys):
    a = bench.parse_args(["--beamrl-set", "placement.off_policy_steps=1", "--beamrl-set",
                          "algorithm.importance={mode: tis, cap: 2.0}"])
    assert a.beamrl_set == ["placement.off_policy_steps=1", "algorithm.importance={mode: tis, cap: 2.0}"]
    for bad in ("trainer.lr=1e-3", "run.num_steps=5", "rollout.temperature=0.5", "sft.steps=0", "novalue"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--beamrl-set", bad])
        assert "--beamrl-set" in capsys.readouterr().err


def test_settings_follow_the_quickstart_recipe():
    recipe = bench.quickstart_recipe()
    s = bench.settings_from_recipe(recipe, steps=7, sft_steps=3, vocab=("a", "b"), target_params=10, threads=1)
    assert (s.steps, s.sft_steps) == (7, 3)
    assert s.prompts_per_step == recipe["rollout"]["prompts_per_step"]
    assert s.generations == recipe["rollout"]["n_samples_per_prompt"]
    assert s.max_new_tokens == recipe["rollout"]["max_new_tokens"]
    assert (s.lr, s.sft_lr, s.sft_batch) == (recipe["trainer"]["lr"], recipe["sft"]["lr"], recipe["sft"]["batch"])
    del recipe["sft"]["batch"]
    with pytest.raises(KeyError, match="sft.batch"):
        bench.settings_from_recipe(recipe, 1, 1, ("a",), 1, 1)


def test_qwen2_param_formula_and_ffn_match():
    # Hand count for hidden 4, 1 layer, 2 heads / 1 kv head (head_dim 2), FFN 3, vocab 5:
    # q 4*4+4, k and v 4*2+2 each, o 4*4, mlp 3*4*3, 2 norms of 4; embed + lm_head 2*5*4; final norm 4.
    assert bench.qwen2_params(5, 4, 1, 2, 1, 3) == (20 + 10 + 10 + 16 + 36 + 8) + 40 + 4
    target = 623_336
    ffn = bench.qwen2_ffn_for(target, 15)
    got = bench.qwen2_params(15, bench.QWEN_HIDDEN, bench.QWEN_LAYERS, bench.QWEN_HEADS, bench.QWEN_KV_HEADS, ffn)
    step = 3 * bench.QWEN_HIDDEN * bench.QWEN_LAYERS  # one more FFN unit
    assert abs(got - target) <= step / 2


def _write_metrics(path, rewards, times):
    with open(path, "w") as f:
        for i, (r, t) in enumerate(zip(rewards, times)):
            f.write(json.dumps({"step": i, "reward/mean": r, "time/step_s": t, "other": 1}) + "\n")


def test_summarize_from_synthetic_metrics(tmp_path):
    rewards = [0.1 * i for i in range(10)]
    times = [50.0] + [1.0, 3.0, 2.0, 2.0, 4.0, 2.0, 1.0, 2.0, 3.0]  # the first step carries set-up
    p = tmp_path / "metrics.jsonl"
    _write_metrics(p, rewards, times)
    lines = p.read_text().splitlines()
    p.write_text("\n".join(reversed(lines)) + "\n\n")  # order and blank lines must not matter
    s = bench.summarize("x", bench.read_metrics(p), 1000, 5.0, 99.0)
    assert s["steps"] == 10
    assert s["grpo_s_per_step"] == 2.0  # median without the first step
    assert math.isclose(s["reward_first_20pct"], (0.0 + 0.1) / 2)
    assert math.isclose(s["reward_last_20pct"], (0.8 + 0.9) / 2)
    assert (s["params"], s["sft_s"], s["total_wall_s"]) == (1000, 5.0, 99.0)


def test_summarize_single_step_and_missing_keys():
    s = bench.summarize("x", [{"step": 0, "reward/mean": 0.5, "time/step_s": 7.0}], None, None, None)
    assert (s["grpo_s_per_step"], s["reward_first_20pct"], s["reward_last_20pct"]) == (7.0, 0.5, 0.5)
    with pytest.raises(ValueError, match="reward/mean"):
        bench.summarize("x", [{"step": 0, "time/step_s": 1.0}], None, None, None)


def test_table_has_one_row_per_framework_and_dashes_for_missing():
    rows = [bench.summarize("beamrl", [{"step": 0, "reward/mean": 0.25, "time/step_s": 3.0}], 623_336, 12.0, 80.5),
            bench.summarize("trl", [{"step": 0, "reward/mean": 0.5, "time/step_s": 0.5}], None, None, 40.0)]
    table = bench.format_table(rows).splitlines()
    assert len(table) == 4 and all(line.count("|") == len(bench.HEADERS) + 1 for line in table)
    assert table[2].split("|")[1:3] == [" beamrl ", " 0.623 M "]
    assert " - " in table[3]  # params / SFT s unknown


def test_parse_sft_seconds_reads_beamrl_log():
    log = ("[beamrl] SFT step 1/20: nll 3.0800 (2 s)\nnoise\n"
           "[beamrl] SFT step 20/20: nll 1.1303 (41 s)\n[beamrl] rollout: ready\n")
    assert bench.parse_sft_seconds(log) == (41.0, 1.1303)
    assert bench.parse_sft_seconds("[beamrl] SFT step 15/15: nll 0.5615 (2.4 s)\n") == (2.4, 0.5615)
    assert bench.parse_sft_seconds("no sft here") == (None, None)


def test_parse_args_repeat():
    assert bench.parse_args(["--repeat", "3"]).repeat == 3
    assert bench.parse_args([]).repeat == 1
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeat", "0"])


def _row(fw, run, step_s, sft_s, first, last, wall):
    return {"framework": fw, "run": run, "params": 1, "grpo_s_per_step": step_s, "sft_s": sft_s,
            "reward_first_20pct": first, "reward_last_20pct": last, "total_wall_s": wall}


def test_aggregate_medians_spreads_and_ratio():
    rows = [_row("beamrl", 1, 0.30, 2.5, 0.3, 0.7, 60.0), _row("trl-qwen2", 1, 0.20, 1.9, 0.5, 0.8, 26.0),
            _row("beamrl", 2, 0.50, 2.1, 0.4, 0.6, 70.0), _row("trl-qwen2", 2, 0.22, 1.7, 0.5, 0.7, 27.0),
            _row("beamrl", 3, 0.28, None, 0.2, 0.8, 65.0), _row("trl-qwen2", 3, 0.19, 1.8, 0.4, 0.9, 25.0)]
    agg = bench.aggregate(rows)
    assert agg["beamrl"]["runs"] == 3 and agg["beamrl"]["grpo_s_per_step"] == (0.30, 0.28, 0.50)
    assert agg["beamrl"]["sft_s"] == (2.3, 2.1, 2.5)  # a run without the SFT line is left out
    assert agg["trl-qwen2"]["reward_last_20pct"] == (0.8, 0.7, 0.9)
    text = bench.format_summary(agg)
    assert "| beamrl | 3 | 0.300 (0.280-0.500) |" in text
    assert "beamrl / trl-qwen2, median GRPO s/step: 1.50x" in text and "median SFT s: 1.28x" in text
    assert "beamrl / trl" not in bench.format_summary(bench.aggregate(rows[::2]))  # one side: no ratio
    # A second TRL model is a side of its own, with its own ratios.
    both = bench.format_summary(bench.aggregate(rows + [_row("trl-beam", 1, 0.6, 5.0, 0.3, 0.6, 90.0)]))
    assert "beamrl / trl-qwen2, median GRPO s/step: 1.50x" in both
    assert "beamrl / trl-beam, median GRPO s/step: 0.50x" in both and "beamrl / trl-beam, median SFT s: 0.46x" in both
    table = bench.format_table(rows).splitlines()
    assert table[2].startswith("| beamrl run 1 |") and table[3].startswith("| trl-qwen2 run 1 |")


def test_run_logged_kills_a_silent_side_at_its_limit(tmp_path):
    # A side that hangs without printing must still end at --timeout-s (the watchdog, not the output loop).
    rc, wall = bench._run_logged(["bash", "-c", "echo started; sleep 60"], tmp_path / "side" / "stdout.log", 1.0)
    assert rc == 124 and wall < 30
    assert (tmp_path / "side" / "stdout.log").read_text() == "started\n"


def test_prompt_loader_order_is_beamrls_loader_order():
    # The TRL side must draw the very batches beamrl draws: the contract is beamrl's own PromptLoader, across
    # epoch boundaries (a batch may span two epochs) and with shuffling off.
    from beamrl.data.loader import PromptLoader

    for shuffle in (True, False):
        loader = PromptLoader(list(range(7)), 4, shuffle=shuffle, seed=3)
        want = [i for _ in range(6) for i in loader.next_batch()]
        assert bench.prompt_loader_order(7, 3, 24, shuffle) == want
    assert bench.prompt_loader_order(7, 3, 24) != bench.prompt_loader_order(7, 4, 24)


def test_settings_carry_the_models_and_the_data_order():
    recipe = bench.quickstart_recipe()
    s = bench.settings_from_recipe(recipe, 1, 1, ("a",), 1, 1, trl_model="beam")
    assert s.trl_model == "beam" and s.model_seed == recipe["model"]["seed"]
    assert (s.data_shuffle, s.data_shuffle_seed) == (True, recipe["data"]["shuffle_seed"])
    recipe["model"]["seed"], recipe["run"]["seed"], recipe["data"]["shuffle"] = None, 5, False
    s = bench.settings_from_recipe(recipe, 1, 1, ("a",), 1, 1)
    assert (s.model_seed, s.data_shuffle, s.trl_model) == (5, False, "qwen2")  # beamrl's fallback: run.seed
    s = bench.settings_from_recipe(recipe, 1, 1, ("a",), 1, 1, seed=7)  # --seed replaces run.seed
    assert (s.seed, s.model_seed) == (7, 7)
    recipe["model"]["seed"] = 0
    assert bench.settings_from_recipe(recipe, 1, 1, ("a",), 1, 1, seed=7).model_seed == 0
    assert bench.parse_args(["--seed", "3"]).seed == 3 and bench.parse_args([]).seed is None
    assert bench.parse_args(["--trl-model", "beam"]).trl_model == ["beam"]
    assert bench.parse_args(["--trl-model", "qwen2", "beam", "qwen2"]).trl_model == ["qwen2", "beam"]
    assert bench.parse_args([]).trl_model == ["qwen2"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--trl-model", "llama"])


def test_an_earlier_run_in_out_is_refused_or_overwritten(tmp_path, capsys):
    for name in ("run1", "run2", "beamrl", "trl", "trl-beam"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "results.json").write_text("{}\n")
    (tmp_path / "notes.txt").write_text("mine\n")
    (tmp_path / "runs").mkdir()
    assert bench.main(["--out", str(tmp_path), "--skip-trl"]) == 2
    assert "--overwrite" in capsys.readouterr().err and (tmp_path / "results.json").exists()
    assert [p.name for p in bench.earlier_outputs(tmp_path)] == ["beamrl", "results.json", "run1", "run2", "trl",
                                                                  "trl-beam"]
    assert bench.earlier_outputs(tmp_path / "missing") == []
    assert len(bench.clear_earlier_outputs(tmp_path)) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "runs"]  # not ours: kept
