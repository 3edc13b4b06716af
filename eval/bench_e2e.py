"""End-to-end speed and memory as users meet them: a bf16 model and its MXFP8 quantization.

    python -m mxq.eval.bench_e2e --shape llama3-8b --out e2e-8b.json        # random weights, on the GPU
    python -m mxq.eval.bench_e2e --shape gpt-oss-20b --out e2e-gpt-oss.json # gpt-oss-20b widths, random weights
    python -m mxq.eval.bench_e2e --shape llama4-scout-4l --out e2e-l4.json  # Llama-4-Scout widths, 4 layers
    python -m mxq.eval.bench_e2e --model default --out e2e-smollm2.json     # SmolLM2-135M (embedded)

Each model runs in a fresh process (a worker: ``--worker bf16`` or ``--worker mxfp8``; the
quantized one is built the same way, then ``mxq.quantize_model``), so neither inherits the other's
compiled kernels, allocator state or CUDA graphs. Through the calls a user makes, each worker measures:

* weights: bytes of parameters and buffers;
* prefill: ``model(ids)`` (logits for every position, no cache) at ``--seq-len`` tokens per
  sequence, batch ``--prefill-batch``: tokens/s (median of timed runs) and peak memory; one
  forward's host time (the call until it returns, the device idle before it) and device time (CUDA
  events), the host time per MoE layer (modules holding routed experts), and the kernel launches of
  one forward (``torch.profiler``, counted last; ``--no-launch-count`` skips it);
* ``model.generate(ids, cache_implementation="static")`` at each ``--batch``, ``--new-tokens``
  after a ``--prompt-len`` prompt (on CUDA transformers compiles the forward and replays CUDA
  graphs): decode tokens/s = B * n / (t(1 + n) - t(1)), after warm-up calls of both lengths (the longer first: one static cache shape and graph serve both);
* ``model.generate(ids)`` with the default dynamic cache at B=1 (``--generate-tokens`` new);
* ``mxq.runtime.decode.StaticGreedyDecoder`` at each ``--batch``: the decode step replayed from a CUDA
  graph, compiled first with ``--compile``; ``--eager-decoder`` adds the same step without graph.
  The graph path is checked to give the same tokens as the eager static path first. Beside it, on a
  GPU, its byte bound: B x copy bandwidth (one 1 GiB device copy, read + written bytes) / the weight
  bytes one step reads (``step_bytes``: embedding tables by the row, routed experts by their expected
  share at B), and the step's percentage of it.

``--tp N`` runs each model sharded over N GPUs, as transformers' tensor parallelism does it: the
driver first writes the bf16 model (random weights) and its ``mxq quantize`` output under
``--checkpoint-dir`` (kept for later runs), then starts each role under ``torchrun --nproc-per-node
N``; every rank loads its shard with ``from_pretrained(path, tp_plan="auto")`` and runs the same
calls on the same inputs, and rank 0 reports (weights: one rank's bytes). ``--tp 1
--checkpoint-dir DIR`` loads the same checkpoints on one GPU. Both checkpoints are written one
tensor at a time from a seeded source (``random_source``), so no model is ever whole on one device;
``--mx-only`` writes only the MXFP8 one (the converter reads the source directly: a model too large
for bf16 on these GPUs, e.g. ``--shape qwen3-235b-a22b --layers 40``, and says what bf16 would need).
``--layers N`` takes N decoder layers of any shape.

``--pairs N`` alternates the fresh processes N times (bf16, MXFP8, bf16, ...) and gives every ratio as
the median over the pairs with its min-max: run-to-run noise (transformers' host time, clocks) shows in
each figure. ``--profile`` adds, per static-cache batch, where a decode step goes (device busy vs wall time,
kernels per step, the top kernels). ``--roles`` picks the models (bf16, mxfp8, bf16-grouped: bf16 with
mxq's attention without repeated K/V); ``--merge`` joins partial runs into one table.

The driver prints a markdown table of MXFP8 / bf16 ratios (> 1: MXFP8 faster; for memory, times and
launch counts the fraction of bf16) and writes JSON. On a CPU (``--device cpu``) it runs without graphs or
compilation (tests use a tiny shape there); figures worth reporting come from a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROLES = ("bf16", "mxfp8", "bf16-grouped")
# openai/gpt-oss-20b's rope_scaling (YaRN) and rope_theta, as transformers 5 reads them (``rope_parameters``)
GPT_OSS_ROPE = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096)  # fmt: skip
WORKERS = (*ROLES, "prepare")  # "prepare": write the --checkpoint-dir checkpoints
QWEN3_30B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                 num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 vocab_size=151936, max_position_embeddings=8192, rope_theta=1000000.0, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
SHAPES = {
    # Llama-3-8B (random weights, for speed only) and a tiny one for tests.
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    # Llama-3-70B widths with 16 of its 80 layers (tensor-parallel runs: the checkpoints go to disk)
    "llama3-70b-16l": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=16, num_attention_heads=64,
                           num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024),
    # Qwen3-30B-A3B widths (a mixture of experts: 128 experts, top-8): all 48 layers, 16 of them, and a tiny one
    "qwen3-30b-a3b": QWEN3_30B,
    "qwen3-30b-a3b-16l": dict(QWEN3_30B, num_hidden_layers=16),
    # Qwen3-235B-A22B widths (94 layers; ``--layers N`` takes fewer): with ``--mx-only`` its MXFP8
    # checkpoint is written tensor by tensor, no bf16 copy on disk or in memory
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                            num_experts=128, num_experts_per_tok=8, num_hidden_layers=94, num_attention_heads=64,
                            num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=8192,
                            rope_theta=1000000.0, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                     num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=1024,
                     decoder_sparse_step=1, mlp_only_layers=[]),
    # gpt-oss-20b (all 24 layers; 32 experts top-4 with biases, interleaved gate/up and a clamped GLU; attention
    # with sinks, alternating 128-token sliding-window and full layers, YaRN rope) as openai/gpt-oss-20b's
    # config.json has it, and a tiny one of the same family. transformers runs its attention eagerly (no sdpa).
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                        num_experts_per_tok=4, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                        head_dim=64, vocab_size=201088, max_position_embeddings=131072, sliding_window=128,
                        layer_types=["sliding_attention", "full_attention"] * 12, rope_parameters=GPT_OSS_ROPE,
                        attention_bias=True, rms_norm_eps=1e-5, router_aux_loss_coef=0.9),
    "tiny-gpt-oss": dict(model_type="gpt_oss", hidden_size=128, intermediate_size=128, num_local_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, vocab_size=512, max_position_embeddings=131072, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"], rope_parameters=GPT_OSS_ROPE,
                         attention_bias=True, rms_norm_eps=1e-5),
    # Llama-4-Scout widths with 4 of its 48 layers (16 experts top-1 of width 8192 with a shared expert of
    # 16384; chunked attention in three of four layers, QK norm): transformers runs every expert on every
    # token, mxq only the chosen one (``mxq.runtime.routing``); and a tiny one of the same family.
    "llama4-scout-4l": dict(model_type="llama4_text", hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
                            num_local_experts=16, num_experts_per_tok=1, num_hidden_layers=4, num_attention_heads=40,
                            num_key_value_heads=8, head_dim=128, vocab_size=202048, max_position_embeddings=8192),
    "tiny-llama4": dict(model_type="llama4_text", hidden_size=128, intermediate_size=128, intermediate_size_mlp=256,
                        num_local_experts=4, num_experts_per_tok=1, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=1024,
                        attention_chunk_size=16),
}  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Timer:
    """Wall time of a block on the device (CUDA events on a GPU, perf_counter elsewhere)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        _sync(self.device)
        if self.device.type == "cuda":
            self.a, self.b = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self.a.record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.b.record()
            self.b.synchronize()
            self.s = self.a.elapsed_time(self.b) / 1e3
        else:
            self.s = time.perf_counter() - self.t0


def _reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def weight_bytes(model) -> int:
    """Bytes of parameters and buffers (tensor parallel: this rank's shards)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: the shard this rank holds
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def step_bytes(model, batch: int) -> int:
    """Weight bytes one decode step at ``batch`` sequences must read: every parameter and buffer once,
    embedding tables not (a step reads ``batch`` rows; a tied head reads the whole table and counts
    it), routed experts by their expected share: with k of E chosen a token, uniformly, a step reads
    1 - (1 - k/E)^batch of each experts module (at B=1, k/E). Shards a rank holds under tensor
    parallelism; no KV cache (a short context's is small beside the weights)."""
    from mxq.runtime.experts import is_experts

    k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    k = getattr(getattr(getattr(model, "config", None), "text_config", None), "num_experts_per_tok", k)
    seen, total = set(), 0.0

    def add(t, share):
        nonlocal total
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.data_ptr() in seen:
            return
        seen.add(t.data_ptr())
        total += share * t.numel() * t.element_size()

    tables = []
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding) or type(m).__name__ == "MXEmbedding":
            tables.append(m)
            continue
        share = 1.0
        if is_experts(m) and k:
            e = getattr(m, "num_experts", None) or next(p for p in m.parameters() if p.dim() == 3).shape[0]
            share = 1.0 - (1.0 - min(k, e) / e) ** batch
        tensors = m._parameters.values() if not is_experts(m) else [p for _, p in m.named_parameters()]
        for t in list(tensors) + list(m._buffers.values()):
            if t is not None:
                add(t, share)
    for m in tables:  # rows only: mark the table's tensors as seen
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None:
                seen.add((t.to_local() if hasattr(t, "to_local") else t).data_ptr())
    return int(total)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """Bytes a second of a device-to-device copy of ``nbytes`` (read + written), median of 10; None on a CPU."""
    if device.type != "cuda":
        return None
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del x, y
    return 2 * nbytes / sorted(times[2:])[len(times[2:]) // 2]


def shape_config(shape: str, layers: int | None = None):
    """The transformers config of ``shape`` (Llama unless it names another ``model_type``), with
    ``layers`` decoder layers instead of the shape's own count when given."""
    from transformers import AutoConfig

    kw = dict(SHAPES[shape])
    if layers:
        kw["num_hidden_layers"] = layers
        if "layer_types" in kw:  # gpt-oss alternates sliding and full attention: the first ``layers``
            kw["layer_types"] = (kw["layer_types"] * (layers // len(kw["layer_types"]) + 1))[:layers]
    return AutoConfig.for_model(kw.pop("model_type", "llama"), **kw, tie_word_embeddings=False)


def build_random(shape: str, device: torch.device, seed: int = 0, layers: int | None = None):
    """A bf16 model of ``shape`` with random weights (transformers' initialisation), built directly on
    ``device`` (``shape_config``). Mixtures of experts run their
    bf16 experts with transformers' fastest implementation here (``grouped_mm``; transformers 5.17's
    default too). Biases that transformers initialises to zero (gpt-oss: attention and experts) are
    drawn like the weights (normal, ``initializer_range``), so the quantized model's bias paths count
    in the logits check; every weight is finite (gpt-oss's 3-D experts parameters are drawn by its own
    ``_init_weights``)."""
    from transformers import AutoModelForCausalLM

    cfg = shape_config(shape, layers)
    if getattr(cfg, "num_experts", None):  # Qwen3-MoE's num_experts, gpt-oss's num_local_experts (aliased)
        cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and not p.any():
                p.normal_(0.0, getattr(cfg, "initializer_range", 0.02))
        bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise RuntimeError(f"build_random({shape!r}): non-finite initial weights in {bad[:5]}")
    return model.eval()


def random_source(shape: str, device: torch.device, seed: int = 0, layers: int | None = None):
    """The bf16 tensors of ``shape`` as the converter's ``TensorSource``, each made on ``device`` when
    the converter asks for it: norms 1, correction biases 0, everything else normal(0,
    ``initializer_range``), seeded by the tensor's name. A model too large for the disk or memory in
    bf16 gets its MXFP8 checkpoint this way, one tensor in memory at a time."""
    import zlib

    from transformers import AutoModelForCausalLM

    from mxq.checkpoint.files import DTYPE_NAMES
    from mxq.convert.converter import TensorSource

    cfg = shape_config(shape, layers)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    shapes = {n: tuple(t.shape) for n, t in skeleton.state_dict().items()}
    std = getattr(cfg, "initializer_range", 0.02)

    def read(name: str) -> torch.Tensor:
        t = torch.empty(shapes[name], dtype=torch.bfloat16, device=device)
        if t.dim() == 1 and "norm" in name:
            return t.fill_(1.0)
        if name.endswith("e_score_correction_bias"):
            return t.zero_()
        g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return t.normal_(0.0, std, generator=g)

    raw = cfg.to_dict()
    raw["dtype"] = "bfloat16"
    return TensorSource(cfg, raw, [(n, DTYPE_NAMES[torch.bfloat16], s) for n, s in shapes.items()], read,
                        label=f"{shape} with {cfg.num_hidden_layers} layers (random weights)")  # fmt: skip


def write_bf16(source, out: str) -> None:
    """``source``'s tensors as a bf16 checkpoint in ``out`` (shards of 5 GiB, one tensor in memory at
    a time; written beside it, then renamed): the model is never whole on the device or the host."""
    import json
    import shutil

    from mxq.checkpoint.files import PlannedTensor, ShardWriter

    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    writer = ShardWriter(tmp, [PlannedTensor(n, d, s) for n, d, s in source.tensors], 5 * 2**30)
    for name, _, _ in source.tensors:
        writer.write(name, source.read(name))
    writer.close()
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(source.raw_config, f, indent=1)
    os.replace(tmp, out)


def bf16_bytes(config) -> int:
    """Bytes of a model of ``config`` in bf16 (built on the meta device: nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return sum(t.numel() for t in m.state_dict().values()) * 2


def moe_layers(model) -> int:
    """Modules holding routed experts (``mxq.runtime.experts.is_experts``: transformers' 3-D experts or
    ``MXExperts``), one per MoE layer; 0 for a dense model."""
    from mxq.runtime.experts import is_experts

    return sum(1 for m in model.modules() if is_experts(m))


def prefill_ids(model, batch: int, seq_len: int) -> torch.Tensor:
    """The prefill's token ids (the same in every process and every call that counts them)."""
    g = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=g)
    return ids.to(next(model.parameters()).device)


def bench_prefill(model, batch: int, seq_len: int, reps: int) -> dict:
    """``model(ids)`` at ``batch`` x ``seq_len`` tokens (no cache), the median of ``reps`` calls after
    a warm-up. Each call starts with the device idle (synchronized) and gives two times:

    * ``device_s`` (= ``median_s``, which tokens/s is computed from): CUDA events recorded before
      the call and after it returns, i.e. until the device has finished the forward;
    * ``host_s``: wall time from the call until it returns to Python, stopped before synchronizing:
      what the host spends issuing one forward. When it is near ``device_s`` the device waits on
      the host. ``host_s_per_moe_layer``: ``host_s`` / ``moe_layers`` (None for a dense model), a
      decoder layer's share when every layer is MoE; ``bench_moe --layer`` gives the experts' own.

    On a CPU both are the wall time of the call."""
    device = next(model.parameters()).device
    ids = prefill_ids(model, batch, seq_len)
    cuda = device.type == "cuda"
    with torch.inference_mode():
        model(ids, use_cache=False)  # warm-up (kernel compilation, autotune)
        _reset_peak(device)
        host, dev = [], []
        for _ in range(reps):
            _sync(device)  # the device idle before the call: the host time is the host's alone
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            t0 = time.perf_counter()
            model(ids, use_cache=False)
            host.append(time.perf_counter() - t0)
            if cuda:
                b.record()
                b.synchronize()
                dev.append(a.elapsed_time(b) / 1e3)
            else:
                dev.append(host[-1])
    med, host_s, n_moe = statistics.median(dev), statistics.median(host), moe_layers(model)
    return dict(batch=batch, seq_len=seq_len, reps=reps, median_s=med, tokens_per_s=batch * seq_len / med,
                device_s=med, host_s=host_s, moe_layers=n_moe, host_s_per_moe_layer=host_s / n_moe if n_moe else None,
                peak_bytes=_peak(device))  # fmt: skip


def count_launches(model, batch: int, seq_len: int) -> dict | None:
    """Device work of one prefill forward (``prefill_ids``), from ``torch.profiler``'s CUDA activity:
    ``kernels`` (kernel launches) and ``copies`` (memcpy/memset). None off CUDA. ``measure`` calls it
    after every timed figure, so the profiler cannot perturb them."""
    if next(model.parameters()).device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    ids = prefill_ids(model, batch, seq_len)
    with torch.inference_mode():
        model(ids, use_cache=False)  # the same calls as the profiled one, compiled and planned
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model(ids, use_cache=False)
            torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = sum(1 for e in ev if e.name.startswith(("Memcpy", "Memset")))
    return dict(kernels=len(ev) - copies, copies=copies)


def bench_decode_static(
    model, batch: int, prompt_len: int, new_tokens: int, cuda_graph: bool, compile: bool = False
) -> tuple[dict, torch.Tensor]:
    from mxq.runtime.decode import StaticGreedyDecoder

    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(batch)  # the same prompt for every mode
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=device, generator=g)
    _reset_peak(device)
    dec = StaticGreedyDecoder(
        model, batch, prompt_len + new_tokens + 1, cuda_graph=cuda_graph, compile=compile
    )
    dec.prefill(ids)
    t0 = time.perf_counter()
    if cuda_graph:
        dec.capture()
    dec.step()  # warm-up step (eager: kernel compilation)
    _sync(device)
    setup_s = time.perf_counter() - t0
    dec.prefill(ids)
    with _Timer(device) as t:
        for _ in range(new_tokens):
            dec.step()
    tokens = dec.seq[:, : prompt_len + new_tokens + 1].clone()
    out = dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, cuda_graph=cuda_graph,
               compiled=bool(compile), setup_s=setup_s, decode_s=t.s, tokens_per_s=batch * new_tokens / t.s, ms_per_step=1e3 * t.s / new_tokens,
               peak_bytes=_peak(device))  # fmt: skip
    del dec
    return out, tokens


def bench_decode_generate(model, batch: int, prompt_len: int, new_tokens: int, reps: int = 3) -> dict:
    """Eager ``generate()`` with the default (dynamic) cache: decode time = t(1 + n) - t(1), the
    median over ``reps`` timed pairs after both lengths ran once. The first call at a new length
    pays one-time setup per sequence length (cuDNN attention builds a plan for each shape it
    meets: ~30 ms per token on an H100 at 32 layers), which a warm-up of fewer tokens misses."""
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=device)
    mask = torch.ones_like(ids)

    def gen(n):
        with _Timer(device) as t, torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)  # fmt: skip
        return t.s

    gen(1 + new_tokens), gen(1)  # warm-up: every shape the timed calls meet
    dt = max(statistics.median(-gen(1) + gen(1 + new_tokens) for _ in range(reps)), 1e-9)
    return dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, decode_s=dt, reps=reps,
                tokens_per_s=batch * new_tokens / dt, ms_per_step=1e3 * dt / new_tokens)  # fmt: skip


def union_length(intervals) -> float:
    """Total length covered by (start, end) intervals (overlaps counted once)."""
    busy, start, end = 0.0, 0.0, None
    for s0, s1 in sorted(intervals):
        if end is None or s0 > end:
            busy, start, end = busy + ((end - start) if end is not None else 0.0), s0, s1
        else:
            end = max(end, s1)
    return busy + ((end - start) if end is not None else 0.0)


def profile_steps(gen, new_tokens: int, reps: int = 3) -> dict:
    """Where a decode step of ``gen(n)`` (a generate call of n new tokens) goes, from profiled calls
    of n = 1 and n = 1 + new_tokens (their difference is decoding alone), ``reps`` alternated calls
    of each: wall ms per step (from the median wall of each length), device-busy ms per step (the
    union of kernel and copy intervals), kernels per step, and the kernels by time per step (from
    the last call of each length). Wall minus busy is the time the device waits for the host."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    stats, walls = {}, {1: [], 1 + new_tokens: []}
    for _ in range(max(1, reps)):
        for n in walls:
            with profile(activities=acts) as prof:
                walls[n].append(gen(n))
            ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            busy = union_length([(e.time_range.start, e.time_range.end) for e in ev])
            kernels = {}
            for e in ev:
                if not e.name.startswith(("Memcpy", "Memset")):
                    c = kernels.setdefault(e.name[:100], [0, 0.0])
                    c[0] += 1
                    c[1] += e.time_range.elapsed_us()
            stats[n] = dict(wall_ms=1e3 * statistics.median(walls[n]), busy_ms=busy / 1e3, kernels=kernels)
    a, b = stats[1], stats[1 + new_tokens]
    per = {k: [(c - a["kernels"].get(k, [0, 0.0])[0]) / new_tokens, (us - a["kernels"].get(k, [0, 0.0])[1]) / new_tokens]
           for k, (c, us) in b["kernels"].items()}  # fmt: skip
    top = sorted(per.items(), key=lambda kv: -kv[1][1])[:25]
    return dict(wall_ms_per_step=(b["wall_ms"] - a["wall_ms"]) / new_tokens, busy_ms_per_step=(b["busy_ms"] - a["busy_ms"]) / new_tokens,
                kernels_per_step=sum(c for c, _ in per.values()),
                top_kernels=[dict(name=k, per_step=c, us_per_step=us) for k, (c, us) in top])  # fmt: skip


def bench_generate_static(model, batch: int, prompt_len: int, new_tokens: int, profile: bool = False,
                          reps: int = 3) -> dict:  # fmt: skip
    """``generate(cache_implementation="static")``: decode time = median t(1 + n) - median t(1) over
    ``reps`` alternated calls of each, both lengths called once before timing (the first call of a
    cache length compiles on CUDA). One call of each was too few: the host-bound prompt step moves
    t(1) by as much as a whole short decode takes."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=device, generator=g)
    mask = torch.ones_like(ids)

    def gen(n):
        with _Timer(device) as t, torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0, cache_implementation="static")  # fmt: skip
        return t.s

    _reset_peak(device)
    t0 = time.perf_counter()
    # warm-up: compilation and graph capture. The longer call first: transformers keeps the largest
    # static cache length it has seen, so the short call reuses that cache shape and graph.
    gen(1 + new_tokens), gen(1)
    setup_s = time.perf_counter() - t0
    t1s, tns = [], []
    for _ in range(max(1, reps)):
        t1s.append(gen(1))
        tns.append(gen(1 + new_tokens))
    t1, tn = statistics.median(t1s), statistics.median(tns)
    dt = max(tn - t1, 1e-9)
    out = dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, decode_s=dt, setup_s=setup_s,
               tokens_per_s=batch * new_tokens / dt, ms_per_step=1e3 * dt / new_tokens, peak_bytes=_peak(device))  # fmt: skip
    if profile:
        out["profile"] = profile_steps(gen, min(new_tokens, 32), reps=reps)
    return out


def measure(model, label: str, a, device: torch.device) -> dict:
    res = {"label": label, "weight_bytes": weight_bytes(model), "step_bytes": {b: step_bytes(model, b) for b in a.batch},
           "copy_bytes_per_s": copy_bandwidth(device)}  # fmt: skip
    _sync(device)
    res["allocated_bytes"] = (
        int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None
    )
    print(f"[{label}] weights {res['weight_bytes'] / 2**30:.2f} GiB", flush=True)
    res["prefill"] = pf = bench_prefill(model, a.prefill_batch, a.seq_len, a.reps)
    per_moe = f", {1e3 * pf['host_s_per_moe_layer']:.2f} ms host per MoE layer ({pf['moe_layers']})" if pf["moe_layers"] else ""
    print(f"[{label}] prefill {pf['tokens_per_s']:.0f} tok/s: host {1e3 * pf['host_s']:.1f} ms, device {1e3 * pf['device_s']:.1f} ms "
          f"a forward{per_moe}", flush=True)  # fmt: skip
    res["decode"] = []
    for b in [] if a.no_static_generate else a.batch:
        try:
            r = bench_generate_static(model, b, a.prompt_len, a.new_tokens, profile=a.profile, reps=a.reps)
        except Exception as e:  # noqa: BLE001 - recorded; the other figures still count
            r = dict(batch=b, mode="generate() static cache", error=f"{type(e).__name__}: {str(e)[:300]}")
            res["decode"].append(r)
            print(f"[{label}] decode B={b} {r['mode']}: failed: {r['error']}", flush=True)
            continue
        r["mode"] = 'generate() static cache'
        res["decode"].append(r)
        print(f"[{label}] decode B={b} {r['mode']}: {r['tokens_per_s']:.1f} tok/s (setup {r['setup_s']:.1f} s)", flush=True)
        if a.profile:
            pr = r["profile"]
            print(f"[{label}]   profiled: {pr['wall_ms_per_step']:.2f} ms/step, device busy {pr['busy_ms_per_step']:.2f} ms, "
                  f"{pr['kernels_per_step']:.0f} kernels/step", flush=True)  # fmt: skip
            for k in pr["top_kernels"][:12]:
                print(f"[{label}]   {k['us_per_step']:8.1f} us/step {k['per_step']:6.1f}/step  {k['name'][:80]}", flush=True)
    if not a.no_generate:
        r = bench_decode_generate(model, 1, a.prompt_len, a.generate_tokens)
        r["mode"] = "generate() dynamic cache"
        res["decode"].append(r)
        print(f"[{label}] decode B=1 {r['mode']}: {r['tokens_per_s']:.1f} tok/s", flush=True)
    graphs = device.type == "cuda" and not a.no_graph
    modes = [("static eager", False, False)]
    if graphs:
        graph_mode = ("StaticGreedyDecoder compile+graph", True, True) if a.compile else ("StaticGreedyDecoder graph", True, False)
        modes = [graph_mode] + (modes if a.eager_decoder else [])
    for b in a.batch:
        toks, rows = {}, []
        for mode, cg, comp in modes:
            try:
                r, toks[mode] = bench_decode_static(model, b, a.prompt_len, a.new_tokens, cg, comp)
            except Exception as e:  # noqa: BLE001 - one mode failing (e.g. a graph capture) is a result too
                r = dict(batch=b, error=f"{type(e).__name__}: {str(e)[:300]}")
                print(f"[{label}] decode B={b} {mode}: failed: {r['error']}", flush=True)
                r["mode"] = mode
                rows.append(r)
                continue
            r["mode"] = mode
            rows.append(r)
            if mode != "static eager":
                r["tokens"] = toks[mode][:, a.prompt_len:].tolist()  # to compare runs (e.g. TP=1 and TP=2)
            bw = res["copy_bytes_per_s"]
            if bw and mode != "static eager":  # the byte bound: weight bytes a step over copy bandwidth
                r["bound_tokens_per_s"] = b * bw / res["step_bytes"][b]
            bound = f", {100 * r['tokens_per_s'] / r['bound_tokens_per_s']:.0f} % of its byte bound" if r.get("bound_tokens_per_s") else ""
            print(
                f"[{label}] decode B={b} {mode}: {r['tokens_per_s']:.1f} tok/s (setup {r['setup_s']:.1f} s){bound}",
                flush=True,
            )
        if "static eager" in toks:  # a graph replays the eager step: the same prompt gives the same tokens
            for r in rows:
                if r["mode"] in toks:
                    r["tokens_match_eager"] = bool(torch.equal(toks[r["mode"]], toks["static eager"]))
        res["decode"] += rows
    if not a.no_launch_count:  # last: the profiler starts after every timed figure
        try:
            pf["launches"] = count_launches(model, a.prefill_batch, a.seq_len)
        except Exception as e:  # noqa: BLE001 - recorded; the timed figures stand
            pf["launches_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if pf.get("launches"):
            n = pf["launches"]
            print(f"[{label}] prefill: {n['kernels']} kernel launches, {n['copies']} copies a forward", flush=True)
    return res


def _ratio(q, b):
    return q / b if isinstance(q, (int, float)) and isinstance(b, (int, float)) and b else None


def _pct(v, bound):
    return 100 * v / bound if isinstance(v, (int, float)) and isinstance(bound, (int, float)) and bound else None


def _scaled(v, scale: float):
    return v * scale if isinstance(v, (int, float)) else None


def summary_rows(res: dict) -> list[dict]:
    """Metric rows: bf16 value, MXFP8 value, ratio (MXFP8 / bf16: for speeds > 1 is MXFP8 faster; for
    memory, times and launch counts it is MXFP8's fraction of bf16)."""
    b, q = res["bf16"], res["mxfp8"]
    rows = [
        dict(
            metric="weights (GiB)", bf16=b["weight_bytes"] / 2**30, mxfp8=q["weight_bytes"] / 2**30
        )
    ]
    pb, pq = b["prefill"], q["prefill"]
    rows.append(
        dict(
            metric=f"prefill tok/s (B={pb['batch']}, S={pb['seq_len']})",
            bf16=pb["tokens_per_s"],
            mxfp8=pq["tokens_per_s"],
        )
    )
    # one forward's host and device time, host time per MoE layer, kernel launches (runs before these
    # figures existed have none: their rows are left out)
    for metric, key, scale in (("prefill host ms / forward", "host_s", 1e3), ("prefill device ms / forward", "device_s", 1e3),
                               ("prefill host ms / MoE layer", "host_s_per_moe_layer", 1e3)):
        if pb.get(key) is not None or pq.get(key) is not None:
            rows.append(dict(metric=metric, bf16=_scaled(pb.get(key), scale), mxfp8=_scaled(pq.get(key), scale)))
    if pb.get("launches") or pq.get("launches"):
        rows.append(dict(metric="prefill kernel launches / forward", bf16=(pb.get("launches") or {}).get("kernels"),
                         mxfp8=(pq.get("launches") or {}).get("kernels")))
    if pb["peak_bytes"] is not None:
        rows.append(
            dict(
                metric="prefill peak memory (GiB)",
                bf16=pb["peak_bytes"] / 2**30,
                mxfp8=pq["peak_bytes"] / 2**30,
            )
        )
    for db, dq in zip(b["decode"], q["decode"]):
        rows.append(
            dict(
                metric=f"decode tok/s B={db['batch']} {db['mode']}",
                bf16=db.get("tokens_per_s"),
                mxfp8=dq.get("tokens_per_s"),
            )
        )
        if db.get("bound_tokens_per_s") or dq.get("bound_tokens_per_s"):  # weight bytes a step / copy bandwidth
            rows.append(dict(metric=f"byte bound tok/s B={db['batch']}", bf16=db.get("bound_tokens_per_s"),
                             mxfp8=dq.get("bound_tokens_per_s")))  # fmt: skip
            rows.append(dict(metric=f"decode % of byte bound B={db['batch']} {db['mode']}",
                             bf16=_pct(db.get("tokens_per_s"), db.get("bound_tokens_per_s")),
                             mxfp8=_pct(dq.get("tokens_per_s"), dq.get("bound_tokens_per_s"))))  # fmt: skip
        if db.get("peak_bytes") is not None and db["mode"] == "generate() static cache":
            rows.append(
                dict(
                    metric=f"decode peak memory B={db['batch']} (GiB)",
                    bf16=db["peak_bytes"] / 2**30,
                    mxfp8=dq["peak_bytes"] / 2**30,
                )
            )
    if res.get("quantize"):
        rows.append(
            dict(metric="quantize in memory (s)", bf16=None, mxfp8=res["quantize"]["wall_s"])
        )
    for r in rows:
        r["ratio"] = _ratio(r["mxfp8"], r["bf16"])
    return rows  # fmt: skip


def table_lines(res: dict) -> list[str]:
    """The end-to-end result as a markdown heading and table (also used by eval/plots.py)."""
    f = lambda v: "-" if v is None else (f"{v:.2f}" if v < 100 else f"{v:.0f}")
    tp = f" x {res['tp']} (tensor parallel)" if res.get("tp", 1) > 1 else ""
    lines = [
        f"## End to end: {res['model']} on {res['env']['device']}{tp} ({res['env']['date']}), recipe {res['recipe']}",
        "",
        "| metric | bf16 | MXFP8 | MXFP8 / bf16 |",
        "|---|---:|---:|---:|",
    ]
    spread = lambda r: f" ({f(r['ratio_min'])}-{f(r['ratio_max'])}, {r['pairs']} pairs)" if r.get("pairs") else ""
    lines += [
        f"| {r['metric']} | {f(r['bf16'])} | {f(r['mxfp8'])} | {f(r['ratio'])}{spread(r)} |"
        for r in res["summary"]
    ]
    return lines


def single_lines(res: dict) -> list[str]:
    """The MXFP8 figures alone (a run without bf16, e.g. ``--mx-only``) as a markdown table."""
    q, gib = res["mxfp8"], 2**30
    tp = f" x {res['tp']} (tensor parallel)" if res.get("tp", 1) > 1 else ""
    lines = [f"## {res['model']} on {res['env']['device']}{tp} ({res['env']['date']}), recipe {res['recipe']}", "",
             "| metric | MXFP8 |", "|---|---:|", f"| weights a rank (GiB) | {q['weight_bytes'] / gib:.2f} |"]  # fmt: skip
    if q.get("allocated_bytes"):
        lines.append(f"| allocated a rank after loading (GiB) | {q['allocated_bytes'] / gib:.2f} |")
    pf = q["prefill"]
    lines.append(f"| prefill tok/s (B={pf['batch']}, S={pf['seq_len']}) | {pf['tokens_per_s']:.0f} |")
    if pf.get("peak_bytes"):
        lines.append(f"| prefill peak memory a rank (GiB) | {pf['peak_bytes'] / gib:.2f} |")
    for d in q["decode"]:
        v = d.get("tokens_per_s")
        lines.append(f"| decode tok/s B={d['batch']} {d['mode']} | {'failed' if v is None else f'{v:.1f}'} |")
    if res.get("bf16_bytes"):  # --mx-only: the bf16 model that was never built
        tp_n = res.get("tp", 1)
        fits = "" if not res.get("device_bytes") else (
            f" against {res['device_bytes'] / gib:.1f} GiB a GPU: " + ("fits" if res["bf16_bytes"] / tp_n < res["device_bytes"] else "does not fit"))
        lines += ["", f"bf16 would hold {res['bf16_bytes'] / gib:.1f} GiB of weights, {res['bf16_bytes'] / tp_n / gib:.1f} GiB a rank{fits}."]
    return lines


def print_table(res: dict) -> None:
    print("\n" + "\n".join(table_lines(res)))


def env_info(device: torch.device) -> dict:
    import transformers

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    return dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, triton=tv, transformers=transformers.__version__,
        python=platform.python_version(), date=datetime.date.today().isoformat(),
    )  # fmt: skip


def _build(a, device: torch.device):
    """The bf16 model the arguments describe, and its label (the same weights in every process)."""
    if a.model:
        from mxq.hf.models import load_model

        model, _ = load_model(a.model, device=device, tokenizer=False)
        return model, a.model
    shape = a.shape or "llama3-8b"
    with _Timer(device) as t:
        model = build_random(shape, device, layers=a.layers)
    print(f"built {shape} on {device} in {t.s:.1f} s", flush=True)
    return model, f"{shape} (random weights)"


def prepare_checkpoints(a, device: torch.device) -> None:
    """``--checkpoint-dir``: the bf16 model of ``--shape`` (random weights) as a checkpoint, then
    ``mxq quantize`` of it with ``--recipe``; either is kept if already there. With ``--mx-only``
    no bf16 checkpoint: the converter reads ``random_source``, one tensor made at a time."""

    bf16, mx = os.path.join(a.checkpoint_dir, "bf16"), os.path.join(a.checkpoint_dir, a.recipe)
    if a.mx_only:
        if not os.path.exists(os.path.join(mx, "config.json")):
            from mxq.convert.converter import quantize_checkpoint

            t0 = time.perf_counter()
            quantize_checkpoint(random_source(a.shape or "llama3-8b", device, layers=a.layers), mx, a.recipe,
                                device=device.type, max_shard_bytes=5 * 2**30)  # fmt: skip
            print(f"wrote {mx} (no bf16 copy) in {time.perf_counter() - t0:.1f} s", flush=True)
        return
    if not os.path.exists(os.path.join(bf16, "config.json")):
        with _Timer(device) as t:
            write_bf16(random_source(a.shape or "llama3-8b", device, layers=a.layers), bf16)
        print(f"wrote {bf16} in {t.s:.1f} s", flush=True)
    if not os.path.exists(os.path.join(mx, "config.json")):
        t0 = time.perf_counter()
        mxq_cli = [sys.executable, "-c", "import sys; from mxq.cli import main; sys.argv[0] = 'mxq'; sys.exit(main())"]
        rc = subprocess.call([*mxq_cli, "quantize", bf16, mx, "--recipe", a.recipe,
                              "--device", device.type, "--force"])  # fmt: skip
        if rc:
            raise SystemExit(f"bench_e2e: mxq quantize {bf16} failed (exit {rc})")
        print(f"wrote {mx} in {time.perf_counter() - t0:.1f} s", flush=True)


def _load_checkpoint(a, role: str, device: torch.device):
    """A role's model from ``--checkpoint-dir`` through ``from_pretrained``: sharded over the
    torchrun ranks (``tp_plan="auto"``) when there are several, else on ``device``."""

    from transformers import AutoModelForCausalLM

    import mxq  # noqa: F401  (quant_method "mxq")

    path = os.path.join(a.checkpoint_dir, "bf16" if role.startswith("bf16") else a.recipe)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    kw = {"tp_plan": "auto"} if world > 1 else {"device_map": str(device)}
    with _Timer(device) as t:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kw)
    if getattr(model.config, "num_experts", None):
        model.set_experts_implementation("grouped_mm") if hasattr(model, "set_experts_implementation") else None
    print(f"loaded {path} (TP={world}) in {t.s:.1f} s", flush=True)
    return model.eval(), f"{a.shape or 'llama3-8b'} (random weights, loaded from checkpoints)"


def worker(a, device: torch.device) -> dict:
    """One model in this process: bf16 as built, or quantized with ``a.recipe`` (``a.worker``);
    ``bf16-grouped``: bf16 with mxq's attention without repeated K/V (``mxq.runtime.fuse.GROUPED_SDPA``),
    to tell that part of the MXFP8 model's gain from the rest. With ``--checkpoint-dir``, the
    role's checkpoint loaded (``_load_checkpoint``; one shard per rank under torchrun)."""
    import mxq

    if a.checkpoint_dir:
        torch.manual_seed(0)  # every rank draws the same inputs
        model, label = _load_checkpoint(a, a.worker, device)
        res = {"model": label, "config": {k: getattr(model.config, k, None) for k in ("hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")}, "tp": a.tp}  # fmt: skip
        if a.mx_only:  # what the same model would hold in bf16, against what one GPU has
            res["bf16_bytes"] = bf16_bytes(model.config)
            if device.type == "cuda":
                res["device_bytes"] = torch.cuda.get_device_properties(device).total_memory
            print(f"bf16 would hold {res['bf16_bytes'] / 2**30:.1f} GiB, {res['bf16_bytes'] / a.tp / 2**30:.1f} GiB a rank",
                  flush=True)  # fmt: skip
        res["measured"] = measure(model, a.worker, a, device)
        return res
    model, label = _build(a, device)
    if a.worker == "bf16-grouped":
        from mxq.runtime.fuse import use_grouped_sdpa

        assert use_grouped_sdpa(model), "the bf16 model does not use sdpa attention"
    res = {"model": label, "config": {k: getattr(model.config, k, None) for k in ("hidden_size", "intermediate_size",
           "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size", "num_experts",
           "num_experts_per_tok", "moe_intermediate_size")}}  # fmt: skip
    if a.worker == "mxfp8":
        check_ids = torch.randint(0, model.config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0)).to(device)
        with torch.inference_mode():
            ref_logits = model(check_ids).logits.float()
        _reset_peak(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        with _Timer(device) as t, contextlib.redirect_stderr(sys.stdout):
            mxq.quantize_model(model, a.recipe, fuse=not a.no_fuse)
        res["quantize"] = dict(wall_s=t.s, peak_extra_bytes=(_peak(device) - base) if device.type == "cuda" else None)
        print(f"quantized in memory ({a.recipe}) in {t.s:.2f} s", flush=True)
        with torch.inference_mode():  # sanity: the quantized model computes nearly the same function
            q_logits = model(check_ids).logits.float()
        res["check"] = dict(
            logits_finite=bool(torch.isfinite(q_logits).all()),
            logits_rel_err_vs_bf16=float((q_logits - ref_logits).norm() / ref_logits.norm()),
            top1_agreement=float((q_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
        )
        del ref_logits, q_logits
        print(f"check vs bf16 logits: {res['check']}", flush=True)
    res["measured"] = measure(model, a.worker, a, device)
    return res


def _leave_process_group() -> None:
    """Under torchrun with gloo: wait for every rank, then close the process group, so no rank exits
    while another still talks to it (gloo aborts a process whose peer vanished). Not with NCCL: after
    CUDA graphs that captured its all-reduces, the barrier never returned on 2x H200 (2026-11-26),
    and NCCL ranks exit cleanly without it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        dist.barrier()
        dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--shape", choices=sorted(SHAPES),
        help="random-weight shape: Llama, or a Qwen3, gpt-oss or Llama 4 mixture of experts (default llama3-8b)"
    )
    src.add_argument("--model", help="a model mxq can load (HF dir, hub id, .gguf, 'default')")
    p.add_argument("--recipe", default="mxfp8")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--prefill-batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", default="1,8", help="decode batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument(
        "--generate-tokens", type=int, default=32, help="new tokens for the eager generate() figure"
    )
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph decode")
    p.add_argument(
        "--compile",
        action="store_true",
        help="StaticGreedyDecoder: compile the step (inductor) before capturing its graph",
    )
    p.add_argument("--no-generate", action="store_true", help="skip the eager generate() figure")
    p.add_argument("--no-static-generate", action="store_true", help="skip generate(cache_implementation=\"static\")")
    p.add_argument("--profile", action="store_true",
                   help="profile the static-cache generate() decode: device-busy vs wall time per step, kernels per step, top kernels")
    p.add_argument("--no-launch-count", action="store_true",
                   help="skip counting the kernel launches of one prefill forward (torch.profiler, CUDA only; by default "
                        "once per worker, after every timed figure, so it costs a few seconds and perturbs no timing)")
    p.add_argument("--no-fuse", action="store_true", help="the quantized model as transformers builds it: no fused projections, producers or grouped attention (mxq.runtime.fuse)")
    p.add_argument("--eager-decoder", action="store_true", help="also time the StaticGreedyDecoder step without a graph")
    p.add_argument("--roles", default="bf16,mxfp8",
                   help="models to run, each in a fresh process: bf16, mxfp8, bf16-grouped (bf16 with mxq's attention "
                        "without repeated K/V); a run of some roles writes a partial JSON that --merge completes")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="combine the JSON of earlier runs into one table: partial runs complete each other, "
                        "complete runs (bf16 and mxfp8) add their pairs to one median")
    p.add_argument("--pairs", type=int, default=1,
                   help="alternate the roles' fresh processes N times (bf16, mxfp8, bf16, ...); the table gives each "
                        "ratio as the median over the pairs with its min-max")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: each role under torchrun on N GPUs (needs --checkpoint-dir)")
    p.add_argument("--checkpoint-dir", help="load the models from checkpoints here (written first if missing: bf16/ and RECIPE/)")
    p.add_argument("--layers", type=int, help="decoder layers of --shape (default: the shape's own count)")
    p.add_argument("--mx-only", action="store_true",
                   help="with --checkpoint-dir: write only the RECIPE checkpoint, each tensor made on the device as the "
                        "converter reads it (no bf16 copy on disk or in memory); --roles mxfp8 only")
    p.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="JSON file to write")
    a = p.parse_args(argv)
    a.batch = [int(v) for v in a.batch.split(",") if v.strip()]  # "" : no decode figures
    if a.merge:
        res, runs = {}, {"bf16": [], "mxfp8": []}
        for path in a.merge:
            with open(path) as f:
                part = json.load(f)
            res.update({k: v for k, v in part.items() if k not in ROLES or v})
            res.update({r: part[r] for r in ROLES if part.get(r)})
            if part.get("bf16") and part.get("mxfp8"):  # each complete run adds its pairs
                for r in runs:
                    runs[r] += part["runs"][r] if part.get("runs") else [part[r]]
        res.pop("runs", None)
        if len(runs["bf16"]) > 1:
            res["runs"], res["bf16"], res["mxfp8"] = runs, runs["bf16"][0], runs["mxfp8"][0]
        return _finish(res, a.out)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "bench_e2e: --device cuda but CUDA is not available (use --device cpu for a smoke run)",
            file=sys.stderr,
        )
        return 2
    if a.mx_only and (not a.checkpoint_dir or a.model or any(r.strip() != "mxfp8" for r in a.roles.split(","))):
        print("bench_e2e: --mx-only needs --checkpoint-dir, a --shape and --roles mxfp8 (there is no bf16 model to run)",
              file=sys.stderr)  # fmt: skip
        return 2
    if a.tp > 1 and not a.checkpoint_dir:
        print("bench_e2e: --tp needs --checkpoint-dir (tensor parallelism loads checkpoints from disk)", file=sys.stderr)
        return 2
    if a.worker:
        if a.worker == "prepare":
            prepare_checkpoints(a, device)
            return 0
        rank = int(os.environ.get("RANK", "0"))
        if "LOCAL_RANK" in os.environ and device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        with contextlib.redirect_stdout(sys.stdout if rank == 0 else open(os.devnull, "w")):
            out = worker(a, device)
        if rank == 0:  # complete or absent: the parent reads its presence as "measured"
            with open(a.worker_out + ".tmp", "w") as f:
                json.dump(out, f)
            os.replace(a.worker_out + ".tmp", a.worker_out)
        _leave_process_group()
        return 0
    res = {"env": env_info(device), "recipe": a.recipe, "args": {k: v for k, v in vars(a).items()}}
    print(json.dumps(res["env"]), flush=True)
    args = list(sys.argv[1:] if argv is None else argv)
    roles = [r.strip() for r in a.roles.split(",") if r.strip()]
    bad = [r for r in roles if r not in ROLES]
    if bad:
        print(f"bench_e2e: --roles: unknown {bad}; choose from {', '.join(ROLES)}", file=sys.stderr)
        return 2
    runs: dict[str, list] = {r: [] for r in roles}
    if a.checkpoint_dir:
        rc = subprocess.call([sys.executable, "-m", "mxq.eval.bench_e2e", *args, "--worker", "prepare"])
        if rc:
            return rc
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.tp}"] if a.tp > 1 else [sys.executable]
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.pairs):  # each model in a fresh process; with --pairs N the roles alternate N times
            for role in roles:
                path = f"{tmp}/{role}-{i}.json"
                cmd = [*launch, "-m", "mxq.eval.bench_e2e", *args, "--worker", role, "--worker-out", path]
                print(f"--- {role}{f' (pair {i + 1} of {a.pairs})' if a.pairs > 1 else ''}: a fresh process", flush=True)
                rc = subprocess.call(cmd)
                if rc != 0 and a.tp > 1 and os.path.exists(path):
                    # every figure was measured and written; a rank died while the process group was
                    # torn down (gloo on CPU aborted a rank now and then under load, after the barrier)
                    print(f"bench_e2e: the {role} processes exited with {rc} after rank 0 wrote every figure; "
                          f"the figures are kept", file=sys.stderr)  # fmt: skip
                elif rc != 0:
                    print(f"bench_e2e: the {role} process failed (exit {rc})", file=sys.stderr)
                    return rc
                with open(path) as f:
                    out = json.load(f)
                res["model"], res["config"] = out["model"], out["config"]
                res.update({k: out[k] for k in ("bf16_bytes", "device_bytes") if k in out})
                runs[role].append(out["measured"])
                if role == "mxfp8" and i == 0 and "quantize" in out:
                    res["quantize"], res["check"] = out["quantize"], out["check"]
                res["tp"] = out.get("tp", 1)
    for role in roles:
        res[role] = runs[role][0]
    if a.pairs > 1 and "bf16" in roles and "mxfp8" in roles:
        res["runs"] = runs
    return _finish(res, a.out)


def pair_summary(res: dict) -> list[dict]:
    """With alternated pairs (``res["runs"]``): each metric's bf16 and MXFP8 medians and the median
    ratio over the pairs with its min and max, so run-to-run noise shows in every figure."""
    per_pair = [summary_rows({**res, "bf16": b, "mxfp8": q}) for b, q in zip(res["runs"]["bf16"], res["runs"]["mxfp8"])]
    by_metric = {}  # merged runs may have measured different modes: a metric's pairs are the runs that have it
    for rows_of_pair in per_pair:
        for c in rows_of_pair:
            by_metric.setdefault(c["metric"], []).append(c)
    rows = []
    for cells in by_metric.values():
        ratios = [c["ratio"] for c in cells if c["ratio"] is not None]
        med = lambda vs: statistics.median(vs) if vs else None
        rows.append(dict(
            metric=cells[0]["metric"], bf16=med([c["bf16"] for c in cells if c["bf16"] is not None]),
            mxfp8=med([c["mxfp8"] for c in cells if c["mxfp8"] is not None]), ratio=med(ratios),
            ratio_min=min(ratios) if ratios else None, ratio_max=max(ratios) if ratios else None, pairs=len(cells),
        ))  # fmt: skip
    return rows


def _finish(res: dict, out: str | None) -> int:
    """The table (when both bf16 and mxfp8 are there) and the JSON."""
    if res.get("bf16") and res.get("mxfp8"):
        res["summary"] = pair_summary(res) if res.get("runs") else summary_rows(res)
        print_table(res)
        if res.get("bf16-grouped"):
            grouped = dict(res, bf16=res["bf16-grouped"])
            res["summary_vs_bf16_grouped"] = summary_rows(grouped)
            print("\nMXFP8 against bf16 with the same attention (mxq's, without repeated K/V):")
            print("\n".join(table_lines(dict(grouped, summary=res["summary_vs_bf16_grouped"]))[2:]))
    elif res.get("mxfp8") and not res.get("bf16"):
        print("\n" + "\n".join(single_lines(res)))
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
