import json

import pytest

from beamrl.data import PromptLoader, PromptSample, build_prompt_loader
from beamrl.data.config import DataConfig
from beamrl.data.prompts import load_tokenizer


def _samples(n):
    return [PromptSample(f"p{i}", [i], str(i), "t", {}, i) for i in range(n)]


def test_epochs_are_permutations_and_differ():
    loader = PromptLoader(_samples(10), batch_size=4, seed=1)
    seen = [s.index for _ in range(5) for s in loader.next_batch()]  # 20 = two epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:] and seen[:10] != list(range(10))
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["index"] == 10


def test_same_seed_same_order_other_seed_other_order():
    a = [s.index for s in PromptLoader(_samples(30), 30, seed=5).next_batch()]
    assert a == [s.index for s in PromptLoader(_samples(30), 30, seed=5).next_batch()]
    assert a != [s.index for s in PromptLoader(_samples(30), 30, seed=6).next_batch()]
    assert [s.index for s in PromptLoader(_samples(5), 5, shuffle=False).next_batch()] == list(range(5))


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 7])
def test_resume_sees_exactly_the_same_prompts(stop_after):
    full = PromptLoader(_samples(7), batch_size=3, seed=2)
    reference = [[s.index for s in full.next_batch()] for _ in range(8)]
    first = PromptLoader(_samples(7), batch_size=3, seed=2)
    got = [[s.index for s in first.next_batch()] for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state_dict()))  # as saved in a checkpoint
    resumed = PromptLoader(_samples(7), batch_size=3, seed=2)
    resumed.load_state_dict(state)
    got += [[s.index for s in resumed.next_batch()] for _ in range(8 - stop_after)]
    assert got == reference


def test_resume_refuses_other_data_or_seed():
    state = PromptLoader(_samples(7), 3, seed=2).state_dict()
    with pytest.raises(ValueError, match="num_prompts"):
        PromptLoader(_samples(8), 3, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PromptLoader(_samples(7), 3, seed=3).load_state_dict(state)


def test_empty_loader_is_an_error():
    with pytest.raises(ValueError, match="no prompts"):
        PromptLoader([], 2)


def test_build_from_quickstart_recipe():
    from beamrl.recipe import load_recipe

    recipe = load_recipe("quickstart")
    loader = build_prompt_loader(recipe.data, recipe.rollout.prompts_per_step, load_tokenizer("digit", None))
    batch = loader.next_batch()
    assert len(batch) == 8 and len(loader) == 1000
    for s in batch:
        a, b = s.prompt[:-1].split("+")
        assert s.ground_truth == str(int(a) + int(b)) and len(s.prompt_ids) == 4


def test_build_from_jsonl_drops_long_prompts(tmp_path, caplog):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "11+22=", "answer": "33"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(format="jsonl-prompt-answer", source=str(path), tokenizer="digit", max_prompt_len=4)
    loader = build_prompt_loader(data, 1, load_tokenizer("digit", None), cache_dir=str(tmp_path / "cache"))
    assert len(loader) == 1 and loader.next_batch()[0].ground_truth == "3"
    assert "dropped 1 of 2" in caplog.text


def test_build_samples_dapo_rows_with_chat_template():
    from beamrl.data.loader import build_samples
    from tests.data.test_formats import DAPO_ROW
    from tests.data.test_prompts import _hf_tokenizer

    rows = [DAPO_ROW, {**DAPO_ROW, "reward_model": {"ground_truth": "7", "style": "x"}}]
    samples, dropped = build_samples(rows, "dapo", _hf_tokenizer(), None, True, max_prompt_len=64)
    assert dropped == 0 and [s.ground_truth for s in samples] == ["2", "7"] and [s.index for s in samples] == [0, 1]
    assert samples[0].prompt.startswith("<|user|> Solve 1+1.") and samples[0].prompt.endswith("<|assistant|>")
    assert samples[0].data_source == "math_dapo" and samples[0].metadata["extra_info"] == {"index": "abc"}
    assert len(samples[0].prompt_ids) == len(samples[0].prompt.split())  # WordLevel: one id per word
