"""GPTQ rounding for MX weights: codes chosen jointly against the layer's inputs.

Round-to-nearest picks every fp8 code on its own. GPTQ (Frantar et al., 2022, arXiv 2210.17323)
quantizes a weight matrix W[N, K] one input column at a time and feeds each column's rounding
error into the columns not yet quantized, weighted by the inverse of H = XᵀX, the second moment
of the layer's calibration inputs; the output error ‖(W − Ŵ)Xᵀ‖² falls, the format does not change.

What MX changes: the 32 columns of a 1x32 block share one power-of-two scale per row. The scale
of a block is fixed when the sweep reaches the block's first column, from the weights as they are
then (already moved by the errors of earlier blocks), with the recipe's scale rule; every column
of the block is then rounded to the element grid under that scale. Each row of W is independent of
the others, so sibling projections that read the same input (q/k/v, gate/up) are one problem.

The result Ŵ holds values that are exactly MX-representable (an fp8 code times 2^e; exact in
bf16 too), and direct cast of Ŵ with the same recipe reproduces them bit for bit: a block's
amax is a code times 2^e, so RCEIL picks 2^e or a smaller power at which every element of the
block is again a code, and the MSE search finds that zero-error scale first
(``tests/test_gptq.py`` holds that). The checkpoint is therefore
the standard one; only the chosen codes differ. (Under the ``floor`` and ``even`` rules an E4M3
block whose largest code is 240 would be re-scaled one step lower and clip, so GPTQ takes
``rceil`` and ``mse``, the rules that never clip.)

``gptq_model`` runs the model's decoder layers in order on the calibration batches: each layer's
Hessians come from the outputs of the layers before it *as already rounded* (weights and, for
W8A8, activations), so later layers correct for earlier rounding. Only the layer being rounded
needs to be on the device (``offload=True`` keeps the rest on the host).

Routed experts (``mxq.experts``: one module holding every expert as 3-D parameters) are rounded in
the same pass, expert by expert and projection by projection, each an [N, K] problem of its own:
``gate_up_proj`` (or ``up_proj``) on the hidden states of the tokens the model's own router sent
to that expert, then ``down_proj`` on those tokens' gated intermediate as the expert computes it
with its already rounded ``gate_up`` (W8A8: the input MX-rounded, as inference does). An expert's
projection that saw fewer than ``EXPERT_MIN_TOKENS``·K tokens is cast directly instead: with fewer
tokens than K its Hessian is singular and GPTQ fits the codes to the directions the few tokens
happened to span. Measured on SmolLM2-135M's MLP inputs (wikitext-2, GPTQ on n tokens, output
error on 4096 others): GPTQ's held-out error was 1.0-1.3x nearest's for n <= K (worst near K/2),
0.80-0.97x at 1.25·K and 0.56-0.94x at 1.5·K. ``experts_all_tokens`` builds every expert's
Hessians from every calibration token instead (the layer's output still follows the router), so
that no expert is starved.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from mxq.formats import (
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    ElemFormat,
    ScaleRule,
    cast_elements,
    exp2_f32,
    fake_quantize_mx,
    shared_exponents,
)
from mxq.progress import progress_bar
from mxq.recipe import TensorSpec

__all__ = ["GPTQError", "GPTQResult", "LayerInputs", "decoder_layers", "gptq_mx", "gptq_model", "hessian", "EXPERT_MIN_TOKENS"]

GPTQ_RULES = (ScaleRule.RCEIL, ScaleRule.MSE)
LAZY_BLOCK = 128  # columns updated together (a multiple of the MX block)
EXPERT_MIN_TOKENS = 1.5  # tokens per unit of K an expert's projection needs for GPTQ (module doc)


class GPTQError(ValueError):
    """A layer or model GPTQ cannot round; the message names it."""


def _round_column(w: torch.Tensor, e: torch.Tensor, elem: ElemFormat) -> torch.Tensor:
    """w[N] rounded to ``elem`` under the per-row scale 2**e[N]: the element cast of ``quantize_mx``
    (saturating, nearest even) on blocks of one element."""
    return cast_elements(w.view(-1, 1, 1), e.view(-1, 1), elem).float().view(-1) * exp2_f32(e)


def hessian(x: torch.Tensor) -> torch.Tensor:
    """XᵀX (float32) of inputs x[..., K] — accumulate it over batches with ``+=``."""
    x = x.reshape(-1, x.shape[-1]).float()
    return x.t() @ x


def gptq_mx(
    w: torch.Tensor,
    h: torch.Tensor,
    spec: TensorSpec,
    *,
    block_size: int = 32,
    damp: float = 0.01,
    lazy_block: int = LAZY_BLOCK,
    act_order: bool = False,
) -> torch.Tensor:
    """GPTQ-rounded values of ``w`` [N, K] (float32, each an fp8 code times its block's 2**e).

    ``h`` [K, K]: Σ xᵀx of the layer's calibration inputs (any positive multiple). ``damp``: added
    to the diagonal as a fraction of its mean. Columns never seen active (zero diagonal) are
    rounded like the others but receive no error and pass none on. ``act_order``: visit the 1x32
    blocks by decreasing Hessian diagonal (their sum), and the columns of each block likewise;
    blocks stay whole, so the stored layout is unchanged and only the order of rounding moves.
    """
    w_in = w
    n, k = w.shape
    if spec.scale_rule not in GPTQ_RULES:
        raise GPTQError(f"GPTQ rounding takes scale_rule rceil or mse, got {spec.scale_rule.value!r}")
    if k % block_size:
        raise GPTQError(f"GPTQ needs K divisible by {block_size}, got K = {k}")
    if h.shape != (k, k):
        raise GPTQError(f"Hessian of shape {tuple(h.shape)} for a weight of shape {(n, k)}")
    lazy_block = max(block_size, lazy_block // block_size * block_size)
    w = w.detach().float()
    w = w.clone() if w.data_ptr() == w_in.data_ptr() else w  # a float32 input is not modified
    h = h.detach().float().clone()
    perm = None
    if act_order:
        diag = torch.diagonal(h).reshape(-1, block_size)
        blocks = torch.argsort(diag.sum(1), descending=True, stable=True)
        inner = torch.argsort(diag, dim=1, descending=True, stable=True)
        perm = (blocks.unsqueeze(1) * block_size + inner[blocks]).reshape(-1)
        w, h = w[:, perm], h[perm][:, perm]
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    d = torch.diagonal(h)
    d += damp * d.mean()
    hinv = _inverse_cholesky_upper(h)
    del h, d

    elem = spec.elem
    out = torch.empty_like(w)
    for i1 in range(0, k, lazy_block):
        i2 = min(i1 + lazy_block, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        e = None
        for j in range(i2 - i1):
            if j % block_size == 0:
                blk = w1[:, j : j + block_size].unsqueeze(1)  # [N, 1, 32]: the block as it is now
                e = shared_exponents(blk, elem, spec.scale_rule)[0].squeeze(1)
                e = e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
            col = w1[:, j]
            q = _round_column(col, e, elem)
            out[:, i1 + j] = q
            err = (col - q) / hinv1[j, j]
            w1[:, j:] -= err.unsqueeze(1) * hinv1[j, j:].unsqueeze(0)
            err1[:, j] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    if perm is not None:
        out[:, perm] = out.clone()
    return out


def _inverse_cholesky_upper(h: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of H⁻¹, with more damping if H is not positive definite."""
    mean = float(torch.diagonal(h).mean())
    for extra in (0.0, 1e-3, 1e-2, 1e-1, 1.0):
        hd = h
        if extra:
            hd = h.clone()
            torch.diagonal(hd).add_(extra * mean)
        l_, info = torch.linalg.cholesky_ex(hd)
        del hd
        if int(info) == 0:
            hinv = torch.cholesky_inverse(l_)
            del l_
            u, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0:
                return u
    raise GPTQError("the calibration Hessian is not positive definite even with 100 % damping")


# --- the model, decoder layer by decoder layer -----------------------------------------------------

@dataclass
class GPTQResult:
    """What ``gptq_model`` did: per layer, the output error of GPTQ and of round-to-nearest; per
    experts module, what each expert received and how each of its projections was rounded."""

    layers: dict[str, dict] = field(default_factory=dict)  # name -> {"gptq_err", "rtn_err", "seconds"}
    seconds: float = 0.0
    tokens: int = 0
    # name -> {"tokens": routed tokens per expert, "hessian_tokens": per expert, "seconds",
    #          "projections": {proj: {"rounding": ["gptq" | "nearest"] per expert, "gptq_err", "rtn_err"}}}
    experts: dict[str, dict] = field(default_factory=dict)
    expert_min_tokens: float = EXPERT_MIN_TOKENS
    experts_all_tokens: bool = False

    def summary(self) -> dict:
        g = [v["gptq_err"] for v in self.layers.values()]
        r = [v["rtn_err"] for v in self.layers.values()]
        ratio = [a / b for a, b in zip(g, r) if b > 0]
        out = {
            "layers": len(self.layers), "tokens": self.tokens, "seconds": round(self.seconds, 1),
            "mean_error_ratio_gptq_over_nearest": sum(ratio) / len(ratio) if ratio else None,
        }
        if self.experts:
            out["experts"] = self.experts_summary()
        return out

    def experts_summary(self) -> dict:
        """How the routed experts were rounded: per projection, how many experts got GPTQ and how
        many were cast directly for want of tokens."""
        gptq: dict[str, int] = {}
        nearest: dict[str, int] = {}
        ratio, tokens = [], []
        for st in self.experts.values():
            tokens += st["tokens"]
            for proj, d in st["projections"].items():
                gptq[proj] = gptq.get(proj, 0) + d["rounding"].count("gptq")
                nearest[proj] = nearest.get(proj, 0) + d["rounding"].count("nearest")
                ratio += [a / b for a, b in zip(d["gptq_err"], d["rtn_err"]) if a is not None and b]
        tokens.sort()
        return {
            "modules": len(self.experts), "experts": len(tokens), "all_tokens": self.experts_all_tokens,
            "min_tokens_per_k": self.expert_min_tokens, "gptq": gptq, "nearest": nearest,
            "routed_tokens_per_expert": {"min": tokens[0], "median": tokens[len(tokens) // 2], "max": tokens[-1]} if tokens else None,
            "mean_error_ratio_gptq_over_nearest": sum(ratio) / len(ratio) if ratio else None,
        }


class _Stop(Exception):
    pass


@dataclass(frozen=True)
class _Rounding:
    """How ``gptq_model`` rounds (its arguments of that name; ``expert_min_tokens`` and
    ``experts_all_tokens`` for the experts)."""

    damp: float
    act_order: bool
    quantized_inputs: bool
    expert_min_tokens: float
    experts_all_tokens: bool
    block_size: int


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers (``model.model.layers``), in order; refused in one line if absent."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise GPTQError(f"{type(model).__name__}: GPTQ runs decoder layers in order and found no model.layers")
    return layers


def _groups(layer: nn.Module, prefix: str, specs: dict) -> list[list[tuple[str, nn.Linear]]]:
    """The layer's rounded Linear modules, grouped by shared input (q/k/v, gate/up: one problem)."""
    from mxq.linear import SIBLINGS

    lins = {f"{prefix}.{n}": m for n, m in layer.named_modules() if isinstance(m, nn.Linear) and f"{prefix}.{n}" in specs}
    groups, done = [], set()
    for name, lin in lins.items():
        if name in done:
            continue
        parent, _, leaf = name.rpartition(".")
        group = [(name, lin)]
        for sib in SIBLINGS:
            if leaf == sib[0]:
                for other in sib[1:]:
                    o = f"{parent}.{other}"
                    if o in lins and specs[o] == specs[name]:
                        group.append((o, lins[o]))
        done.update(n for n, _ in group)
        groups.append(group)
    return groups


def _quantize_input_hook(act: TensorSpec, block_size: int):
    def hook(mod, args):
        x = args[0]
        return (fake_quantize_mx(x, -1, act.elem, block_size, act.scale_rule), *args[1:])

    return hook


def _errors(w: torch.Tensor, wq: torch.Tensor, h: torch.Tensor, spec: TensorSpec, block_size: int,
            rows: int = 2048) -> tuple[float, float]:  # fmt: skip
    """‖(W − Ŵ)Xᵀ‖² / ‖WXᵀ‖² from H = XᵀX, for GPTQ's Ŵ and for round-to-nearest, a few rows at a
    time in float32 (MX rounding is per row, so the chunks change no value; memory stays bounded)."""
    def err(wi: torch.Tensor, q: torch.Tensor) -> float:
        d = wi - q
        return float(((d @ h) * d).sum())

    g = r = den = 0.0
    for i in range(0, w.shape[0], rows):
        wi = w[i : i + rows].float()
        den += float(((wi @ h) * wi).sum())
        g += err(wi, wq[i : i + rows])
        r += err(wi, fake_quantize_mx(wi, -1, spec.elem, block_size, spec.scale_rule))
    return (g / den, r / den) if den > 0 else (0.0, 0.0)


def _round_group(group: list[tuple[str, nn.Linear]], h: torch.Tensor, spec: TensorSpec, how: _Rounding) -> dict[str, dict]:
    """GPTQ over Linear layers that read one input (their rows stacked), in place; per layer: the
    group's output errors, GPTQ and nearest, and its share of the time."""
    t0 = time.perf_counter()
    w = torch.cat([lin.weight.detach() for _, lin in group])  # in the model's dtype
    wq = gptq_mx(w, h, spec, block_size=how.block_size, damp=how.damp, act_order=how.act_order)
    g_err, r_err = _errors(w, wq, h, spec, how.block_size)
    del w
    row = 0
    for _, lin in group:
        lin.weight.data.copy_(wq[row : row + lin.out_features].to(lin.weight.dtype))
        row += lin.out_features
    secs = round((time.perf_counter() - t0) / len(group), 3)
    return {name: {"gptq_err": g_err, "rtn_err": r_err, "seconds": secs} for name, _ in group}


# --- routed experts ----------------------------------------------------------------------------

class _ExpertsInputs:
    """What one experts module received on the calibration tokens, kept per call as the rows it saw
    and which experts each row went to, so that one expert's rows can be gathered at a time.

    ``(x, ids, scale)`` per call: ``ids`` [rows, k] the experts of each row (None: every row goes
    to every expert); ``scale`` [rows, E] a per-expert factor on the rows (Llama 4, whose experts
    see the hidden state times the router's score). ``routed``: tokens the router sent to each expert."""

    def __init__(self, num_experts: int, all_tokens: bool):
        self.num_experts, self.all_tokens = num_experts, all_tokens
        self.calls: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        self.routed = torch.zeros(num_experts, dtype=torch.int64)
        self.router: tuple[torch.Tensor, torch.Tensor] | None = None  # the last router call: (input, logits)

    def record(self, x: torch.Tensor, ids: torch.Tensor) -> None:
        """``experts(hidden, top_k_index, top_k_weights)``; ids >= E are no expert (sentinels)."""
        x = x.reshape(-1, x.shape[-1])
        ids = ids.reshape(x.shape[0], -1)
        self.routed += torch.bincount(ids[ids < self.num_experts].flatten().cpu(), minlength=self.num_experts)[: self.num_experts]
        self.calls.append((x.clone(), None if self.all_tokens else ids.clone(), None))

    def record_expanded(self, routed: torch.Tensor) -> None:
        """Llama 4's ``experts(routed)``: every token once per expert, expert-major, times its
        score, which is zero where the router did not pick the expert (those rows add nothing)."""
        v = routed.reshape(self.num_experts, -1, routed.shape[-1])
        picked = v.ne(0).any(-1)  # [E, T]
        self.routed += picked.sum(1).cpu()
        if not self.all_tokens:
            self.calls.append((v[picked], picked.nonzero()[:, :1], None))
            return
        if self.router is None:
            raise GPTQError("experts_all_tokens: the experts are called with routed rows and no router was seen before them")
        h, logits = self.router
        if logits.shape != (v.shape[1], self.num_experts) or h.shape[0] != v.shape[1]:
            raise GPTQError(f"experts_all_tokens: router logits {tuple(logits.shape)} do not match {v.shape[1]} tokens "
                            f"and {self.num_experts} experts")  # fmt: skip
        # what each expert would see had the router picked it: the token times its sigmoid score
        self.calls.append((h.reshape(-1, h.shape[-1]).clone(), None, torch.sigmoid(logits.float()).to(h.dtype)))
        self.router = None

    @property
    def shared(self) -> bool:
        """Every expert gets the same rows (all tokens, no per-expert factor)."""
        return all(ids is None and scale is None for _, ids, scale in self.calls)

    def count(self, e: int) -> int:
        return sum(x.shape[0] if ids is None else int((ids == e).any(1).sum()) for x, ids, _ in self.calls)

    def rows(self, e: int) -> torch.Tensor:
        """Expert ``e``'s rows over all calls, in call and token order."""
        parts = []
        for x, ids, scale in self.calls:
            if scale is not None:
                parts.append(x * scale[:, e, None])
            elif ids is None:
                parts.append(x)
            else:
                parts.append(x[(ids == e).any(1)])
        return torch.cat(parts)


def _capture_experts(mod: nn.Module, inputs: _ExpertsInputs, router: nn.Module | None) -> list:
    """Hooks that fill ``inputs`` from the experts module's calls (both calling conventions)."""
    def on_call(m, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        ids = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
        if ids is None:
            inputs.record_expanded(x)
        else:
            inputs.record(x, ids)

    hooks = [mod.register_forward_pre_hook(on_call, with_kwargs=True)]
    if router is not None and inputs.all_tokens:
        def on_router(m, args, out):
            logits = out[1] if isinstance(out, tuple) and len(out) == 2 else None  # Llama 4: (scores, logits)
            inputs.router = (args[0], logits) if logits is not None else None

        hooks.append(router.register_forward_hook(on_router))
    return hooks


def _router_of(model: nn.Module, name: str) -> nn.Module | None:
    from mxq.experts import ROUTER_NAMES

    parent = model.get_submodule(name.rpartition(".")[0])
    return next((getattr(parent, r) for r in ROUTER_NAMES if isinstance(getattr(parent, r, None), nn.Module)), None)


def _gate_of(mod: nn.Module, projections: tuple[str, ...]):
    """The function between the expert's two projections: the family's own gate (gpt-oss's clamped
    GLU on interleaved columns, ...) or act(gate)·up, or the activation alone without a gate."""
    from mxq.experts import GATED, silu_gate

    if projections != GATED:
        return mod.act_fn
    gate = getattr(type(mod), "_apply_gate", None) or silu_gate
    return lambda h: gate(mod, h)


def _round_expert_projection(w: torch.Tensor, rows_of, n_of, spec: TensorSpec, act: TensorSpec | None, how: _Rounding,
                             shared: bool = False) -> dict:  # fmt: skip
    """One projection of every expert, ``w`` [E, N, K] (a view of the module's parameter, written in
    place): GPTQ on each expert's rows (``rows_of(e)``) where it has at least
    ``how.expert_min_tokens``·K of them (``n_of(e)``), else direct cast. One K×K Hessian at a time
    (``shared``: the same rows for every expert, so one Hessian for all)."""
    k = w.shape[-1]
    out = {"rounding": [], "gptq_err": [], "rtn_err": []}
    h_shared = None
    for e in range(w.shape[0]):
        we = w[e]
        if n_of(e) == 0 or n_of(e) < how.expert_min_tokens * k:
            we.copy_(fake_quantize_mx(we.float(), -1, spec.elem, how.block_size, spec.scale_rule).to(we.dtype))
            out["rounding"].append("nearest")
            out["gptq_err"].append(None)
            out["rtn_err"].append(None)
            continue
        if h_shared is not None:
            h = h_shared
        else:
            x = rows_of(e)
            if how.quantized_inputs and act is not None:
                x = fake_quantize_mx(x, -1, act.elem, how.block_size, act.scale_rule)
            h = hessian(x)
            del x
            h_shared = h if shared else None
        wq = gptq_mx(we, h, spec, block_size=how.block_size, damp=how.damp, act_order=how.act_order)
        g_err, r_err = _errors(we, wq, h, spec, how.block_size)
        we.copy_(wq.to(we.dtype))
        del wq, h
        out["rounding"].append("gptq")
        out["gptq_err"].append(g_err)
        out["rtn_err"].append(r_err)
    return out


def _round_experts(name: str, mod: nn.Module, inputs: _ExpertsInputs, spec: tuple[TensorSpec, TensorSpec | None],
                   how: _Rounding) -> dict:  # fmt: skip
    """GPTQ for every expert of one experts module, in place: ``gate_up``/``up`` first, then
    ``down`` on the gated intermediate of each expert's rounded ``gate_up`` (module doc)."""
    from mxq.experts import canonical, experts_layer, quantize_experts_weight
    from mxq.kernels.moe import mx_grouped_linear

    t0 = time.perf_counter()
    wspec, act = spec
    info = experts_layer(name, mod)
    up, down = info.projections
    counts = [inputs.count(e) for e in range(info.num_experts)]
    n_of = counts.__getitem__
    stats = {"tokens": inputs.routed.tolist(), "hessian_tokens": counts, "projections": {}}
    w_up = canonical(mod._parameters[up].data, info.transposed)
    stats["projections"][up] = _round_expert_projection(w_up, inputs.rows, n_of, wspec, act, how, shared=inputs.shared)

    gate = _gate_of(mod, info.projections)
    bias = mod._parameters.get(up + "_bias")

    def intermediate(e: int) -> torch.Tensor:
        """Expert e's input to ``down`` as inference computes it: its rows through the MX codes of its
        rounded ``gate_up`` (W8A8: the rows MX-rounded), then the gate."""
        x = inputs.rows(e)
        codes, scales = quantize_experts_weight(w_up[e : e + 1], wspec, how.block_size)
        ends = torch.tensor([x.shape[0]], dtype=torch.int32, device=x.device)
        h = mx_grouped_linear(x, ends, codes, scales, bias[e : e + 1] if bias is not None else None,
                              act_elem=act.elem if act is not None else None,
                              act_rule=act.scale_rule if act is not None else ScaleRule.RCEIL, block_size=how.block_size)  # fmt: skip
        return gate(h).to(x.dtype)

    w_down = canonical(mod._parameters[down].data, info.transposed)
    stats["projections"][down] = _round_expert_projection(w_down, intermediate, n_of, wspec, act, how)
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    return stats


def _expert_codes(w: torch.Tensor, spec: TensorSpec, block_size: int, codes: torch.Tensor | None = None,
                  scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Direct cast of [E, N, K] one expert at a time (into ``codes``/``scales`` where given): casting
    the whole tensor at once holds float32 temporaries of it (several GiB for one Qwen3-30B-A3B layer)."""
    from mxq.experts import quantize_experts_weight

    if codes is None:
        codes = torch.empty(w.shape, dtype=spec.elem.torch_dtype, device=w.device)
        scales = torch.empty((*w.shape[:-1], w.shape[-1] // block_size), dtype=torch.uint8, device=w.device)
    for e in range(w.shape[0]):
        c, s = quantize_experts_weight(w[e], spec, block_size)
        codes[e].copy_(c)
        scales[e].copy_(s)
    return codes, scales


def _swap_in_mx_experts(model: nn.Module, experts: list[tuple[str, nn.Module]], specs: dict, block_size: int) -> list:
    """Replace rounded experts modules by ``MXExperts`` over their codes (direct cast of the rounded
    values reproduces them), so that the layer's output is what inference computes; returns what
    to put back."""
    from mxq.experts import SCALE_SUFFIX, MXExperts, canonical, experts_layer

    swapped = []
    for name, mod in experts:
        wspec, act = specs[name]
        info = experts_layer(name, mod)
        mx = MXExperts(mod, elem=wspec.elem, act=act, block_size=block_size, dtype=mod._parameters[info.projections[0]].dtype)
        for p in info.projections:
            w = canonical(mod._parameters[p].data, info.transposed)
            _expert_codes(w, wspec, block_size, getattr(mx, p), getattr(mx, p + SCALE_SUFFIX))
            b = mod._parameters.get(p + "_bias")
            if b is not None:
                getattr(mx, p + "_bias").copy_(b.detach())
        model.set_submodule(name, mx)
        swapped.append((name, mod))
    return swapped


def _is_experts(m: nn.Module) -> bool:
    from mxq.experts import MXExperts, is_experts

    return is_experts(m) and not isinstance(m, MXExperts)


@torch.inference_mode()
def gptq_model(
    model: nn.Module,
    batches: list[torch.Tensor],
    specs: dict[str, tuple[TensorSpec, TensorSpec | None]],
    *,
    device: torch.device | str | None = None,
    damp: float = 0.01,
    offload: bool = False,
    progress: bool = True,
    on_layer: Callable[[int], None] | None = None,
    quantized_inputs: bool = False,
    act_order: bool = False,
    experts_all_tokens: bool = False,
    expert_min_tokens: float = EXPERT_MIN_TOKENS,
    block_size: int = 32,
) -> GPTQResult:
    """Round the weights of the Linear layers and experts modules in ``specs`` (name -> (weights,
    activations)) with GPTQ, in place: afterwards ``model`` holds the rounded values in its own
    dtype, and direct cast with the same specs (``mxq.quantize_model``, the converter) reproduces
    the GPTQ codes.

    Decoder layers run in order on ``batches`` (token ids [B, T]); a rounded layer's activations
    are MX-rounded as W8A8 inference would (``specs``' activations) when it produces the next
    layer's inputs. ``offload``: keep the decoder layers on the host and move one at a time to
    ``device`` (the device then holds one layer, its Hessians and working copy, the calibration
    activations, and the model's other modules: embedding, norm, head). An ``lm_head``
    in ``specs`` is rounded last, on the final normed hidden states. With ``offload`` the decoder
    layers are left on the host. ``quantized_inputs``: build each Hessian from the MX-rounded
    inputs the W8A8 layer will see (its activations spec) instead of the exact ones. ``act_order``:
    as in ``gptq_mx``. ``block_size``: the MX block (the recipe's).

    Experts modules (module doc): every expert's projection with at least ``expert_min_tokens``·K
    calibration tokens gets GPTQ, the others direct cast (``GPTQResult.experts`` says which);
    ``experts_all_tokens``: every expert's Hessians from every token. A rounded layer's output
    then comes from ``MXExperts`` over the rounded codes, as inference computes it. Memory, beyond
    the dense layers': the inputs each experts module received (the calibration tokens' hidden
    states in the model's dtype, as large as the layer activations held anyway, and their expert
    ids), one expert's rows and intermediate at a time, one K×K float32 Hessian at a time with
    ``gptq_mx``'s factors of it (about 4·K²·4 bytes: 64 MiB at K = 2048), and during the output
    pass the module's codes in MX (about half its bf16 size). Per-expert Hessians are never held
    together (E·K²·4 bytes would be 2 GiB for Qwen3-30B-A3B's 128 experts at K = 2048).
    """
    t0 = time.perf_counter()
    layers = decoder_layers(model)
    device = torch.device(device) if device is not None else next(layers[0].parameters()).device
    names = {id(m): n for n, m in model.named_modules()}
    _check_specs(model, specs)
    _place(model, layers, device, offload)
    inputs = LayerInputs.capture(model, layers[0], batches, device)
    how = _Rounding(damp, act_order, quantized_inputs, expert_min_tokens, experts_all_tokens, block_size)
    result = GPTQResult(tokens=sum(b.numel() for b in batches), expert_min_tokens=expert_min_tokens,
                        experts_all_tokens=experts_all_tokens)
    with progress_bar("gptq {task.fields[layer]}", enabled=progress) as bar:
        task = bar.add_task("gptq", total=len(specs), layer="")
        run = _Pass(model, specs, how, inputs, result, lambda n, layer: bar.update(task, advance=n, layer=layer))
        for i, layer in enumerate(layers):
            if offload:
                layer.to(device)
            run.decoder_layer(layer, names[id(layer)])
            if offload:
                layer.to("cpu")
            if on_layer is not None:
                on_layer(i)
        run.head(names.get(id(model.get_output_embeddings())))
    result.seconds = time.perf_counter() - t0
    return result


def _check_specs(model: nn.Module, specs: dict) -> None:
    unknown = sorted(set(specs) - {n for n, m in model.named_modules() if isinstance(m, nn.Linear) or _is_experts(m)})
    if unknown:
        raise GPTQError(f"GPTQ: {unknown[0]!r} is not a Linear layer or experts module of {type(model).__name__}")


def _place(model: nn.Module, layers: nn.ModuleList, device: torch.device, offload: bool) -> None:
    """The whole model on ``device``; with ``offload`` all but the decoder layers, which wait on the
    host for their turn."""
    if not offload:
        model.to(device)
        return
    for child in model.children():
        if child is not model.model:
            child.to(device)
    for child in model.model.children():
        if child is not layers:
            child.to(device)
    layers.to("cpu")


class LayerInputs:
    """The current decoder layer's inputs for every batch: the hidden states, replaced by each
    layer's outputs as the rounded model computes them, and the other arguments (mask, positions),
    which every decoder layer takes alike."""

    def __init__(self, captured: list[tuple[tuple, dict]]):
        self.hidden = [a[0] if a else k["hidden_states"] for a, k in captured]
        self.extra = [(a[1:], {kk: v for kk, v in k.items() if kk != "hidden_states"}) for a, k in captured]

    @classmethod
    def capture(cls, model: nn.Module, first: nn.Module, batches: list[torch.Tensor], device: torch.device) -> LayerInputs:
        """The inputs of decoder layer ``first`` for every batch (the rest of the forward is cut off)."""
        captured: list[tuple[tuple, dict]] = []

        def grab(mod, args, kwargs):
            captured.append((args, kwargs))
            raise _Stop

        hk = first.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            for b in batches:
                try:
                    model(input_ids=b.to(device), use_cache=False)
                except _Stop:
                    pass
        finally:
            hk.remove()
        return cls(captured)

    def run(self, layer: nn.Module) -> None:
        """Every batch through ``layer``, for the hooks on it; the outputs are dropped."""
        for h, (a, k) in zip(self.hidden, self.extra):
            layer(h, *a, **k)

    def advance(self, layer: nn.Module) -> None:
        """``layer``'s outputs become the next layer's inputs."""
        for j, (h, (a, k)) in enumerate(zip(self.hidden, self.extra)):
            out = layer(h, *a, **k)
            self.hidden[j] = out[0] if isinstance(out, tuple) else out


def _accumulate_hessian(lin: nn.Linear, name: str, hs: dict[str, torch.Tensor], act: TensorSpec | None, block_size: int):
    """A hook adding XᵀX of ``lin``'s input (MX-rounded first under ``act``) to ``hs[name]``."""
    def acc(mod, args):
        x = args[0] if act is None else fake_quantize_mx(args[0], -1, act.elem, block_size, act.scale_rule)
        h = hessian(x)
        hs[name] = hs[name] + h if name in hs else h

    return lin.register_forward_pre_hook(acc)


@dataclass
class _Pass:
    """``gptq_model``'s pass over the decoder layers: what rounding one layer reads and writes."""

    model: nn.Module
    specs: dict[str, tuple[TensorSpec, TensorSpec | None]]
    how: _Rounding
    inputs: LayerInputs
    result: GPTQResult
    advance: Callable[[int, str], None]  # the progress bar: how many layers done, the last one's name

    def decoder_layer(self, layer: nn.Module, prefix: str) -> None:
        """Round the layer's Linear layers and experts modules, then compute its outputs as rounded."""
        groups = _groups(layer, prefix, self.specs)
        experts = [(f"{prefix}.{n}", m) for n, m in layer.named_modules() if f"{prefix}.{n}" in self.specs and _is_experts(m)]
        if groups or experts:
            self._round(layer, groups, experts)
        self._forward_rounded(layer, prefix, experts)

    def _round(self, layer: nn.Module, groups: list[list[tuple[str, nn.Linear]]], experts: list[tuple[str, nn.Module]]) -> None:
        """One run of the layer's inputs fills every Hessian (dense) and every expert's rows; then
        each group, then each experts module, is rounded."""
        hs: dict[str, torch.Tensor] = {}
        seen: dict[str, _ExpertsInputs] = {}
        hooks = []
        for name, mod in experts:
            seen[name] = _ExpertsInputs(int(mod._parameters["down_proj"].shape[0]), self.how.experts_all_tokens)
            hooks += _capture_experts(mod, seen[name], _router_of(self.model, name))
        for group in groups:
            name, lin = group[0]
            act = self.specs[name][1] if self.how.quantized_inputs else None
            hooks.append(_accumulate_hessian(lin, name, hs, act, self.how.block_size))
        try:
            self.inputs.run(layer)
        finally:
            for hk in hooks:
                hk.remove()
        for group in groups:
            name = group[0][0]
            self.result.layers.update(_round_group(group, hs.pop(name), self.specs[name][0], self.how))
            self.advance(len(group), group[-1][0])
        for name, mod in experts:
            self.result.experts[name] = _round_experts(name, mod, seen.pop(name), self.specs[name], self.how)
            self.advance(1, name)

    def _forward_rounded(self, layer: nn.Module, prefix: str, experts: list[tuple[str, nn.Module]]) -> None:
        """This layer's outputs, as the rounded model computes them, feed the next layer."""
        specs, bs = self.specs, self.how.block_size
        act_hooks = [
            lin.register_forward_pre_hook(_quantize_input_hook(specs[f"{prefix}.{n}"][1], bs))
            for n, lin in layer.named_modules()
            if isinstance(lin, nn.Linear) and f"{prefix}.{n}" in specs and specs[f"{prefix}.{n}"][1] is not None
        ]
        swapped = _swap_in_mx_experts(self.model, experts, specs, bs)
        try:
            self.inputs.advance(layer)
        finally:
            for hk in act_hooks:
                hk.remove()
            for name, mod in swapped:
                self.model.set_submodule(name, mod)

    def head(self, head_name: str | None) -> None:
        """An ``lm_head`` in ``specs``, rounded last on the final normed hidden states."""
        if head_name not in self.specs:
            return
        head = self.model.get_output_embeddings()
        emb = self.model.get_input_embeddings()
        if emb is not None and emb.weight is head.weight:
            raise GPTQError(f"{head_name}: tied to the input embedding; round it with the embedding or keep it in bf16")
        norm = getattr(self.model.model, "norm", None)
        h = None
        for x in self.inputs.hidden:
            x = norm(x) if norm is not None else x
            h = hessian(x) if h is None else h + hessian(x)
        self.result.layers.update(_round_group([(head_name, head)], h, self.specs[head_name][0], self.how))
        self.advance(1, head_name)


def round_plan(model: nn.Module, plan, batches: list[torch.Tensor], *, damp: float = 0.01,
               offload: bool = False, progress: bool = True, quantized_inputs: bool = False,
               act_order: bool = False, experts_all_tokens: bool = False,
               expert_min_tokens: float = EXPERT_MIN_TOKENS):  # fmt: skip
    """GPTQ over the layers and experts modules a calibration plan quantizes; the plan then carries
    their codes.

    ``model``: the bf16 model the plan was made from (its weights are overwritten with the rounded
    values; the plan's permutations are folded into it first). The codes and scales are stored in
    ``plan.rounded`` (name -> (fp8 codes, E8M0 bytes)) and, for experts, ``plan.rounded_experts``
    (module -> projection -> (fp8 codes [E, N, K], E8M0 bytes [E, N, K/32])), with each expert's
    rounding in ``plan.experts``; ``save_plan`` writes them beside the plan's JSON and the converter
    writes them instead of direct-cast codes. ``experts_all_tokens``, ``expert_min_tokens``: as in
    ``gptq_model``.
    """
    from mxq.reorder import permute_model

    permute_model(model, plan.permutations)
    specs = {**plan.quantized, **plan.quantized_experts}
    bs = plan.recipe.block_size
    res = gptq_model(model, batches, specs, damp=damp, offload=offload, progress=progress,
                     quantized_inputs=quantized_inputs, act_order=act_order, experts_all_tokens=experts_all_tokens,
                     expert_min_tokens=expert_min_tokens, block_size=bs)  # fmt: skip
    mods = dict(model.named_modules())
    plan.rounded = _layer_codes(plan, mods, res, bs)
    plan.rounded_experts = _experts_codes(plan, mods, res, bs)
    plan.choices["rounding"] = "gptq"
    plan.choices["gptq"] = {"damp": damp, "lazy_block": LAZY_BLOCK, "quantized_inputs": quantized_inputs, "act_order": act_order,
                            **res.summary(),
                            "error_basis": "weights only, on the calibration inputs of each layer (as rounded before it)"}
    return plan


def _layer_codes(plan, mods: dict[str, nn.Module], res: GPTQResult, block_size: int) -> dict:
    """The plan's rounded Linear layers as codes and scales on the host (direct cast of the rounded
    values gives GPTQ's codes); each layer's weight SQNR, GPTQ and nearest, goes to its plan entry."""
    from mxq.formats import quantize_mx

    rounded = {}
    for name, (wspec, _act) in plan.quantized.items():
        q = quantize_mx(mods[name].weight.detach(), -1, wspec.elem, block_size, wspec.scale_rule)
        rounded[name] = (q.data.cpu(), q.scales.cpu())
        st = res.layers.get(name)
        if st is not None and name in plan.layers:
            lp = plan.layers[name]
            lp.sqnr_db["weights_nearest"] = _db(st["rtn_err"])
            lp.sqnr_db["weights_gptq"] = _db(st["gptq_err"])
    return rounded


def _experts_codes(plan, mods: dict[str, nn.Module], res: GPTQResult, block_size: int) -> dict:
    """The plan's rounded experts modules: per projection the codes [E, N, K] and scales on the
    host; the tokens each expert got, how it was rounded and its SQNRs go to the plan's entry."""
    from mxq.experts import canonical, experts_layer

    rounded = {}
    for name, (wspec, _act) in plan.quantized_experts.items():
        info = experts_layer(name, mods[name])
        rounded[name] = {}
        for proj in info.projections:
            codes, scales = _expert_codes(canonical(mods[name]._parameters[proj].detach(), info.transposed), wspec, block_size)
            rounded[name][proj] = (codes.cpu(), scales.cpu())
        st = res.experts[name]
        ep = plan.experts[name]
        ep.tokens = list(st["tokens"])
        ep.rounding = {proj: list(d["rounding"]) for proj, d in st["projections"].items()}
        ep.sqnr_db = {proj: {"weights_nearest": [_db(v) if v is not None else None for v in d["rtn_err"]],
                             "weights_gptq": [_db(v) if v is not None else None for v in d["gptq_err"]]}
                      for proj, d in st["projections"].items()}  # fmt: skip
    return rounded


def _db(rel_err: float) -> float:
    import math

    return 10 * math.log10(1 / rel_err) if rel_err > 0 else math.inf
