"""Session 19: how much a CUDA graph's launch latency added to the one-replay timings.

Until session 19, `tune.time_interleaved` and `bench_gemm._bench_graph` timed one replay right after
a synchronize, so the host's graph launch latency G was inside every figure, divided by the calls in
the graph (1-8 weight or cache copies). Here: graphs of n tiny kernels (an in-place add on 4 bytes)
timed the old way and behind a spin kernel (`tune.time_replays`); G ≈ old - new per replay."""
import json, os
import torch
from mxq.kernels.tune import capture_graph, time_replays

x = torch.zeros(1, device="cuda")
rows = []
for n in (1, 2, 8, 32):
    g = capture_graph([lambda: x.add_(1)] * n)
    old, new = [], []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        old.append(a.elapsed_time(b) * 1e3)
        new.append(time_replays(g, 2) / 2)
    old.sort(), new.sort()
    rows.append(dict(kernels=n, old_us=old[25], new_us=new[25]))
    print(f"graph of {n:2d} tiny kernels: one replay after a sync {old[25]:6.2f} µs | behind a spin {new[25]:6.2f} µs"
          f" | per kernel {old[25] / n:5.2f} -> {new[25] / n:5.2f}", flush=True)
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
          open(os.path.join(os.environ.get("OUT", "/tmp"), "graph_latency.json"), "w"), indent=1)
