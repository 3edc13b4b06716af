"""Signed-gradient rounding: each decoder layer's MX codes tuned against the layer's output.

GPTQ (``mxq.calib.gptq``) chooses codes one weight matrix at a time against that matrix's own output
error. Here the codes of a whole decoder layer are chosen together against what the layer is for:
its output, on calibration tokens, next to the unquantized model's. The method is the one
AutoRound (Cheng et al., 2023, arXiv 2309.05516) uses: every weight gets a rounding offset v in
[-1/2, 1/2] of its own element step, the layer runs on the rounded weights (and, for W8A8, on
MX-rounded inputs) with straight-through gradients, and v moves by a fixed step against the sign
of its gradient, the step decaying linearly to zero over ``iters`` steps.

What MX changes: the element step of an E4M3/E5M2 value depends on its binade, so v is measured in
the step of the value it perturbs (``2^(floor(log2|y|) - mbits)``, at least the subnormal step),
and the shared scale of every 1x32 block stays the one the recipe's rule gives the starting
weights. Every tuned value is therefore an element code times the block's power of two, and direct
cast with the same recipe reproduces the tuned codes bit for bit, as for GPTQ: the checkpoint is
the standard one, only the codes differ. With ``scales`` a block may instead take the exponent below
(a tuned factor on its amax, ``TunedLinear``); its values are then clipped to that range, and the
recipe's rule gives that exponent back, so direct cast still reproduces them.

The layers run in order. Layer i's student inputs are the outputs of layers < i as already tuned
(with MX-rounded activations for W8A8); its target is the unquantized layer's output on the
unquantized inputs. Routed experts keep the codes they had (GPTQ's or direct cast) and are not
tuned; the layer's other Linear layers in ``specs`` are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from mxq.calib.gptq import LayerInputs, decoder_layers
from mxq.formats import exp2_f32, fake_quantize_mx, shared_exponents
from mxq.progress import progress_bar
from mxq.recipe import TensorSpec

__all__ = ["SIGNROUND_LR", "SignRoundResult", "TunedLinear", "signround_model", "signround_plan"]

SIGNROUND_LR = 5e-3  # the sign step at the first iteration, in element steps (AutoRound's default)
SIGNROUND_ITERS = 50  # signed steps per layer (AutoRound's light recipe); `mxq quantize --iters N`


class TunedLinear(nn.Module):
    """A Linear layer whose weights are MX-rounded with a learnable offset (module doc). Forward:
    ``F.linear`` of the (MX-rounded, for W8A8) input with the rounded weights; gradients reach
    ``v`` straight through the rounding."""

    def __init__(self, lin: nn.Linear, weights: TensorSpec, acts: TensorSpec | None, block_size: int,
                 scales: bool = False):  # fmt: skip
        super().__init__()
        w = lin.weight.detach().float()
        n, k = w.shape
        if k % block_size:
            raise ValueError(f"TunedLinear: K={k} is not a multiple of the block size {block_size}")
        blocks = w.reshape(n, k // block_size, block_size)
        e, _ = shared_exponents(blocks, weights.elem, weights.scale_rule)
        self.register_buffer("scale", exp2_f32(e.long()).unsqueeze(-1), persistent=False)
        elem = weights.elem
        self.v = nn.Parameter(torch.zeros_like(blocks))
        # ``scales``: a factor a in [1/2, 1] on each block's amax, the shared exponent the recipe's
        # rule gives the shrunk amax (so a block may clip its largest values for a finer step)
        self.a = nn.Parameter(torch.ones_like(self.scale)) if scales else None
        if scales:  # log2 of amax over the top of the block's current range: in (-1, 0] for RCEIL
            self.register_buffer("blocks", blocks, persistent=False)
            amax = blocks.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
            self.register_buffer("lg", torch.log2(amax / (self.scale * elem.max_normal)), persistent=False)
        else:  # the scales stay: the scaled values and their element steps are fixed, worked out once
            self.register_buffer("y", blocks / self.scale, persistent=False)  # exact: a power of two
            self.register_buffer("step", self._steps(self.y, elem), persistent=False)
        self.bias = lin.bias
        self.elem, self.acts, self.block_size, self.shape = elem, acts, block_size, (n, k)

    @staticmethod
    def _steps(y: torch.Tensor, elem) -> torch.Tensor:
        """The element step at each scaled value: 2^(its binade - mbits), the subnormal step at least."""
        return torch.exp2(torch.floor(torch.log2(y.abs().clamp_min(2.0**-126))).clamp_min(1 - elem.bias) - elem.mbits)

    def block_scales(self) -> torch.Tensor:
        """Each block's power of two: the recipe's, or with ``a`` the exponent lowered where the
        shrunk amax fits a lower one (straight-through in ``a``, as log2 of the scale moves with log2 a)."""
        if self.a is None:
            return self.scale
        lg = self.lg + torch.log2(self.a)
        shift = torch.ceil(lg.detach()) - torch.ceil(self.lg)  # 0 or -1 with a in [1/2, 1]
        return self.scale * torch.exp2(shift + (lg - lg.detach()))

    def rounded(self) -> torch.Tensor:
        """The weights as MX values (float32 [N, K]), straight-through in ``v`` (and ``a``). v is
        measured in the element step of the value it moves (module doc)."""
        scale = self.block_scales()
        if self.a is None:
            z = self.y + self.v * self.step
        else:
            y = self.blocks / scale  # exact where the scale is a power of two
            z = y + self.v * self._steps(y.detach(), self.elem)
        q = z.clamp(-self.elem.max_normal, self.elem.max_normal).to(self.elem.torch_dtype).float()
        z = z + (q - z).detach()
        return (z * scale).reshape(self.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.acts is not None:
            xq = fake_quantize_mx(x.detach(), -1, self.acts.elem, self.block_size, self.acts.scale_rule)
            x = x + (xq - x.detach())
        w = self.rounded()
        return nn.functional.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


@dataclass
class SignRoundResult:
    """What ``signround_model`` did: per layer, the output error (mean squared) against the unquantized
    layer before and after tuning, on the calibration batches."""

    iters: int
    lr: float
    tokens: int
    layers: dict[str, tuple[float, float]] = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self) -> dict:
        before = sum(b for b, _ in self.layers.values())
        after = sum(a for _, a in self.layers.values())
        return {"iters": self.iters, "lr": self.lr, "tokens": self.tokens, "layers": len(self.layers),
                "output_mse_sum_before": before, "output_mse_sum_after": after, "seconds": round(self.seconds, 1)}  # fmt: skip


def _outputs(layer: nn.Module, hidden: list[torch.Tensor], extra: list[tuple]) -> list[torch.Tensor]:
    outs = []
    for h, (a, k) in zip(hidden, extra):
        out = layer(h, *a, **k)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return outs


def _mse(layer: nn.Module, hidden, extra, targets) -> float:
    with torch.no_grad():
        got = _outputs(layer, hidden, extra)
    return sum(((g.float() - t.float()) ** 2).mean().item() for g, t in zip(got, targets)) / max(1, len(targets))


def signround_model(model: nn.Module, batches: list[torch.Tensor], specs: dict[str, tuple[TensorSpec, TensorSpec | None]],
               *, iters: int = SIGNROUND_ITERS, lr: float = SIGNROUND_LR, block_size: int = 32, scales: bool = False,
               progress: bool = True) -> SignRoundResult:  # fmt: skip
    """Tune the codes of the Linear layers named in ``specs`` (name -> (weights, activations); other
    entries, such as experts modules, are left alone), in place: afterwards ``model`` holds the
    tuned MX values in its own dtype, and direct cast with the same specs reproduces them. The
    decoder layers run in order on ``batches`` (token ids [B, T]) on the model's device, one
    calibration batch per step, round robin (module doc). ``scales``: each block's shared exponent
    tuned too (``TunedLinear``)."""
    if iters < 0 or lr <= 0:
        raise ValueError(f"signround_model: iters must be >= 0 and lr > 0, got {iters} and {lr}")
    t0 = time.perf_counter()
    layers = decoder_layers(model)
    device = next(layers[0].parameters()).device
    names = {id(m): n for n, m in model.named_modules()}
    result = SignRoundResult(iters, lr, sum(b.numel() for b in batches))
    with torch.no_grad():
        student = LayerInputs.capture(model, layers[0], batches, device)
    teacher = [h.clone() for h in student.hidden]
    with progress_bar("signround {task.fields[layer]}", enabled=progress) as bar:
        task = bar.add_task("signround", total=len(layers), layer="")
        for layer in layers:
            prefix = names[id(layer)]
            bar.update(task, layer=prefix)
            with torch.no_grad():
                targets = _outputs(layer, teacher, student.extra)
            result.layers[prefix] = _tune_layer(layer, prefix, specs, student, targets, iters, lr, block_size, scales)
            with torch.no_grad():
                hooks = [m.register_forward_pre_hook(_rounded_input(s[1], block_size))
                         for n, m in layer.named_modules() if isinstance(m, nn.Linear)
                         and (s := specs.get(f"{prefix}.{n}")) is not None and s[1] is not None]  # fmt: skip
                try:
                    student.advance(layer)
                finally:
                    for h in hooks:
                        h.remove()
            teacher = targets
            bar.update(task, advance=1)
    result.seconds = time.perf_counter() - t0
    return result


def _rounded_input(acts: TensorSpec, block_size: int):
    def hook(mod, args):
        return (fake_quantize_mx(args[0], -1, acts.elem, block_size, acts.scale_rule), *args[1:])

    return hook


def _tune_layer(layer: nn.Module, prefix: str, specs: dict, inputs: LayerInputs, targets: list[torch.Tensor],
                iters: int, lr: float, block_size: int, scales: bool = False) -> tuple[float, float]:  # fmt: skip
    """One decoder layer's Linear layers in ``specs`` tuned together, in float32 (a bf16 layer goes
    back to bf16 after, its tuned values exact there); returns the output error before and after."""
    dtype = next(layer.parameters()).dtype
    layer.float()
    hidden = [h.float() for h in inputs.hidden]
    swapped: list[tuple[str, nn.Linear, TunedLinear]] = []
    try:
        for n, m in list(layer.named_modules()):
            spec = specs.get(f"{prefix}.{n}")
            if isinstance(m, nn.Linear) and spec is not None:
                tuned = TunedLinear(m, spec[0], spec[1], block_size, scales)
                layer.set_submodule(n, tuned)
                swapped.append((n, m, tuned))
        before = _mse(layer, hidden, inputs.extra, targets)
        params = [t.v for _, _, t in swapped] + [t.a for _, _, t in swapped if t.a is not None]
        bounds = [(-0.5, 0.5)] * len(swapped) + [(0.5, 1.0)] * (len(params) - len(swapped))
        frozen = [p for p in layer.parameters() if p.requires_grad and all(p is not q for q in params)]
        for p in frozen:
            p.requires_grad_(False)
        try:
            with torch.enable_grad():
                for it in range(iters if params else 0):
                    j = it % len(targets)
                    out = layer(hidden[j], *inputs.extra[j][0], **inputs.extra[j][1])
                    out = out[0] if isinstance(out, tuple) else out
                    loss = ((out - targets[j].float()) ** 2).mean()
                    for p in params:
                        p.grad = None
                    loss.backward()
                    step = lr * (1.0 - it / iters)
                    with torch.no_grad():
                        for p, (lo, hi) in zip(params, bounds):
                            p.sub_(step * p.grad.sign()).clamp_(lo, hi)
        finally:
            for p in frozen:
                p.requires_grad_(True)
        after = _mse(layer, hidden, inputs.extra, targets)
    finally:
        with torch.no_grad():
            for n, lin, tuned in swapped:
                lin.weight.copy_(tuned.rounded())
                layer.set_submodule(n, lin)
        layer.to(dtype)
    return before, after


def signround_plan(model: nn.Module, plan, batches: list[torch.Tensor], *, iters: int = SIGNROUND_ITERS, lr: float = SIGNROUND_LR,
                   scales: bool = False, progress: bool = True):  # fmt: skip
    """``signround_model`` over the Linear layers a calibration plan quantizes (experts keep direct
    cast); the plan then carries their codes, as ``mxq.calib.gptq.round_plan`` does for GPTQ. ``model``:
    the model the plan was made from (its weights are overwritten with the tuned values; the plan's
    permutations are folded into it first)."""
    from mxq.calib.reorder import permute_model
    from mxq.formats import quantize_mx

    permute_model(model, plan.permutations)
    bs = plan.recipe.block_size
    res = signround_model(model, batches, dict(plan.quantized), iters=iters, lr=lr, block_size=bs, scales=scales,
                         progress=progress)
    mods = dict(model.named_modules())
    rounded = {}
    for name, (wspec, _act) in plan.quantized.items():
        q = quantize_mx(mods[name].weight.detach(), -1, wspec.elem, bs, wspec.scale_rule)
        rounded[name] = (q.data.cpu(), q.scales.cpu())
    plan.rounded = rounded
    plan.choices["rounding"] = "signround-scales" if scales else "signround"
    plan.choices["signround"] = {**res.summary(), "scales": scales, "error_basis": "each decoder layer's output on the calibration tokens"}
    return plan
