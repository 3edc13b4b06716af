"""GPTQ calibration cost at scale: time and peak device memory of ``mxq.calib.gptq.gptq_model``.

    python -m mxq.eval.bench_gptq --shape llama3-8b --samples 128 --seq-len 2048 --out gptq-8b.json

A Llama-shaped bf16 model with random weights (``bench_e2e.build_random``) and random token ids:
what is measured is the cost, not the accuracy (eval/CALIBRATION_RESULTS.md has that, on
SmolLM2 and real text). The decoder layers are kept on the host and brought to the device one
at a time (``offload``), so peak device memory is one layer, its Hessians and the calibration
activations; ``--no-offload`` keeps the whole model on the device. The baseline row is direct
cast (round to nearest) of the same layers; the table gives each row's time and its layer output
error (on the calibration inputs, weights only) relative to that baseline.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch


def main(argv=None) -> int:
    from mxq.eval.bench_e2e import SHAPES, build_random

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--recipe", default="mxfp8")
    ap.add_argument("--no-offload", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import mxq
    from mxq.calib.gptq import gptq_model
    from mxq.formats import quantize_mx
    from mxq.recipe import load_recipe

    device = torch.device(a.device)
    if a.layers is not None:
        SHAPES[a.shape] = dict(SHAPES[a.shape], num_hidden_layers=a.layers)
    rec = load_recipe(a.recipe)
    t_build = time.perf_counter()
    model = build_random(a.shape, device)
    print(f"model built in {time.perf_counter() - t_build:.1f} s", flush=True)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and rec.selects(n)]
    specs = {n: (rec.weights, rec.activations) for n in names}
    mods = dict(model.named_modules())

    # baseline: direct cast of the same layers
    t0 = time.perf_counter()
    for n in names:
        quantize_mx(mods[n].weight.detach(), -1, rec.weights.elem, 32, rec.weights.scale_rule)
    _sync(device)
    t_rtn = time.perf_counter() - t0

    offload = not a.no_offload
    if offload:
        model.model.layers.to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (a.samples, a.seq_len), generator=g)
    batches = list(ids.split(a.batch_size))
    t0 = time.perf_counter()
    def tick(i: int) -> None:  # one line per decoder layer, so a cut-off run still tells its pace
        print(f"layer {i}: {time.perf_counter() - t0:.1f} s", flush=True)

    res = gptq_model(model, batches, specs, device=device, offload=offload, progress=False, on_layer=tick)
    _sync(device)
    t_gptq = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters()) / 2**30
    act_bytes = a.samples * a.seq_len * model.config.hidden_size * 2 / 2**30
    summ = res.summary()
    rows = [
        {"method": "nearest (direct cast)", "seconds": t_rtn, "error_vs_nearest": 1.0},
        {"method": "gptq", "seconds": t_gptq, "error_vs_nearest": summ["mean_error_ratio_gptq_over_nearest"],
         "peak_device_gib": peak},
    ]
    print(f"| {a.shape} x{model.config.num_hidden_layers} layers, {a.samples} x {a.seq_len} tokens, "
          f"offload {offload} | seconds | x nearest | layer output error vs nearest | peak GiB |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['seconds']:.1f} | {r['seconds'] / t_rtn:.0f} | {r['error_vs_nearest']:.3f} | "
              f"{r.get('peak_device_gib', float('nan')):.2f} |")
    print(f"one decoder layer {layer_bytes:.2f} GiB, calibration activations {act_bytes:.2f} GiB (bf16)")
    out = {
        "shape": a.shape, "layers": model.config.num_hidden_layers, "samples": a.samples, "seq_len": a.seq_len,
        "recipe": rec.name, "offload": offload, "rows": rows, "layer_gib": layer_bytes, "activations_gib": act_bytes,
        "per_layer": res.layers,
        "versions": {"mxq": mxq.__version__, "torch": torch.__version__, "python": platform.python_version(),
                     "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()},
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    raise SystemExit(main())
