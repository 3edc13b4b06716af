"""The chat check: what a user sees first, a quantized model's greedy answers beside its baseline's.

Short prompts written for the project (``chat_prompts.json``: facts, arithmetic, instructions) go
through the tokenizer's chat template as one user turn, one prompt at a time (no padding, so each
answer is exactly what a user asking that one question gets), and each model answers greedily.
The report gives, per prompt, both answers and whether they agree on the first ``first`` tokens
and as a whole, and, where the prompt names what a right answer contains (``expect``), whether
each answer contains it. Perplexity says what quantization costs on average; this says whether
the answers a user reads changed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import torch

from mxq.progress import progress_bar

__all__ = ["ChatPrompt", "ChatAnswer", "ChatReport", "load_prompts", "answer", "compare"]


@dataclass(frozen=True)
class ChatPrompt:
    id: str
    prompt: str
    expect: tuple[str, ...] = ()  # a right answer contains one of these (case-insensitive); () where none is fixed


@dataclass
class ChatAnswer:
    """One model's greedy answer: the new token ids (up to the end-of-turn token, excluded) and their text."""

    ids: list[int]
    text: str


@dataclass
class ChatReport:
    first: int  # tokens compared at the start of each answer
    rows: list[dict] = field(default_factory=list)  # per prompt: id, prompt, baseline, model, agree_first, agree_all, right
    agree_first: float = 0.0  # share of prompts whose answers agree on the first `first` tokens
    agree_all: float = 0.0  # share whose whole answers agree
    right: dict[str, str] = field(default_factory=dict)  # per model: "k/n" answers containing what the prompt expects

    def differing(self) -> list[dict]:
        return [r for r in self.rows if not r["agree_first"]]

    def to_json(self) -> dict:
        return asdict(self)


def load_prompts(path: str | Path | None = None) -> list[ChatPrompt]:
    """The prompts of ``path`` (JSON: {"prompts": [{id, prompt, expect?}]}) or, by default, the
    ones shipped with mxq; ValueError naming the file and entry for anything else."""
    where = str(path) if path is not None else "mxq/eval/chat_prompts.json"
    try:
        raw = Path(path).read_text() if path is not None else resources.files("mxq.eval").joinpath("chat_prompts.json").read_text()
        data = json.loads(raw)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: {' '.join(str(e).split())[:200]}") from None
    items = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise ValueError(f"{where}: expected {{\"prompts\": [{{\"id\", \"prompt\", \"expect\"?}}, ...]}}")
    out, seen = [], set()
    for i, d in enumerate(items):
        ok = isinstance(d, dict) and isinstance(d.get("id"), str) and isinstance(d.get("prompt"), str) and d["prompt"].strip()
        exp = d.get("expect", ()) if isinstance(d, dict) else ()
        exp = (exp,) if isinstance(exp, str) else exp
        if not ok or not isinstance(exp, (list, tuple)) or not all(isinstance(e, str) and e for e in exp):
            raise ValueError(f"{where}: prompts[{i}]: expected {{\"id\": str, \"prompt\": str, \"expect\": str or [str]}}")
        if d["id"] in seen:
            raise ValueError(f"{where}: prompts[{i}]: id {d['id']!r} appears twice")
        seen.add(d["id"])
        out.append(ChatPrompt(d["id"], d["prompt"], tuple(exp)))
    return out


def _prompt_ids(tok, prompt: str) -> list[int]:
    """One user turn through the tokenizer's chat template (the plain text where it has none)."""
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tok(prompt).input_ids)


@torch.no_grad()
def answer(model, tok, prompts: list[ChatPrompt], max_new_tokens: int = 24, label: str = "answers") -> list[ChatAnswer]:
    """Greedy answers of ``model`` to each prompt, one prompt per ``generate`` call."""
    device = next(model.parameters()).device
    stop = {t for t in (tok.eos_token_id, getattr(model.generation_config, "eos_token_id", None)) if t is not None}
    stop = {s for t in stop for s in (t if isinstance(t, (list, tuple)) else (t,))}
    out = []
    bar = progress_bar(label, transient=True, unit="prompts")
    with bar:
        task = bar.add_task(label, total=len(prompts))
        for p in prompts:
            ids = torch.tensor([_prompt_ids(tok, p.prompt)], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else min(stop, default=0))  # fmt: skip
            new = gen[0, ids.shape[1]:].tolist()
            cut = next((i for i, t in enumerate(new) if t in stop), len(new))
            out.append(ChatAnswer(new[:cut], tok.decode(new[:cut], skip_special_tokens=True).strip()))
            bar.advance(task, 1)
    return out


def _right(p: ChatPrompt, a: ChatAnswer) -> bool | None:
    return any(e.lower() in a.text.lower() for e in p.expect) if p.expect else None


def compare(prompts: list[ChatPrompt], baseline: list[ChatAnswer], model: list[ChatAnswer], first: int = 8) -> ChatReport:
    """Side by side: per prompt, the two answers, whether their first ``first`` token ids agree
    (all of them, where an answer is shorter: then the lengths must agree too) and whether they
    agree entirely; per model, how many answers contain what their prompt expects."""
    if not (len(prompts) == len(baseline) == len(model)):
        raise ValueError("compare: one answer per prompt and model")
    rep = ChatReport(first=first)
    for p, b, m in zip(prompts, baseline, model):
        rep.rows.append({
            "id": p.id, "prompt": p.prompt, "baseline": b.text, "model": m.text, "baseline_ids": b.ids, "model_ids": m.ids,
            "agree_first": b.ids[:first] == m.ids[:first], "agree_all": b.ids == m.ids,
            "right": {"baseline": _right(p, b), "model": _right(p, m)},
        })  # fmt: skip
    n = len(rep.rows)
    rep.agree_first = sum(r["agree_first"] for r in rep.rows) / n
    rep.agree_all = sum(r["agree_all"] for r in rep.rows) / n
    judged = [r for r in rep.rows if r["right"]["model"] is not None]
    for who in ("baseline", "model"):
        rep.right[who] = f"{sum(r['right'][who] for r in judged)}/{len(judged)}"
    return rep
