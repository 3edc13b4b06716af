"""Recipes: what to quantize and how, as validated data.

A recipe is a small YAML file (the shipped ones live in ``recipes/``). Every key is checked;
an error names the file and the key. Module patterns are globs matched against the full
module name or its last component (``lm_head``, ``*.mlp.down_proj``, ``down_proj``), or
regular expressions when written ``re:<pattern>`` (matched against the full name).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from mxq.formats import ElemFormat, ScaleRule, as_elem_format, as_scale_rule

DEFAULT_RECIPE = "mxfp8"


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class TensorSpec:
    """How one operand is quantized: element format and scale rule."""

    elem: ElemFormat
    scale_rule: ScaleRule

    def to_dict(self) -> dict:
        return {"elem": self.elem.name, "scale_rule": self.scale_rule.value}

    @classmethod
    def from_dict(cls, d: dict) -> TensorSpec:
        return cls(as_elem_format(d["elem"]), as_scale_rule(d["scale_rule"]))


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str = ""
    block_size: int = 32
    weights: TensorSpec = field(default_factory=lambda: TensorSpec(as_elem_format("e4m3"), ScaleRule.RCEIL))
    activations: TensorSpec | None = None  # None: weight-only (activations stay bf16)
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ("lm_head",)
    attention: str | None = None
    embeddings: str | None = None  # "mxfp8": the input embedding in the weights' format (mxq.runtime.embedding)
    rounding: str = "nearest"  # weights: "nearest" (direct cast) or "gptq" (needs calibration text)
    source: str = ""  # where the recipe was read from

    def selects(self, module_name: str) -> bool:
        """Whether a Linear module of this name is quantized by the recipe."""
        return _matches_any(module_name, self.include) and not _matches_any(module_name, self.exclude)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["weights"] = self.weights.to_dict()
        if d.pop("rounding") != "nearest":
            d["weights"]["rounding"] = self.rounding
        d["activations"] = self.activations.to_dict() if self.activations else None
        if self.activations:
            d["activations"]["dynamic"] = True
        d["include"] = list(self.include)
        d["exclude"] = list(self.exclude)
        d.pop("source")
        if d["embeddings"] is None:  # recipes without the key keep their recorded form
            d.pop("embeddings")
        return d


_TOP_KEYS = {"name", "description", "block_size", "weights", "activations", "include", "exclude", "attention", "embeddings"}
_SPEC_KEYS = {"elem", "scale_rule"}
_WEIGHT_KEYS = _SPEC_KEYS | {"rounding"}
_ACT_KEYS = _SPEC_KEYS | {"dynamic"}
ROUNDINGS = ("nearest", "gptq", "signround", "signround-scales")


def _matches_any(name: str, patterns: tuple[str, ...]) -> bool:
    last = name.rsplit(".", 1)[-1]
    for p in patterns:
        if p.startswith("re:"):
            if re.fullmatch(p[3:], name):
                return True
        elif fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(last, p):
            return True
    return False


def available_recipes() -> list[str]:
    return sorted(p.name[: -len(".yaml")] for p in resources.files("mxq.recipes").iterdir() if p.name.endswith(".yaml"))


def load_recipe(name_or_path: str | Path | None = None) -> Recipe:
    """A shipped recipe by name (``mxfp8``, ``mxfp8-w8a16``, ``mxfp8-e5m2``, ``mxfp8-attn``, ``mxfp8-lm-head``, ``mxfp8-all``) or a YAML file path."""
    ref = str(name_or_path) if name_or_path is not None else DEFAULT_RECIPE
    path = Path(ref).expanduser()
    if ref.endswith((".yaml", ".yml")) or path.is_file():
        if not path.is_file():
            raise RecipeError(f"{ref}: recipe file not found")
        try:
            text, where = path.read_text(encoding="utf-8"), str(path)
        except UnicodeDecodeError:
            raise RecipeError(f"{ref}: not a text file (a recipe is YAML)") from None
    else:
        res = resources.files("mxq.recipes").joinpath(f"{ref}.yaml")
        if not res.is_file():
            raise RecipeError(f"unknown recipe {ref!r}; shipped recipes: {', '.join(available_recipes())} (or pass a .yaml path)")
        text, where = res.read_text(), f"recipes/{ref}.yaml"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RecipeError(f"{where}: not valid YAML ({str(e).splitlines()[0]})") from None
    except ValueError as e:  # e.g. an integer beyond Python's digit limit
        raise RecipeError(f"{where}: unreadable value ({str(e).splitlines()[0]})") from None
    return parse_recipe(data, where)


def parse_recipe(data: object, where: str = "<recipe>") -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe is a mapping of keys, got {type(data).__name__}")
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise RecipeError(f"{where}: unknown key {sorted(unknown)[0]!r} (allowed: {', '.join(sorted(_TOP_KEYS))})")
    if "name" not in data:
        raise RecipeError(f"{where}: missing key 'name'")
    if "weights" not in data:
        raise RecipeError(f"{where}: missing key 'weights'")
    if not isinstance(data["name"], str) or not data["name"].strip():
        raise RecipeError(f"{where}: name: expected a non-empty string, got {data['name']!r}"[:300])
    if not isinstance(data.get("description", ""), str):
        raise RecipeError(f"{where}: description: expected a string")
    block_size = data.get("block_size", 32)
    if type(block_size) is not int or block_size != 32:
        raise RecipeError(f"{where}: block_size: MX blocks are 32 elements, got {block_size!r}"[:300])
    weights = _spec(data["weights"], where, "weights", _WEIGHT_KEYS)
    if weights is None:
        raise RecipeError(f"{where}: weights: must be given (elem, scale_rule)")
    rounding = data["weights"].get("rounding", "nearest")
    if rounding not in ROUNDINGS:
        raise RecipeError(f"{where}: weights.rounding: expected one of {', '.join(ROUNDINGS)}, got {rounding!r}"[:300])
    if rounding != "nearest" and weights.scale_rule not in (ScaleRule.RCEIL, ScaleRule.MSE):
        raise RecipeError(f"{where}: weights.rounding: {rounding} takes scale_rule rceil or mse, got {weights.scale_rule.value!r}")
    acts = _spec(data.get("activations"), where, "activations", _ACT_KEYS)
    if acts is not None and data["activations"].get("dynamic", True) is not True:
        raise RecipeError(f"{where}: activations.dynamic: only dynamic activation scales are supported")
    if acts is not None and acts.scale_rule is ScaleRule.MSE:
        raise RecipeError(f"{where}: activations.scale_rule: 'mse' is a search for weights; use rceil, floor or even")
    attention = data.get("attention")
    if attention not in (None, "bf16", "mxfp8"):
        raise RecipeError(f"{where}: attention: expected null, 'bf16' or 'mxfp8', got {attention!r}")
    embeddings = data.get("embeddings")
    if embeddings not in (None, "bf16", "mxfp8"):
        raise RecipeError(f"{where}: embeddings: expected null, 'bf16' or 'mxfp8', got {embeddings!r}"[:300])
    return Recipe(
        name=str(data["name"]),
        description=str(data.get("description", "")),
        block_size=32,
        weights=weights,
        activations=acts,
        include=_patterns(data.get("include", ["*"]), where, "include"),
        exclude=_patterns(data.get("exclude", ["lm_head"]), where, "exclude"),
        attention=None if attention == "bf16" else attention,
        embeddings=None if embeddings == "bf16" else embeddings,
        rounding=rounding,
        source=where,
    )


def _spec(d: object, where: str, key: str, allowed: set[str]) -> TensorSpec | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise RecipeError(f"{where}: {key}: expected a mapping with {sorted(_SPEC_KEYS)} or null")
    unknown = set(d) - allowed
    if unknown:
        raise RecipeError(f"{where}: {key}: unknown key {sorted(unknown)[0]!r} (allowed: {', '.join(sorted(allowed))})")
    try:
        return TensorSpec(as_elem_format(d.get("elem", "e4m3")), as_scale_rule(d.get("scale_rule", "rceil")))
    except ValueError as e:
        raise RecipeError(f"{where}: {key}: {e}") from None


def _patterns(v: object, where: str, key: str) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(p, str) for p in v):
        raise RecipeError(f"{where}: {key}: expected a list of glob or re: patterns")
    for p in v:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise RecipeError(f"{where}: {key}: bad regular expression {p!r} ({e})") from None
    return tuple(v)
