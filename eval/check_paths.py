"""Does the fast path compute the same function as the reference? Perplexity through each path.

    python -m mxq.eval.check_paths CHECKPOINT --dataset valid.txt --max-windows 4 --dtype float32 \
        --device cuda --out paths.json

Scores the same windows through every way mxq can run an MX linear layer:

* ``triton``: the Triton kernels (CUDA only);
* ``reference``: the torch reference (``mx_linear_reference``: fp32 products);
* ``reference_fp64``: the same reference with float64 accumulation;

each for the checkpoint as quantized (W8A8 when its recipe rounds activations) and with the
activation rounding removed (W8A16: the same weights, bf16/fp32 activations).

Why both: W8A16 is a continuous function of the activations, so every path must agree to
accumulation rounding (~1e-6 relative). W8A8 rounds activations to MX between layers, a step
function: a 1e-7 difference in accumulation order flips a few roundings, and the flips cascade
through the layers, so W8A8 paths agree only statistically. ``reference`` vs ``reference_fp64``
shows the size of that spread; the fast path is right when it falls inside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch


def _fp64_linear(
    x, weight, weight_scale=None, bias=None, *, act_elem=None, act_rule="rceil", block_size=32, kernels=None,
    x_mx=None,
):  # fmt: skip
    from mxq.formats import MXTensor, fake_quantize_mx
    from mxq.kernels.reference import elem_of

    n, k = weight.shape
    w = MXTensor(
        weight, weight_scale, torch.Size((n, k)), 1, block_size, elem_of(weight)
    ).dequantize(torch.float64)
    xf = x.to(torch.float32)
    if act_elem is not None and x_mx is None:  # with x_mx, x holds the values its producer rounded
        xf = fake_quantize_mx(xf, -1, act_elem, block_size, act_rule)
    y = xf.double() @ w.t()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


_UNSET = object()


@contextlib.contextmanager
def path(name: str, model):
    """Route every MXLinear of ``model`` through one implementation for the duration of the block:
    ``triton`` the dispatch's choice (``kernels`` as the model had it, default "auto"), ``reference``
    ``mxq.set_kernels(model, "reference")``, ``reference_fp64`` the float64 product below."""
    import mxq.kernels as K
    from mxq.runtime.linear import MXLinear, set_kernels

    # what set_kernels writes: each MXLinear's ``kernels``, every other module's ``mxq_kernels``
    saved = [(m, "kernels" if isinstance(m, MXLinear) else "mxq_kernels") for m in model.modules()]
    saved = [(m, attr, m.__dict__.get(attr, _UNSET)) for m, attr in saved]
    fn = K.mx_linear
    try:
        if name == "reference":
            set_kernels(model, "reference")
        elif name == "reference_fp64":
            K.mx_linear = _fp64_linear
        elif name != "triton":
            raise ValueError(f"unknown path {name!r}")
        yield
    finally:
        K.mx_linear = fn
        for m, attr, value in saved:
            if value is not _UNSET:
                setattr(m, attr, value)
            elif attr in m.__dict__:
                delattr(m, attr)


def check(model, windows, device: torch.device, paths=None) -> dict:
    from mxq.eval.perplexity import perplexity
    from mxq.runtime.linear import MXLinear

    paths = paths or (["triton"] if device.type == "cuda" else []) + ["reference", "reference_fp64"]
    layers = [m for m in model.modules() if isinstance(m, MXLinear)]
    if not layers:
        raise ValueError("the model has no MXLinear layers: pass an mxq checkpoint")
    acts = [m.act for m in layers]
    out = {}
    for variant in ("as_quantized", "w8a16"):
        if variant == "w8a16":
            if all(a is None for a in acts):
                break  # already weight-only
            for m in layers:
                m.act = None
        for p in paths:
            with path(p, model):
                r = perplexity(model, windows=windows, progress=False)
            out[f"{variant}/{p}"] = r.ppl
            print(f"{variant:>12} {p:>15}: {r.ppl:.6f}", file=sys.stderr, flush=True)
    for m, a in zip(layers, acts):
        m.act = a
    return out


_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "float32": "float32",
           "fp32": "float32"}  # fmt: skip


def main(argv=None) -> int:
    from mxq.eval.data import load_texts
    from mxq.eval.perplexity import make_windows
    from mxq.hf.models import load_model, resolve_device

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--dataset", default="pydoc")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--max-windows", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    device = resolve_device(a.device)
    model, tok = load_model(a.checkpoint, device=device, dtype=getattr(torch, _DTYPES[a.dtype]))
    windows = make_windows(tok, load_texts(a.dataset), a.seq_len, None, a.max_windows)
    res = {"checkpoint": a.checkpoint, "dataset": a.dataset, "n_windows": windows.n_windows, "dtype": a.dtype,
           "device": str(device), "torch": torch.__version__, "ppl": check(model, windows, device)}  # fmt: skip
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
