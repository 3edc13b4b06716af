"""Greedy decoding with a static KV cache, the decode step replayed from one CUDA graph.

Eager ``generate()`` spends most of a decode step launching kernels (hundreds per token for a
32-layer model). Here the step -- forward of one token per sequence, argmax, writing the token
and advancing the position -- is captured once as a CUDA graph over fixed buffers and a
transformers ``StaticCache``, then replayed once per new token: no Python, no launches, no host
syncs between tokens. It works for bf16 models and for mxq models alike (``MXLinear`` and the
Triton kernels never sync the host), so it measures what the weights cost, not the launcher.

    from mxq.runtime.decode import StaticGreedyDecoder
    dec = StaticGreedyDecoder(model, batch_size=1, max_len=512)
    tokens = dec.generate(input_ids, max_new_tokens=128)   # [B, prompt + 128]

On a CPU (or with ``cuda_graph=False``) the same step runs eagerly: identical tokens, which the
tests compare with ``model.generate(do_sample=False)``.

Two transformers pieces are swapped for capturable ones with the same values: sliding-window layers get
a full-length static cache (``_full_length_cache``), and eager attention's additive mask is made on the
device (``capturable_masks``). gpt-oss needs both.

A model spread over several devices (``from_pretrained(..., device_map=...)`` with layers on two
GPUs, or offloaded to the CPU) is refused with the graph: the step is captured on one device's
stream, and the other device's work (its layers, accelerate's copies between the devices) is not
recorded into that graph (capture fails). Such a model decodes with ``cuda_graph=False`` or
``model.generate()``.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from mxq.compat import mask_overrides
from mxq.runtime.fuse import device_eager_mask


def _refuse_split(model) -> None:
    """A one-line error for a model whose parameters are not all on one device (module doc)."""
    devices = sorted({str(p.device) for p in model.parameters()})
    if len(devices) > 1:
        on = ", ".join(devices[:-1]) + " and " + devices[-1]
        raise ValueError(
            f"StaticGreedyDecoder: the model's parameters are on {on} (device_map); it captures one CUDA "
            "graph on one device: load the model on one GPU, or use cuda_graph=False or model.generate()"
        )


@contextlib.contextmanager
def capturable_masks():
    """While the step runs, eager attention's mask comes from ``mxq.runtime.fuse.device_eager_mask`` (a local
    override of transformers' mask table, put back after; one another took first is kept)."""
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS as table
        from transformers.masking_utils import sdpa_mask
    except ImportError:
        yield
        return
    local = mask_overrides(table)
    if local is None or "eager" in local:
        yield
        return
    local["eager"] = functools.partial(device_eager_mask, sdpa_mask)
    try:
        yield
    finally:
        local.pop("eager", None)


def _full_length_cache(cache, max_len: int):
    """``cache`` with each static sliding-window layer replaced by a full-length static layer. Once
    full, transformers' sliding layer counts in a Python int and indexes with a host-made tensor: a
    CUDA graph would freeze the branch and cannot capture the copy, and ``torch.compile`` cannot trace
    it. With every position kept, the model's sliding-window mask (built from the config's window for
    those layers) hides the same keys: the same attention, max_len keys read instead of the window."""
    from transformers.cache_utils import StaticLayer

    layers = getattr(cache, "layers", None)
    if isinstance(layers, list):
        for i, layer in enumerate(layers):
            if getattr(layer, "is_sliding", False) and isinstance(layer, StaticLayer):
                layers[i] = StaticLayer(max_cache_len=max_len)
    return cache


def _with_backward_hooks(model) -> list:
    """The modules of ``model`` with backward hooks: tensor parallelism's gradient all-reduce on
    replicated norms (transformers' ``replicated_with_grad_allreduce``, Qwen3's q/k norms), for one."""
    return [m for m in model.modules() if m._backward_hooks or m._backward_pre_hooks]


def _call_hooks_aside(modules: list, fn) -> None:
    """``fn()`` with ``modules``' backward hooks set aside and put back after. The step runs under
    ``inference_mode``, where no backward hook can fire, but ``torch.compile(fullgraph=True)``
    refuses a module that has one; a CUDA graph replays the step without calling this at all."""
    held = [(m, m._backward_hooks, m._backward_pre_hooks) for m in modules]
    for m, _, _ in held:
        m._backward_hooks, m._backward_pre_hooks = type(m._backward_hooks)(), type(m._backward_pre_hooks)()
    try:
        fn()
    finally:
        for m, hooks, pre in held:
            m._backward_hooks, m._backward_pre_hooks = hooks, pre


class StaticGreedyDecoder:
    def __init__(
        self,
        model,
        batch_size: int,
        max_len: int,
        *,
        cuda_graph: bool | None = None,
        compile: bool | str = False,
    ):
        """``compile``: run the step through ``torch.compile(fullgraph=True)`` (inductor fuses
        the small elementwise ops between the GEMMs; a string names another backend) before
        capturing it. ``MXLinear`` enters the compiled graph as ``torch.ops.mxq.mx_linear``."""
        from transformers import StaticCache

        self.model = model
        self.device = next(model.parameters()).device
        self.batch_size = batch_size
        self.max_len = max_len
        self.cuda_graph = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        if self.cuda_graph:
            _refuse_split(model)
        if self.cuda_graph and self.device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs a model on a CUDA device, got {self.device}")
        self.cache = _full_length_cache(StaticCache(config=model.config, max_cache_len=max_len), max_len)
        self.seq = torch.zeros(batch_size, max_len, dtype=torch.long, device=self.device)
        self.ids = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)  # position of self.ids
        self.graph = None
        self._step_fn = self._step
        if compile:
            backend = compile if isinstance(compile, str) else "inductor"
            compiled = torch.compile(self._step, fullgraph=True, dynamic=False, backend=backend)
            hooked = _with_backward_hooks(model)
            self._step_fn = compiled if not hooked else lambda: _call_hooks_aside(hooked, compiled)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> None:
        b, p = input_ids.shape
        if b != self.batch_size:
            raise ValueError(
                f"input_ids has batch {b}, the decoder was built for {self.batch_size}"
            )
        if p >= self.max_len:
            raise ValueError(f"prompt of {p} tokens does not fit max_len={self.max_len}")
        self.cache.reset()
        self.seq.zero_()
        self.seq[:, :p] = input_ids
        pos = torch.arange(p, device=self.device)
        # positions given, not left to the model: it would add the cache's length, a tensor on the
        # first layer's device, to positions on the embedding's (two devices under a device_map)
        out = self.model(
            input_ids=input_ids.to(self.device), past_key_values=self.cache, cache_position=pos,
            position_ids=pos[None], use_cache=True, logits_to_keep=1,
        )  # fmt: skip
        nxt = out.logits[:, -1].argmax(-1)
        self.seq[:, p] = nxt
        self.ids.copy_(nxt[:, None])
        self.pos.fill_(p)

    def _step(self) -> None:
        out = self.model(
            input_ids=self.ids, past_key_values=self.cache, cache_position=self.pos, position_ids=self.pos[None],
            use_cache=True, logits_to_keep=1,
        )  # fmt: skip
        nxt = out.logits[:, -1].argmax(-1)
        self.seq.index_copy_(1, self.pos + 1, nxt[:, None])
        self.ids.copy_(nxt[:, None])
        self.pos.add_(1)

    def _cache_counters(self) -> list[torch.Tensor]:
        # transformers' static layers keep their own write position (a device tensor); the
        # warm-up steps advance it, so capture() puts it back.
        return [
            c
            for layer in getattr(self.cache, "layers", [])
            if isinstance(c := getattr(layer, "cumulative_length", None), torch.Tensor)
        ]

    @torch.inference_mode()
    def warm_up(self, steps: int = 2):
        """Run the step ``steps`` times (on a side stream on CUDA, as graph capture needs) and
        put positions back: the cache slots written are written again by the real steps
        before anything reads them."""
        pos0, ids0 = self.pos.clone(), self.ids.clone()
        counters = [(c, c.clone()) for c in self._cache_counters()]

        def restore():
            self.pos.copy_(pos0)
            self.ids.copy_(ids0)
            for c, v in counters:
                c.copy_(v)

        ctx = (
            torch.cuda.stream(torch.cuda.Stream())
            if self.device.type == "cuda"
            else contextlib.nullcontext()
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        with ctx, capturable_masks():
            for _ in range(steps):
                restore()
                self._step_fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        restore()

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture the step as a CUDA graph (call after ``prefill``)."""
        self.warm_up()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), capturable_masks():  # records the step without running it
            self._step_fn()

    @torch.inference_mode()
    def step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            with capturable_masks():
                self._step_fn()

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Prompt + ``max_new_tokens`` greedy tokens, [B, P + max_new_tokens] (no early stop)."""
        p = input_ids.shape[1]
        if p + max_new_tokens > self.max_len:
            raise ValueError(
                f"prompt {p} + max_new_tokens {max_new_tokens} > max_len {self.max_len}"
            )
        self.prefill(input_ids)
        if self.cuda_graph and self.graph is None and max_new_tokens > 1:
            self.capture()
        for _ in range(max_new_tokens - 1):
            self.step()
        return self.seq[:, : p + max_new_tokens].clone()
