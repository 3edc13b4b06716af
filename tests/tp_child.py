"""One run of tests/test_tp_runtime.py: load an mxq checkpoint with ``from_pretrained`` (with
``tp_plan="auto"`` when started by torchrun; arguments: checkpoint, output, device), then what a user runs: logits of a fixed batch and a
greedy ``generate``. Rank 0 saves them with the local shapes of every MX tensor (``torch.save``)."""

from __future__ import annotations

import os
import sys

import torch
from transformers import AutoModelForCausalLM

import mxq  # noqa: F401  (registers quant_method "mxq")


def main() -> None:
    path, out = sys.argv[1], sys.argv[2]
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    kw = {"tp_plan": "auto"} if world > 1 else ({"device_map": device} if device != "cpu" else {})
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (3, 37), generator=torch.Generator().manual_seed(1)).to(model.device)
    with torch.inference_mode():
        logits = model(ids).logits
        tokens = model.generate(ids[:2, :9], max_new_tokens=12, do_sample=False)
    # the compiled decode step (fullgraph): tensor parallelism's backward hooks must not stop it
    from mxq.runtime.decode import StaticGreedyDecoder

    static = StaticGreedyDecoder(model, 2, 32, cuda_graph=False).generate(ids[:2, :9], 12)
    compiled = StaticGreedyDecoder(model, 2, 32, cuda_graph=False, compile="eager").generate(ids[:2, :9], 12)
    shapes = {n: tuple(p.shape) for n, p in model.state_dict().items() if p.dtype in (torch.float8_e4m3fn, torch.uint8)}
    saved = None
    try:  # a sharded model must refuse to write a checkpoint of its shards
        model.save_pretrained(out + ".saved")
        saved = "written"
    except ValueError as e:
        saved = str(e)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"logits": logits.cpu(), "tokens": tokens.cpu(), "static": static.cpu(), "compiled": compiled.cpu(), "shapes": shapes, "world": world, "saved": saved}, out + ".tmp")
        os.replace(out + ".tmp", out)
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo":  # no rank leaves while another talks to it
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
