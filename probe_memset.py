"""Where the train step's cudaMemsetAsync calls come from (one train_pairs call at micro-batch 32)."""
import collections
import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from hpcnft.bench.levers import fast_overrides
from hpcnft.bench.shapes import SHAPES
from hpcnft.bench.stack import HpcnftStack

dev = torch.device("cuda", 0)
S = SHAPES["sd35m"]()
st = HpcnftStack("p", "p", S, dev, fast_overrides(S, dev, []))
fn, ctx, n = st.train_pairs(32)
with ctx():
    fn(); fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
evs = prof.events()
calls = [e for e in evs if e.device_type == DeviceType.CPU and "emset" in e.name]
chains = collections.Counter()
for e in calls:
    p, chain = e.cpu_parent, []
    while p is not None and len(chain) < 5:
        chain.append(p.name[:60])
        p = p.cpu_parent
    chains[" < ".join(chain)] += 1
print("memset calls", len(calls))
for k, v in chains.most_common(12):
    print(f"{v:6d}  {k}")
gpu = [e for e in evs if e.device_type == DeviceType.CUDA]
mem = [e for e in gpu if "emset" in e.name]
print("gpu memsets", len(mem), "total ms", sum(e.device_time for e in mem) / 1e3,
      "of all gpu ms", sum(e.device_time for e in gpu) / 1e3)
sizes = collections.Counter(e.name for e in mem)
print(sizes.most_common(5))
print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=70))
sys.stdout.flush()
