"""Third-party noise is filtered at its source: warnings raised from Megatron/torch/... modules and their loggers
are hidden by default and shown once with verbose; beamrl's own warnings stay; Ray gets no colour codes when
stdout is not a terminal. Each case runs in a fresh interpreter (filters are process-wide)."""

import subprocess
import sys
import textwrap

from beamrl.third_party_output import worker_runtime_env


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


NOISE = """
    import logging, sys, types, warnings
    from beamrl.third_party_output import quiet
    quiet(verbose={verbose})
    logging.basicConfig(stream=sys.stderr)
    megatron = types.ModuleType("megatron.core.optimizer")  # a warning attributed to a Megatron module
    for _ in range(3):
        exec("import warnings\\nwarnings.warn('Transformer Engine and Apex are not installed.')",
             {{"__name__": "megatron.core.optimizer"}})
    logging.getLogger("megatron.core.models.gpt.gpt_model").warning("GPTModel IS DEPRECATED")
    exec("import warnings\\nwarnings.warn('beamrl: a warning of our own')", {{"__name__": "beamrl.loop.driver"}})
"""


def test_third_party_warnings_are_hidden_and_beamrl_warnings_stay():
    p = _run(NOISE.format(verbose=False))
    assert p.returncode == 0, p.stderr
    assert "Transformer Engine" not in p.stderr and "GPTModel" not in p.stderr
    assert "a warning of our own" in p.stderr


def test_verbose_shows_each_third_party_warning_once():
    p = _run(NOISE.format(verbose=True))
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("Transformer Engine and Apex are not installed") == 1
    assert "GPTModel IS DEPRECATED" in p.stderr and "a warning of our own" in p.stderr


def test_ray_output_is_plain_when_stdout_is_not_a_terminal():
    p = _run("""
        import io, os
        from beamrl.third_party_output import plain_ray_output
        plain_ray_output(io.StringIO())
        print(os.environ.get("RAY_COLOR_PREFIX"), os.environ.get("RAY_DEDUP_LOGS"))
    """)
    assert p.stdout.split() == ["0", "0"], p.stderr


def test_every_ray_worker_installs_the_same_filters():
    for verbose in (False, True):
        hook = worker_runtime_env(verbose)["worker_process_setup_hook"]
        module, _, name = hook.rpartition(".")
        assert callable(getattr(__import__(module, fromlist=[name]), name))
    assert worker_runtime_env(False) != worker_runtime_env(True)


def test_dataset_loading_draws_no_progress_bars(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    p = _run(f"""
        from beamrl.third_party_output import quiet
        quiet()
        from beamrl.data.sources import load_rows
        print(len(load_rows({str(tmp_path / 'rows.jsonl')!r}, cache_dir={str(tmp_path / 'cache')!r})))
    """)
    assert p.returncode == 0 and p.stdout.strip() == "1", p.stderr
    assert "Generating" not in p.stderr and "examples" not in p.stderr, p.stderr
