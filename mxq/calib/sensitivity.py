"""What one quantized layer costs the whole model: ``layer_sensitivity`` (the KL divergence of the final
logits from the unquantized logits when only that Linear layer is quantized, direct cast) and
``quantized_ppl`` (perplexity with a set of layers quantized), both through ``Quantizer``'s forward
hooks, which replace a chosen layer's output by ``quantized_output`` (what ``MXLinear``'s reference
computes, with the calibration's channel permutation). ``Resumable`` starts a Llama/Qwen-style
forward at the decoder layer a change first reaches. The calibrator (``mxq.calib.calibrator``) ranks the
layers it keeps in bf16 by these figures."""

from __future__ import annotations

import math

import torch
from torch import nn

from mxq.formats import fake_quantize_mx
from mxq.progress import progress_bar
from mxq.recipe import TensorSpec
from mxq.runtime.linear import linear_layers

__all__ = ["fake_quant_weight", "quantized_output", "Quantizer", "Resumable", "layer_index", "layer_sensitivity",
           "quantized_ppl"]  # fmt: skip


def fake_quant_weight(w: torch.Tensor, spec: TensorSpec, perm: torch.Tensor | None, block_size: int) -> torch.Tensor:
    w = w.detach().float()
    if perm is not None:
        w = w[:, perm]
    return fake_quantize_mx(w, -1, spec.elem, block_size, spec.scale_rule)


def quantized_output(x: torch.Tensor, wq: torch.Tensor, bias, act: TensorSpec | None, perm: torch.Tensor | None,
           block_size: int) -> torch.Tensor:  # fmt: skip
    """What MXLinear's reference computes (float32), with K permuted: fq(x[:, p]) @ fq(W[:, p])ᵀ + b."""
    xf = x.float()
    if perm is not None:
        xf = xf[..., perm]
    if act is not None:
        xf = fake_quantize_mx(xf, -1, act.elem, block_size, act.scale_rule)
    y = xf @ wq.t()
    if bias is not None:
        y = y + bias.float()
    return y


class Quantizer:
    """Forward hooks that replace chosen Linear outputs by their MX fake-quant outputs."""

    def __init__(self, model: nn.Module, settings: dict[str, tuple], perms: dict[str, torch.Tensor] | None,
                 block_size: int):  # fmt: skip
        self.model = model
        self.lin = linear_layers(model)
        self.settings = settings  # name -> (weights spec, activations spec)
        self.perms = perms or {}
        self.block_size = block_size
        self._wq: dict[str, torch.Tensor] = {}
        self._hooks: list = []

    def wq(self, name: str) -> torch.Tensor:
        if name not in self._wq:
            self._wq[name] = fake_quant_weight(self.lin[name].weight, self.settings[name][0], self.perms.get(name), self.block_size)
        return self._wq[name]

    def enable(self, names) -> None:
        self.disable()
        for n in names:
            lin, act, perm = self.lin[n], self.settings[n][1], self.perms.get(n)

            def hook(mod, args, out, n=n, act=act, perm=perm):
                x = args[0]
                return quantized_output(x, self.wq(n), mod.bias, act, perm, self.block_size).to(x.dtype)

            self._hooks.append(lin.register_forward_hook(hook))

    def disable(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class Resumable:
    """Runs a Llama/Qwen-style model from the input of decoder layer i, reusing captured inputs.

    Quantizing one Linear changes nothing before its decoder layer, so the forward pass can start
    there. Checked against the full forward on construction; other architectures run in full.
    """

    def __init__(self, model: nn.Module, ids: torch.Tensor):
        self.model, self.ids = model, ids
        base = getattr(model, "model", None)
        self.layers = getattr(base, "layers", None)
        self.norm = getattr(base, "norm", None)
        self.head = model.get_output_embeddings()
        self.inputs: list = []
        caps: list = [None] * len(self.layers or [])
        hooks = [
            layer.register_forward_pre_hook(lambda m, a, k, i=i: caps.__setitem__(i, (a, k)), with_kwargs=True)
            for i, layer in enumerate(self.layers or [])
        ]
        try:
            self.full = model(input_ids=ids, use_cache=False).logits.float()
        finally:
            for h in hooks:
                h.remove()
        if self.layers is None or self.norm is None or self.head is None or any(c is None for c in caps):
            return
        self.inputs = caps
        if not torch.equal(self.run_from(0), self.full):
            self.inputs = []

    def run_from(self, i: int) -> torch.Tensor:
        if not self.inputs:
            return self.model(input_ids=self.ids, use_cache=False).logits.float()
        args, kwargs = self.inputs[i]
        h = args[0] if args else kwargs["hidden_states"]
        kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        for layer in self.layers[i:]:
            h = layer(h, *args[1:], **kwargs)
            h = h[0] if isinstance(h, tuple) else h
        return self.head(self.norm(h)).float()


def layer_index(name: str) -> int:
    parts = name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b)
    return 0


def _kl(ref_logp: torch.Tensor, logits: torch.Tensor) -> float:
    logq = torch.log_softmax(logits.float(), -1)
    return float((ref_logp.exp() * (ref_logp - logq)).sum(-1).double().mean())


@torch.inference_mode()
def layer_sensitivity(
    model: nn.Module, settings: dict[str, tuple], batches: list[torch.Tensor], progress: bool = True,
    perms: dict[str, torch.Tensor] | None = None, block_size: int = 32,
) -> dict[str, float]:
    """Per layer: mean KL(bf16 logits || logits with only this layer quantized), nats per token."""
    device = next(model.parameters()).device
    q = Quantizer(model, settings, perms, block_size)
    runs = [Resumable(model, b.to(device)) for b in batches]
    refs = [torch.log_softmax(r.full, -1) for r in runs]
    out: dict[str, float] = {}
    try:
        with progress_bar("layer sensitivity", enabled=progress, unit="layers") as bar:
            task = bar.add_task("layers", total=len(settings))
            for name in settings:
                q.enable([name])
                i = layer_index(name)
                out[name] = sum(_kl(ref, r.run_from(i)) for ref, r in zip(refs, runs)) / len(runs)
                q.disable()
                q._wq.pop(name, None)
                bar.advance(task)
    finally:
        q.disable()
    return out


@torch.inference_mode()
def quantized_ppl(model: nn.Module, q: Quantizer, names: list[str], batches: list[torch.Tensor]) -> float:
    """Perplexity on ``batches`` with ``names`` quantized by ``q``'s fake-quant hooks."""
    device = next(model.parameters()).device
    q.enable(names)
    try:
        nll, n = 0.0, 0
        for b in batches:
            b = b.to(device)
            logits = model(input_ids=b, use_cache=False).logits.float()
            nll += float(nn.functional.cross_entropy(logits[0, :-1], b[0, 1:], reduction="sum"))
            n += b.shape[1] - 1
    finally:
        q.disable()
    return math.exp(nll / n)
