"""`hpcnft bench`: time, FLOPs and MFU of each phase of one DiffusionNFT iteration (see __init__)."""
from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import time

from hpcnft.bench.eager import EagerStack
from hpcnft.bench.held import held_summary, held_tensors
from hpcnft.bench.levers import expand_levers, fast_overrides
from hpcnft.bench.memory_caps import run_caps
from hpcnft.bench.report import _fmt_ms, _fmt_pct, _fmt_rate, environment, targets
from hpcnft.bench.shapes import TRAIN_K, Shapes, _torch
from hpcnft.bench.stack import DEFAULT_ALGO, HpcnftStack, _toml
from hpcnft.bench.timing import count_flops, matmul_ceiling, measure
from hpcnft.common.errors import first_line

SCHEMA = "hpcnft-bench/1"
HELD_GIB = 1.0  # memory still allocated after a stack is freed beyond which its holders are looked for


class Bench:
    def __init__(self, args, S: Shapes, dev):
        self.args, self.S, self.dev = args, S, dev
        self.t0 = time.perf_counter()
        self.doc = {"schema": SCHEMA, "command": "hpcnft bench " + " ".join(args.argv),
                    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "shapes": S.name, "environment": environment(dev), "ceiling": {}, "stacks": {}, "levers": [],
                    "errors": [], "skipped": []}

    # -- bookkeeping
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self) -> bool:
        return self.args.budget_s is not None and self.elapsed() > self.args.budget_s

    def save(self) -> None:
        self.doc["elapsed_s"] = round(self.elapsed(), 1)
        if self.args.json:
            tmp = self.args.json + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.doc, f, indent=1, default=str)
            os.replace(tmp, self.args.json)

    def log(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {text}", file=sys.stderr, flush=True)

    @property
    def ceiling(self) -> float:
        return self.doc["ceiling_tflops"] * 1e12

    def error(self, rec: dict, name: str, e: Exception) -> str:
        """Record a failed measurement (the run goes on) and return its message."""
        torch = _torch()
        msg = f"{rec['key']}:{name}: {type(e).__name__}: {first_line(e)[:300]}"
        self.doc["errors"].append(msg)
        self.log("ERROR " + msg)
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
        self.save()
        return msg

    # -- one phase of one stack
    def phase(self, rec: dict, name: str, make, unit: str, per: int, warm=None, reps=None, flops=True) -> dict | None:
        if self.over_budget():
            self.doc["skipped"].append(f"{rec['key']}:{name} (budget)")
            return None
        warm = self.S.warm if warm is None else warm
        reps = self.S.reps if reps is None else reps
        try:
            made = make()
            fn, ctx = made[0], made[1]
            with ctx():
                m = measure(fn, self.dev, warm, reps)
                if flops:
                    m.update(self.flops_of(fn))
        except Exception as e:  # noqa: BLE001 - one failing phase must not lose the others
            rec["phases"][name] = {"error": self.error(rec, name, e)}
            return None
        m.update(unit=unit, per=per, per_unit_s=m["s"] / per)
        if m.get("flops"):
            m["tflops"] = m["flops"] / m["s"] / 1e12
            m["mfu"] = m["flops"] / m["s"] / self.ceiling
        rec["phases"][name] = m
        self.log(f"{rec['key']:<16} {name:<18} {_fmt_ms(m['s']):>10} per call, {_fmt_ms(m['per_unit_s']):>10} per "
                 f"{unit}" + (f", {_fmt_rate(m['flops'] / m['s'])}, MFU {_fmt_pct(m['mfu'])}" if m.get("mfu") else "")
                 + (f", peak {m['peak_gib']:.1f} GiB" if "peak_gib" in m else ""))
        self.save()
        return m

    def flops_of(self, fn) -> dict:
        """{"flops": n}, or {"flops_error": why}: the count runs the call once more, eagerly,
        which can need more memory than the compiled call it counts, so a count that fails loses
        no time."""
        try:
            return {"flops": count_flops(fn)}
        except Exception as e:  # noqa: BLE001
            if self.dev.type == "cuda":
                _torch().cuda.empty_cache()
            return {"flops_error": f"{type(e).__name__}: {first_line(e)[:200]}"}

    def run_stack(self, stack, phases: list[tuple], iteration: bool, extra: dict | None = None) -> dict:
        rec = {"key": stack.key, "label": stack.label, "config": stack.config, "phases": {}}
        if extra:
            rec.update(extra)
        self.doc["stacks"][stack.key] = rec
        self.log(f"stack {stack.key}: {stack.label}")
        for ph in phases:
            self.phase(rec, *ph, flops=getattr(stack, "count_flops", True))
        if iteration:
            S = self.S
            # Every stack gets the same untimed iterations first (the eager one's phases alone
            # may not have run: --phases iteration); the slow eager iteration is timed once.
            eager = stack.key == "eager"
            m = self.phase(rec, "iteration", stack.iteration, "iteration", 1, warm=self.args.iteration_warm,
                           reps=1 if eager else self.args.iteration_reps, flops=False)
            if m is not None:
                m.update(self._iteration_flops(rec))
                if getattr(stack, "last_metrics", None):
                    m["metrics"] = met = stack.last_metrics
                    # the package's own split of the (last) iteration: rollout incl. decode and reward, train
                    for part in ("rollout", "train"):
                        if m.get(f"{part}_flops") and met.get(f"perf/{part}_s"):
                            m[f"{part}_s"] = met[f"perf/{part}_s"]
                            m[f"{part}_mfu"] = m[f"{part}_flops"] / met[f"perf/{part}_s"] / self.ceiling
                m["samples"], m["pairs"] = S.samples, S.samples * S.trained_steps
                self.save()
        return rec

    def _iteration_flops(self, rec: dict) -> dict:
        """Iteration FLOPs from the per-call counts of its phases at the stack's own batch sizes."""
        S, ph = self.S, rec["phases"]
        b = rec.get("rollout_batch") or max(S.rollout_batches)
        mb = rec.get("micro_batch") or max(S.micro_batches)
        parts = {"rollout_fwd": (ph.get(f"rollout_fwd_b{b}"), S.samples * S.num_steps / b),
                 "vae_decode": (ph.get("vae_decode"), S.samples / max(S.rollout_batches)),
                 "pickscore": (ph.get("pickscore"), 1),
                 "train": (ph.get(f"train_pair_mb{mb}"), S.samples * S.trained_steps / (TRAIN_K * mb))}
        if any(p is None or not p.get("flops") for p, _ in parts.values()):
            return {}
        total = sum(p["flops"] * k for p, k in parts.values())
        t = ph["iteration"]["s"]
        out = {"flops": int(total), "flops_from": "phase counts x phase calls per iteration",
               "tflops": total / t / 1e12, "mfu": total / t / self.ceiling,
               "rollout_flops": int(sum(parts[k][0]["flops"] * parts[k][1] for k in ("rollout_fwd", "vae_decode",
                                                                                     "pickscore"))),
               "train_flops": int(parts["train"][0]["flops"] * parts["train"][1])}
        return out

    def phases_for(self, stack, rollout_batches, micro_batches, vae=True, pick=True, terms=False) -> list[tuple]:
        """The phases of `stack` that --phases asks for. `terms`: the reward terms beside
        PickScore too (measured once, in the fast stack: no lever touches them). The VAE decodes
        and PickScore scores samples (S.unit: images, or videos of S.num_frames); the other terms
        score images (a video's shapes: its frames; OCR its own images of text)."""
        from hpcnft.bench.terms import TERMS

        S, only = self.S, set(self.args.phases)
        rollout_batches = rollout_batches if "rollout" in only else []
        micro_batches = micro_batches if "train" in only else []
        vae, pick = vae and "vae" in only, pick and "pickscore" in only
        out = [(f"rollout_fwd_b{b}", (lambda b=b: stack.rollout_forward(b)), "forward sample", b)
               for b in rollout_batches]
        if vae:
            b = max(S.rollout_batches)
            out.append(("vae_decode", lambda: stack.vae_decode(b), S.unit, b))
        if pick:
            out.append(("pickscore", lambda: stack.pickscore(S.samples), S.unit, S.samples))
        if terms and "reward_terms" in only:
            out += [(kind, (lambda kind=kind: stack.reward_term(kind, S.samples)),
                     "frame" if S.video and kind != "ocr" else "image", S.samples) for kind in TERMS]
        for mb in micro_batches:
            out.append((f"train_pair_mb{mb}", (lambda mb=mb: stack.train_pairs(mb)), "pair", TRAIN_K * mb,
                        max(1, S.warm - 1), max(2, S.reps - 2)))
        return out

    def iteration_for(self, stack: str) -> bool:
        """Whether a stack (eager, fast, default) runs whole iterations: --iteration, and --phases."""
        if "iteration" not in self.args.phases or self.args.iteration == "none":
            return False
        return self.args.iteration == "all" or stack != "default"

    def free(self, stack) -> None:
        """Drop a stack's models before the next stack builds its own: one DiT in memory at a
        time (the largest shapes' weights are 16-24 GB). On a GPU the memory still allocated
        after it is recorded in the stack's record (`allocated_after_free_gib`)."""
        torch = _torch()
        stack.close()
        try:
            import torch._dynamo

            torch._dynamo.reset()  # compiled graphs and their guards hold on to the blocks
        except Exception:  # noqa: BLE001
            pass
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            left = torch.cuda.memory_allocated(self.dev) / 2**30
            # what holds more than the shared scraps (cuBLAS workspaces, RNG states): named in the JSON
            held = held_tensors("cuda") if left > HELD_GIB else None
            for rec in [self.doc["stacks"].get(stack.key)] + self.doc["levers"] + self.doc.get("variants", []):
                if rec and rec.get("key") == stack.key:
                    rec["allocated_after_free_gib"] = round(left, 3)
                    if held:
                        rec["held_after_free"] = held
            self.log(f"freed {stack.key}: {left:.2f} GiB still allocated")
            if held:
                self.log("  " + held_summary(held))

    # -- the whole run
    def run(self) -> dict:
        S, args, dev = self.S, self.args, self.dev
        self.log(f"shapes {S.name} on {self.doc['environment']['device']}")
        self.doc["ceiling"] = matmul_ceiling(dev, S.ceiling_n)
        # against the ceiling of the shapes' compute dtype (fp16 for SD3.5, bf16 for FLUX.1)
        key = f"{S.precision}_tflops" if dev.type == "cuda" else "fp32_tflops"
        self.doc["ceiling_tflops"] = self.doc["ceiling"][key]
        self.doc["ceiling_what"] = f"dense matmul {S.ceiling_n}^3, {key.split('_')[0]}, measured in this process"
        self.log(f"ceiling {self.doc['ceiling']}")
        self.save()

        fast_over = fast_overrides(S, dev, args.overrides)
        fast_b = int(fast_over.get("rollout.batch_size", max(S.rollout_batches)))
        fast_mb = int(fast_over.get("train.micro_batch", max(S.micro_batches)))
        if DEFAULT_ALGO in args.algo:
            self.run_nft(fast_over, fast_b, fast_mb)
        for name in (n for n in args.algo if n != DEFAULT_ALGO):
            self.run_algorithm(name, fast_over, fast_mb)
        self.finish()
        return self.doc

    def run_algorithm(self, name: str, fast_over: dict, fast_mb: int) -> None:
        """Another algorithm's path (bench.algo_stack): the fast stack's levers, then every lever off."""
        from hpcnft.bench.algo_stack import AlgorithmStack

        S = self.S
        stacks = [(f"hpcnft_fast_{name}", f"hpcnft fast, {name}", fast_over, [fast_mb], self.iteration_for("fast"))]
        if not self.args.no_default:
            stacks.append((f"hpcnft_default_{name}", f"hpcnft default, {name}", {}, list(S.micro_batches),
                           self.iteration_for("default")))
        for key, label, over, mbs, iteration in stacks:
            stack = AlgorithmStack(key, label, S, self.dev, over, name)
            self.run_stack(stack, self.phases_for(stack, [], mbs, vae=False, pick=False), iteration,
                           {"micro_batch": max(mbs), "algo": name})
            self.free(stack)

    def run_nft(self, fast_over: dict, fast_b: int, fast_mb: int) -> None:
        """DiffusionNFT's stacks: the eager baseline, hpcnft fast, its variants, hpcnft default, the levers."""
        S, args, dev = self.S, self.args, self.dev
        if args.baseline:
            eager = EagerStack(S, dev)
            self.run_stack(eager, self.phases_for(eager, S.rollout_batches, S.micro_batches),
                           self.iteration_for("eager"), {"rollout_batch": eager.rollout_batch, "micro_batch": eager.mb})
            self.free(eager)
        real_text = args.text_encoders == "real"
        fast = HpcnftStack("hpcnft_fast", "hpcnft path, levers of hpcnft.perf.levers.FAST", S, dev, fast_over,
                           real_text=real_text)
        # the largest baseline shapes too, so fast and eager meet at one shape (and mb16's memory is read)
        fb = {fast_b} if args.own_shapes else {fast_b, max(S.rollout_batches)}
        fm = {fast_mb} if args.own_shapes else {fast_mb, max(S.micro_batches)}
        fb = sorted(fb | (set(S.rollout_batches) if args.all_shapes else set()))
        fm = sorted(fm | (set(S.micro_batches) if args.all_shapes else set()))
        rec = self.run_stack(fast, self.phases_for(fast, fb, fm, terms=True), self.iteration_for("fast"),
                             {"rollout_batch": fast_b, "micro_batch": fast_mb})
        if fast.term_towers:
            rec["reward_term_towers"] = fast.term_towers
            self.save()
        # What the numerics levers cost, where the phases asked for use what they change: the
        # fp8 cost samples at the rollout shapes (on a GPU, compiles them); not for --phases train.
        # v_old's fp8 cost runs one micro-batch at the train shapes.
        sampled = bool({"rollout", "iteration"} & set(args.phases))
        scored = bool({"pickscore", "iteration"} & set(args.phases))
        trained = bool({"train", "iteration"} & set(args.phases))
        if fast.cfg.perf.pickscore_preprocess == "device" and scored:  # four scorer calls: no budget check
            rec["pickscore_preprocess_cost"] = fast.preprocess_cost(S.samples)
            self.log(f"pickscore_preprocess=device vs PIL, |score difference|: {rec['pickscore_preprocess_cost']}")
            self.save()
        if fast.cfg.perf.rollout_fp8 and sampled and not self.over_budget():
            rec["rollout_fp8_cost"] = fast.rollout_fp8_cost(fast_b)
            self.log(f"rollout_fp8 vs {fast.cfg.train.precision} rollout: {rec['rollout_fp8_cost']}")
            self.save()
        if fast.cfg.perf.base_fp8_storage and sampled and not self.over_budget():
            rec["base_fp8_storage_cost"] = fast.base_fp8_storage_cost(fast_b)
            self.log(f"base_fp8_storage vs a {fast.cfg.train.precision} base: {rec['base_fp8_storage_cost']}")
            self.save()
        if fast.cfg.perf.v_old_fp8 and trained and not self.over_budget():
            rec["v_old_fp8_cost"] = fast.v_old_fp8_cost(fast_mb)
            self.log(f"v_old_fp8 vs {fast.cfg.train.precision} v_old: {rec['v_old_fp8_cost']}")
            self.save()
        if args.profile:
            self.profile(fast, rec, max(fb), max(fm))
        self.free(fast)
        if args.memory_caps:
            run_caps(self, args.memory_caps, fast_over, real_text)
        for change in expand_levers(args.variants, dev, S, "--variant"):
            if self.over_budget():
                self.doc["skipped"].append(f"variant {change} (budget)")
                continue
            self.run_variant(fast_over, change, fb, fm, {"rollout_batch": fast_b, "micro_batch": fast_mb})
        if not args.no_default:
            default = HpcnftStack("hpcnft_default", "hpcnft path, every perf lever off", S, dev, {})
            self.run_stack(default, self.phases_for(default, S.rollout_batches, S.micro_batches),
                           self.iteration_for("default"),
                           {"rollout_batch": max(S.rollout_batches), "micro_batch": max(S.micro_batches)})
            self.free(default)
        for lever in expand_levers(args.levers, dev, S):
            if self.over_budget():
                self.doc["skipped"].append(f"lever {lever} (budget)")
                continue
            self.run_lever(lever)

    def profile(self, stack, rec: dict, b: int, mb: int) -> None:
        """--profile: torch.profiler over one rollout forward at batch b, one train-pairs call at
        micro-batch mb (each where --phases has it) and, where the stack ran one, one whole
        iteration (where its time goes, by the package's named ranges, and on a GPU where the
        device idled), each after one more untimed call: a table each in the folder, a summary in rec."""
        from hpcnft.bench.profiling import profile_call

        out = rec["profile"] = {}
        calls = [("rollout_forward", f"rollout_fwd_b{b}", lambda: stack.rollout_forward(b)),
                 ("train_pairs", f"train_pair_mb{mb}", lambda: stack.train_pairs(mb))]
        calls = [c for c, part in zip(calls, ("rollout", "train")) if part in self.args.phases]
        if "iteration" in rec["phases"]:
            calls.append(("iteration", "iteration", stack.iteration))
        for name, phase, make in calls:
            if self.over_budget():
                self.doc["skipped"].append(f"{rec['key']}:profile {name} (budget)")
                continue
            path = os.path.join(self.args.profile, f"profile-{name}.txt")
            try:
                made = make()
                out[name] = {"phase": phase, **profile_call(made[0], made[1], self.dev, path)}
            except Exception as e:  # noqa: BLE001 - as for a phase
                out[name] = {"phase": phase, "error": self.error(rec, f"profile {name}", e)}
                continue
            self.log(f"profile {name} ({phase}): {path}")
            self.save()

    def finish(self) -> None:
        """Speed-ups against the eager stack beside each phase, and the targets."""
        eager = self.doc["stacks"].get("eager", {}).get("phases", {})
        for rec in list(self.doc["stacks"].values()) + self.doc["levers"] + self.doc.get("variants", []):
            if rec.get("key") == "eager":
                continue
            for name, m in rec["phases"].items():
                if "s" in m and eager.get(name, {}).get("s"):
                    m["speedup_vs_eager"] = eager[name]["per_unit_s"] / m["per_unit_s"]
        self.doc["targets"] = targets(self.doc, self.S)
        self.save()

    def run_variant(self, fast_over: dict, change: dict, fb: list, fm: list, extra: dict) -> None:
        """'hpcnft fast' with `change` on top, the same phases at the same batch sizes, in this
        process: what one change does to the fast stack, free of machine-to-machine variance."""
        name = _change_name(change)
        stack = HpcnftStack(f"variant:{name}", f"hpcnft fast + {name}", self.S, self.dev, {**fast_over, **change})
        rec = self.run_stack(stack, self.phases_for(stack, fb, fm), self.iteration_for("fast"), extra)
        self.keep_change(stack, rec, "variant", name, "fast")

    def keep_change(self, stack, rec: dict, kind: str, name: str, base: str) -> None:
        """A stack measured with one change (kind "variant" on hpcnft fast, "lever" on hpcnft
        default): out of the stacks, into doc[kind + "s"] with each phase's speed-up against the base."""
        self.doc["stacks"].pop(stack.key, None)
        rec[kind] = name
        base_phases = self.doc["stacks"].get(f"hpcnft_{base}", {}).get("phases", {})
        for ph, m in rec["phases"].items():
            if "s" in m and base_phases.get(ph, {}).get("s"):
                m[f"speedup_vs_{base}"] = base_phases[ph]["per_unit_s"] / m["per_unit_s"]
        self.doc.setdefault(kind + "s", []).append(rec)
        self.free(stack)
        self.save()

    def run_lever(self, lever: dict) -> None:
        """hpcnft default plus `lever` (one lever; compile comes with skip_single_rank_fsdp)."""
        S = self.S
        name = _change_name(lever)
        stack = HpcnftStack(f"lever:{name}", f"hpcnft default + {name}", S, self.dev, lever)
        k, v = next(iter(lever.items()))
        b, mb = max(S.rollout_batches), max(S.micro_batches)
        if k == "rollout.batch_size":
            phases = self.phases_for(stack, [int(v)], [], vae=False, pick=False)
        elif k in ("perf.vae_channels_last", "perf.vae_dtype", "perf.compile_vae", "perf.cudnn_benchmark"):
            phases = self.phases_for(stack, [], [], vae=True, pick=False)
        elif k == "perf.pickscore_dtype":
            phases = self.phases_for(stack, [], [], vae=False, pick=True)
        elif k == "perf.old_pass_batch":
            phases = self.phases_for(stack, [], [min(S.micro_batches)], vae=False, pick=False)
        elif k == "train.grad_checkpointing":
            phases = self.phases_for(stack, [], [mb], vae=False, pick=False)
        else:
            phases = self.phases_for(stack, [b], [mb], vae=False, pick=False)
        self.keep_change(stack, self.run_stack(stack, phases, False), "lever", name, "default")


def _change_name(change: dict) -> str:
    return ",".join(f"{k}={_toml(v)}" for k, v in change.items())
