"""The processes hpcnft starts never run what the working directory holds: modules planted
where the user stands (a `json.py`, an `argparse.py`, a folder named `hpcnft`) run neither in the
fork server nor in its ranks nor in a rank started as a new interpreter; and a child finds the
same hpcnft as its parent."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpcnft.distributed import interpreter, spawner
from hpcnft.distributed.spawner import spawn_local

PLANTED = {
    "json.py": "open({marker!r}, 'a').write('json ')\n",  # the fork server imports json
    "argparse.py": "open({marker!r}, 'a').write('argparse ')\n",  # a rank's entry imports argparse
    os.path.join("hpcnft", "__init__.py"): "open({marker!r}, 'a').write('hpcnft ')\n",
}


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A working directory holding modules that, imported, write to a marker file; the test runs there."""
    where, marker = tmp_path / "cwd", str(tmp_path / "marker")
    for name, code in PLANTED.items():
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_text(code.format(marker=marker))
    monkeypatch.chdir(where)
    return marker


def test_planted_modules_run_in_a_plain_python_m_the_control(planted):
    subprocess.run([sys.executable, "-m", "hpcnft.distributed.fork_server", "--help"], capture_output=True)
    with open(planted) as f:
        assert "json" in f.read()  # the danger is real: this is what the spawner used to do


def test_a_rank_started_as_a_new_interpreter_never_runs_them(planted):
    env = {k: v for k, v in interpreter.python_env(os.environ).items() if k != "HPCNFT_START"}
    r = subprocess.run(spawner.RANK_COMMAND, capture_output=True, text=True, env=env, timeout=120)
    # started by hand (no config handed over): one line, exit 2, and nothing of the cwd imported
    assert r.returncode == 2 and r.stderr.startswith("hpcnft.run.rank: ") and len(r.stderr.splitlines()) == 1
    assert not os.path.exists(planted)


def test_the_fork_server_and_the_ranks_it_forks_never_run_them(planted, monkeypatch, capfd):
    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    code = spawn_local([], 2, lambda rank: "train", fork=("fork_entries:prepare", "fork_entries:report"))
    assert code == 0, capfd.readouterr()
    assert capfd.readouterr().out.count("rank ") == 2
    assert not os.path.exists(planted)


def test_a_child_finds_the_package_where_its_parent_did():
    root = interpreter.package_root()
    assert os.path.isfile(os.path.join(root, "hpcnft", "__init__.py"))
    env = interpreter.python_env({"PYTHONPATH": "/elsewhere"})
    paths = env["PYTHONPATH"].split(os.pathsep)
    assert (paths == [root, "/elsewhere"]) or (paths == ["/elsewhere"] and root in interpreter._site_dirs())
    assert interpreter.python_env({"PYTHONPATH": root}) == {"PYTHONPATH": root}  # already there: unchanged
    found = subprocess.run([sys.executable, "-P", "-c", "import hpcnft, os; print(os.path.dirname(hpcnft.__file__))"],
                           capture_output=True, text=True, env=env, cwd="/", timeout=120).stdout.strip()
    assert found == os.path.join(root, "hpcnft")
