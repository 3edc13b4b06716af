"""The calibrator: statistics from real text, channel reordering, scale rules, kept layers -> a plan.

1. **Statistics.** Forward hooks on every ``nn.Linear`` see its input X[rows, K] while calibration
   text streams through the bf16 model in batches. Per input channel they keep the absolute
   maximum, Σ|x| and Σx² (float64), a histogram of log2 of the 1x32 block amax, and a small
   fixed-size sample of rows (memory is bounded by the sample, not by the text).
2. **Reordering** (see :mod:`mxq.calib.reorder` for which permutations can be folded): candidate
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

The result is a :class:`mxq.calib.plan.Plan` (its file format and validation live in :mod:`mxq.calib.plan`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

import mxq
from mxq.calib.plan import ExpertsPlan, LayerPlan, Plan, PlanError
from mxq.calib.reorder import Geometry, Permutations, permute_model
from mxq.calib.sensitivity import (
    Quantizer,
    fake_quant_weight,
    layer_index,
    layer_sensitivity,
    quantized_output,
    quantized_ppl,
)
from mxq.formats import ScaleRule, sqnr_db
from mxq.progress import progress_bar
from mxq.recipe import Recipe, TensorSpec
from mxq.runtime.linear import linear_layers

__all__ = [
    "LinearStats", "Calibration", "CalibrationOptions", "calibration_batches", "collect_statistics", "calibrate",
    "make_plan", "layer_sensitivity", "apply_plan", "block_spread",
]

HIST_LO, HIST_HI = -40, 40  # log2 block-amax histogram range; the ends collect everything beyond


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
            idx = torch.randperm(x.shape[0], generator=generator, device="cpu")[:take].sort().values
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
    model: nn.Module, batches: list[torch.Tensor], sample_rows: int = 256, progress: bool = True, seed: int = 0,
    block_size: int = 32,
) -> dict[str, LinearStats]:
    """Run the batches through ``model`` and return the input statistics of every Linear layer."""
    stats: dict[str, LinearStats] = {}
    gen = torch.Generator().manual_seed(seed)
    per_batch = math.ceil(sample_rows / max(len(batches), 1))
    hooks = []
    for name, lin in linear_layers(model).items():
        stats[name] = LinearStats(lin.in_features, sample_rows, block_size)

        def hook(mod, args, kwargs, name=name):
            x = args[0] if args else kwargs["input"]
            stats[name].update(x, per_batch, gen)

        hooks.append(lin.register_forward_pre_hook(hook, with_kwargs=True))
    device = next(model.parameters()).device
    n = sum(b.shape[0] for b in batches)
    try:
        with progress_bar("calibration statistics", enabled=progress, unit="windows") as bar:
            task = bar.add_task("samples", total=n)
            for b in batches:
                model(input_ids=b.to(device), use_cache=False)
                bar.advance(task, b.shape[0])
    finally:
        for h in hooks:
            h.remove()
    return stats


# --- quantized layer outputs on the sampled rows ----------------------------------------------

def output_sqnr(lin: nn.Linear, x: torch.Tensor, w: TensorSpec, a: TensorSpec | None, perm=None,
                 block_size: int = 32) -> float:  # fmt: skip
    """The layer's output SQNR (dB) on rows ``x`` with its weight as ``w`` and inputs as ``a`` (None:
    as given), the input channels in order ``perm`` first."""
    x = x.to(lin.weight.device)  # the sampled rows are kept on the host; the model may be on a GPU
    ref = x.float() @ lin.weight.detach().float().t()
    return sqnr_db(ref, quantized_output(x, fake_quant_weight(lin.weight, w, perm, block_size), None, a, perm, block_size))


# --- the calibration -------------------------------------------------------------------------

@dataclass(frozen=True)
class CalibrationOptions:
    """What ``mxq calibrate`` and ``mxq quantize --calibrate`` are asked for: the text
    (``calibrate``), the plan's choices (``make_plan``), how the weights are rounded ("gptq":
    ``mxq.calib.gptq.round_plan``; "nearest": direct cast) and where the model runs."""

    dataset: str | None = None
    samples: int = 64
    seq_len: int = 512
    sensitivity_samples: int = 2
    sensitivity_seq_len: int = 256
    reorder: bool = True
    scale_search: bool = True
    keep_bf16: int = 0
    max_dppl: float | None = None
    keep_bytes: float | None = None  # percent
    rounding: str = "gptq"
    iters: int | None = None  # signround's steps per layer (None: ``mxq.calib.signround.SIGNROUND_ITERS``)
    experts_all_tokens: bool = False
    device: str = "cpu"


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
    from mxq.runtime.experts import select_model_layers as select_layers

    t0 = time.perf_counter()
    model.eval()
    batches = calibration_batches(tokenizer, texts, samples, seq_len, batch_size)
    stats = collect_statistics(model, batches, sample_rows, progress, block_size=recipe.block_size)
    selected, kept = select_layers(model, recipe)
    from mxq.runtime.experts import experts_layers

    moe = experts_layers(model)  # routed experts: no per-layer statistics or sensitivity; GPTQ rounds them
    experts = [n for n in selected if n in moe]
    selected = [n for n in selected if n not in moe]
    n_s = min(sensitivity_samples, samples)
    sens_ids = torch.cat(batches)[:n_s, :sensitivity_seq_len]
    sens_batches = [sens_ids[i : i + 1] for i in range(n_s)]
    direct = {n: (recipe.weights, recipe.activations) for n in selected}
    sens = layer_sensitivity(model, direct, sens_batches, progress=progress, block_size=recipe.block_size)
    prov = {
        "dataset": dataset, "samples": samples, "seq_len": seq_len, "tokens": samples * seq_len,
        "sample_rows": sample_rows, "sensitivity_samples": n_s, "sensitivity_seq_len": int(sens_ids.shape[1]),
        "sensitivity_metric": "mean KL(bf16 || only this layer quantized, direct cast) of final logits, nats/token",
        "seconds": round(time.perf_counter() - t0, 1), "mxq_version": mxq.__version__, "torch_version": torch.__version__,
    }
    return Calibration(recipe, Geometry.from_config(model.config), stats, selected, kept, sens, sens_batches, prov, batches,
                       experts)


# --- choosing ------------------------------------------------------------------------------------

def channel_orders(st: LinearStats, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The input-channel orders a reordering may choose, largest first: by the activations' absmax,
    their RMS, and absmax times the weight column's absmax."""
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
    rec = cal.recipe
    sampled = _SampledOutputs(linear_layers(model), {n: cal.stats[n].samples for n in cal.selected}, rec)
    direct = {n: sampled.sqnr(n) for n in cal.selected}
    orders = _Orders(how={n: "none" for n in cal.selected})
    residual_notes = {}
    if reorder and residual:
        residual_notes = _choose_residual_order(model, cal, sampled, direct, orders, min_gain_db)
    if reorder:
        _choose_producer_orders(cal, sampled, direct, orders, min_gain_db)
    layers = {n: _layer_plan(n, cal, sampled, direct[n], orders, scale_search) for n in cal.selected}
    n_keep, keep_notes = _keep_most_sensitive(model, cal, layers, orders.perm_of, keep_bf16, max_dppl, keep_bytes)
    _add_kept_by_recipe(model, cal, layers)
    choices = {
        "reorder": reorder, "residual_permutation": residual, "scale_search": scale_search, "keep_bf16": keep_bf16,
        "max_dppl_percent": max_dppl, "keep_bytes_percent": keep_bytes, "min_gain_db": min_gain_db,
        "kept_by_sensitivity": n_keep,
        "sqnr_basis": "output SQNR on the sampled calibration rows, weights and activations quantized",
        **residual_notes, **keep_notes,
    }
    experts = {n: ExpertsPlan(rec.weights, rec.activations) for n in cal.experts}
    return Plan(rec, cal.geometry, layers, orders.perms, _plan_statistics(cal, orders.perm_of), dict(cal.provenance),
                choices, experts=experts)  # fmt: skip


@dataclass
class _SampledOutputs:
    """Output SQNR of the selected Linear layers on their sampled calibration rows, quantized as the
    recipe says (weights as given), with K permuted as given."""

    lins: dict[str, nn.Linear]
    rows: dict[str, torch.Tensor]
    recipe: Recipe

    def sqnr(self, name: str, perm: torch.Tensor | None = None, weights: TensorSpec | None = None) -> float:
        w = self.recipe.weights if weights is None else weights
        return output_sqnr(self.lins[name], self.rows[name], w, self.recipe.activations, perm, self.recipe.block_size)


@dataclass
class _Orders:
    """The channel orders chosen so far: per layer its K permutation and how it was chosen, the
    permutations the plan folds, and the SQNR of every order tried, kept or not (what reordering
    could buy)."""

    how: dict[str, str]  # none, residual, mlp:<key>, v:<key>
    perm_of: dict[str, torch.Tensor] = field(default_factory=dict)
    perms: Permutations = field(default_factory=Permutations)
    candidate_sqnr: dict[str, dict] = field(default_factory=dict)


RESIDUAL_READERS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def _choose_residual_order(model: nn.Module, cal: Calibration, sampled: _SampledOutputs, direct: dict[str, float],
                           orders: _Orders, min_gain_db: float) -> dict:  # fmt: skip
    """One permutation of the residual stream for every layer reading it, kept if it raises their mean
    SQNR by ``min_gain_db``; returns the notes for the plan's choices."""
    from mxq.runtime.experts import experts_layers

    if experts_layers(model):
        return {"residual_skipped": "routers and experts read the residual stream; mxq.calib.reorder folds no permutation into them"}
    readers = [n for n in cal.selected if n.rsplit(".", 1)[-1] in RESIDUAL_READERS]
    if not readers:
        return {}
    score = torch.zeros(cal.geometry.hidden_size, dtype=torch.float64)
    for n in readers:
        a = cal.stats[n].absmax.double().clamp_min(1e-30)
        score += torch.log2(a / a.median())
    r = torch.argsort(score, descending=True, stable=True)
    after = {n: sampled.sqnr(n, r) for n in readers}
    gain = sum(after[n] - direct[n] for n in readers) / len(readers)
    orders.candidate_sqnr.update({n: {"residual": after[n]} for n in readers})
    if gain >= min_gain_db:
        orders.perms.residual = r.tolist()
        for n in readers:
            orders.perm_of[n], orders.how[n] = r, "residual"
    return {"residual_mean_gain_db": gain}


def _folds_into_producer(name: str, lins: dict[str, nn.Linear]) -> bool:
    """Whether ``mxq.calib.reorder`` folds a permutation of this layer's K axis into the layer producing its
    input: a dense MLP's down_proj (into gate/up; not a shared expert's) and o_proj (into v_proj;
    not an MLA attention's kv projection)."""
    leaf, i = name.rsplit(".", 1)[-1], layer_index(name)
    if leaf not in ("down_proj", "o_proj") or name != f"model.layers.{i}.{'mlp' if leaf == 'down_proj' else 'self_attn'}.{leaf}":
        return False
    return leaf == "down_proj" or f"model.layers.{i}.self_attn.v_proj" in lins


def _choose_producer_orders(cal: Calibration, sampled: _SampledOutputs, direct: dict[str, float], orders: _Orders,
                            min_gain_db: float) -> None:  # fmt: skip
    """Per down_proj / o_proj, the best candidate order of its K axis, kept if it raises the layer's
    SQNR by ``min_gain_db``."""
    for n in cal.selected:
        if not _folds_into_producer(n, sampled.lins):
            continue
        leaf, i = n.rsplit(".", 1)[-1], layer_index(n)
        st, w = cal.stats[n], sampled.lins[n].weight
        if leaf == "down_proj":
            cands = channel_orders(st, w)
        else:
            vc = _v_candidates(st, cal.geometry, w)
            cands = {k: Permutations(v={i: p}).o_cols(i, cal.geometry) for k, p in vc.items()}
        scores = {k: sampled.sqnr(n, p) for k, p in cands.items()}
        orders.candidate_sqnr[n] = scores
        best = max(scores, key=scores.get)
        if scores[best] - direct[n] < min_gain_db:
            continue
        orders.perm_of[n] = cands[best]
        if leaf == "down_proj":
            orders.perms.mlp[i] = cands[best].tolist()
            orders.how[n] = f"mlp:{best}"
        else:
            orders.perms.v[i] = vc[best]
            orders.how[n] = f"v:{best}"


def _layer_plan(name: str, cal: Calibration, sampled: _SampledOutputs, direct: float, orders: _Orders,
                scale_search: bool) -> LayerPlan:  # fmt: skip
    """The layer's weight scale rule (the recipe's, or MSE where that gives the higher SQNR) and the
    SQNRs behind its choices."""
    rec = cal.recipe
    p = orders.perm_of.get(name)
    reordered = sampled.sqnr(name, p) if p is not None else direct
    w_spec, chosen = rec.weights, reordered
    sq = {"direct": direct, "reorder": reordered}
    if name in orders.candidate_sqnr:
        sq["reorder_best_candidate"] = max(orders.candidate_sqnr[name].values())
    if scale_search and rec.weights.scale_rule is not ScaleRule.MSE:
        alt = TensorSpec(rec.weights.elem, ScaleRule.MSE)
        s_alt = sampled.sqnr(name, p, alt)
        sq["scale_search"] = s_alt
        if s_alt > chosen:
            w_spec, chosen = alt, s_alt
    sq["chosen"] = chosen
    return LayerPlan(w_spec, rec.activations, sensitivity_kl=cal.sensitivity.get(name), reorder=orders.how[name], sqnr_db=sq)


def _keep_most_sensitive(model: nn.Module, cal: Calibration, layers: dict[str, LayerPlan], perm_of: dict[str, torch.Tensor],
                         keep_bf16: int, max_dppl: float | None, keep_bytes: float | None) -> tuple[int, dict]:  # fmt: skip
    """Mark the most sensitive layers kept in bf16 under the budget (``make_plan``'s doc); returns
    how many and the notes of the search for the plan's choices."""
    ranking = sorted(cal.selected, key=lambda n: -cal.sensitivity.get(n, 0.0))
    n_keep = min(max(keep_bf16, 0), len(ranking))
    notes: dict = {}
    if max_dppl is not None:
        settings = {n: (lp.weights, lp.activations) for n, lp in layers.items()}

        def ppl(names: list[str]) -> float:
            return quantized_ppl(model, Quantizer(model, settings, perm_of, cal.recipe.block_size), names, cal.sens_batches)

        n_keep, notes["max_dppl_search"] = _keep_for_budget(ppl, ranking, max_dppl, n_keep)
    elif keep_bytes is not None and n_keep == 0:
        n_keep, extra, total = _keep_for_bytes(model, ranking, keep_bytes, cal.recipe.block_size)
        notes["keep_bytes_search"] = {"direct_cast_bytes": total, "extra_bytes": extra}
    for rank, n in enumerate(ranking[:n_keep]):
        layers[n].keep_bf16 = True
        layers[n].reason = f"sensitivity rank {rank + 1} (KL {cal.sensitivity[n]:.3g})"
    return n_keep, notes


def _add_kept_by_recipe(model: nn.Module, cal: Calibration, layers: dict[str, LayerPlan]) -> None:
    from mxq.runtime.experts import structure

    plain = {lay.name for lay in structure(model) if lay.role == "linear"}
    for n, why in cal.kept_by_recipe.items():
        if n in plain:  # routers and shared-expert gates are kept by every recipe; the plan lists Linear layers
            layers.setdefault(n, LayerPlan(cal.recipe.weights, cal.recipe.activations, True, why))


def _plan_statistics(cal: Calibration, perm_of: dict[str, torch.Tensor]) -> dict:
    """Every layer's statistics summary; for the selected ones also the block spread before and
    after its chosen order."""
    bs = cal.recipe.block_size
    stats = {n: s.summary() for n, s in cal.stats.items()}
    for n in cal.selected:
        a = cal.stats[n].absmax
        stats[n]["block_spread_log2"] = {"before": block_spread(a, block_size=bs), "after": block_spread(a, perm_of.get(n), bs)}
    return stats


def _keep_for_bytes(model: nn.Module, ranking: list[str], percent: float, block_size: int) -> tuple[int, int, int]:
    """Most sensitive layers, in rank order, whose bf16 weights add at most ``percent`` to the
    direct-cast checkpoint's bytes (every ranked layer fp8 + E8M0 scales, the rest as stored; a
    tied tensor once): (how many, the bytes they add, the direct-cast bytes)."""
    mods = dict(model.named_modules())
    ranked = {id(mods[n].weight): n for n in ranking}
    total = 0
    for p in model.parameters():  # tied parameters come once
        total += p.numel() + p.numel() // block_size if id(p) in ranked else p.numel() * p.element_size()
    budget = percent / 100 * total
    n, extra = 0, 0
    for name in ranking:
        w = mods[name].weight
        add = w.numel() * w.element_size() - (w.numel() + w.numel() // block_size)
        if extra + add > budget:
            break
        n, extra = n + 1, extra + add
    return n, extra, total


def _keep_for_budget(ppl: Callable[[list[str]], float], ranking: list[str], max_dppl: float,
                     at_least: int) -> tuple[int, dict]:  # fmt: skip
    """Smallest number of most-sensitive layers to keep so that the calibration-text perplexity
    (``ppl(names quantized)``) rises by at most ``max_dppl`` percent over bf16 (exponential then
    binary search)."""
    base = ppl([])
    curve: dict[int, float] = {}

    def ok(k: int) -> bool:
        if k not in curve:
            curve[k] = ppl(ranking[k:])
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
    ``mxq.calib.gptq.round_plan`` gets the plan's GPTQ codes)."""
    from mxq.checkpoint.config import experts_entry, native_config
    from mxq.hf.quantizer import MXQConfig
    from mxq.runtime.experts import experts_layers, quantize_experts
    from mxq.runtime.linear import MXLinear

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
        model.set_submodule(n, MXLinear.from_linear(model.get_submodule(n), w, a, plan.recipe.block_size))
    for n, (w, a) in plan.quantized_experts.items():
        quantize_experts(model, [n], w, a, plan.recipe.block_size)
    experts = {n: experts_entry(moe[n], w, a) for n, (w, a) in plan.quantized_experts.items()}
    cfg = native_config(plan.recipe, plan.quantized, sorted(set(lins) - set(plan.quantized)), calibration=plan.config_section(),
                        experts=experts or None)  # fmt: skip
    model.config.quantization_config = MXQConfig.from_dict(cfg)
    return model
