"""The calibration plan and its file: what ``mxq calibrate`` chose, as JSON (with the GPTQ codes
in a safetensors file beside it).

A plan holds the recipe, the model geometry it was made for, per Linear layer its weight and
activation specs (or that it stays in bf16, and why), the channel permutations to fold, per experts
module how each expert was rounded, and the statistics and choices behind them. ``load_plan``
validates a file with one-line errors naming the file and the key; ``save_plan`` writes the JSON
and, after ``mxq.calib.gptq.round_plan``, the codes. The calibrator (``mxq.calib.calibrator``) makes plans; the
converter (``mxq.convert.converter``) and ``mxq.calib.calibrator.apply_plan`` apply them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mxq.calib.reorder import Geometry, Permutations, ReorderError
from mxq.recipe import Recipe, RecipeError, TensorSpec, parse_recipe

__all__ = [
    "PLAN_FORMAT", "PLAN_VERSION", "EXPERTS_ROUNDINGS", "PlanError", "LayerPlan", "ExpertsPlan", "Plan",
    "load_plan", "parse_plan", "save_plan",
]

PLAN_FORMAT = "mxq-plan"
PLAN_VERSION = 1


class PlanError(ValueError):
    """A plan file that cannot be used; the message names the file and the key."""


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
    (``mxq.calib.gptq.round_plan``), how each expert's projections were rounded ("gptq", or "nearest"
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
    # GPTQ-rounded layers (mxq.calib.gptq.round_plan): name -> (fp8 codes, E8M0 bytes), in memory or in
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
    from mxq.checkpoint.files import CheckpointError, read_header, read_tensor
    from mxq.runtime.experts import GATED, UNGATED

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
            want, bs = plan.experts[module].weights.elem.torch_dtype, plan.recipe.block_size
            if data.dim() != 3 or data.dtype != want or scales.dtype != torch.uint8 or tuple(scales.shape) != (e, n, k // bs) or k % bs:
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
