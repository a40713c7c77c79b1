"""slurm/*.sbatch without Slurm: the #SBATCH header, and the scripts run with bash (through
hpcnft.run.batch), a stand-in `hpcnft` (HPCNFT_CMD) and a stand-in `srun` (SRUN) that record
their argv. hpcnft.run.batch's rules one by one: test_batch.py. The same scripts run under a real
Slurm in tests/hpc/test_cluster_smoke.py."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SD3 = ROOT / "slurm" / "sd3_pickscore.sbatch"
TINY = ROOT / "slurm" / "tiny.sbatch"
SCRIPTS = [SD3, TINY]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def sbatch_options(path: Path) -> dict[str, list[str | None]]:
    """#SBATCH options as sbatch reads them: up to the first line that is not a comment."""
    opts: dict[str, list[str | None]] = {}
    for line in path.read_text().splitlines()[1:]:
        s = line.strip()
        if s and not s.startswith("#"):
            break
        if not s.startswith("#SBATCH"):
            continue
        for word in shlex.split(s[len("#SBATCH"):]):
            assert word.startswith("--"), f"{path.name}: use long options: {line!r}"
            name, eq, value = word[2:].partition("=")
            opts.setdefault(name, []).append(value if eq else None)
    return opts


def sbatch_lines_after_first_command(path: Path) -> list[str]:
    lines = path.read_text().splitlines()[1:]
    first = next(i for i, line in enumerate(lines) if line.strip() and not line.strip().startswith("#"))
    return [line for line in lines[first:] if line.startswith("#SBATCH")]


# ------------------------------------------------------------------------------------ header

def test_sd3_header():
    o = sbatch_options(SD3)
    assert o["ntasks"] == ["3"]                 # 2 train + 1 reward
    assert o["gpus-per-task"] == ["1"]
    assert o["signal"] == ["USR2@120"]
    assert o["requeue"] == [None]
    assert o["open-mode"] == ["append"]
    assert "%j" in o["output"][0] and "$" not in o["output"][0]
    assert "time" in o and "job-name" in o
    # options that break the documented CPU override `sbatch --gpus-per-task=0` must stay off
    for bad in ("mem-per-gpu", "gres", "gpus", "gpus-per-node", "mem"):
        assert bad not in o, bad


def test_tiny_header():
    o = sbatch_options(TINY)
    assert o["ntasks"] == ["3"]
    assert o["cpus-per-task"] == ["1"]
    assert not any(k.startswith(("gpu", "gres", "mem-per-gpu")) for k in o)
    h, m, _ = (o["time"][0].split(":") + ["0"])[:3]
    assert int(h) * 60 + int(m) <= 30
    assert o["requeue"] == [None] and o["open-mode"] == ["append"]
    assert o["signal"] and "%j" in o["output"][0]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_header_well_formed(script):
    text = script.read_text()
    assert text.startswith("#!/bin/bash\n")
    assert sbatch_lines_after_first_command(script) == [], "#SBATCH after a command is ignored by sbatch"
    for line in text.splitlines():
        if line.startswith("#SBATCH"):
            assert "#" not in line[1:], f"no trailing comments on #SBATCH lines: {line!r}"
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert os.access(script, os.X_OK)


def test_one_screen_and_one_srun_line():
    for script in SCRIPTS:
        lines = script.read_text().splitlines()
        assert len(lines) <= 40, f"{script.name}: {len(lines)} lines"
        commands = [line for line in lines if line.strip() and not line.startswith("#")]
        assert commands[-1] == "exec python3 -P -m hpcnft.run.batch srun --kill-on-bad-exit=1 --mpi=none"
        assert len(commands) == 2 and commands[0].startswith("export RECIPE=${RECIPE:-")


# ------------------------------------------------------------------------------- running them

FAKE = """#!{python}
import json, os, sys
rec = {{"name": os.path.basename(sys.argv[0]), "argv": sys.argv[1:], "cwd": os.getcwd(),
       "env": {{k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED")}}}}
with open(os.environ["FAKE_OUT"], "a") as f:
    f.write(json.dumps(rec) + "\\n")
print("FAKE", rec["name"], "ran")
sys.exit(int(os.environ.get("FAKE_RC", "0")))
"""


@pytest.fixture
def sandbox(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("fake_hpcnft", "fake_srun"):
        p = bin_dir / name
        p.write_text(FAKE.format(python=sys.executable))
        p.chmod(0o755)
    (bin_dir / "python3").symlink_to(sys.executable)  # the scripts' python3, with this checkout's hpcnft
    work = tmp_path / "work"
    work.mkdir()
    return tmp_path


def run_script(sandbox: Path, script: Path, extra: dict[str, str], *, hpcnft: bool = True):
    env = {"PATH": f"{sandbox / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}", "HOME": str(sandbox),
           "TMPDIR": str(sandbox), "FAKE_OUT": str(sandbox / "calls.jsonl"), "PYTHONPATH": str(ROOT)}
    if hpcnft:
        env["HPCNFT_CMD"] = shlex.quote(str(sandbox / "bin" / "fake_hpcnft"))
    env.update(extra)
    proc = subprocess.run(["bash", str(script)], cwd=sandbox / "work", env=env,
                          capture_output=True, text=True, timeout=60)
    out = sandbox / "calls.jsonl"
    calls = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if out.exists():
        out.unlink()
    return proc, calls


@pytest.mark.parametrize("script,recipe", [(SD3, "sd35m_pickscore"), (TINY, "tiny")],
                         ids=["sd3", "tiny"])
def test_defaults_without_slurm_run_directly(sandbox, script, recipe):
    proc, calls = run_script(sandbox, script, {})
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert len(calls) == 1 and calls[0]["name"] == "fake_hpcnft"
    argv = calls[0]["argv"]
    assert argv[:2] == ["run", recipe]
    assert argv[2] == "--run-dir"
    run_dir = Path(argv[3])
    assert run_dir.is_absolute() and run_dir.parent == sandbox / "work" / "runs"
    assert run_dir.name.startswith("local-")
    assert argv[4:] == []
    log = run_dir / "logs" / "slurm-local.out"
    assert "FAKE fake_hpcnft ran" in log.read_text()
    # what the script creates is private, like hpcnft's own run files
    assert [oct(p.stat().st_mode & 0o777) for p in (run_dir, run_dir / "logs", log)] == ["0o700", "0o700", "0o600"]
    assert calls[0]["env"] == {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_values_arrive_intact_and_nothing_is_executed(sandbox, script):
    pwned = sandbox / "pwned"
    evil_dir = f"my runs/a b; touch {pwned}1 $(touch {pwned}2) `touch {pwned}3` * ~"
    args = (f"--steps 3 --set 'train.note=hello world' --set \"x='y'\" a\\ b "
            f"$(touch {pwned}4) `touch {pwned}5` ; touch {pwned}6 | cat * ~ $HOME")
    proc, calls = run_script(sandbox, script, {
        "RECIPE": "my recipe; touch {0}7.toml".format(pwned),
        "RUN_DIR": evil_dir, "HPCNFT_ARGS": args})
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert not list(sandbox.glob("pwned*"))
    argv = calls[0]["argv"]
    assert argv[:4] == ["run", f"my recipe; touch {pwned}7.toml", "--run-dir",
                        str(sandbox / "work" / evil_dir)]
    assert argv[4:] == ["--steps", "3", "--set", "train.note=hello world", "--set", "x='y'", "a b",
                        "$(touch", f"{pwned}4)", "`touch", f"{pwned}5`", ";", "touch", f"{pwned}6",
                        "|", "cat", "*", "~", "$HOME"]
    assert (sandbox / "work" / evil_dir / "logs").is_dir()


def test_absolute_run_dir_and_slurm_launch(sandbox):
    run_dir = sandbox / "abs run"
    proc, calls = run_script(sandbox, SD3, {
        "SLURM_JOB_ID": "777", "SLURM_CPUS_PER_TASK": "2", "SLURM_NTASKS": "3",
        "SRUN": str(sandbox / "bin" / "fake_srun"), "SRUN_ARGS": "--exclusive --label",
        "RUN_DIR": str(run_dir), "HPCNFT_ARGS": "--steps 3"})
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert len(calls) == 1 and calls[0]["name"] == "fake_srun"
    assert calls[0]["argv"] == [
        "--kill-on-bad-exit=1", "--mpi=none", "--cpus-per-task=2", "--gpu-bind=none",
        "--exclusive", "--label",
        str(sandbox / "bin" / "fake_hpcnft"), "run", "sd35m_pickscore", "--run-dir", str(run_dir),
        "--steps", "3"]
    assert calls[0]["env"]["OMP_NUM_THREADS"] == "2"
    log = (run_dir / "logs" / "slurm-777.out").read_text()
    assert "FAKE fake_srun ran" in log and "job 777" in log and "exit 0" in log
    assert "FAKE fake_srun ran" in proc.stdout  # still in the Slurm log (the script's stdout)


def test_gpu_bind_can_be_dropped(sandbox):
    proc, calls = run_script(sandbox, TINY, {
        "SLURM_JOB_ID": "5", "SRUN": str(sandbox / "bin" / "fake_srun"), "GPU_BIND": ""})
    assert proc.returncode == 0, proc.stderr
    assert not any(a.startswith("--gpu-bind") for a in calls[0]["argv"])


def test_requeue_keeps_run_dir_and_appends_log(sandbox):
    base = {"SLURM_JOB_ID": "4242", "SRUN": "", "HPCNFT_ARGS": "--steps 3"}
    _, first = run_script(sandbox, TINY, base)
    _, second = run_script(sandbox, TINY, base | {"SLURM_RESTART_COUNT": "1"})
    assert first[0]["argv"] == second[0]["argv"]
    run_dir = sandbox / "work" / "runs" / "4242"
    assert first[0]["argv"][3] == str(run_dir)
    log = (run_dir / "logs" / "slurm-4242.out").read_text()
    assert "attempt 1 " in log and "attempt 2 " in log and log.count("FAKE fake_hpcnft ran") == 2


def test_exit_code_propagates(sandbox):
    proc, calls = run_script(sandbox, SD3, {"FAKE_RC": "3", "RUN_DIR": "r"})
    assert proc.returncode == 3
    assert len(calls) == 1
    assert "exit 3" in (sandbox / "work" / "r" / "logs" / "slurm-local.out").read_text()


def test_no_tee(sandbox):
    proc, _ = run_script(sandbox, SD3, {"HPCNFT_TEE": "0", "RUN_DIR": "r"})
    assert proc.returncode == 0
    assert "FAKE fake_hpcnft ran" in proc.stdout
    assert list((sandbox / "work" / "r" / "logs").iterdir()) == []


@pytest.mark.parametrize("var", ["HPCNFT_ARGS", "HPCNFT_CMD", "SRUN", "SRUN_ARGS"])
def test_unbalanced_quote_refused(sandbox, var):
    proc, calls = run_script(sandbox, SD3, {var: "--set 'a=b", "SLURM_JOB_ID": "1", "RUN_DIR": "r"})
    assert proc.returncode == 2
    assert calls == []
    assert f"bad {var}" in proc.stderr


NASTY = "x; touch MARKER 'q' \"dq\" $(touch M2) `touch M3` | cat"


@pytest.mark.parametrize("script", ["sd3_pickscore.sbatch", "tiny.sbatch"])
def test_sbatch_scripts_pass_a_nasty_run_dir_and_prompt_path_intact(tmp_path, script):
    fake = tmp_path / "fake_hpcnft"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"open({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "TMPDIR": str(tmp_path), "RUN_DIR": NASTY,
           "PYTHONPATH": str(ROOT),
           "HPCNFT_CMD": str(fake), "HPCNFT_ARGS": f"--steps 1 --set 'data.train_prompts=/p/{NASTY.replace(chr(39), '')}'"}
    r = subprocess.run(["bash", str(ROOT / "slurm" / script)], cwd=work, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[2:4] == ["--run-dir", str(work / NASTY)]
    assert argv[4:] == ["--steps", "1", "--set", f"data.train_prompts=/p/{NASTY.replace(chr(39), '')}"]
    assert sorted(os.listdir(work)) == [NASTY]  # the run dir only: no MARKER, M2, M3
