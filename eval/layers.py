"""Per-Linear error of a quantized model against its baseline, on real text.

For every quantized module of the quantized model (an ``MXLinear``: ``weight`` in an FP8
dtype, ``weight_scale`` uint8 E8M0, ``dequantized_weight()`` giving the fp32 [N, K] weight)
and the module of the same name in the baseline:

- **weight SQNR**: baseline weight against the dequantized MX weight;
- **output SQNR** (the layer in isolation): the baseline runs the text; each baseline Linear's
  own input is fed to the quantized module as well, and the two outputs are compared. Only
  this layer's error (weight and, for W8A8, activation quantization) is in the number;
- **end-to-end SQNR** (drift): the quantized model runs the same text on its own; each
  quantized module's output is compared with the baseline Linear's output. Errors of all
  earlier layers are in the number.

SQNR over several batches is ``10 log10(Σ signal² / Σ noise²)`` over all of them (the same
definition as :func:`mxq.formats.sqnr_db` applied to the concatenated outputs).

Modules are matched by name, so a checkpoint whose channels were reordered by the calibrator
compares permuted weights with unpermuted ones for the layers the reordering touched; this
report is meant for direct-cast checkpoints, or read it with that in mind.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from mxq.formats import sqnr_db

__all__ = ["LayerSQNR", "is_quantized_module", "layer_sqnr", "layers_report", "LAYERS_METHOD"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
LAYERS_METHOD = (
    "weight SQNR: baseline weight vs dequantized MX weight. output SQNR: the baseline Linear's "
    "input fed to both the baseline Linear and the quantized module (this layer's error alone). "
    "end-to-end SQNR: each model run on its own input (accumulated drift). Sorted by output "
    "SQNR, worst first."
)


@dataclass
class LayerSQNR:
    name: str
    shape: tuple[int, int]  # [N, K] of the weight
    weight_sqnr_db: float
    output_sqnr_db: float
    end_to_end_sqnr_db: float | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


def is_quantized_module(m: torch.nn.Module) -> bool:
    """An MX projection (``mxq.runtime.linear.mx_layers``' kind, or another tool's module of that shape);
    not the stacked weight of a fused group, whose projections are reported one by one."""
    from mxq.runtime.linear import FusedMXLinear

    if isinstance(m, FusedMXLinear):
        return False
    w = getattr(m, "weight", None)
    s = getattr(m, "weight_scale", None)
    return (
        isinstance(w, torch.Tensor)
        and w.dtype in FP8_DTYPES
        and isinstance(s, torch.Tensor)
        and s.dtype == torch.uint8
        and callable(getattr(m, "dequantized_weight", None))
    )


class _Acc:
    """Σ ref² and Σ (ref - approx)² in float64, across batches."""

    def __init__(self) -> None:
        self.signal = 0.0
        self.noise = 0.0

    def add(self, ref: torch.Tensor, approx: torch.Tensor) -> None:
        ref = ref.double()
        self.signal += float(ref.square().sum())
        self.noise += float((ref - approx.double()).square().sum())

    def db(self) -> float:
        if self.noise == 0:
            return math.inf
        if self.signal == 0:
            return -math.inf
        return 10.0 * math.log10(self.signal / self.noise)


def _compute_dtype(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point() and p.dtype not in FP8_DTYPES:
            return p.dtype
    return torch.float32


def layer_sqnr(
    quant_model: torch.nn.Module,
    base_model: torch.nn.Module,
    batches: torch.Tensor,
    *,
    batch_size: int = 1,
    end_to_end: bool = True,
) -> list[LayerSQNR]:
    """Per-layer SQNR (see the module doc) on token windows ``batches`` [n, seq_len], worst first.

    Both models must sit on the same device.
    """
    base_mods = dict(base_model.named_modules())
    pairs = []
    for name, q in quant_model.named_modules():
        if not is_quantized_module(q):
            continue
        b = base_mods.get(name)
        bw = getattr(b, "weight", None)
        if not isinstance(bw, torch.Tensor):
            raise ValueError(f"{name}: quantized in the model but no Linear of that name in the baseline")
        if bw.dim() != 2 or bw.shape[0] != q.weight.shape[0]:
            raise ValueError(f"{name}: baseline weight shape {tuple(bw.shape)} does not match the quantized layer")
        pairs.append((name, q, b))
    if not pairs:
        raise ValueError(
            "the model has no quantized Linear modules (weight in FP8 with a uint8 weight_scale): "
            "is it an mxq checkpoint?"
        )

    results = {}
    with torch.inference_mode():
        for name, q, b in pairs:
            wq = q.dequantized_weight().float()
            wb = b.weight.float()
            if wq.shape != wb.shape:
                raise ValueError(f"{name}: dequantized weight {tuple(wq.shape)} vs baseline {tuple(wb.shape)}")
            results[name] = LayerSQNR(name, (int(wb.shape[0]), int(wb.shape[1])), sqnr_db(wb, wq), math.nan)

        q_dtype = _compute_dtype(quant_model)
        device = next(base_model.parameters()).device
        iso = {name: _Acc() for name, _, _ in pairs}
        e2e = {name: _Acc() for name, _, _ in pairs}
        ref_out: dict[str, torch.Tensor] = {}

        def base_hook(name, q):
            def hook(mod, inputs, output):
                x = inputs[0]
                y_q = q(x.to(q_dtype))
                iso[name].add(output, y_q)
                if end_to_end:
                    ref_out[name] = output.detach()

            return hook

        def quant_hook(name):
            def hook(mod, inputs, output):
                e2e[name].add(ref_out.pop(name), output)

            return hook

        for b0 in range(0, batches.shape[0], batch_size):
            ids = batches[b0 : b0 + batch_size].to(device)
            handles = [b.register_forward_hook(base_hook(n, q)) for n, q, b in pairs]
            try:
                base_model(input_ids=ids, use_cache=False)
            finally:
                for h in handles:
                    h.remove()
            if end_to_end:
                handles = [q.register_forward_hook(quant_hook(n)) for n, q, _ in pairs]
                try:
                    quant_model(input_ids=ids.to(next(quant_model.parameters()).device), use_cache=False)
                finally:
                    for h in handles:
                        h.remove()
                ref_out.clear()

    for name, _, _ in pairs:
        results[name].output_sqnr_db = iso[name].db()
        if end_to_end:
            results[name].end_to_end_sqnr_db = e2e[name].db()
    return sorted(results.values(), key=lambda r: (r.output_sqnr_db, r.weight_sqnr_db))


def layers_report(rows: list[LayerSQNR], *, model: str = "", baseline: str = "", dataset: str = "",
                  seq_len: int = 0, n_batches: int = 0) -> dict:
    return {
        "model": model,
        "baseline": baseline,
        "dataset": dataset,
        "seq_len": seq_len,
        "n_batches": n_batches,
        "method": LAYERS_METHOD,
        "layers": [r.to_dict() for r in rows],
    }
