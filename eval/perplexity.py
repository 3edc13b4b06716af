"""Perplexity of a causal LM on a text corpus, token level, in two protocols.

Default (GPTQ style): the documents are joined with "\\n\\n" and tokenized once; the token
stream is cut into non-overlapping windows of ``seq_len`` tokens; the last partial window is
dropped. Each window is scored on its own: every token but the first (which has no context)
contributes its negative log-likelihood.

Sliding (``stride``, as in the Hugging Face perplexity guide): windows of ``seq_len`` tokens
start every ``stride`` tokens; the first window scores all its tokens (but the first), every
later window scores only its last ``stride`` tokens -- the ones no earlier window scored -- so
each scored token sees at least ``seq_len - stride`` tokens of context. Only whole windows are
used: the tail shorter than one stride after the last window is dropped. ``stride == seq_len``
is exactly the default protocol.

Perplexity is ``exp(sum NLL / scored tokens)``; log-softmax runs in fp32 on the model's
logits and the sums are kept in float64, so batch size does not change the result beyond
fp32 rounding of the logits themselves.

Windows are data (:class:`Windows`): build them once with :func:`make_windows` and pass them
to :func:`perplexity` for every model that should be compared, so a quantized model and its
baseline are scored on exactly the same tokens.
"""

from __future__ import annotations

import hashlib
import math
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from mxq.progress import progress_bar

__all__ = [
    "DOC_SEPARATOR",
    "Windows",
    "PerplexityResult",
    "make_windows",
    "perplexity",
    "tokenizer_fingerprint",
    "check_same_tokenizer",
    "peak_memory_bytes",
]

DOC_SEPARATOR = "\n\n"


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary (token -> id), to tell tokenizers apart."""
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    for tok, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{tok}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:16]


def check_same_tokenizer(a, b, name_a: str = "baseline", name_b: str = "model") -> None:
    """Raise ValueError unless both tokenizers map the same tokens to the same ids."""
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        only_a = len(va.keys() - vb.keys())
        only_b = len(vb.keys() - va.keys())
        raise ValueError(
            f"{name_a} and {name_b} use different tokenizers (vocab sizes {len(va)} and {len(vb)}, "
            f"{only_a} and {only_b} tokens not in the other): perplexities are only comparable "
            "on the same token stream"
        )


@dataclass(frozen=True)
class Windows:
    """Token windows to score, shared between models.

    ``input_ids[i]`` is window i; tokens at positions ``score_from[i] .. seq_len-1`` are scored
    (each predicted from the logits one position earlier).
    """

    input_ids: torch.Tensor  # [n_windows, seq_len] int64, on CPU
    score_from: torch.Tensor  # [n_windows] int64, >= 1
    seq_len: int
    stride: int | None  # None: non-overlapping (the default protocol)
    n_text_tokens: int  # tokens in the joined text
    n_windows_total: int  # windows the text yields before max_windows
    tokenizer_id: str = ""  # tokenizer_fingerprint of the tokenizer that made them

    @property
    def n_windows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_scored(self) -> int:
        return int((self.seq_len - self.score_from).sum())

    @property
    def protocol(self) -> str:
        n, tot = self.n_windows, self.n_windows_total
        if self.stride is None:
            s = (
                f"GPTQ-style token-level perplexity: documents joined with '\\n\\n', "
                f"non-overlapping windows of {self.seq_len} tokens ({self.seq_len - 1} scored per "
                "window), last partial window dropped"
            )
        else:
            s = (
                f"sliding-window token-level perplexity: documents joined with '\\n\\n', windows of "
                f"{self.seq_len} tokens every {self.stride} tokens, each scoring only its "
                f"{self.stride} new tokens (the first window scores {self.seq_len - 1}), "
                f"tail shorter than one stride dropped"
            )
        if n < tot:
            s += f"; first {n} of {tot} windows (--max-windows {n})"
        else:
            s += f"; all {n} windows"
        return s


def make_windows(
    tokenizer,
    texts: Sequence[str] | str,
    seq_len: int = 2048,
    stride: int | None = None,
    max_windows: int | None = None,
) -> Windows:
    """Tokenize the "\\n\\n"-joined texts once and cut them into windows (see the module doc)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    if stride is not None and not 1 <= stride <= seq_len:
        raise ValueError(f"stride must be between 1 and seq_len ({seq_len}), got {stride}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be at least 1, got {max_windows}")
    text = texts if isinstance(texts, str) else DOC_SEPARATOR.join(texts)
    # verbose=False: the whole corpus is longer than model_max_length on purpose.
    ids = tokenizer(text, verbose=False)["input_ids"]
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    n_tok = int(ids.numel())
    if n_tok < seq_len:
        raise ValueError(
            f"the text is {n_tok} tokens long, shorter than one window (seq_len {seq_len}): "
            "pass a longer text or a smaller --seq-len"
        )
    step = seq_len if stride is None else stride
    starts = list(range(0, n_tok - seq_len + 1, step))
    n_total = len(starts)
    if max_windows is not None:
        starts = starts[:max_windows]
    input_ids = torch.stack([ids[s : s + seq_len] for s in starts])
    score_from = torch.ones(len(starts), dtype=torch.long)
    if stride is not None:
        score_from[1:] = max(1, seq_len - stride)  # stride == seq_len: the default protocol
    return Windows(
        input_ids=input_ids,
        score_from=score_from,
        seq_len=seq_len,
        stride=stride,
        n_text_tokens=n_tok,
        n_windows_total=n_total,
        tokenizer_id=tokenizer_fingerprint(tokenizer),
    )


@dataclass
class PerplexityResult:
    ppl: float
    nll_sum: float  # total NLL over scored tokens (nats, float64)
    n_tokens: int  # scored tokens
    n_windows: int
    per_window_nll: list[float]  # mean NLL per scored token of each window (nats)
    tokens_per_s: float  # forward throughput: window tokens (n_windows * seq_len) per second
    peak_mem_bytes: int
    peak_mem_kind: str  # "cuda max allocated" or "process peak RSS"
    seq_len: int
    stride: int | None
    protocol: str
    n_windows_total: int = 0
    elapsed_s: float = 0.0
    device: str = "cpu"
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ppl"] = _json_float(self.ppl)
        return d


def _json_float(x: float):
    return x if math.isfinite(x) else str(x)


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """Peak memory: CUDA max allocated since the last reset on GPU; on CPU the process's peak
    resident set size (``ru_maxrss``), which covers the whole process lifetime, model loading
    included, and never goes down."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda max allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(rss if sys.platform == "darwin" else rss * 1024), "process peak RSS"


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _vocab_size(model) -> int | None:
    try:
        return int(model.get_input_embeddings().weight.shape[0])
    except Exception:  # noqa: BLE001 - a model without a plain embedding: skip the check
        return None


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    p = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("windows"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    p.start()
    p.add_task(desc, total=total)
    return p


def perplexity(
    model,
    tokenizer=None,
    texts: Sequence[str] | str | None = None,
    *,
    seq_len: int = 2048,
    stride: int | None = None,
    max_windows: int | None = None,
    batch_size: int = 1,
    windows: Windows | None = None,
    progress: bool = True,
    desc: str = "perplexity",
) -> PerplexityResult:
    """Token-level perplexity of ``model`` (see the module doc for the two protocols).

    Pass either ``tokenizer`` and ``texts`` (windows are built with :func:`make_windows`), or
    ``windows`` built earlier -- then ``tokenizer``, if given, must be the one that built them.
    The model runs on its own device; a rich progress bar goes to stderr unless
    ``progress=False``.
    """
    if windows is None:
        if tokenizer is None or texts is None:
            raise ValueError("perplexity() needs tokenizer and texts, or windows")
        windows = make_windows(tokenizer, texts, seq_len, stride, max_windows)
    else:
        if tokenizer is not None and windows.tokenizer_id and (
            tokenizer_fingerprint(tokenizer) != windows.tokenizer_id
        ):
            raise ValueError(
                "the windows were made with a different tokenizer than this model's: "
                "perplexities are only comparable on the same token stream"
            )
        if max_windows is not None and max_windows < windows.n_windows:
            windows = _first_windows(windows, max_windows)
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")

    device = _model_device(model)
    vocab = _vocab_size(model)
    max_id = int(windows.input_ids.max())
    if vocab is not None and max_id >= vocab:
        raise ValueError(
            f"token id {max_id} is outside the model's vocabulary ({vocab} embeddings): "
            "the windows were made with another model's tokenizer"
        )

    S = windows.seq_len
    per_window: list[float] = []
    nll_sum = 0.0
    n_tokens = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    bar = progress_bar(desc, enabled=progress, transient=True, unit="windows")
    with bar, torch.inference_mode():
        task = bar.add_task(desc, total=windows.n_windows)
        for b0 in range(0, windows.n_windows, batch_size):
            ids = windows.input_ids[b0 : b0 + batch_size].to(device)
            logits = model(input_ids=ids, use_cache=False).logits
            sums, finite = _window_nll_sums(logits, ids, windows.score_from[b0 : b0 + ids.shape[0]])
            if not finite:
                _check_finite(model, logits, ids, b0)
            for j, s in enumerate(sums):
                sf = int(windows.score_from[b0 + j])
                nll_sum += s
                n_tokens += S - sf
                per_window.append(s / (S - sf))
            del logits
            bar.advance(task, ids.shape[0])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    peak, kind = peak_memory_bytes(device)
    mean = nll_sum / n_tokens
    return PerplexityResult(
        ppl=math.exp(mean) if mean < 700 else math.inf,
        nll_sum=nll_sum,
        n_tokens=n_tokens,
        n_windows=windows.n_windows,
        per_window_nll=per_window,
        tokens_per_s=windows.n_windows * S / elapsed if elapsed > 0 else math.inf,
        peak_mem_bytes=peak,
        peak_mem_kind=kind,
        seq_len=S,
        stride=windows.stride,
        protocol=windows.protocol,
        n_windows_total=windows.n_windows_total,
        elapsed_s=elapsed,
        device=str(device),
    )


NLL_ROWS = 128  # logits rows turned to fp32 at a time: [128, V] stays in cache on a CPU


def _window_nll_sums(logits: torch.Tensor, ids: torch.Tensor, score_from: torch.Tensor) -> tuple[list[float], bool]:
    """Per window j, the NLL (float64 sum, nats) of tokens ``score_from[j] .. S-1``, each from the fp32
    log-softmax of the logits one position earlier; and whether every logit is finite, from row
    sums (a finite sum has no inf or NaN term; a sum that overflows is checked element by element by
    the caller). Rows are converted to fp32 ``NLL_ROWS`` at a time, not the whole [S, V] at once."""
    S = logits.shape[1]
    sums, finite = [], torch.ones((), dtype=torch.bool, device=logits.device)
    for j in range(logits.shape[0]):
        sf = int(score_from[j])
        acc = torch.zeros((), dtype=torch.float64, device=logits.device)
        for a in range(0, S, NLL_ROWS):
            x = logits[j, a : a + NLL_ROWS].float()
            finite &= torch.isfinite(x.sum(dim=-1)).all()
            lo, hi = max(a, sf - 1), min(a + NLL_ROWS, S - 1)
            if lo < hi:
                nll = torch.nn.functional.cross_entropy(x[lo - a : hi - a], ids[j, lo + 1 : hi + 1], reduction="none")
                acc += nll.double().sum()
        sums.append(acc)
    return [float(s) for s in sums], bool(finite)


class NonFiniteError(ValueError):
    """The model produced inf or NaN on a window: the message names the window and the first
    module (in execution order) whose output was not finite."""


def _first_non_finite_module(model, ids: torch.Tensor) -> str | None:
    """Run ``ids`` once more with a hook on every module; the name and type of the first one that
    returned a non-finite tensor (modules run in execution order), or None."""
    found: list[str] = []
    handles = []

    def hook(name):
        def fn(mod, inputs, output):
            out = output[0] if isinstance(output, tuple) and output else output
            if not found and isinstance(out, torch.Tensor) and out.is_floating_point() and not bool(torch.isfinite(out).all()):
                found.append(f"{name} ({type(mod).__name__})")

        return fn

    for name, mod in model.named_modules():
        if name and not list(mod.children()):
            handles.append(mod.register_forward_hook(hook(name)))
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def _check_finite(model, logits: torch.Tensor, ids: torch.Tensor, first_window: int) -> None:
    bad = ~torch.isfinite(logits).flatten(1).all(1)
    if not bool(bad.any()):
        return
    j = int(bad.nonzero()[0])
    where = _first_non_finite_module(model, ids[j : j + 1])
    raise NonFiniteError(
        f"window {first_window + j}: the model's logits are not finite (inf or NaN)"
        + (f"; the first non-finite output comes from {where}" if where else "")
    )


def _first_windows(w: Windows, n: int) -> Windows:
    return Windows(
        input_ids=w.input_ids[:n],
        score_from=w.score_from[:n],
        seq_len=w.seq_len,
        stride=w.stride,
        n_text_tokens=w.n_text_tokens,
        n_windows_total=w.n_windows_total,
        tokenizer_id=w.tokenizer_id,
    )
