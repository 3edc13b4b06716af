"""AutoRound's MXFP8 recipe on mxq's calibration tokens, scored by mxq: the peer measured as mxq is.

    python -m mxq.eval.peer_autoround --calib calib_ar.txt --heldout valid.txt --device cuda \\
        --samples 128 --seq-len 512 --max-windows 12 --out autoround.json

Loads the model (default: the embedded SmolLM2-135M) in bf16, cuts the calibration text into the
same token windows ``mxq.eval.calibration_grid`` calibrates on (``calibration_batches``), and hands
them to AutoRound as its dataset. The defaults are AutoRound's light recipe: scheme MXFP8 (W8A8), 50
iterations, lr 5e-3, 8 samples a step. ``--set KEY=VALUE`` (repeatable) passes any other argument of
AutoRound's constructor, for ablations (``--set amp=False --set enable_minmax_tuning=False``); those
with an option of their own (``--iters``, ``--lr``, ...) are set there. AutoRound writes its export in
the llm-compressor format, and mxq loads that export through ``mxq.load``, with mxq's layers and kernels, and scores it beside bf16
on the same held-out windows with mxq's perplexity. The table gives each perplexity against bf16;
the JSON keeps the settings, times and versions. Needs ``auto-round`` and ``compressed-tensors``,
which mxq does not depend on.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import tempfile
import time

from mxq.eval.calibration_grid import protocol_args

# AutoRound's arguments that this bench sets from its own options (``--set`` refuses them)
OWN_OPTIONS = {"scheme": "--scheme", "iters": "--iters", "lr": "--lr", "nsamples": "--samples", "seqlen": "--seq-len",
               "batch_size": "--batch-size", "dataset": "--calib", "device_map": "--device"}  # fmt: skip


def autoround_kwargs(pairs: list[str]) -> dict:
    """``--set KEY=VALUE`` pairs as keyword arguments: True/False/None, then int, then float, else the string."""
    out = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.isidentifier():
            raise SystemExit(f"peer_autoround: --set {pair!r}: expected KEY=VALUE with KEY an argument name of AutoRound")
        if key in OWN_OPTIONS:
            raise SystemExit(f"peer_autoround: --set {pair!r}: {key} has its own option, {OWN_OPTIONS[key]}")
        value: object = {"True": True, "False": False, "None": None}.get(text, text)
        if isinstance(value, str):
            for cast in (int, float):
                try:
                    value = cast(text)
                    break
                except ValueError:
                    pass
        out[key] = value
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    protocol_args(ap, samples=128, seq_len=512)
    ap.add_argument("--iters", type=int, default=50, help="AutoRound's iterations per block (light recipe: 50)")
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--batch-size", type=int, default=8, help="samples a step")
    ap.add_argument("--scheme", default="MXFP8", help="AutoRound's scheme (MXFP8: W8A8)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="another argument of AutoRound's constructor (repeatable), e.g. amp=False")
    ap.add_argument("--save", default=None, help="keep AutoRound's export in this folder (default: a temporary one)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    knobs = autoround_kwargs(a.set)
    try:
        import auto_round
        import compressed_tensors  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"peer_autoround: needs auto-round and compressed-tensors ({e}); "
                         "pip install auto-round compressed-tensors") from None  # fmt: skip

    import torch
    from auto_round import AutoRound

    from mxq.calib.calibrator import calibration_batches
    from mxq.eval.data import load_texts
    from mxq.eval.perplexity import make_windows, perplexity
    from mxq.hf.models import load_model, runtime

    model, tok = load_model(a.model, dtype=torch.bfloat16, fuse=False)
    batches = calibration_batches(tok, load_texts(a.calib), a.samples, a.seq_len, a.batch_size)
    windows = make_windows(tok, load_texts(a.heldout), a.eval_seq_len, max_windows=a.max_windows)
    with tempfile.TemporaryDirectory() as tmp:
        save = a.save or tmp
        t0 = time.perf_counter()
        ar = AutoRound(model, tok, scheme=a.scheme, iters=a.iters, lr=a.lr, nsamples=a.samples, seqlen=a.seq_len,
                       batch_size=a.batch_size, dataset=batches, device_map=0 if a.device == "cuda" else "cpu", **knobs)  # fmt: skip
        ar.quantize_and_save(save, format="llm_compressor")
        t_ar = time.perf_counter() - t0
        del ar, model
        found = glob.glob(os.path.join(save, "**", "config.json"), recursive=True)
        if not found:
            raise SystemExit(f"peer_autoround: AutoRound wrote no config.json under {save}")
        base, _ = load_model(a.model, device=a.device, dtype=torch.bfloat16, tokenizer=False)
        ppl_bf16 = perplexity(base, windows=windows, progress=False).ppl
        del base
        quant, _ = load_model(os.path.dirname(found[0]), device=a.device, dtype=torch.bfloat16, tokenizer=False)
        ran = runtime(quant)
        ppl_ar = perplexity(quant, windows=windows, progress=False).ppl
    delta = (ppl_ar / ppl_bf16 - 1) * 100
    print(f"\n| model ({windows.n_windows} held-out windows x {a.eval_seq_len}) | perplexity | vs bf16 | tuning s |")
    print("|---|---:|---:|---:|")
    print(f"| bf16 | {ppl_bf16:.4f} | — | |")
    extra = "".join(f", {k}={v}" for k, v in knobs.items())
    print(f"| AutoRound {a.scheme}, {a.iters} iterations, lr {a.lr}{extra} | {ppl_ar:.4f} | {delta:+.2f} % | {t_ar:.1f} |")
    print(f"AutoRound's export ran on {ran}")
    if a.out:
        rec = {"model": a.model or "default", "calib": a.calib, "heldout": a.heldout, "samples": a.samples,
               "seq_len": a.seq_len, "batch_size": a.batch_size, "iters": a.iters, "lr": a.lr, "scheme": a.scheme, "set": knobs,
               "windows": windows.n_windows, "eval_seq_len": a.eval_seq_len, "bf16": ppl_bf16, "autoround": ppl_ar,
               "delta_pct": delta, "autoround_s": t_ar, "runtime": ran,
               "versions": {"auto_round": getattr(auto_round, "__version__", "?"), "torch": torch.__version__,
                            "python": platform.python_version(),
                            "device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor()}}  # fmt: skip
        with open(a.out, "w") as f:
            json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
