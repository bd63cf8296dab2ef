"""How a run treats its output directory, decided before anything is written: an earlier run is refused (named,
its files unchanged), resumed from its newest complete checkpoint, reported complete, or deleted with
--overwrite. Checkpoints are written by the real `RunCheckpoints` with a minimal trainer (tests/loop/
test_checkpoints.py); the e2e replay of the same scenarios is tests/loop/test_first_run.py."""

import hashlib
import json

import pytest

from beamrl.loop.checkpoints import RunCheckpoints
from beamrl.loop.run_dir import delete_outputs, earlier_run, plan_start
from beamrl.recipe import RecipeError, load_recipe
from tests.loop.test_checkpoints import _FakeTrainer


def _recipe(out, *overrides):
    return load_recipe("quickstart", [f"run.output_dir={out}", "run.num_steps=3", *overrides])


def _finished_run(out, steps_logged=3, checkpoint_steps=(3,)):
    """What a finished quickstart run leaves: its files, and checkpoints after `checkpoint_steps`."""
    out.mkdir(parents=True)
    (out / "recipe.yaml").write_text(_recipe(out).to_yaml())
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n"
                                               for s in range(steps_logged)))
    (out / "summary.json").write_text("{}\n")
    (out / "sft_checkpoint").mkdir()
    (out / "init_checkpoint_seed0").mkdir()
    (out / "adapter").mkdir()  # what a LoRA run writes at its end (PEFT format)
    (out / "notes.txt").write_text("the user's own file\n")
    ckpts, trainer = RunCheckpoints(out / "checkpoints", 2, False, 60.0, lambda m: None), _FakeTrainer()
    for s in checkpoint_steps:
        ckpts.save(trainer, s, weight_version=s, data_state={"index": s})
    return out


def _digest(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_fresh_run_refuses_an_earlier_run_naming_it_and_changing_nothing(tmp_path):
    out = _finished_run(tmp_path / "run")
    before = _digest(out)
    with pytest.raises(RecipeError) as e:
        plan_start(_recipe(out), resume=False, overwrite=False, log=print)
    assert e.value.path == "run.output_dir"
    assert "run 'quickstart-addition' (3 of 3 steps logged; last checkpoint step_3)" in str(e.value)
    assert "--resume" in str(e.value) and "--overwrite" in str(e.value)
    assert _digest(out) == before


def test_what_counts_as_an_earlier_run(tmp_path):
    assert earlier_run(tmp_path / "absent", tmp_path / "absent" / "checkpoints") is None
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")  # a user's file is not a run
    assert earlier_run(tmp_path / "mine", tmp_path / "mine" / "checkpoints") is None
    assert plan_start(_recipe(tmp_path / "mine"), False, False, print).resume_dir is None
    (tmp_path / "mine" / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 1, "cut')  # crashed
    found = earlier_run(tmp_path / "mine", tmp_path / "mine" / "checkpoints")
    assert found.describe() == "run '(unnamed)' (2 steps logged; no checkpoint)"


def test_a_staged_checkpoint_alone_is_an_earlier_run(tmp_path):
    """A checkpoint still being written (`step_N.incomplete`) is an earlier run's output, with nothing else there."""
    from beamrl.loop.checkpoints import STAGING_SUFFIX

    out = tmp_path / "run"
    staged = out / "checkpoints" / f"step_3{STAGING_SUFFIX}"
    staged.mkdir(parents=True)
    found = earlier_run(out, out / "checkpoints")
    assert found is not None and found.checkpoints == [] and found.outputs == [staged]


def test_resume_continues_from_the_newest_checkpoint_or_says_the_run_is_complete(tmp_path):
    out = _finished_run(tmp_path / "run", steps_logged=3, checkpoint_steps=(2, 3))
    plan = plan_start(_recipe(out), resume=True, overwrite=False, log=print)
    assert plan.completed and plan.resume_dir == out / "checkpoints" / "step_3"
    plan = plan_start(_recipe(out, "run.num_steps=5"), resume=True, overwrite=False, log=print)
    assert not plan.completed and plan.resume_dir == out / "checkpoints" / "step_3"


def test_resume_without_a_run_or_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(RecipeError, match="--resume: no earlier run there to continue"):
        plan_start(_recipe(tmp_path / "nothing"), resume=True, overwrite=False, log=print)
    out = _finished_run(tmp_path / "run", steps_logged=2, checkpoint_steps=())  # killed before its final save
    with pytest.raises(RecipeError, match=r"run 'quickstart-addition' \(2 of 3 steps logged; no checkpoint\) "
                                          r"cannot be resumed: it wrote no checkpoint"):
        plan_start(_recipe(out), resume=True, overwrite=False, log=print)


def test_overwrite_deletes_only_what_the_earlier_run_wrote(tmp_path):
    out = _finished_run(tmp_path / "run", checkpoint_steps=(2, 3))
    plan = plan_start(_recipe(out), resume=False, overwrite=True, log=print)
    assert plan.replace is not None and plan.resume_dir is None
    logs = []
    delete_outputs(plan.replace, logs.append)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "notes.txt"]
    assert list((out / "checkpoints").iterdir()) == []
    assert "deleted the outputs of run 'quickstart-addition'" in logs[0]


@pytest.mark.parametrize("override,field", [
    ("data.shuffle_seed=5", "data.shuffle_seed"),
    ("data.max_prompt_len=6", "data.max_prompt_len"),
    ("model.dtype=bfloat16", "model.dtype"),
    ("trainer.lora={rank: 4}", "trainer.lora"),
])
def test_a_resume_that_changes_what_the_checkpoints_are_or_the_prompt_order_is_refused_by_name(tmp_path, override,
                                                                                             field):
    """Before, a changed data.shuffle_seed ended the resumed run with a raw traceback once Ray, the trainer and the
    engines were up; a LoRA run resumed without LoRA failed loading its checkpoint."""
    out = _finished_run(tmp_path / "run", checkpoint_steps=(2,))
    before = _digest(out)
    with pytest.raises(RecipeError) as e:
        plan_start(_recipe(out, override), resume=True, overwrite=False, log=print)
    assert e.value.path.startswith(field) and "a resume must keep it" in str(e.value), str(e.value)
    assert _digest(out) == before


def test_a_resume_with_other_settings_says_which_and_keeps_the_earlier_recipe(tmp_path):
    from beamrl.loop.resume_recipe import EARLIER, keep_earlier_recipe

    out = _finished_run(tmp_path / "run", checkpoint_steps=(2,))
    earlier = (out / "recipe.yaml").read_text()
    said = []
    plan = plan_start(_recipe(out, "trainer.lr=0.001", "run.num_steps=5"), resume=True, overwrite=False,
                      log=said.append)
    assert plan.recipe_changed and len(said) == 1
    assert "trainer.lr: 0.0005 -> 0.001" in said[0] and "run.num_steps: 3 -> 5" in said[0]
    assert not plan_start(_recipe(out), resume=True, overwrite=False, log=print).recipe_changed
    kept = keep_earlier_recipe(out, 2)
    assert kept == out / EARLIER.format(step=2) and kept.read_text() == earlier
    assert earlier_run(out, out / "checkpoints").outputs.count(kept) == 1  # --overwrite deletes it too


def test_fields_that_another_beamrl_version_added_or_removed_are_not_changes():
    """A run written by an older beamrl lacks the fields added since (and may hold removed ones): those are not
    changes, so a resume across versions is not refused for a FIXED section's new field; a section that appears or
    disappears is one change."""
    from beamrl.loop.resume_recipe import changed_fields

    assert changed_fields({"trainer": {"lora": {"rank": 4}}}, {"trainer": {"lora": {"rank": 4, "seed": 0}}}) == []
    assert changed_fields({"data": {"shuffle": True, "gone": 1}}, {"data": {"shuffle": True}}) == []
    assert changed_fields({"trainer": {"lora": None}}, {"trainer": {"lora": {"rank": 4}}}) == [
        ("trainer.lora", None, {"rank": 4})]
    assert changed_fields({"trainer": {"lr": 1}}, {"trainer": {"lr": 2}}) == [("trainer.lr", 1, 2)]


def test_a_field_inside_a_fixed_section_is_fixed_too():
    """A FIXED entry covers the fields under it: trainer.lora.rank 4 -> 8 is refused, naming trainer.lora.rank."""
    from beamrl.loop.resume_recipe import check_resume_recipe

    old = {"trainer": {"lr": 1, "lora": {"rank": 4, "alpha": 8}}}
    new = {"trainer": {"lr": 1, "lora": {"rank": 8, "alpha": 8}}}
    said = []
    with pytest.raises(RecipeError) as e:
        check_resume_recipe(old, new, said.append)
    assert e.value.path == "trainer.lora.rank" and "a resume must keep it" in str(e.value), str(e.value)
    assert said == []


def test_free_form_mappings_are_compared_whole_and_a_kept_recipe_is_not_overwritten(tmp_path):
    from beamrl.loop.resume_recipe import changed_fields, keep_earlier_recipe

    old = {"model": {"config_overrides": {"vocab_size": 16}}}
    new = {"model": {"config_overrides": {"vocab_size": 16, "num_hidden_layers": 2}}}
    assert changed_fields(old, new) == [("model.config_overrides", {"vocab_size": 16},
                                         {"vocab_size": 16, "num_hidden_layers": 2})]
    (tmp_path / "recipe.yaml").write_text("first stretch\n")
    assert keep_earlier_recipe(tmp_path, 10) == tmp_path / "recipe.until_step_10.yaml"
    (tmp_path / "recipe.yaml").write_text("a stretch from step 10 that crashed before its next checkpoint\n")
    assert keep_earlier_recipe(tmp_path, 10) is None
    assert (tmp_path / "recipe.until_step_10.yaml").read_text() == "first stretch\n"


@pytest.fixture(scope="module")
def tokenizer_checkpoints(tmp_path_factory):
    """Three tiny checkpoints with a tokenizer beside the weights: the byte tokenizer ('a'), the same files at
    another path ('moved'), and the byte tokenizer with one more token ('other')."""
    import shutil

    from beamrl.cli import main
    from beamrl.data.byte_tokenizer import byte_tokenizer

    root = tmp_path_factory.mktemp("tokenizers")
    assert main(["init-checkpoint", "--preset", "tiny", "--out", str(root / "a"), "--dtype", "float32",
                 "--tokenizer", "byte"]) == 0
    shutil.copytree(root / "a", root / "moved")
    shutil.copytree(root / "a", root / "other")
    tok = byte_tokenizer()
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(root / "other")
    return root


def _byte_recipe(out, checkpoint, *overrides):
    return _recipe(out, "model.preset=null", "model.seed=null", f"model.checkpoint={checkpoint}",
                   "model.config_overrides={}", "data.tokenizer=null", *overrides)


def test_a_tokenizer_is_known_by_what_it_does_not_by_its_path(tokenizer_checkpoints):
    from beamrl.data.prompts import load_tokenizer
    from beamrl.data.tokenizer_identity import tokenizer_digest

    root = tokenizer_checkpoints
    a, moved, other = (tokenizer_digest(load_tokenizer(None, str(root / n))) for n in ("a", "moved", "other"))
    assert a == moved != other
    assert len({a, tokenizer_digest(load_tokenizer("digit", None)), tokenizer_digest(load_tokenizer("byte", None))}) \
        == 2  # the byte tokenizer beside the checkpoint is the built-in one
    from beamrl.data.byte_tokenizer import byte_tokenizer

    assert tokenizer_digest(byte_tokenizer(chat_template=False)) != a  # the chat template makes the prompts
    from tokenizers import processors

    bos = byte_tokenizer()  # the same vocabulary, now prepending BOS: prompts without a chat template change
    bos._tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos.bos_token} $A",
                                                                  special_tokens=[(bos.bos_token, bos.bos_token_id)])
    assert tokenizer_digest(bos) != a


def test_a_tokenizer_digest_is_the_same_in_another_process():
    """The digest is compared across runs: no hash randomisation or load-order dependence may enter it."""
    import os
    import subprocess
    import sys

    from beamrl.data.prompts import load_tokenizer
    from beamrl.data.tokenizer_identity import tokenizer_digest

    code = ("from beamrl.data.prompts import load_tokenizer as L; from beamrl.data.tokenizer_identity import "
            "tokenizer_digest as D; print(D(L('digit', None)), D(L('byte', None)))")
    here = f"{tokenizer_digest(load_tokenizer('digit', None))} {tokenizer_digest(load_tokenizer('byte', None))}"
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                             env=dict(os.environ, PYTHONHASHSEED=seed))
        assert out.stdout.split() == here.split()


def test_a_resume_whose_tokenizer_tokenizes_otherwise_is_refused_before_anything_starts(tokenizer_checkpoints,
                                                                                      tmp_path, capsys):
    """`data.tokenizer: null` takes the tokenizer beside `model.checkpoint`, and `model.checkpoint` may change on
    resume (the weights come from the run's checkpoint): before, a resume from another checkpoint directory
    tokenized its prompts with that directory's tokenizer, unnoticed."""
    from beamrl.cli import main
    from beamrl.data.prompts import load_tokenizer
    from beamrl.data.tokenizer_identity import TOKENIZER_DIGEST_FILE, tokenizer_digest
    from beamrl.loop.resume_recipe import check_resume_tokenizer

    root = tokenizer_checkpoints
    out = tmp_path / "run"
    _finished_run(out, checkpoint_steps=(2,))
    (out / "recipe.yaml").write_text(_byte_recipe(out, root / "a").to_yaml())
    (out / TOKENIZER_DIGEST_FILE).write_text(tokenizer_digest(load_tokenizer(None, str(root / "a"))) + "\n")
    before = _digest(out)
    args = ["train", "quickstart", "--resume", f"run.output_dir={out}", "run.num_steps=3", "model.preset=null",
            "model.seed=null", f"model.checkpoint={root / 'other'}", "model.config_overrides={}",
            "data.tokenizer=null"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"beamrl train: model.checkpoint='{root / 'other'}'") and "tokenizes otherwise" in err, err
    assert _digest(out) == before  # refused before anything was written
    assert earlier_run(out, out / "checkpoints").outputs.count(out / TOKENIZER_DIGEST_FILE) == 1  # --overwrite too
    # The same tokenizer at another path is the same tokenizer; a run from before the digest was kept is not checked.
    check_resume_tokenizer(out, tokenizer_digest(load_tokenizer(None, str(root / "moved"))), "model.checkpoint",
                           str(root / "moved"))
    (out / TOKENIZER_DIGEST_FILE).unlink()
    check_resume_tokenizer(out, "0" * 64, "model.checkpoint", str(root / "other"))
