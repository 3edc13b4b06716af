"""What each calibration choice buys: held-out perplexity, bytes and time, one model load.

    python -m mxq.eval.calibration_grid --calib calib.txt --heldout heldout.txt --device cuda --out grid.json

Loads the model once (default: the embedded SmolLM2-135M), measures it in bf16, then for each
recipe calibrates once (statistics and per-layer sensitivity, ``mxq.calib.calibrator.calibrate``) and
builds every variant in memory from that calibration: direct cast, GPTQ rounding
(``mxq.calib.gptq.round_plan``), kept layers, each applied with ``mxq.calib.calibrator.apply_plan`` exactly as
``mxq quantize --plan`` writes it (``tests/test_gptq.py`` holds the two equal). Every variant is
scored on the same held-out windows. The table gives each row's perplexity against bf16 and its
bytes against the recipe's direct cast; the JSON keeps the calibration provenance and times.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from typing import NamedTuple

import torch

from mxq.calib.signround import SIGNROUND_ITERS, SIGNROUND_LR


class Variant(NamedTuple):
    """One calibration choice: the recipe, the weights' rounding, layers kept in bf16 and whether
    the GPTQ Hessians come from the MX-rounded inputs."""

    recipe: str
    rounding: str
    keep_bf16: int = 0
    quantized_inputs: bool = False


VARIANTS = {
    "direct": Variant("mxfp8", "nearest"),
    "gptq": Variant("mxfp8", "gptq"),
    "gptq-actorder": Variant("mxfp8", "gptq-actorder"),
    "gptq-qin": Variant("mxfp8", "gptq", quantized_inputs=True),
    "nearest+keep8": Variant("mxfp8", "nearest", keep_bf16=8),
    "gptq+keep8": Variant("mxfp8", "gptq", keep_bf16=8),
    "gptq+keep12": Variant("mxfp8", "gptq", keep_bf16=12),
    "gptq+keep16": Variant("mxfp8", "gptq", keep_bf16=16),
    "signround": Variant("mxfp8", "signround"),
    "signround+keep8": Variant("mxfp8", "signround", keep_bf16=8),
    "signround-scales": Variant("mxfp8", "signround-scales"),
    "signround-scales+keep8": Variant("mxfp8", "signround-scales", keep_bf16=8),
    "w8a16 direct": Variant("mxfp8-w8a16", "nearest"),
    "w8a16 signround": Variant("mxfp8-w8a16", "signround"),
    "w8a16 signround+keep8": Variant("mxfp8-w8a16", "signround", keep_bf16=8),
    "w8a16 signround-scales": Variant("mxfp8-w8a16", "signround-scales"),
    "w8a16 gptq": Variant("mxfp8-w8a16", "gptq"),
    "attn direct": Variant("mxfp8-attn", "nearest"),
    "attn gptq": Variant("mxfp8-attn", "gptq"),
}


def _bytes(model) -> int:
    """Bytes of parameters and persistent buffers, a tied matrix once (what the checkpoint holds)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + [b for _, b in model.named_buffers() if b is not None]:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def protocol_args(ap: argparse.ArgumentParser, *, samples: int, seq_len: int) -> None:
    """The options of every calibrate-then-score bench: the model, the calibration text and its token
    windows, the held-out text and its scoring windows, the device."""
    ap.add_argument("--model", default=None, help="model reference (default: the embedded SmolLM2-135M)")
    ap.add_argument("--calib", required=True, help="calibration text file")
    ap.add_argument("--heldout", required=True, help="held-out text file (scored)")
    ap.add_argument("--samples", type=int, default=samples)
    ap.add_argument("--seq-len", type=int, default=seq_len)
    ap.add_argument("--eval-seq-len", type=int, default=2048)
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--device", default="cuda")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    protocol_args(ap, samples=64, seq_len=2048)
    ap.add_argument("--batch-size", type=int, default=4, help="calibration samples per batch: signround's samples per step (default 4)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    ap.add_argument("--iters", type=int, default=SIGNROUND_ITERS, help=f"signround's steps per layer (default {SIGNROUND_ITERS})")
    ap.add_argument("--lr", type=float, default=SIGNROUND_LR, help=f"signround's first step, in element steps (default {SIGNROUND_LR})")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import mxq
    from mxq.calib.calibrator import apply_plan, calibrate, make_plan
    from mxq.calib.gptq import round_plan
    from mxq.eval.data import load_texts
    from mxq.eval.perplexity import make_windows, perplexity
    from mxq.hf.models import load_model
    from mxq.recipe import load_recipe

    names = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown[0]!r}")
    device = torch.device(a.device)
    t0 = time.perf_counter()
    model, tok = load_model(a.model, device=device, dtype=torch.bfloat16)
    t_load = time.perf_counter() - t0
    texts = load_texts(a.calib)
    windows = make_windows(tok, load_texts(a.heldout), a.eval_seq_len, max_windows=a.max_windows)

    def score(m) -> float:
        return perplexity(m, windows=windows, progress=False).ppl

    def save(rows, cals) -> None:
        if a.out:
            out = {
                "model": a.model or "default", "calib": a.calib, "heldout": a.heldout, "samples": a.samples,
                "seq_len": a.seq_len, "batch_size": a.batch_size, "iters": a.iters, "lr": a.lr, "windows": windows.n_windows, "eval_seq_len": a.eval_seq_len, "rows": rows,
                "calibrate_s": {k: round(v[2], 1) for k, v in cals.items()}, "load_s": t_load,
                "versions": {"mxq": mxq.__version__, "torch": torch.__version__, "python": platform.python_version(),
                             "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()},
            }
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1, default=str)

    rows = [{"variant": "bf16", "ppl": score(model), "bytes": _bytes(model)}]
    base = rows[0]["ppl"]
    cals: dict[str, tuple] = {}
    for v in names:
        rname, rounding, keep, qin = VARIANTS[v]
        if rname not in cals:
            rec = load_recipe(rname)
            t1 = time.perf_counter()
            cals[rname] = (rec, calibrate(model, tok, texts, rec, samples=a.samples, seq_len=a.seq_len,
                                          batch_size=a.batch_size, dataset=str(a.calib), progress=False), time.perf_counter() - t1)
        rec, cal, t_cal = cals[rname]
        t1 = time.perf_counter()
        m = copy.deepcopy(model)
        if rec.attention == "mxfp8":
            import mxq.runtime.attention  # noqa: F401

            m.set_attn_implementation("mxfp8")
        plan = make_plan(m, cal, keep_bf16=keep, progress=False)
        t_gptq = 0.0
        if rounding.startswith("gptq"):
            t2 = time.perf_counter()
            round_plan(m, plan, cal.batches, progress=False, quantized_inputs=qin, act_order=rounding == "gptq-actorder")
            t_gptq = time.perf_counter() - t2
        elif rounding.startswith("signround"):  # the "GPTQ s" column then holds signround's time
            from mxq.calib.signround import signround_plan

            t2 = time.perf_counter()
            signround_plan(m, plan, cal.batches, iters=a.iters, lr=a.lr, scales=rounding == "signround-scales", progress=False)
            t_gptq = time.perf_counter() - t2
        apply_plan(m, plan)
        row = {"variant": v, "recipe": rname, "rounding": rounding, "keep_bf16": keep, "quantized_inputs": qin,
               "ppl": score(m), "bytes": _bytes(m), "calibrate_s": t_cal, "plan_s": time.perf_counter() - t1 - t_gptq,
               "gptq_s": t_gptq, "gptq": plan.choices.get("gptq"), "signround": plan.choices.get("signround")}
        rows.append(row)
        print(f"{v}: ppl {row['ppl']:.4f} ({(row['ppl'] / base - 1) * 100:+.2f} %), {rounding} {t_gptq:.1f} s", flush=True)
        del m
        save(rows, cals)

    direct_bytes = {r["recipe"]: r["bytes"] for r in rows if r.get("rounding") == "nearest" and r.get("keep_bf16") == 0}
    print(f"\n| variant ({windows.n_windows} held-out windows x {a.eval_seq_len}) | perplexity | vs bf16 | MiB | bytes vs direct | GPTQ s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        db = direct_bytes.get(r.get("recipe"))
        ratio = f"{r['bytes'] / db:.3f}" if db else "—"
        print(f"| {r['variant']} | {r['ppl']:.4f} | {(r['ppl'] / base - 1) * 100:+.2f} % | {r['bytes'] / 2**20:.1f} | {ratio} | "
              f"{r.get('gptq_s', 0.0):.1f} |")
    cal_times = {k: round(v[2], 1) for k, v in cals.items()}
    print(f"model load {t_load:.1f} s; calibration statistics + sensitivity per recipe: {cal_times}")
    save(rows, cals)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
