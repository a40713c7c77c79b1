"""Helpers for the unit tests of hostile input and failed writes (test_checkpoint, test_runfile,
test_rundir, ...) and tests/integration/test_hardening_runs.py: pickle payloads, a size-limited
tmpfs, checkpoints and run files made by hpcnft's own writers, and fuzzing the readers of run
files and standards.

Fuzzing:

Cases are derived from one good run.h5 (and a standard recorded from it): random truncation, bit
flips, wrong dtypes and shapes, missing groups and attributes, odd attribute values, files that
are not HDF5 at all, an HDF5 file of another schema, and broken JSON standards. Each case is fed
to `hpcnft show`, `compare`, `plot`, `export-metrics` (in process, through hpcnft.cli.main) and
to the resume path's run-file open (run.rundir.check_existing_run, RunFileWriter). A case passes
when every consumer ends with exit 0 (compare: 0 or 1) or exit 2 with one line on stderr, and
never with a traceback.

The cases run in a worker subprocess that announces each case before it starts, so that a hang
or a crash inside the HDF5 library is caught (by a timeout) and pinned to its case.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import traceback

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


# -- hostile files and full disks --------------------------------------------------------------
class Payload:
    """Unpickling this runs `touch MARKER`: what a planted pickle does."""

    def __init__(self, marker: str):
        self.marker = str(marker)

    def __reduce__(self):
        import shlex

        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def payload_bytes(marker: str) -> bytes:
    import pickle

    return pickle.dumps(Payload(marker))


@contextlib.contextmanager
def small_tmpfs(path: str, size: str):
    """A tmpfs of `size` (e.g. "2m") mounted at `path` (created); skips the test when it
    cannot be mounted (not root, no mount permission)."""
    import pytest

    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", path],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", path], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", path], capture_output=True)


def tmpfs_available(probe: str) -> bool:
    """Whether small_tmpfs can mount here (root, or the mount capability)."""
    os.makedirs(probe, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", probe], capture_output=True).returncode:
        return False
    subprocess.run(["umount", probe], capture_output=True)
    return True


def remount_read_only(path: str) -> None:
    subprocess.run(["mount", "-o", "remount,ro", path], check=True, capture_output=True)


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# -- making cases ------------------------------------------------------------------------------
def _flip_bits(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    buf = bytearray(data)
    n = rng.choice([1, 1, 2, 4, 16, 64])
    head = rng.random() < 0.6  # most of the file is chunk data: aim at the metadata up front too
    where = []
    for _ in range(n):
        pos = rng.randrange(min(len(buf), 8192) if head else len(buf))
        buf[pos] ^= 1 << rng.randrange(8)
        where.append(pos)
    return f"{n} bit flip(s) at {sorted(where)[:6]}", bytes(buf)


def _truncate(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    k = rng.choice([0, 1, 8, 512, rng.randrange(len(data)), rng.randrange(len(data)), len(data) - 1])
    return f"truncated to {k} bytes", data[:k]


def _metric_paths(f: h5py.File) -> list[str]:
    out: list[str] = []
    f["metrics"].visititems(lambda name, obj: out.append(f"metrics/{name}") if isinstance(obj, h5py.Dataset) else None)
    return out


def _replace(f: h5py.File, name: str, make) -> None:
    del f[name]
    make(name)


STRUCTURAL = []


def structural(fn):
    STRUCTURAL.append(fn)
    return fn


@structural
def metric_wrong_dtype(rng, f):
    key = rng.choice(_metric_paths(f))
    kind = rng.choice(["int", "str", "compound", "bool"])
    n = f[key].shape[0]
    data = {"int": np.zeros((n, 2), "i4"), "bool": np.zeros((n, 2), bool),
            "str": np.array([[b"a", b"b"]] * max(n, 1), dtype="S3"),
            "compound": np.zeros(max(n, 1), dtype=[("step", "<f8"), ("value", "<f8")])}[kind]
    _replace(f, key, lambda name: f.create_dataset(name, data=data))
    return f"{key} as {kind}"


@structural
def metric_wrong_shape(rng, f):
    key = rng.choice(_metric_paths(f))
    shape = rng.choice([(), (3,), (2, 3), (4, 2, 2), (0,), (1, 1)])
    _replace(f, key, lambda name: f.create_dataset(name, data=np.ones(shape)))
    return f"{key} of shape {shape}"


@structural
def metric_odd_values(rng, f):
    key = rng.choice(_metric_paths(f))
    rows = np.array([[rng.choice([np.nan, np.inf, -np.inf, 1e308, -1.0, 2.0 ** 70, 0.5]),
                      rng.choice([np.nan, np.inf, -np.inf, 1e308, -0.0, 5e-324])] for _ in range(rng.randrange(1, 6))])
    _replace(f, key, lambda name: f.create_dataset(name, data=rows, maxshape=(None, 2), chunks=True))
    return f"{key} = {rows.tolist()}"


@structural
def missing_object(rng, f):
    name = rng.choice(["metrics", "events", "topology", "attempts", "rng", "metrics/train", "metrics/train/nft_loss",
                       "metrics/rollout", rng.choice(_metric_paths(f))])
    if name in f:
        del f[name]
    return f"no {name}"


@structural
def object_of_wrong_kind(rng, f):
    name = rng.choice(["metrics", "events", "topology", "attempts", "rng", "metrics/train/nft_loss"])
    if name in f:
        del f[name]
    if name == "metrics/train/nft_loss" or rng.random() < 0.5:
        f.create_group(name) if name != "events" or rng.random() < 0.5 else f.create_dataset(name, data=np.arange(3))
        return f"{name} as a group"
    f.create_dataset(name, data=np.arange(4))
    return f"{name} as a dataset"


@structural
def missing_attr(rng, f):
    name = rng.choice(["schema", "config", "created", "hpcnft_version"])
    if name in f.attrs:
        del f.attrs[name]
    return f"no root attribute {name}"


@structural
def odd_attr(rng, f):
    name, value = rng.choice([
        ("schema", 2), ("schema", "1"), ("schema", np.array([1, 1])), ("schema", 1.5), ("schema", -1),
        ("config", "{"), ("config", "[1, 2]"), ("config", "3"), ("config", "null"), ("config", np.arange(3)),
        ("config", np.void(b"\xff\xfe")), ("config", b"\xff\xfe"), ("config", '{"steps": ' + "[" * 5000 + "]" * 5000 + "}"),
        ("config", json.dumps({"steps": "many", "data": [1]})), ("created", np.arange(2)), ("hpcnft_version", b"\xff")])
    f.attrs[name] = value
    return f"root attribute {name} = {str(value)[:40]!r}"


@structural
def odd_events(rng, f):
    choice = rng.choice(["dtype", "time", "text", "kind", "shape"])
    if choice == "dtype":
        _replace(f, "events", lambda n: f.create_dataset(n, data=np.zeros(2, dtype=[("step", "<i8"), ("when", "<f8")])))
    elif choice == "shape":
        _replace(f, "events", lambda n: f.create_dataset(n, data=np.zeros((2, 2))))
    else:
        ds = f["events"]
        rows = ds[()]
        if not len(rows):
            return "events: nothing to spoil"
        if choice == "time":
            rows["time"][0] = rng.choice([np.nan, np.inf, -1e300, 1e300, 2.0 ** 62])
        elif choice == "text":
            rows["text"][0] = b"\xff\xfe" + b"\n" * 100 + b"\x00zz"
        else:
            rows["kind"][0] = b"\xff" * 16
        ds[...] = rows
    return f"events {choice}"


@structural
def odd_names(rng, f):
    name = rng.choice(["rng/step_x", "rng/foo", "rng/step_", "rng/step_-3", "attempts/zz", "attempts/-1",
                       "metrics/new/weird key", "metrics/train/nft_loss_extra"])
    if name in f:
        return f"{name} exists"
    if name.startswith("metrics/"):
        f.create_dataset(name, data=np.zeros((1, 2)))
    else:
        f.create_group(name)
    return f"extra {name}"


@structural
def dangling_link(rng, f):
    name = rng.choice(["metrics/train/nft_loss", "events", "topology", "metrics/eval", "rng/step_1"])
    if name in f:
        del f[name]
    target = rng.choice(["/nowhere", "/metrics", "/"])
    if rng.random() < 0.5:
        f[name] = h5py.SoftLink(target)
    else:
        f[name] = h5py.ExternalLink("/etc/passwd", "/x")
    return f"{name} -> link to {target}"


@structural
def huge_rows(rng, f):
    key = rng.choice(_metric_paths(f))
    ds = f[key]
    if ds.maxshape[0] is None:
        ds.resize((200_000, 2))  # sparse: rows of zeros (the fill value), tiny on disk
        return f"{key} with 200000 rows"
    return f"{key} not resizable"


def _non_hdf5(rng: random.Random, path: str) -> str:
    kind = rng.choice(["empty", "text", "random", "json", "png", "dir", "fifo", "other-schema", "hdf5-no-attrs",
                       "symlink-loop"])
    if kind == "empty":
        open(path, "wb").close()
    elif kind == "text":
        with open(path, "w") as f:
            f.write("step,value\n1,2\n")
    elif kind == "random":
        with open(path, "wb") as f:
            f.write(rng.randbytes(rng.choice([7, 4096, 70000])))
    elif kind == "json":
        with open(path, "w") as f:
            json.dump({"metrics": {}}, f)
    elif kind == "png":
        with open(path, "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n" + rng.randbytes(100))
    elif kind == "dir":
        os.makedirs(path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink-loop":
        os.symlink(path, path)
    elif kind == "other-schema":
        with h5py.File(path, "w") as f:
            f.attrs["schema"] = rng.choice([0, 2, 99])
            f.create_dataset("metrics/x", data=np.zeros((2, 2)))
    else:
        with h5py.File(path, "w") as f:
            f.create_dataset("data", data=np.arange(10))
            f.create_group("metrics").create_dataset("a", data=np.zeros((3, 2)))
    return f"not a run file: {kind}"


def make_case(rng: random.Random, src: str, src_bytes: bytes, dst: str) -> str:
    """Write one damaged variant of `src` at `dst` (removed first); returns its description."""
    _remove(dst)
    r = rng.random()
    if r < 0.25:
        desc, data = _flip_bits(rng, src_bytes)
    elif r < 0.40:
        desc, data = _truncate(rng, src_bytes)
    elif r < 0.88:
        shutil.copyfile(src, dst)
        fn = rng.choice(STRUCTURAL)
        with h5py.File(dst, "a") as f:
            try:
                desc = fn(rng, f)
            except Exception as e:  # noqa: BLE001 - h5py would not write this variant: still a case
                desc = f"{fn.__name__} half done ({type(e).__name__})"
        return desc
    else:
        return _non_hdf5(rng, dst)
    with open(dst, "wb") as f:
        f.write(data)
    return desc


def _remove(path: str) -> None:
    if os.path.islink(path) or (os.path.exists(path) and not os.path.isdir(path)):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def make_standard_case(rng: random.Random, good_text: str, dst: str) -> str:
    """A damaged standard (.json)."""
    _remove(dst)
    kind = rng.choice(["truncate", "flip", "deep", "huge-int", "types", "list", "bad-utf8", "nan-tokens",
                       "rows", "fifo"])
    text: str | bytes
    if kind == "truncate":
        text = good_text[:rng.randrange(len(good_text))]
    elif kind == "flip":
        b = bytearray(good_text.encode())
        for _ in range(rng.choice([1, 4, 32])):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        text = bytes(b)
    elif kind == "deep":
        text = '{"metrics": {"a": ' + "[" * 100000 + "]" * 100000 + "}}"
    elif kind == "huge-int":
        text = '{"metrics": {"a": [[1' + "0" * 400 + ", 1], [2, 1e999]]}}"
    elif kind == "types":
        text = json.dumps({"metrics": {"a": [[True, 1], ["x", None]], "b": [[{"s": 1}, [2]]]}})
    elif kind == "list":
        text = json.dumps([1, 2, 3])
    elif kind == "bad-utf8":
        text = b'{"metrics": {"\xff\xfe": [[1, 2]]}}'
    elif kind == "nan-tokens":
        text = '{"metrics": {"train/nft_loss": [[NaN, Infinity], [-Infinity, "NaN"], [1, "inf"]]}}'
    elif kind == "fifo":
        os.mkfifo(dst)
        return "standard: a FIFO"
    else:
        text = json.dumps({"metrics": {"train/nft_loss": [[1, 2, 3], [4]]}})
    with open(dst, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)
    return f"standard: {kind}"


# -- consumers ---------------------------------------------------------------------------------
def call_cli(argv: list[str]) -> tuple[int | None, str, str, str | None]:
    """(exit code, stdout, stderr, traceback or None) of hpcnft.cli.main(argv) in process."""
    from hpcnft import cli

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 2
    except BaseException:  # noqa: BLE001 - that is the finding
        return None, out.getvalue(), err.getvalue(), traceback.format_exc()
    return rc, out.getvalue(), err.getvalue(), None


def judge(what: str, rc, out: str, err: str, tb, allowed=(0, 2)) -> str | None:
    """Why this outcome is not acceptable, or None."""
    if tb is not None:
        return f"{what}: raised\n{tb}"
    if rc not in allowed:
        return f"{what}: exit {rc}\n{err[-2000:]}"
    if "Traceback" in out or "Traceback" in err:
        return f"{what}: traceback in the output\n{err[-2000:]}"
    if rc == 2 and len(err.strip().splitlines()) != 1:
        return f"{what}: exit 2 with {len(err.strip().splitlines())} lines on stderr:\n{err[-2000:]}"
    return None


def resume_path(case_dir: str, config: dict) -> list[str]:
    """The resume path's view of a run dir holding the damaged run.h5."""
    from hpcnft.algo.nft.spec import TRAIN_KEYS as NFT_KEYS
    from hpcnft.algo.root_config import config_from_dict
    from hpcnft.common.errors import UsageError
    from hpcnft.io import runfile
    from hpcnft.io.run_writer import RunFileWriter
    from hpcnft.run.rundir import check_existing_run

    problems = []
    cfg = config_from_dict(config)
    cfg.run_dir = case_dir
    path = os.path.join(case_dir, "run.h5")
    try:
        check_existing_run(cfg)
    except UsageError as e:
        if len(str(e).splitlines()) != 1:
            problems.append(f"check_existing_run: {len(str(e).splitlines())} lines: {e}")
    except BaseException:  # noqa: BLE001
        problems.append(f"check_existing_run raised\n{traceback.format_exc()}")
    if os.path.isdir(path) or not os.path.lexists(path):
        return problems
    if os.path.exists(path) and not os.path.isfile(path):
        pass  # a FIFO: RunFileWriter must refuse it rather than block
    opened = False
    try:
        w = RunFileWriter(path, cfg.to_json(), "fuzz", NFT_KEYS)
        opened = True
        try:
            w.set_topology({"world_size": 3})
            w.truncate_after(1)
            w.drop_rng_after(1)
            w.event(1, "resume", "fuzz")
            w.add_attempt({"from_step": 1})
            w.append_metrics(2, {k: 0.5 for k in runfile.PER_STEP_KEYS})
            w.write_rng(2, {0: b"\x01\x02"})
            w.event(2, "done", "fuzz")
        finally:
            w.close()
    except runfile.RunFileError as e:
        if len(str(e).splitlines()) != 1 or path not in str(e):
            problems.append(f"RunFileError not one line naming the path: {e}")
        return problems
    except BaseException:  # noqa: BLE001
        problems.append(f"RunFileWriter ({'after open' if opened else 'open'}) raised\n{traceback.format_exc()}")
        return problems
    try:  # a file the writer accepted and appended to must read back with the new row
        run = runfile.read_run(path)
        if 2.0 not in run.metrics["train/grad_norm"][:, 0]:
            problems.append("the appended step 2 row did not read back")
    except BaseException:  # noqa: BLE001
        problems.append(f"read_run after a successful resume raised\n{traceback.format_exc()}")
    return problems


def check_case(case_path: str, good: str, standard: str, config: dict, out_dir: str, plot: bool) -> list[str]:
    problems = []
    argvs = [("show", ["show", case_path], (0, 2)),
             ("compare", ["compare", good, case_path], (0, 1, 2)),
             ("export-metrics", ["export-metrics", case_path, "--csv", os.path.join(out_dir, "m.csv")], (0, 2))]
    if plot:
        argvs.append(("plot", ["plot", case_path, "-o", os.path.join(out_dir, "p.png")], (0, 2)))
    for what, argv, allowed in argvs:
        why = judge(what, *call_cli(argv), allowed=allowed)
        if why:
            problems.append(why)
    problems += resume_path(os.path.dirname(case_path), config)
    return problems


def check_standard_case(path: str, good: str) -> list[str]:
    problems = []
    for what, argv in (("compare standard", ["compare", path, good]), ("compare standard B", ["compare", good, path])):
        why = judge(what, *call_cli(argv), allowed=(0, 1, 2))
        if why:
            problems.append(why)
    return problems


# -- the worker and its driver -----------------------------------------------------------------
def worker(src: str, workdir: str, n: int, seed: int, plot_every: int, log_path: str) -> None:
    """Run `n` cases, the same ones for the same seed; one JSON line per case to `log_path`."""
    import warnings

    warnings.simplefilter("ignore")  # library notices are not what is judged here
    from hpcnft.cli import report
    from hpcnft.io import runfile

    rng = random.Random(seed)
    with open(src, "rb") as f:
        src_bytes = f.read()
    config = runfile.read_run(src).config
    good = os.path.join(workdir, "good", "run.h5")
    os.makedirs(os.path.dirname(good), exist_ok=True)
    shutil.copyfile(src, good)
    standard = os.path.join(workdir, "good.json")
    report.record_standard(good, standard)
    with open(standard) as f:
        standard_text = f.read()
    case_dir = os.path.join(workdir, "case")
    out_dir = os.path.join(workdir, "out")
    os.makedirs(case_dir, exist_ok=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(log_path, "a", buffering=1) as log:
        for i in range(n):
            sub = random.Random(rng.random())
            if i % 10 == 9:
                path = os.path.join(workdir, "std.json")
                desc = make_standard_case(sub, standard_text, path)
                log.write(json.dumps({"begin": i, "desc": desc}) + "\n")
                problems = check_standard_case(path, good)
            else:
                path = os.path.join(case_dir, "run.h5")
                _remove(os.path.join(case_dir, "checkpoints"))
                desc = make_case(sub, src, src_bytes, path)
                log.write(json.dumps({"begin": i, "desc": desc}) + "\n")
                problems = check_case(path, good, standard, config, out_dir, plot=i % plot_every == 0)
            log.write(json.dumps({"end": i, "desc": desc, "problems": problems}) + "\n")


def fuzz(src: str, workdir: str, n: int, seed: int = 0, plot_every: int = 16, hang_s: float = 300.0) -> dict:
    """Run the worker; returns {"cases": [...], "problems": [...], "died": None | str}. `hang_s`
    only tells a hung worker from a slow one."""
    log_path = os.path.join(workdir, "fuzz.jsonl")
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import hardening_tools as z; "
            f"z.worker({src!r}, {workdir!r}, {n}, {seed}, {plot_every}, {log_path!r})")
    died = None
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=hang_s,
                           env={**os.environ, "MPLBACKEND": "Agg"})
        if r.returncode != 0:
            died = f"worker exited {r.returncode}: {r.stderr[-3000:]}"
    except subprocess.TimeoutExpired:
        died = "worker hung"
    cases, problems, last_begin = [], [], None
    if os.path.exists(log_path):
        with open(log_path) as f:
            for line in f:
                rec = json.loads(line)
                if "begin" in rec:
                    last_begin = rec
                else:
                    cases.append(rec)
                    problems += [f"case {rec['end']} ({rec['desc']}): {p}" for p in rec["problems"]]
                    last_begin = None
    if died and last_begin is not None:
        died += f" during case {last_begin['begin']} ({last_begin['desc']})"
    return {"cases": cases, "problems": problems, "died": died}


# ---------------------------------------------------------------------------------------------
# checkpoints and run files made by hpcnft's own writers
# ---------------------------------------------------------------------------------------------
def tiny_policy(seed: int = 0, width: int = 32, eval_ema: bool = False):
    """A Linear layer dressed as hpcnft's Policy (trainable params, old-policy shadow, with
    `eval_ema` an evaluation EMA) + AdamW."""
    import types

    import torch

    torch.manual_seed(seed)
    model = torch.nn.Linear(width, width)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    policy = types.SimpleNamespace(transformer=model, trainable_names=names, trainable=params,
                                   shadow=[p.detach().clone() for p in params],
                                   eval_shadow=[p.detach() * 0.5 for p in params] if eval_ema else None)
    opt = torch.optim.AdamW(params, lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return policy, opt


def make_checkpoint(run_dir: str, step: int, seed: int = 0, width: int = 32, keep: int = 2) -> str:
    from hpcnft.algo.checkpoint_parts import checkpoint_parts
    from hpcnft.common import determinism
    from hpcnft.io import checkpoint

    policy, opt = tiny_policy(seed, width)
    checkpoint.save(run_dir, step, checkpoint_parts(policy, opt), None, True, 0, determinism.capture_rng_state())
    return checkpoint.commit(run_dir, step, checkpoint.TrainState(step, {}), '{"steps": 3}', keep)


def run_with_checkpoints(cfg, steps=(1, 2)) -> dict[int, str]:
    """CFG's run dir (created) with a run.h5 row and a checkpoint after each of STEPS, each
    checkpoint holding CFG's config and its copy of run.h5 as the job writes it; returns
    {step: checkpoint dir}."""
    from hpcnft.io import run_state, runfile
    from hpcnft.algo.nft.spec import TRAIN_KEYS as NFT_KEYS
    from hpcnft.io.run_writer import RunFileWriter

    os.makedirs(cfg.run_dir)
    w = RunFileWriter(os.path.join(cfg.run_dir, "run.h5"), cfg.to_json(), "test", NFT_KEYS)
    ckpts = {}
    for step in steps:
        w.append_metrics(step, {k: step + 0.5 for k in runfile.PER_STEP_KEYS})
        ckpts[step] = make_checkpoint(cfg.run_dir, step, keep=5)
        with open(os.path.join(ckpts[step], "config.json"), "w") as f:
            f.write(cfg.to_json())
        w.snapshot(run_state.run_state_path(ckpts[step]), (step, "checkpoint", ckpts[step]))
    w.close()
    return ckpts


def writer_made_run(path: str, steps: int = 4) -> None:
    """A run file laid out by hpcnft's own writer exactly as a run writes it."""
    from hpcnft.algo.root_config import load_config
    from hpcnft.common import determinism
    from hpcnft.io import runfile
    from hpcnft.algo.nft.spec import TRAIN_KEYS as NFT_KEYS
    from hpcnft.io.run_writer import RunFileWriter

    cfg = load_config("tiny", steps=steps)
    w = RunFileWriter(path, cfg.to_json(), "test", NFT_KEYS)
    w.set_topology({"world_size": 3, "train_ranks": [0, 1], "reward_ranks": [2], "hosts": ["h"] * 3})
    w.truncate_after(-1)
    w.add_attempt({"started": "now", "from_step": 0, "slurm_job_id": "", "restart_count": 0})
    w.event(0, "start", "local launch, world 3")
    for step in range(1, steps + 1):
        values = {k: step + i / 7 for i, k in enumerate(runfile.PER_STEP_KEYS)}
        values["train/nft_loss"] = float("nan") if step == 2 else 60.0 + step
        if step % 2 == 0:
            values.update({k: 0.1 * step for k in runfile.EVAL_KEYS})
        w.append_metrics(step, values)
        if step % 2 == 0:
            w.write_rng(step, {r: determinism.capture_rng_state() for r in range(3)})
            w.event(step, "checkpoint", f"checkpoints/step_{step:06d}")
    w.event(steps, "done", "finished")
    w.close()
