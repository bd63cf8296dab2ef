"""A first run as a new user makes it (issue 16), replayed end to end through the CLI: the quickstart recipe for two
steps, started from a directory holding the user's own reward module (named `module:registered-name` in the
recipe, found like `beamrl reward test` finds it). Then what a user does next: run it again (refused, nothing
changed), `--resume` it (complete: exits at once), raise `run.num_steps` and `--resume` (the default run is
resumable), `--overwrite` with a broken field (nothing deleted)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from beamrl.loop.checkpoints import problems, published, step_of
from tests.loop.e2e_helpers import QUICKSTART, ROOT, env, metrics, trainer_pids

pytestmark = pytest.mark.slow

USER_REWARDS = '''from beamrl.rewards import reward


@reward("answer-length")
def answer_length(completion):
    return float(len(completion.strip()))
'''
REWARDS = ("rewards=[{name: exact, fn: 'beamrl.rewards.exact:exact_match', timeout_s: 10}, "
           "{name: length, fn: 'my_rewards:answer-length', weight: 0, timeout_s: 10}]")
# beamrl's own console lines: progress, step lines, sample headers and sample rows
OWN_LINE = re.compile(r"^(\[beamrl\] |step \d+/\d+ \| |samples of step \d+/\d+ |\s+-?\d+\.\d{3} \| )")


def beamrl_train(cwd: Path, out: Path, *args: str, timeout: float = 580) -> subprocess.CompletedProcess:
    """`beamrl train` on the quickstart as a user runs it: from `cwd`, stdout and stderr in one stream."""
    cmd = [sys.executable, "-m", "beamrl.cli", "train", str(QUICKSTART), f"run.output_dir={out}", "run.num_steps=2",
           "sft.steps=2", REWARDS, *args]
    return subprocess.run(cmd, env=env(), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("user")
    (cwd / "my_rewards.py").write_text(USER_REWARDS)
    out = cwd / "outputs" / "first"
    p = beamrl_train(cwd, out)
    assert p.returncode == 0, p.stdout[-6000:]
    return cwd, out, p.stdout


def test_the_console_is_quiet_and_says_what_happens(first_run):
    _, out, console = first_run
    lines = [ln for ln in console.splitlines() if ln.strip()]
    third_party = [ln for ln in lines if not OWN_LINE.match(ln)]
    assert len(third_party) < 5, "\n".join(third_party)
    assert "\x1b[" not in console  # no colour codes: the output is not a terminal
    assert lines[0].startswith("[beamrl] train ")
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert [ln.split(" | ")[0] for ln in steps] == ["step 1/2", "step 2/2"]
    assert all(" tok/s | ETA " in ln for ln in steps)
    headers = [i for i, ln in enumerate(lines) if ln.startswith("samples of step ")]
    assert [lines[i].split(" (")[0] for i in headers] == ["samples of step 1/2", "samples of step 2/2"]
    for i in headers:
        rows = lines[i + 1:i + 5]
        assert all(re.match(r'^\s+\d\.\d{3} \| "\d\+\d=" -> ".*" \| "\d+"', r) for r in rows), rows


def test_the_run_leaves_no_shared_memory_behind(first_run):
    """The trainer's weight sync shares its CPU staging slots with the engine as /dev/shm files; a finished run's
    trainer ranks must remove them in their shutdown (4 files of 2.4 MB leaked per quickstart run before). The
    driver's removal of a killed rank's files would hide a broken shutdown, so it must have had nothing to do."""
    from beamrl.sync.shm import files_of

    _, _, console = first_run
    pids = trainer_pids(console)
    assert len(pids) == 2, console[-3000:]  # the SFT warm start's trainer and the RL trainer
    assert files_of(pids) == []
    # ... removed by the ranks' own shutdown, not by the driver's clean-up after killed ranks
    assert "shared-memory file(s) of killed ranks" not in console


def test_outputs_name_the_run_its_samples_and_its_last_checkpoint(first_run):
    cwd, out, _ = first_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["name"] == "quickstart-addition" and summary["steps"] == 2 and summary["wall_time_s"] > 0
    assert summary["last_checkpoint"] == str(out / "checkpoints" / "step_2")
    assert Path(summary["last_checkpoint"], "manifest.json").is_file()
    # checkpoint.every_n_steps defaults to 0 = only at the end: exactly the final checkpoint, complete
    assert [step_of(p) for p in published(out / "checkpoints")] == [2]
    assert problems(out / "checkpoints" / "step_2") == []
    assert summary["files"]["samples.jsonl"] == str(out / "samples.jsonl") and summary["resumed_from"] is None
    from beamrl.data.digit_tokenizer import DigitTokenizer
    from beamrl.data.tokenizer_identity import TOKENIZER_DIGEST_FILE, tokenizer_digest

    # what a resume compares its tokenizer with (the default run's resume below passes that check)
    assert (out / TOKENIZER_DIGEST_FILE).read_text() == tokenizer_digest(DigitTokenizer()) + "\n"
    samples = [json.loads(ln) for ln in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0] * 4 + [1] * 4
    assert {s["reward"] for s in samples} <= {0.0, 1.0} and all(s["prompt"].endswith("=") for s in samples)
    # the user's reward module in the working directory ran in the reward workers, by its registered name
    rows = metrics(out)
    assert all(r["reward/length/count"] == 64 and r["reward/length/errors"] == 0 for r in rows)


def test_every_metric_name_in_the_docs_is_logged_or_listed_as_conditional(first_run):
    _, out, _ = first_run
    doc = (ROOT / "docs" / "metrics.md").read_text()
    emitted = {k for r in metrics(out) for k in r}
    conditional_section = doc.split("### Metrics logged only with a feature")[1].split("\n## ")[0]
    conditional = set(documented_names(conditional_section))
    components = ("exact", "length")
    unknown = []
    for name in documented_names(doc):
        if name in conditional:
            continue
        candidates = {name.replace("<name>", c) for c in components}
        if not candidates & emitted:
            unknown.append(name)
    assert not unknown, f"docs/metrics.md names metrics a run does not log (and does not list as conditional): " \
                        f"{unknown}"
    source = "\n".join(p.read_text() for p in (ROOT / "beamrl").rglob("*.py"))
    for name in conditional:  # a conditional metric must be one the code can log
        last = name.rsplit("/", 1)[-1]
        if "<" not in last:
            assert re.search(rf"[\"/]{re.escape(last)}\"", source), f"{name}: no code logs {last!r}"


def documented_names(markdown: str) -> list[str]:
    """Metric names in a page: backticked tokens with a '/', and the backticked first cells of table rows
    (`reward/x/mean`, `std` means reward/x/std)."""
    names = []
    for line in markdown.splitlines():
        cells = line.split(" | ") if line.startswith("| ") else []
        first = cells[0][2:] if cells else ""
        previous = None
        for token in re.findall(r"`([^`\s]+)`", first):
            if "/" not in token and previous is not None:
                token = previous.rsplit("/", 1)[0] + "/" + token
            names.append(token)
            previous = token if "/" in token else previous
        rest = line[len(cells[0]):] if cells else line
        names += [t for t in re.findall(r"`([a-z_]+(?:/[\w<>.]+)+)`", rest)]
    return [n for n in dict.fromkeys(names)
            if re.fullmatch(r"[a-z_]+(/[\w<>.]+)*", n) and not re.search(r"\.(py|md|jsonl?|png|yaml)$", n)]


def test_a_second_run_into_the_same_directory_is_refused_and_changes_nothing(first_run):
    cwd, out, _ = first_run
    before = digest(out)
    p = beamrl_train(cwd, out)
    assert p.returncode == 2
    errors = [ln for ln in p.stdout.splitlines() if ln.startswith("beamrl train:")]
    assert errors == [f"beamrl train: run.output_dir='{out}': holds the outputs of run 'quickstart-addition' (2 of 2 "
                      "steps logged; last checkpoint step_2): continue it with --resume, replace it with --overwrite, "
                      "or set run.output_dir (or run.name) for a new run; nothing was changed"]
    assert digest(out) == before


def test_resume_of_a_finished_run_says_so_and_exits_at_once(first_run):
    cwd, out, _ = first_run
    before = digest(out)
    p = beamrl_train(cwd, out, "--resume")
    assert p.returncode == 0, p.stdout
    assert f"run 'quickstart-addition' is complete: {out / 'checkpoints' / 'step_2'} covers its 2 steps" in p.stdout
    assert "starting Ray" not in p.stdout and "checks passed" not in p.stdout
    assert digest(out) == before


def test_overwrite_deletes_nothing_when_a_start_up_check_fails(first_run):
    cwd, out, _ = first_run
    before = digest(out)
    p = beamrl_train(cwd, out, "--overwrite", "rewards.1.fn=my_rewardz:answer-length")
    assert p.returncode == 2
    assert "beamrl train: rewards[1].fn='my_rewardz:answer-length': cannot import module 'my_rewardz'" in p.stdout
    assert digest(out) == before


def test_the_default_run_is_resumable(first_run, tmp_path):
    """checkpoint.every_n_steps: 0 (the default) wrote the final checkpoint; raising run.num_steps continues."""
    cwd, out, _ = first_run
    more = tmp_path / "more"
    shutil.copytree(out, more)
    p = beamrl_train(cwd, more, "--resume", "run.num_steps=3")
    assert p.returncode == 0, p.stdout[-6000:]
    assert f"resumed from {more / 'checkpoints' / 'step_2'}" in p.stdout
    assert [r["step"] for r in metrics(more)] == [0, 1, 2]
    assert [json.loads(ln)["step"] for ln in (more / "samples.jsonl").read_text().splitlines()] == \
        [0] * 4 + [1] * 4 + [2] * 4
    summary = json.loads((more / "summary.json").read_text())
    assert summary["resumed_from"] == str(more / "checkpoints" / "step_2") and summary["steps"] == 3
    assert summary["last_checkpoint"] == str(more / "checkpoints" / "step_3")


def test_the_first_line_comes_before_torch_is_imported():
    """`-X importtime` writes each import to stderr as it happens; with both streams in one pipe the first
    progress line must come before the first torch import."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "beamrl.cli", "train", str(QUICKSTART),
                        "--dry-run"], env=env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:]
    lines = p.stdout.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("[beamrl] train "))
    torch = next(i for i, ln in enumerate(lines) if re.search(r"\|\s+torch$", ln))
    assert first < torch
