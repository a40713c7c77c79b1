#!/usr/bin/env python3
"""The whole job at a real recipe's scale on the GPU(s) of one machine, measured: model folders
made at the real shapes (`hpcnft make-weights`), the recipe's 3-rank job over NCCL (on one GPU:
every rank a host of its own, `layout.emulate_hosts`), an uninterrupted run, a run preempted
(SIGUSR2) at a step and resumed, `hpcnft compare` of the two, `hpcnft export` loaded into the
family's diffusers pipeline, and the bench's one-process iteration of the same recipe beside it.

    python3 tools/real_scale_job.py --model sd35m --recipe sd35m_pickscore_24gb --weights /tmp/w \\
        --out $OUT/sd35m-job.json --steps 5 --preempt-at 3 [--set KEY=VALUE ...] [--phases make,run,...]

Each phase adds to the JSON as it ends (a run cut short keeps what it measured): the made
folders' size and time; per run the start-up (command to the first step line, and to "models
loaded"), each step's parts from run.h5 (perf/*), the checkpoints' sizes and write times (rank 0's
log), each rank's peak host RSS and GPU memory (sampled every second from /proc and
nvidia-smi), the resume's start-up and whether `hpcnft compare` found the runs bit-identical;
with `--bench auto`, the bench's one-process iteration at the job's own settings and the job's
efficiency (that iteration / the job's steady one)."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from hpcnft.common.disk import folder_bytes  # noqa: E402 (the repository's package, beside this tool)
BASES = {"sd35m": ("sd3", "models.sd3_dir"), "sd35l": ("sd3", "models.sd3_dir"),
         "flux1dev": ("flux", "models.flux_dir")}
NCCL_ONE_GPU = ["layout.device=cuda", "layout.backend=nccl", "layout.emulate_hosts=true"]
PHASES = ("make", "run", "resume", "export", "bench")


def hpcnft(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcnft", *args]


# A launcher's variables (an allocation's shell, torchrun's or submitit's exports) would make `hpcnft
# run` one rank of that launcher's job; this tool measures the job its local spawner starts.
LAUNCHER_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "SUBMITIT_")
LAUNCHER_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "HPCNFT_LAUNCHER"}
ENV = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIXES)}


class Report:
    def __init__(self, path: str, progress: str):
        self.path, self.progress, self.data = path, progress, {}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def say(self, text: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {text}"
        print(line, flush=True)
        with open(self.progress, "a") as f:
            f.write(line + "\n")

    def put(self, key: str, value) -> None:
        self.data[key] = value
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1, default=str)


class Sampler(threading.Thread):
    """Every second: each rank's host RSS (/proc) and GPU memory (nvidia-smi), kept at their peaks."""

    def __init__(self, run_dir: str):
        super().__init__(daemon=True)
        self.run_dir, self.stop, self.rss, self.gpu = os.path.abspath(run_dir), threading.Event(), {}, {}

    def ranks(self) -> dict[int, str]:
        return job_ranks(self.run_dir)

    def run(self) -> None:
        import psutil

        while not self.stop.wait(1.0):
            ranks = self.ranks()
            for pid, name in ranks.items():
                try:
                    self.rss[name] = max(self.rss.get(name, 0), psutil.Process(pid).memory_info().rss)
                except psutil.Error:
                    pass
            try:
                out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                continue  # no GPU: host memory only
            for line in out.splitlines():
                pid, _, mib = line.partition(",")
                name = ranks.get(int(pid)) if pid.strip().isdigit() else None
                if name:
                    self.gpu[name] = max(self.gpu.get(name, 0), int(mib.strip()) * 2**20)

    def peaks(self) -> dict:
        gib = lambda d: {k: round(v / 2**30, 2) for k, v in sorted(d.items())}  # noqa: E731
        return {"host_rss_gib": gib(self.rss), "gpu_gib": gib(self.gpu)}


def job_ranks(run_dir: str) -> dict[int, str]:
    """The job's ranks by pid: the processes named hpcnft-rank-N (hpcnft.distributed.spawner) that
    hold a file of the run dir open (their logs), wherever the process tree put them."""
    import psutil

    found = {}
    for p in psutil.process_iter(["name"]):
        m = re.fullmatch(r"hpcnft-rank-(\d+)", p.info["name"] or "")
        if not m:
            continue
        try:
            if any(f.path.startswith(run_dir + os.sep) for f in p.open_files()):
                found[p.pid] = f"rank{m.group(1)}"
        except psutil.Error:
            continue
    return found


def run_job(report: Report, label: str, argv: list[str], preempt_at: int = 0) -> dict:
    """One `hpcnft run`; its lines timed; SIGUSR2 to the command once step `preempt_at - 1` is printed."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True, env=ENV)
    sampler = Sampler(argv[argv.index("--run-dir") + 1])
    sampler.start()
    marks, lines, done = {}, [], False
    try:
        res = _follow(report, label, proc, sampler, t0, marks, lines, preempt_at)
        done = True
        return res
    finally:
        if proc.poll() is None:  # this tool stopped (its own time limit): the job must not outlive it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        sampler.stop.set()
        if not done:  # what was measured until then
            report.put(label, {"cut": True, "wall_s": round(time.perf_counter() - t0, 1),
                               **{k: round(v, 1) for k, v in marks.items()}, **sampler.peaks(), "tail": lines[-6:]})


def _follow(report: Report, label: str, proc, sampler, t0: float, marks: dict, lines: list, preempt_at: int) -> dict:
    for line in proc.stdout:
        now = time.perf_counter() - t0
        lines.append(line.rstrip())
        report.say(f"[{label} {now:7.1f}s] {line.rstrip()}")
        if "models loaded in" in line and "loaded_s" not in marks:
            marks["loaded_s"] = now
        m = re.match(r"step (\d+)/(\d+)", line)
        if m:
            marks.setdefault(f"step_{m.group(1)}_s", now)
            marks.setdefault("first_step_s", now)  # a resume's first step is the one after its checkpoint
            # signalled as step preempt_at begins: that step (or, if the ranks agree on the flag
            # before the signal lands, the one before) ends with the preemption's checkpoint
            if preempt_at and int(m.group(1)) == preempt_at - 1 and "signalled_s" not in marks:
                os.kill(proc.pid, signal.SIGUSR2)
                marks["signalled_s"] = now
        stopped = re.search(r"preempted at step (\d+)", line)
        if stopped:
            marks["preempted_at"] = int(stopped.group(1))
    rc = proc.wait()
    sampler.stop.set()
    sampler.join(5)
    return {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1), **{k: round(v, 1) for k, v in marks.items()},
            **sampler.peaks(), "tail": lines[-6:]}


def run_facts(run_dir: str) -> dict:
    """What run.h5 and rank 0's log say of a run: each step's parts, the checkpoints."""
    from hpcnft.io.runfile import read_run

    r = read_run(run_dir)
    parts = {}
    for key in ("perf/iteration_s", "perf/rollout_s", "perf/reward_s", "perf/reward_wait_s", "perf/train_s",
                "perf/mfu_rollout", "perf/mfu_train"):
        if key in r.metrics:
            parts[key] = {int(s): round(float(v), 3) for s, v in r.metrics[key]}
    ckpts = []
    log = os.path.join(run_dir, "logs", "rank0.log")
    if os.path.exists(log):
        for line in open(log):
            m = re.search(r"checkpoint of step (\d+): ([\d.]+) MiB in ([\d.]+) s", line)
            if m:
                ckpts.append({"step": int(m.group(1)), "mib": float(m.group(2)), "s": float(m.group(3))})
    grids = sorted(os.listdir(os.path.join(run_dir, "samples"))) if os.path.isdir(os.path.join(run_dir, "samples")) else []
    evals = sorted({int(s) for k in r.metrics if k.startswith("eval/") for s, _ in r.metrics[k]})
    return {"parts": parts, "checkpoints": ckpts, "sample_grids": grids, "eval_steps": evals,
            "events": [(e["step"], e["kind"]) for e in r.events], "topology": dict(r.topology)}


def auto_bench(family: str, args, sets: list[str]) -> tuple[list[str], str, dict]:
    """`--bench auto`: hpcnft bench's fast stack at the job's settings (hpcnft.bench.job_settings),
    its iteration alone; returns (the bench's arguments, its stack's key, what still differs)."""
    import torch

    from hpcnft.algo.root_config import load_config
    from hpcnft.bench.job_settings import job_sets
    from hpcnft.bench.shapes import SHAPES, tiny_shapes_name
    from hpcnft.bench.stack import DEFAULT_ALGO

    shapes = tiny_shapes_name(family) if args.cpu else args.model
    job = load_config(args.recipe, sets)
    items, left = job_sets(SHAPES[shapes](), torch.device("cpu" if args.cpu else "cuda"), job)
    name = job.algo.name
    return (["--shapes", shapes, "--algo", name, "--no-default", "--own-shapes", "--phases", "iteration",
             "--iteration-warm", "1", "--iteration-reps", "2", *[w for i in items for w in ("--set", i)]],
            "hpcnft_fast" if name == DEFAULT_ALGO else f"hpcnft_fast_{name}", left)


def efficiency(full: dict, bench_json: str, stack: str) -> dict:
    """The job's efficiency: the bench's one-process iteration / the job's steady one (its steps
    after the first, median)."""
    import statistics

    steps = full.get("parts", {}).get("perf/iteration_s", {})
    steady = [v for s, v in steps.items() if int(s) > 1] or list(steps.values())
    with open(bench_json) as f:
        it = json.load(f)["stacks"][stack]["phases"].get("iteration", {})
    if not steady or "s" not in it:
        return {"missing": "the job's iterations" if not steady else "the bench's iteration"}
    job_s = statistics.median(steady)
    return {"job_iteration_s": round(job_s, 3), "bench_iteration_s": round(it["s"], 3),
            "bench_runs_s": it.get("runs_s"), "efficiency": round(it["s"] / job_s, 3)}


def interrupted(signum, frame):
    """`timeout`'s SIGTERM ends this tool as Ctrl-C does: the job it runs is stopped, what it
    measured kept."""
    raise KeyboardInterrupt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(BASES), required=True)
    p.add_argument("--recipe", required=True)
    p.add_argument("--weights", required=True, help="where the made folders are (made there if absent)")
    p.add_argument("--runs", default="/tmp/real-scale-runs")
    p.add_argument("--out", required=True, help="the JSON to write")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--preempt-at", type=int, default=3)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--bench", default="", help="the hpcnft bench arguments to run beside the job (bench phase); "
                   "'auto [MORE]': its fast stack's iteration at the job's own settings, and the job's efficiency")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU (to try this tool on the tiny models)")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, interrupted)
    phases = args.phases.split(",")
    report = Report(args.out, os.path.splitext(args.out)[0] + ".log")
    family, key = BASES[args.model]
    base, pick = os.path.join(args.weights, args.model), os.path.join(args.weights, "pickscore")
    report.put("command", sys.argv)
    try:
        report.put("gpu", subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip())
    except OSError:
        report.put("gpu", "none")
    if "make" in phases:
        made = {}
        for name, folder in ((args.model, base), ("pickscore", pick)):
            if os.path.isdir(folder) and os.listdir(folder):
                continue
            t0 = time.perf_counter()
            res = subprocess.run(hpcnft("make-weights", name, folder, "--device", "cuda"), capture_output=True, text=True,
                                 cwd=REPO, env=ENV)
            report.say(res.stdout + res.stderr)
            made[name] = {"rc": res.returncode, "s": round(time.perf_counter() - t0, 1),
                          "gib": round(folder_bytes(folder) / 2**30, 2)}
        report.put("make_weights", made)
    sets = [f"{key}={base}", f"models.pickscore_dir={pick}", "models.pickscore_processor_dir=",
            f"data.train_prompts={REPO}/hpcnft/data/tiny_train_prompts.txt",
            f"data.eval_prompts={REPO}/hpcnft/data/tiny_eval_prompts.txt", *([] if args.cpu else NCCL_ONE_GPU),
            *args.overrides]
    flags = [w for s in sets for w in ("--set", s)]
    full, cut = os.path.join(args.runs, "full"), os.path.join(args.runs, "preempted")
    if "run" in phases:
        res = run_job(report, "full", hpcnft("run", args.recipe, "--steps", str(args.steps), "--run-dir", full, *flags))
        report.put("full", {**res, **(run_facts(full) if res["rc"] == 0 else {})})
    if "resume" in phases:
        first = run_job(report, "preempted", hpcnft("run", args.recipe, "--steps", str(args.steps), "--run-dir", cut,
                                                    *flags), preempt_at=args.preempt_at)
        report.put("preempted", first)
        again = run_job(report, "resumed", hpcnft("run", args.recipe, "--steps", str(args.steps), "--run-dir", cut,
                                                  *flags))
        report.put("resumed", {**again, **(run_facts(cut) if again["rc"] == 0 else {})})
        cmp = subprocess.run(hpcnft("compare", full, cut), capture_output=True, text=True, cwd=REPO, env=ENV)
        report.put("compare", {"rc": cmp.returncode, "out": (cmp.stdout + cmp.stderr)[-2000:]})
    if "export" in phases:
        out = os.path.join(args.runs, "export")
        res = subprocess.run(hpcnft("export", full, out, "--force"), capture_output=True, text=True, cwd=REPO, env=ENV)
        probe = ("import sys, torch, diffusers; p = getattr(diffusers, sys.argv[1]).from_pretrained(sys.argv[2], "
                 "torch_dtype=torch.float16); p.load_lora_weights(sys.argv[3]); "
                 "print('adapters', p.transformer.active_adapters() if hasattr(p.transformer, 'active_adapters') else '?')")
        pipe = "FluxPipeline" if family == "flux" else "StableDiffusion3Pipeline"
        load = subprocess.run([sys.executable, "-c", probe, pipe, base, out], capture_output=True, text=True, cwd=REPO,
                              env=ENV)
        report.put("export", {"rc": res.returncode, "out": (res.stdout + res.stderr)[-800:],
                              "diffusers_load_rc": load.returncode, "diffusers_load": (load.stdout + load.stderr)[-800:]})
    if "bench" in phases and args.bench:
        bench_json = os.path.splitext(args.out)[0] + "-bench.json"
        bench_args, stack, left = args.bench.split(), None, {}
        if bench_args[0] == "auto":  # the bench's stack at this job's own settings
            auto, stack, left = auto_bench(family, args, sets)
            bench_args = auto + bench_args[1:]
        t0 = time.perf_counter()
        res = subprocess.run(hpcnft("bench", *bench_args, "--json", bench_json), capture_output=True,
                             text=True, cwd=REPO, env=ENV)
        report.put("bench", {"rc": res.returncode, "s": round(time.perf_counter() - t0, 1), "json": bench_json,
                             "args": bench_args, "settings_not_matched": left,
                             "tail": (res.stdout + res.stderr)[-1500:]})
        if stack and res.returncode == 0 and isinstance(report.data.get("full"), dict):
            report.put("efficiency", efficiency(report.data["full"], bench_json, stack))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
