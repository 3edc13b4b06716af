"""Converter speed and memory on a large checkpoint, against the pure-I/O floor.

Generates a random bf16 checkpoint with the tensor shapes of a Llama or Qwen3-MoE config (shard by shard, so
generating it never holds the model either), then in one process:

* the I/O floor: every tensor read and written unchanged through the same streaming reader and
  writer (what any converter must at least spend);
* ``mxq quantize`` (``quantize_checkpoint``) with the default recipe on ``--device``.

Prints wall time, throughput, peak RSS growth and the ratio to the floor; writes JSON.

    python -m mxq.eval.bench_convert --shape llama3-8b --work /tmp/bench-convert --out convert.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

SHAPES = {
    # Llama-3-8B / -70B linear and embedding shapes (random weights: for speed only).
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256),
    "llama3-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=1024),
    # Qwen3-30B-A3B widths with 16 of its 48 layers: 128 experts per layer, stored one by one as its
    # checkpoints store them (experts.N.{gate,up,down}_proj.weight)
    "qwen3-30b-a3b-16l": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                              num_experts=128, num_experts_per_tok=8, num_hidden_layers=16, num_attention_heads=32,
                              num_key_value_heads=4, head_dim=128, vocab_size=151936, decoder_sparse_step=1, mlp_only_layers=[]),
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                     num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, vocab_size=1024, decoder_sparse_step=1, mlp_only_layers=[]),
}  # fmt: skip


def _disk_shapes(skel) -> dict[str, tuple[int, ...]]:
    """Tensor shapes as a checkpoint of this model stores them: fused experts [E, 2I, H] / [E, H, I]
    written one expert and projection at a time."""
    shapes = {}
    for k, v in skel.state_dict().items():
        if k.endswith("experts.gate_up_proj"):
            e, two_i, h = v.shape
            for i in range(e):
                for p in ("gate_proj", "up_proj"):
                    shapes[f"{k[: -len('gate_up_proj')]}{i}.{p}.weight"] = (two_i // 2, h)
        elif k.endswith("experts.down_proj"):
            e, h, inter = v.shape
            for i in range(e):
                shapes[f"{k[: -len('down_proj')]}{i}.down_proj.weight"] = (h, inter)
        else:
            shapes[k] = tuple(v.shape)
    return shapes


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> int:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status("VmRSS")


def generate(shape: str, path: Path, shard_bytes: int = 4 * 1024**3, device: str = "cpu") -> tuple[int, int]:
    """Write a random bf16 checkpoint of the named shape (random numbers drawn on ``device``);
    returns (parameters, bytes)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(SHAPES[shape])
    cfg = AutoConfig.for_model(kw.pop("model_type", "llama"), **kw, tie_word_embeddings=False, torch_dtype="bfloat16")
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    with torch.device("meta"):
        skel = AutoModelForCausalLM.from_config(cfg)
    shapes = _disk_shapes(skel)
    shards, cur, size = [], [], 0
    for k, s in shapes.items():
        n = torch.Size(s).numel() * 2
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += n
    shards.append(cur)
    weight_map, total = {}, 0
    g = torch.Generator(device).manual_seed(0)
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        part = {
            k: (torch.randn(shapes[k], generator=g, device=device) * 0.02).to(torch.bfloat16).cpu() for k in names
        }
        save_file(part, path / fname, metadata={"format": "pt"})
        total += sum(v.numel() * 2 for v in part.values())
        weight_map.update({k: fname for k in names})
        del part
        print(f"  wrote {fname}", flush=True)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total // 2, total


def io_floor(src: Path, out: Path) -> float:
    from mxq.checkpoint.files import (
        DTYPE_NAMES,
        PlannedTensor,
        ShardWriter,
        read_index,
        read_tensor,
    )

    infos = read_index(src)
    layout = [PlannedTensor(i.name, i.dtype, i.shape) for i in infos.values()]
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    w = ShardWriter(out, layout, 2 * 1024**3)
    for info in infos.values():
        t = read_tensor(info)
        assert DTYPE_NAMES[t.dtype] == info.dtype
        w.write(info.name, t)
    w.close()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--work", type=Path, default=Path("/tmp/mxq-bench-convert"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint for the next run")
    args = ap.parse_args()

    from mxq.convert.converter import quantize_checkpoint

    src = args.work / f"src-{args.shape}"
    if not (src / "model.safetensors.index.json").is_file():
        print(f"generating a random {args.shape} checkpoint in {src} ...", flush=True)
        shutil.rmtree(src, ignore_errors=True)
        generate(args.shape, src, device="cuda" if args.device.startswith("cuda") else "cpu")
    n_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    results = {}
    for name in ("io_floor", "mxq_quantize"):
        dst = args.work / f"out-{name}"
        shutil.rmtree(dst, ignore_errors=True)
        base = _reset_peak()
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if name == "io_floor":
            io_floor(src, dst)
        else:
            quantize_checkpoint(src, dst, device=args.device, progress=False)
        wall = time.perf_counter() - t0
        results[name] = {
            "wall_s": wall,
            "source_bytes": n_bytes,
            "output_bytes": sum(f.stat().st_size for f in dst.glob("*.safetensors")),
            "mib_per_s": n_bytes / 2**20 / wall,
            "peak_rss_growth_bytes": _status("VmHWM") - base,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else None,
        }
        shutil.rmtree(dst, ignore_errors=True)
    floor = results["io_floor"]["wall_s"]
    print(f"\nshape {args.shape}, device {args.device}, source {n_bytes / 2**30:.2f} GiB bf16, torch {torch.__version__}")
    print("| run | wall s | MiB/s | output GiB | peak RSS growth MiB | x I/O floor time |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {r['wall_s']:.1f} | {r['mib_per_s']:.0f} | {r['output_bytes'] / 2**30:.2f} | "
            f"{r['peak_rss_growth_bytes'] / 2**20:.0f} | {r['wall_s'] / floor:.2f} |"
        )
    if args.out:
        args.out.write_text(json.dumps({"shape": args.shape, "device": args.device, "results": results}, indent=1))
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)


if __name__ == "__main__":
    main()
