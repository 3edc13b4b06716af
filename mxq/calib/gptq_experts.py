"""GPTQ for routed experts (``mxq.calib.gptq``'s module doc, "Routed experts"): what each experts module
received on the calibration tokens (``ExpertsInputs``, filled by ``capture_experts``), every expert's
projections rounded in place (``round_experts``: ``gate_up`` on the expert's routed rows, ``down`` on
its rounded intermediate), and the rounded modules swapped for ``MXExperts`` over their codes while
the layer's output is computed (``swap_in_mx_experts``)."""

from __future__ import annotations

import time

import torch
from torch import nn

from mxq.calib.gptq_core import GPTQError, Rounding, gptq_mx, hessian, output_errors
from mxq.formats import ScaleRule, fake_quantize_mx
from mxq.recipe import TensorSpec

__all__ = ["ExpertsInputs", "capture_experts", "expert_codes", "router_of", "round_experts", "swap_in_mx_experts", "is_experts_module"]


class ExpertsInputs:
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


def capture_experts(mod: nn.Module, inputs: ExpertsInputs, router: nn.Module | None) -> list:
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


def router_of(model: nn.Module, name: str) -> nn.Module | None:
    from mxq.runtime.experts import ROUTER_NAMES

    parent = model.get_submodule(name.rpartition(".")[0])
    return next((getattr(parent, r) for r in ROUTER_NAMES if isinstance(getattr(parent, r, None), nn.Module)), None)


def _gate_of(mod: nn.Module, projections: tuple[str, ...]):
    """The function between the expert's two projections: the family's own gate (gpt-oss's clamped
    GLU on interleaved columns, ...) or act(gate)·up, or the activation alone without a gate."""
    from mxq.runtime.experts import GATED, silu_gate

    if projections != GATED:
        return mod.act_fn
    gate = getattr(type(mod), "_apply_gate", None) or silu_gate
    return lambda h: gate(mod, h)


def _round_expert_projection(w: torch.Tensor, rows_of, n_of, spec: TensorSpec, act: TensorSpec | None, how: Rounding,
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
        g_err, r_err = output_errors(we, wq, h, spec, how.block_size)
        we.copy_(wq.to(we.dtype))
        del wq, h
        out["rounding"].append("gptq")
        out["gptq_err"].append(g_err)
        out["rtn_err"].append(r_err)
    return out


def round_experts(name: str, mod: nn.Module, inputs: ExpertsInputs, spec: tuple[TensorSpec, TensorSpec | None],
                   how: Rounding) -> dict:  # fmt: skip
    """GPTQ for every expert of one experts module, in place: ``gate_up``/``up`` first, then
    ``down`` on the gated intermediate of each expert's rounded ``gate_up`` (module doc)."""
    from mxq.kernels.moe import mx_grouped_linear
    from mxq.runtime.experts import canonical, experts_layer, quantize_experts_weight

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


def expert_codes(w: torch.Tensor, spec: TensorSpec, block_size: int, codes: torch.Tensor | None = None,
                  scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Direct cast of [E, N, K] one expert at a time (into ``codes``/``scales`` where given): casting
    the whole tensor at once holds float32 temporaries of it (several GiB for one Qwen3-30B-A3B layer)."""
    from mxq.runtime.experts import quantize_experts_weight

    if codes is None:
        codes = torch.empty(w.shape, dtype=spec.elem.torch_dtype, device=w.device)
        scales = torch.empty((*w.shape[:-1], w.shape[-1] // block_size), dtype=torch.uint8, device=w.device)
    for e in range(w.shape[0]):
        c, s = quantize_experts_weight(w[e], spec, block_size)
        codes[e].copy_(c)
        scales[e].copy_(s)
    return codes, scales


def swap_in_mx_experts(model: nn.Module, experts: list[tuple[str, nn.Module]], specs: dict, block_size: int) -> list:
    """Replace rounded experts modules by ``MXExperts`` over their codes (direct cast of the rounded
    values reproduces them), so that the layer's output is what inference computes; returns what
    to put back."""
    from mxq.runtime.experts import SCALE_SUFFIX, MXExperts, canonical, experts_layer

    swapped = []
    for name, mod in experts:
        wspec, act = specs[name]
        info = experts_layer(name, mod)
        mx = MXExperts(mod, elem=wspec.elem, act=act, block_size=block_size, dtype=mod._parameters[info.projections[0]].dtype)
        for p in info.projections:
            w = canonical(mod._parameters[p].data, info.transposed)
            expert_codes(w, wspec, block_size, getattr(mx, p), getattr(mx, p + SCALE_SUFFIX))
            b = mod._parameters.get(p + "_bias")
            if b is not None:
                getattr(mx, p + "_bias").copy_(b.detach())
        model.set_submodule(name, mx)
        swapped.append((name, mod))
    return swapped


def is_experts_module(m: nn.Module) -> bool:
    from mxq.runtime.experts import MXExperts, is_experts

    return is_experts(m) and not isinstance(m, MXExperts)
