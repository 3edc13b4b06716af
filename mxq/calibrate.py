"""The calibrator: statistics from real text, channel reordering, scale rules, kept layers -> a plan.

1. **Statistics.** Forward hooks on every ``nn.Linear`` see its input X[rows, K] while calibration
   text streams through the bf16 model in batches. Per input channel they keep the absolute
   maximum, Σ|x| and Σx² (float64), a histogram of log2 of the 1x32 block amax, and a small
   fixed-size sample of rows (memory is bounded by the sample, not by the text).
2. **Reordering** (see :mod:`mxq.reorder` for which permutations can be folded): candidate
   orders sort channels by activation absmax, by activation RMS, or by activation absmax times
   weight column absmax, so that the 1x32 activation blocks and the 32x1 weight blocks hold
   channels of similar magnitude. A candidate is kept only if it raises the layer's output SQNR
   (on the sampled rows, weights and activations quantized) by at least ``min_gain_db``; the
   residual permutation must raise the mean SQNR of every layer reading the residual stream.
3. **Scale rule** per layer: the recipe's rule or the per-block MSE search, whichever gives the
   higher output SQNR on the sampled rows. Activations stay dynamic with the recipe's rule.
4. **Sensitivity**: the KL divergence of the final logits from the bf16 logits when only that
   Linear is quantized (direct cast), on the first calibration samples. Under a budget
   (``keep_bf16`` layers, or a perplexity increase ``max_dppl`` in percent on that same
   calibration text) the most sensitive layers stay in bf16.

The result is a :class:`Plan`, saved as JSON and validated on load with errors naming the key.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import mxq
from mxq.formats import ScaleRule, fake_quantize_mx, sqnr_db
from mxq.linear import linear_layers
from mxq.progress import progress_bar
from mxq.recipe import Recipe, RecipeError, TensorSpec, parse_recipe
from mxq.reorder import Geometry, Permutations, ReorderError, permute_model

__all__ = [
    "LinearStats", "Calibration", "LayerPlan", "ExpertsPlan", "Plan", "PlanError",
    "calibration_batches", "collect_statistics", "calibrate", "make_plan", "layer_sensitivity",
    "apply_plan", "load_plan", "save_plan", "block_spread",
]

PLAN_FORMAT = "mxq-plan"
PLAN_VERSION = 1
HIST_LO, HIST_HI = -40, 40  # log2 block-amax histogram range; the ends collect everything beyond


class PlanError(ValueError):
    """A plan file that cannot be used; the message names the file and the key."""


# --- statistics --------------------------------------------------------------------------------

class LinearStats:
    """Running statistics of one Linear layer's input X[rows, K] (see the module doc)."""

    def __init__(self, k: int, sample_rows: int = 256, block_size: int = 32):
        self.k = k
        self.block_size = block_size
        self.rows = 0
        self.absmax = torch.zeros(k, dtype=torch.float32)
        self.abs_sum = torch.zeros(k, dtype=torch.float64)
        self.sq_sum = torch.zeros(k, dtype=torch.float64)
        self.block_hist = torch.zeros(HIST_HI - HIST_LO + 2, dtype=torch.int64)  # [zero, <lo, lo..hi-1, >=hi]
        self.sample_rows = sample_rows
        self._samples: list[torch.Tensor] = []
        self._n_sampled = 0

    def update(self, x: torch.Tensor, take: int = 0, generator: torch.Generator | None = None) -> None:
        # Reduced where x lives (a GPU reduces a batch in microseconds; moving it to the host and
        # reducing there cost ~0.6 ms per 1k rows per layer); the running sums stay on the host.
        x = x.detach().reshape(-1, self.k).float()
        a = x.abs()
        self.rows += x.shape[0]
        self.absmax = torch.maximum(self.absmax, a.amax(0).cpu())
        self.abs_sum += a.sum(0, dtype=torch.float64).cpu()
        self.sq_sum += (x.double() ** 2).sum(0).cpu()
        self.block_hist += block_amax_histogram(a, self.block_size).cpu()
        take = min(take, self.sample_rows - self._n_sampled, x.shape[0])
        if take > 0:
            idx = torch.randperm(x.shape[0], generator=generator)[:take].sort().values
            self._samples.append(x[idx.to(x.device)].cpu())
            self._n_sampled += take

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.rows, 1)

    @property
    def second_moment(self) -> torch.Tensor:
        return self.sq_sum / max(self.rows, 1)

    @property
    def samples(self) -> torch.Tensor:
        return torch.cat(self._samples) if self._samples else torch.zeros(0, self.k)

    def summary(self) -> dict:
        am = self.absmax.double()
        med = float(am.median()) or 1.0
        return {
            "rows": self.rows,
            "absmax": float(am.max()),
            "mean_abs": float(self.mean_abs.mean()),
            "rms": math.sqrt(float(self.second_moment.mean())),
            "channel_absmax_max_over_median": float(am.max()) / med,
            "block_amax_log2_hist": {"zero": int(self.block_hist[0]), "below": int(self.block_hist[1]),
                                     "lo": HIST_LO, "counts": _trim(self.block_hist[2:-1].tolist()),
                                     "at_or_above_hi": int(self.block_hist[-1])},
        }


def _trim(counts: list[int]) -> dict:
    """A histogram as {first_nonzero_bin_offset: counts...}: short JSON for long mostly-empty arrays."""
    nz = [i for i, c in enumerate(counts) if c]
    if not nz:
        return {"offset": 0, "counts": []}
    return {"offset": nz[0], "counts": counts[nz[0] : nz[-1] + 1]}


def block_amax_histogram(a: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """Counts of floor(log2(amax)) over the 1x32 blocks of |X| [rows, K] (bins as in LinearStats)."""
    pad = (-a.shape[-1]) % block_size
    if pad:
        a = nn.functional.pad(a, (0, pad))
    amax = a.reshape(a.shape[0], -1, block_size).amax(-1).flatten()
    e = torch.frexp(amax).exponent - 1  # floor(log2 amax) for amax > 0
    idx = (e.clamp(HIST_LO - 1, HIST_HI) - HIST_LO + 2).long()
    idx = torch.where(amax > 0, idx, torch.zeros_like(idx))
    return torch.bincount(idx, minlength=HIST_HI - HIST_LO + 2)


def block_spread(absmax: torch.Tensor, perm: torch.Tensor | None = None, block_size: int = 32) -> float:
    """Mean over 1x32 blocks of log2(max / min) of the per-channel absmax in the block.

    How far apart the magnitudes sharing a block are; a good reordering lowers it.
    """
    a = absmax.double() if perm is None else absmax.double()[perm]
    a = a[: a.numel() // block_size * block_size].reshape(-1, block_size).clamp_min(1e-30)
    return float(torch.log2(a.amax(-1) / a.amin(-1)).mean())


def calibration_batches(tokenizer, texts, samples: int, seq_len: int, batch_size: int = 4) -> list[torch.Tensor]:
    """The first ``samples`` non-overlapping windows of ``seq_len`` tokens of the "\\n\\n"-joined texts."""
    if samples < 1 or seq_len < 2:
        raise ValueError(f"--samples must be >= 1 and --seq-len >= 2, got {samples} and {seq_len}")
    text = texts if isinstance(texts, str) else "\n\n".join(texts)
    ids = torch.as_tensor(tokenizer(text, verbose=False)["input_ids"], dtype=torch.long).flatten()
    need = samples * seq_len
    if ids.numel() < need:
        raise ValueError(
            f"the calibration text is {ids.numel()} tokens long; --samples {samples} --seq-len {seq_len} "
            f"need {need}: pass fewer samples, shorter ones, or more text"
        )
    windows = ids[:need].reshape(samples, seq_len)
    return [windows[i : i + batch_size] for i in range(0, samples, batch_size)]


@torch.inference_mode()
def collect_statistics(
    model: nn.Module, batches: list[torch.Tensor], sample_rows: int = 256, progress: bool = True, seed: int = 0
) -> dict[str, LinearStats]:
    """Run the batches through ``model`` and return the input statistics of every Linear layer."""
    stats: dict[str, LinearStats] = {}
    gen = torch.Generator().manual_seed(seed)
    per_batch = math.ceil(sample_rows / max(len(batches), 1))
    hooks = []
    for name, lin in linear_layers(model).items():
        stats[name] = LinearStats(lin.in_features, sample_rows)

        def hook(mod, args, kwargs, name=name):
            x = args[0] if args else kwargs["input"]
            stats[name].update(x, per_batch, gen)

        hooks.append(lin.register_forward_pre_hook(hook, with_kwargs=True))
    device = next(model.parameters()).device
    n = sum(b.shape[0] for b in batches)
    try:
        with progress_bar("calibrate: statistics", enabled=progress) as bar:
            task = bar.add_task("samples", total=n)
            for b in batches:
                model(input_ids=b.to(device), use_cache=False)
                bar.advance(task, b.shape[0])
    finally:
        for h in hooks:
            h.remove()
    return stats


# --- quantized layer outputs on the sampled rows ----------------------------------------------

def _fq_weight(w: torch.Tensor, spec: TensorSpec, perm: torch.Tensor | None) -> torch.Tensor:
    w = w.detach().float()
    if perm is not None:
        w = w[:, perm]
    return fake_quantize_mx(w, -1, spec.elem, 32, spec.scale_rule)


def _q_out(x: torch.Tensor, wq: torch.Tensor, bias, act: TensorSpec | None, perm: torch.Tensor | None) -> torch.Tensor:
    """What MXLinear's reference computes (float32), with K permuted: fq(x[:, p]) @ fq(W[:, p])ᵀ + b."""
    xf = x.float()
    if perm is not None:
        xf = xf[..., perm]
    if act is not None:
        xf = fake_quantize_mx(xf, -1, act.elem, 32, act.scale_rule)
    y = xf @ wq.t()
    if bias is not None:
        y = y + bias.float()
    return y


def _output_sqnr(lin: nn.Linear, x: torch.Tensor, w: TensorSpec, a: TensorSpec | None, perm=None) -> float:
    x = x.to(lin.weight.device)  # the sampled rows are kept on the host; the model may be on a GPU
    ref = x.float() @ lin.weight.detach().float().t()
    return sqnr_db(ref, _q_out(x, _fq_weight(lin.weight, w, perm), None, a, perm))


# --- the calibration -------------------------------------------------------------------------

@dataclass
class Calibration:
    """Everything measured on the calibration text; plans are made from it without the text."""

    recipe: Recipe
    geometry: Geometry
    stats: dict[str, LinearStats]
    selected: list[str]  # Linear layers the recipe quantizes
    kept_by_recipe: dict[str, str]
    sensitivity: dict[str, float]  # KL of final logits, only this layer quantized (direct cast)
    sens_batches: list[torch.Tensor]
    provenance: dict
    batches: list[torch.Tensor] = field(default_factory=list)  # the calibration token ids (GPTQ reruns them)
    experts: list[str] = field(default_factory=list)  # experts modules the recipe quantizes (no statistics: GPTQ only)


def calibrate(
    model: nn.Module,
    tokenizer,
    texts,
    recipe: Recipe,
    *,
    samples: int = 64,
    seq_len: int = 512,
    batch_size: int = 4,
    sample_rows: int = 256,
    sensitivity_samples: int = 2,
    sensitivity_seq_len: int = 256,
    dataset: str = "",
    progress: bool = True,
) -> Calibration:
    """Statistics and per-layer sensitivity of ``model`` (bf16, eval mode) on the calibration text."""
    from mxq.experts import select_model_layers as select_layers

    t0 = time.perf_counter()
    model.eval()
    batches = calibration_batches(tokenizer, texts, samples, seq_len, batch_size)
    stats = collect_statistics(model, batches, sample_rows, progress)
    selected, kept = select_layers(model, recipe)
    from mxq.experts import experts_layers

    moe = experts_layers(model)  # routed experts: no per-layer statistics or sensitivity; GPTQ rounds them
    experts = [n for n in selected if n in moe]
    selected = [n for n in selected if n not in moe]
    n_s = min(sensitivity_samples, samples)
    sens_ids = torch.cat(batches)[:n_s, :sensitivity_seq_len]
    sens_batches = [sens_ids[i : i + 1] for i in range(n_s)]
    direct = {n: (recipe.weights, recipe.activations) for n in selected}
    sens = layer_sensitivity(model, direct, sens_batches, progress=progress)
    prov = {
        "dataset": dataset, "samples": samples, "seq_len": seq_len, "tokens": samples * seq_len,
        "sample_rows": sample_rows, "sensitivity_samples": n_s, "sensitivity_seq_len": int(sens_ids.shape[1]),
        "sensitivity_metric": "mean KL(bf16 || only this layer quantized, direct cast) of final logits, nats/token",
        "seconds": round(time.perf_counter() - t0, 1), "mxq_version": mxq.__version__, "torch_version": torch.__version__,
    }
    return Calibration(recipe, Geometry.from_config(model.config), stats, selected, kept, sens, sens_batches, prov, batches,
                       experts)


# --- sensitivity -------------------------------------------------------------------------------

class _Quantizer:
    """Forward hooks that replace chosen Linear outputs by their MX fake-quant outputs."""

    def __init__(self, model: nn.Module, settings: dict[str, tuple], perms: dict[str, torch.Tensor] | None = None):
        self.model = model
        self.lin = linear_layers(model)
        self.settings = settings  # name -> (weights spec, activations spec)
        self.perms = perms or {}
        self._wq: dict[str, torch.Tensor] = {}
        self._hooks: list = []

    def wq(self, name: str) -> torch.Tensor:
        if name not in self._wq:
            self._wq[name] = _fq_weight(self.lin[name].weight, self.settings[name][0], self.perms.get(name))
        return self._wq[name]

    def enable(self, names) -> None:
        self.disable()
        for n in names:
            lin, act, perm = self.lin[n], self.settings[n][1], self.perms.get(n)

            def hook(mod, args, out, n=n, act=act, perm=perm):
                x = args[0]
                return _q_out(x, self.wq(n), mod.bias, act, perm).to(x.dtype)

            self._hooks.append(lin.register_forward_hook(hook))

    def disable(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class _Resumable:
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


def _layer_index(name: str) -> int:
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
    perms: dict[str, torch.Tensor] | None = None,
) -> dict[str, float]:
    """Per layer: mean KL(bf16 logits || logits with only this layer quantized), nats per token."""
    device = next(model.parameters()).device
    q = _Quantizer(model, settings, perms)
    runs = [_Resumable(model, b.to(device)) for b in batches]
    refs = [torch.log_softmax(r.full, -1) for r in runs]
    out: dict[str, float] = {}
    try:
        with progress_bar("calibrate: sensitivity", enabled=progress) as bar:
            task = bar.add_task("layers", total=len(settings))
            for name in settings:
                q.enable([name])
                i = _layer_index(name)
                out[name] = sum(_kl(ref, r.run_from(i)) for ref, r in zip(refs, runs)) / len(runs)
                q.disable()
                q._wq.pop(name, None)
                bar.advance(task)
    finally:
        q.disable()
    return out


@torch.inference_mode()
def _quantized_ppl(model, settings, perms, names, batches) -> float:
    """Perplexity on ``batches`` with ``names`` quantized (fake-quant hooks, permutations as given)."""
    device = next(model.parameters()).device
    q = _Quantizer(model, settings, perms)
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


# --- the plan ----------------------------------------------------------------------------------

@dataclass
class LayerPlan:
    weights: TensorSpec
    activations: TensorSpec | None
    keep_bf16: bool = False
    reason: str = ""
    sensitivity_kl: float | None = None
    reorder: str = "none"  # which order its K axis takes: none, residual, mlp:<key>, v:<key>
    sqnr_db: dict = field(default_factory=dict)  # output SQNR on the sampled rows: direct, reorder, scale, chosen

    def to_dict(self) -> dict:
        return {
            "weights": self.weights.to_dict(),
            "activations": self.activations.to_dict() | {"dynamic": True} if self.activations else None,
            "keep_bf16": self.keep_bf16, "reason": self.reason, "sensitivity_kl": self.sensitivity_kl,
            "reorder": self.reorder, "sqnr_db": {k: _jf(v) for k, v in self.sqnr_db.items()},
        }


EXPERTS_ROUNDINGS = ("gptq", "nearest")


@dataclass
class ExpertsPlan:
    """One experts module: the recipe's specs for all its experts and, after GPTQ
    (``mxq.gptq.round_plan``), how each expert's projections were rounded ("gptq", or "nearest"
    for an expert that saw too few calibration tokens) and the tokens the router sent to each."""

    weights: TensorSpec
    activations: TensorSpec | None
    rounding: dict[str, list[str]] = field(default_factory=dict)  # projection -> per expert
    tokens: list[int] = field(default_factory=list)  # calibration tokens routed to each expert
    sqnr_db: dict = field(default_factory=dict)  # projection -> {"weights_nearest"|"weights_gptq": per expert}

    def to_dict(self) -> dict:
        return {
            "weights": self.weights.to_dict(),
            "activations": self.activations.to_dict() | {"dynamic": True} if self.activations else None,
            "rounding": self.rounding, "tokens": self.tokens,
            "sqnr_db": {p: {k: [_jf(v) for v in vs] for k, vs in d.items()} for p, d in self.sqnr_db.items()},
        }


@dataclass
class Plan:
    recipe: Recipe
    geometry: Geometry
    layers: dict[str, LayerPlan]
    permutations: Permutations
    statistics: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)
    choices: dict = field(default_factory=dict)
    # GPTQ-rounded layers (mxq.gptq.round_plan): name -> (fp8 codes, E8M0 bytes), in memory or in
    # the safetensors file written beside the plan's JSON.
    rounded: dict | None = None
    rounded_file: Path | None = None
    experts: dict[str, ExpertsPlan] = field(default_factory=dict)  # experts modules the plan quantizes
    # GPTQ-rounded experts: module -> projection -> (fp8 codes [E, N, K], E8M0 bytes [E, N, K/32])
    rounded_experts: dict | None = None

    def _read(self) -> None:
        if self.rounded is None and self.rounded_file is not None:
            self.rounded, self.rounded_experts = _read_rounded(self.rounded_file, self)

    def rounded_weight(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stored codes and scales of a GPTQ-rounded layer, or None (direct cast)."""
        self._read()
        return (self.rounded or {}).get(name)

    def rounded_expert_weight(self, module: str, projection: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stored codes [E, N, K] and scales [E, N, K/32] of one projection of a GPTQ-rounded
        experts module, or None (direct cast)."""
        self._read()
        return (self.rounded_experts or {}).get(module, {}).get(projection)

    @property
    def quantized_experts(self) -> dict[str, tuple[TensorSpec, TensorSpec | None]]:
        return {n: (ep.weights, ep.activations) for n, ep in self.experts.items()}

    def experts_summary(self) -> dict | None:
        """How many experts' projections got GPTQ and how many were cast directly (None without experts)."""
        if not self.experts:
            return None
        out = {"modules": len(self.experts), "experts": sum(len(ep.tokens) for ep in self.experts.values()),
               "gptq": {}, "nearest": {}}  # fmt: skip
        for ep in self.experts.values():
            for proj, r in ep.rounding.items():
                for k in EXPERTS_ROUNDINGS:
                    out[k][proj] = out[k].get(proj, 0) + r.count(k)
        return out

    @property
    def kept(self) -> dict[str, str]:
        return {n: lp.reason for n, lp in self.layers.items() if lp.keep_bf16}

    @property
    def quantized(self) -> dict[str, tuple[TensorSpec, TensorSpec | None]]:
        return {n: (lp.weights, lp.activations) for n, lp in self.layers.items() if not lp.keep_bf16}

    def config_section(self) -> dict:
        """The ``calibration`` key of the written quantization_config."""
        return {
            "provenance": self.calibration, "choices": self.choices,
            "permutations_folded": self.permutations.summary(),
            "kept_bf16": sorted(self.kept),
        } | ({"experts_rounding": self.experts_summary()} if self.experts else {})

    def to_dict(self) -> dict:
        rec = self.recipe.to_dict()
        return {
            "format": PLAN_FORMAT, "version": PLAN_VERSION, "recipe": rec, "model": self.geometry.to_dict(),
            "choices": self.choices, "calibration": self.calibration,
            "layers": {n: lp.to_dict() for n, lp in sorted(self.layers.items())},
            "permutations": self.permutations.to_dict(), "statistics": self.statistics,
        } | ({"experts": {n: ep.to_dict() for n, ep in sorted(self.experts.items())}} if self.experts else {}) \
          | ({"rounded_weights": {"file": None, "layers": len(self.rounded or {}), "experts": len(self.rounded_experts or {})}}
             if self.rounded or self.rounded_experts or self.rounded_file else {})  # fmt: skip


def _jf(v):
    return v if v is None or math.isfinite(v) else str(v)


def save_plan(plan: Plan, path: str | os.PathLike) -> Path:
    """Write the plan as JSON; GPTQ codes, if any, go to ``<stem>.safetensors`` beside it."""
    path = Path(path)
    plan._read()  # codes read from an earlier file are written again under the new name
    d = plan.to_dict()
    if "rounded_weights" in d:
        from safetensors.torch import save_file

        wfile = path.with_name(path.stem + ".safetensors")
        if wfile == path:
            raise PlanError(f"{path}: a plan with GPTQ codes needs a .json name (its codes go to {wfile.name})")
        tensors = {}
        for name in sorted(plan.rounded or {}):
            data, scales = plan.rounded_weight(name)
            tensors[name + ".weight"], tensors[name + ".weight_scale"] = data.contiguous(), scales.contiguous()
        for name, projs in sorted((plan.rounded_experts or {}).items()):
            for proj, (data, scales) in projs.items():  # as a fused checkpoint names them: <module>.<proj>[_scale]
                tensors[f"{name}.{proj}"], tensors[f"{name}.{proj}_scale"] = data.contiguous(), scales.contiguous()
        wtmp = wfile.with_name(wfile.name + ".tmp")
        save_file(tensors, str(wtmp), metadata={"format": "pt", "mxq_plan": path.name})
        os.replace(wtmp, wfile)
        d["rounded_weights"]["file"] = wfile.name
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(d, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def _read_rounded(path: Path, plan: Plan | None = None) -> tuple[dict, dict]:
    """The GPTQ codes beside a plan: Linear layers (``<layer>.weight`` with ``<layer>.weight_scale``)
    and experts (``<module>.<proj>`` fp8 [E, N, K] with ``<module>.<proj>_scale`` uint8 [E, N, K/32]
    for a module of ``plan.experts``)."""
    from mxq.checkpoint import CheckpointError, read_header, read_tensor
    from mxq.experts import GATED, UNGATED

    try:
        infos, _ = read_header(path)
    except (CheckpointError, OSError) as e:
        raise PlanError(f"{path}: GPTQ codes of the plan: {e}") from None
    out, experts = {}, {}
    for key, info in infos.items():
        if key.endswith("_scale"):
            if key[: -len("_scale")] not in infos:
                raise PlanError(f"{path}: {key}: a scale without its codes ({key[: -len('_scale')]})")
            continue
        module, _, proj = key.rpartition(".")
        if proj in GATED + UNGATED and plan is not None and module in plan.experts:
            if key + "_scale" not in infos:
                raise PlanError(f"{path}: {key}: expected the experts' codes with their {key}_scale")
            data, scales = read_tensor(info), read_tensor(infos[key + "_scale"])
            e, n, k = data.shape if data.dim() == 3 else (0, 0, 0)
            want = plan.experts[module].weights.elem.torch_dtype
            if data.dim() != 3 or data.dtype != want or scales.dtype != torch.uint8 or tuple(scales.shape) != (e, n, k // 32) or k % 32:
                raise PlanError(f"{path}: {key}: expected {want} codes [E, N, K] with uint8 scales [E, N, K/32], got "
                                f"{data.dtype}{list(data.shape)} / {scales.dtype}{list(scales.shape)}")  # fmt: skip
            experts.setdefault(module, {})[proj] = (data, scales)
            continue
        if not key.endswith(".weight") or key[: -len(".weight")] + ".weight_scale" not in infos:
            raise PlanError(f"{path}: {key}: expected <layer>.weight with its <layer>.weight_scale")
        name = key[: -len(".weight")]
        out[name] = (read_tensor(info), read_tensor(infos[name + ".weight_scale"]))
    return out, experts


def load_plan(path: str | os.PathLike) -> Plan:
    """Read and validate a plan file; errors are one line naming the file and the key."""
    where = str(path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PlanError(f"{where}: plan file not found") from None
    except IsADirectoryError:
        raise PlanError(f"{where}: a directory, not a plan file (the JSON `mxq calibrate` writes)") from None
    except UnicodeDecodeError:
        raise PlanError(f"{where}: not a plan (binary, not UTF-8 JSON text; `mxq calibrate` writes plans as JSON)") from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise PlanError(f"{where}: not valid JSON ({str(e)[:120] or type(e).__name__})") from None
    plan = parse_plan(data, where)
    rw = data.get("rounded_weights")
    if rw is not None:
        fname = rw.get("file") if isinstance(rw, dict) else None
        if not isinstance(fname, str) or Path(fname).name != fname or fname in (".", "..") or not fname.endswith(".safetensors"):
            raise PlanError(f"{where}: rounded_weights.file: expected a .safetensors file name beside the plan, got {fname!r}"[:300])
        wfile = Path(path).parent / fname
        if wfile.is_symlink() or (wfile.exists() and wfile.resolve().parent != Path(path).resolve().parent):
            raise PlanError(f"{where}: rounded_weights.file: {fname} must be a regular file beside the plan")
        if not wfile.is_file():
            raise PlanError(f"{where}: rounded_weights.file: {wfile} not found (the plan's GPTQ codes are written beside it)")
        plan.rounded_file = wfile
    return plan


def parse_plan(data, where: str = "<plan>") -> Plan:
    def need(d, key, typ, at):
        if not isinstance(d, dict) or key not in d:
            raise PlanError(f"{where}: missing key {at}{key!r}")
        if not isinstance(d[key], typ):
            raise PlanError(f"{where}: {at}{key}: expected {getattr(typ, '__name__', typ)}, got {type(d[key]).__name__}")
        return d[key]

    if not isinstance(data, dict):
        raise PlanError(f"{where}: a plan is a JSON object, got {type(data).__name__}")
    if data.get("format") != PLAN_FORMAT:
        raise PlanError(f"{where}: format: expected {PLAN_FORMAT!r}, got {data.get('format')!r} (not an mxq plan)")
    if need(data, "version", int, "") > PLAN_VERSION:
        raise PlanError(f"{where}: version: {data['version']} is newer than this mxq reads ({PLAN_VERSION})")
    try:
        recipe = parse_recipe(need(data, "recipe", dict, ""), f"{where}: recipe")
    except RecipeError as e:
        raise PlanError(str(e)) from None
    m = need(data, "model", dict, "")
    try:
        geom = Geometry(**{k: int(need(m, k, int, "model.")) for k in Geometry.__dataclass_fields__})
    except TypeError as e:
        raise PlanError(f"{where}: model: {e}") from None
    layers = {}
    for name, d in need(data, "layers", dict, "").items():
        at = f"layers[{name!r}]."
        try:
            w = TensorSpec.from_dict(need(d, "weights", dict, at))
            a = d.get("activations")
            a = TensorSpec.from_dict(a) if a is not None else None
        except (KeyError, ValueError, TypeError) as e:
            raise PlanError(f"{where}: {at}weights/activations: {str(e).strip(chr(39))}") from None
        keep = need(d, "keep_bf16", bool, at)
        layers[name] = LayerPlan(w, a, keep, str(d.get("reason", "")), d.get("sensitivity_kl"),
                                 str(d.get("reorder", "none")), dict(d.get("sqnr_db", {})))
    p = need(data, "permutations", dict, "")
    try:
        perms = Permutations(
            mlp={int(k): v for k, v in need(p, "mlp", dict, "permutations.").items()},
            v={int(k): v for k, v in need(p, "v", dict, "permutations.").items()},
            residual=p.get("residual"),
        )
        perms.validate(geom, f"{where}: permutations")
    except ReorderError as e:
        raise PlanError(str(e)) from None
    except ValueError as e:
        raise PlanError(f"{where}: permutations: layer keys must be integers ({e})") from None
    experts = {name: _parse_experts(d, f"experts[{name!r}].", where) for name, d in data.get("experts", {}).items()}
    return Plan(recipe, geom, layers, perms, data.get("statistics", {}), data.get("calibration", {}), data.get("choices", {}),
                experts=experts)


def _parse_experts(d, at: str, where: str) -> ExpertsPlan:
    if not isinstance(d, dict) or not isinstance(d.get("weights"), dict):
        raise PlanError(f"{where}: {at}weights: expected an object")
    try:
        w = TensorSpec.from_dict(d["weights"])
        a = TensorSpec.from_dict(d["activations"]) if d.get("activations") is not None else None
    except (KeyError, ValueError, TypeError) as e:
        raise PlanError(f"{where}: {at}weights/activations: {str(e).strip(chr(39))}") from None
    rounding, tokens = d.get("rounding", {}), d.get("tokens", [])
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise PlanError(f"{where}: {at}tokens: expected a list of token counts, one per expert")
    if not isinstance(rounding, dict) or not all(
        isinstance(r, list) and len(r) == len(tokens) and all(v in EXPERTS_ROUNDINGS for v in r) for r in rounding.values()
    ):
        raise PlanError(f"{where}: {at}rounding: expected per projection one of {EXPERTS_ROUNDINGS} per expert ({len(tokens)})")
    return ExpertsPlan(w, a, rounding, tokens, dict(d.get("sqnr_db", {})))


# --- choosing ------------------------------------------------------------------------------------

def _candidates(st: LinearStats, w: torch.Tensor) -> dict[str, torch.Tensor]:
    wcol = w.detach().float().abs().amax(0).double().cpu()  # beside the host-side statistics
    keys = {"absmax": st.absmax.double(), "rms": st.second_moment.sqrt(), "absmax_x_weight": st.absmax.double() * wcol}
    return {k: torch.argsort(v, descending=True, stable=True) for k, v in keys.items()}


def _v_candidates(st: LinearStats, geom: Geometry, w: torch.Tensor) -> dict[str, list[list[int]]]:
    """Per KV head orders of head_dim, from the o_proj input columns of all its query heads."""
    d, rep = geom.head_dim, geom.n_rep
    wcol = w.detach().float().abs().amax(0).double().cpu()  # beside the host-side statistics
    per_col = {"absmax": st.absmax.double(), "rms": st.second_moment.sqrt(), "absmax_x_weight": st.absmax.double() * wcol}
    out = {}
    for key, v in per_col.items():
        heads = v.reshape(geom.num_attention_heads, d)
        out[key] = [
            torch.argsort(heads[h * rep : (h + 1) * rep].amax(0), descending=True, stable=True).tolist()
            for h in range(geom.num_key_value_heads)
        ]
    return out


def make_plan(
    model: nn.Module,
    cal: Calibration,
    *,
    reorder: bool = True,
    residual: bool = True,
    scale_search: bool = True,
    keep_bf16: int = 0,
    max_dppl: float | None = None,
    keep_bytes: float | None = None,
    min_gain_db: float = 0.05,
    progress: bool = True,
) -> Plan:
    """Choose permutations, scale rules and kept layers from a :class:`Calibration` (see module doc).

    Kept layers: the ``keep_bf16`` most sensitive; or, with ``max_dppl``, the fewest for that
    perplexity budget; or, with ``keep_bytes`` (percent), the most sensitive in rank order while the
    checkpoint grows by at most that much over direct cast.
    """
    rec, geom = cal.recipe, cal.geometry
    lins = linear_layers(model)
    act = rec.activations
    sel = list(cal.selected)
    x = {n: cal.stats[n].samples for n in sel}
    direct = {n: _output_sqnr(lins[n], x[n], rec.weights, act) for n in sel}
    perm_of: dict[str, torch.Tensor] = {}  # name -> permutation of its K axis
    how: dict[str, str] = {n: "none" for n in sel}
    perms = Permutations()
    notes: dict = {}
    candidate_sqnr: dict[str, dict] = {}  # every order tried, kept or not: what reordering could buy

    from mxq.experts import experts_layers, structure

    if reorder and residual and experts_layers(model):
        notes["residual_skipped"] = "routers and experts read the residual stream; mxq.reorder folds no permutation into them"
    elif reorder and residual:
        readers = [n for n in sel if n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")]
        if readers:
            score = torch.zeros(geom.hidden_size, dtype=torch.float64)
            for n in readers:
                a = cal.stats[n].absmax.double().clamp_min(1e-30)
                score += torch.log2(a / a.median())
            r = torch.argsort(score, descending=True, stable=True)
            after = {n: _output_sqnr(lins[n], x[n], rec.weights, act, r) for n in readers}
            gain = sum(after[n] - direct[n] for n in readers) / len(readers)
            notes["residual_mean_gain_db"] = gain
            candidate_sqnr.update({n: {"residual": after[n]} for n in readers})
            if gain >= min_gain_db:
                perms.residual = r.tolist()
                for n in readers:
                    perm_of[n], how[n] = r, "residual"

    if reorder:
        for n in sel:
            leaf, i = n.rsplit(".", 1)[-1], _layer_index(n)
            # only where mxq.reorder folds the permutation into the producer: a dense MLP's gate/up
            # (not a shared expert's) and v_proj (not an MLA attention's kv projection)
            if leaf not in ("down_proj", "o_proj") or n != f"model.layers.{i}.{'mlp' if leaf == 'down_proj' else 'self_attn'}.{leaf}":
                continue
            if leaf == "o_proj" and f"model.layers.{i}.self_attn.v_proj" not in lins:
                continue
            st, w = cal.stats[n], lins[n].weight
            if leaf == "down_proj":
                cands = _candidates(st, w)
            else:
                vc = _v_candidates(st, geom, w)
                cands = {k: Permutations(v={i: p}).o_cols(i, geom) for k, p in vc.items()}
            scores = {k: _output_sqnr(lins[n], x[n], rec.weights, act, p) for k, p in cands.items()}
            candidate_sqnr[n] = scores
            best = max(scores, key=scores.get)
            if scores[best] - direct[n] >= min_gain_db:
                perm_of[n] = cands[best]
                if leaf == "down_proj":
                    perms.mlp[i] = cands[best].tolist()
                    how[n] = f"mlp:{best}"
                else:
                    perms.v[i] = vc[best]
                    how[n] = f"v:{best}"

    layers: dict[str, LayerPlan] = {}
    for n in sel:
        p = perm_of.get(n)
        reordered = _output_sqnr(lins[n], x[n], rec.weights, act, p) if p is not None else direct[n]
        w_spec, chosen = rec.weights, reordered
        sq = {"direct": direct[n], "reorder": reordered}
        if n in candidate_sqnr:
            sq["reorder_best_candidate"] = max(candidate_sqnr[n].values())
        if scale_search and rec.weights.scale_rule is not ScaleRule.MSE:
            alt = TensorSpec(rec.weights.elem, ScaleRule.MSE)
            s_alt = _output_sqnr(lins[n], x[n], alt, act, p)
            sq["scale_search"] = s_alt
            if s_alt > chosen:
                w_spec, chosen = alt, s_alt
        sq["chosen"] = chosen
        layers[n] = LayerPlan(w_spec, act, sensitivity_kl=cal.sensitivity.get(n), reorder=how[n], sqnr_db=sq)

    ranking = sorted(sel, key=lambda n: -cal.sensitivity.get(n, 0.0))
    n_keep = min(max(keep_bf16, 0), len(ranking))
    if max_dppl is not None:
        settings = {n: (lp.weights, lp.activations) for n, lp in layers.items()}
        n_keep, curve = _keep_for_budget(model, settings, perm_of, ranking, cal.sens_batches, max_dppl, n_keep)
        notes["max_dppl_search"] = curve
    elif keep_bytes is not None and n_keep == 0:
        n_keep, extra, total = _keep_for_bytes(model, ranking, keep_bytes)
        notes["keep_bytes_search"] = {"direct_cast_bytes": total, "extra_bytes": extra}
    for rank, n in enumerate(ranking[:n_keep]):
        layers[n].keep_bf16 = True
        layers[n].reason = f"sensitivity rank {rank + 1} (KL {cal.sensitivity[n]:.3g})"
    plain = {lay.name for lay in structure(model) if lay.role == "linear"}
    for n, why in cal.kept_by_recipe.items():
        if n in plain:  # routers and shared-expert gates are kept by every recipe; the plan lists Linear layers
            layers.setdefault(n, LayerPlan(rec.weights, act, True, why))

    stats = {n: s.summary() for n, s in cal.stats.items()}
    for n in sel:
        p = perm_of.get(n)
        stats[n]["block_spread_log2"] = {"before": block_spread(cal.stats[n].absmax), "after": block_spread(cal.stats[n].absmax, p)}
    choices = {
        "reorder": reorder, "residual_permutation": residual, "scale_search": scale_search, "keep_bf16": keep_bf16,
        "max_dppl_percent": max_dppl, "keep_bytes_percent": keep_bytes, "min_gain_db": min_gain_db,
        "kept_by_sensitivity": n_keep,
        "sqnr_basis": "output SQNR on the sampled calibration rows, weights and activations quantized",
        **notes,
    }
    experts = {n: ExpertsPlan(rec.weights, rec.activations) for n in cal.experts}
    return Plan(rec, geom, layers, perms, stats, dict(cal.provenance), choices, experts=experts)


def _keep_for_bytes(model: nn.Module, ranking: list[str], percent: float) -> tuple[int, int, int]:
    """Most sensitive layers, in rank order, whose bf16 weights add at most ``percent`` to the
    direct-cast checkpoint's bytes (every ranked layer fp8 + E8M0 scales, the rest as stored; a
    tied tensor once): (how many, the bytes they add, the direct-cast bytes)."""
    mods = dict(model.named_modules())
    ranked = {id(mods[n].weight): n for n in ranking}
    total = 0
    for p in model.parameters():  # tied parameters come once
        total += p.numel() + p.numel() // 32 if id(p) in ranked else p.numel() * p.element_size()
    budget = percent / 100 * total
    n, extra = 0, 0
    for name in ranking:
        w = mods[name].weight
        add = w.numel() * w.element_size() - (w.numel() + w.numel() // 32)
        if extra + add > budget:
            break
        n, extra = n + 1, extra + add
    return n, extra, total


def _keep_for_budget(model, settings, perms, ranking, batches, max_dppl, at_least):
    """Smallest number of most-sensitive layers to keep so that the calibration-text perplexity
    rises by at most ``max_dppl`` percent over bf16 (exponential then binary search)."""
    base = _quantized_ppl(model, settings, perms, [], batches)
    curve: dict[int, float] = {}

    def ok(k: int) -> bool:
        if k not in curve:
            curve[k] = _quantized_ppl(model, settings, perms, ranking[k:], batches)
        return (curve[k] / base - 1) * 100 <= max_dppl

    lo, hi = at_least, at_least
    step = 1
    while hi < len(ranking) and not ok(hi):
        lo, hi = hi + 1, min(hi + step, len(ranking))
        step *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    out = {"bf16_ppl": base, "ppl_by_kept": {str(k): v for k, v in sorted(curve.items())}}
    return hi, out


# --- applying a plan in memory -----------------------------------------------------------------

def apply_plan(model: nn.Module, plan: Plan) -> nn.Module:
    """Fold the plan's permutations into a bf16 model and swap its layers for MXLinear and its
    experts modules for MXExperts (in place; direct cast, so a model rounded by
    ``mxq.gptq.round_plan`` gets the plan's GPTQ codes)."""
    from mxq.config import experts_entry, native_config
    from mxq.experts import experts_layers, quantize_experts
    from mxq.hf import MXQConfig
    from mxq.linear import MXLinear

    geom = Geometry.from_config(model.config)
    if geom != plan.geometry:
        raise PlanError(f"plan: model: made for {plan.geometry.to_dict()}, this model is {geom.to_dict()}")
    lins = linear_layers(model)
    for n in plan.layers:
        if n not in lins:
            raise PlanError(f"plan: layers[{n!r}]: the model has no Linear layer of this name")
    moe = experts_layers(model)
    for n in plan.experts:
        if n not in moe:
            raise PlanError(f"plan: experts[{n!r}]: the model has no experts module of this name")
    permute_model(model, plan.permutations)
    for n, (w, a) in plan.quantized.items():
        parent_name, _, child = n.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, MXLinear.from_linear(getattr(parent, child), w, a))
    for n, (w, a) in plan.quantized_experts.items():
        quantize_experts(model, [n], w, a, plan.recipe.block_size)
    experts = {n: experts_entry(moe[n], w, a) for n, (w, a) in plan.quantized_experts.items()}
    cfg = native_config(plan.recipe, plan.quantized, sorted(set(lins) - set(plan.quantized)), calibration=plan.config_section(),
                        experts=experts or None)  # fmt: skip
    model.config.quantization_config = MXQConfig.from_dict(cfg)
    return model
