"""Device memory that the kernels keep between calls: split-K tickets, transposed scales, rotations.

Such a tensor is made on the first call that needs it, and that call may run while torch
records a CUDA graph: ``generate(cache_implementation="static")`` compiles the decode step with
inductor's CUDA-graph trees, which run the step's first calls (warm-up) and its capture with
every allocation of the calling thread redirected into the graph's private memory pool. A tensor
kept from there lives in memory the graph owns: the trees refuse it ("Detected 1 tensor(s) in
the cudagraph pool not tracked as outputs"), and a plain ``torch.cuda.graph`` would hand its
memory to the next replay's temporaries.

``persistent`` makes it where no graph owns it: the redirection is per thread (torch's
``_cuda_beginAllocateCurrentThreadToPool``), so the tensor is made on a short-lived helper
thread, from the general pool, once per process and buffer. During stream capture nothing may
be made or synchronized at all: it returns None and the caller takes its per-call path.
"""

from __future__ import annotations

import threading

import torch


def persistent(make, device: torch.device) -> torch.Tensor | None:
    """``make()`` (a tensor factory for ``device``) outside any CUDA-graph memory pool, finished
    before this returns; None while the current stream is being captured."""
    if device.type != "cuda":
        return make()
    if torch.cuda.is_current_stream_capturing():
        return None
    # what make() reads was written on the caller's stream: let it land first (once per buffer)
    torch.cuda.current_stream(device).synchronize()
    result: list = []

    def work():
        try:
            with torch.cuda.device(device):
                t = make()
                torch.cuda.current_stream().synchronize()
            result.append(t)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            result.append(e)

    helper = threading.Thread(target=work, name="mxq-persistent-alloc")
    helper.start()
    helper.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


COUNTERS: dict[int, torch.Tensor] = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """Zeroed int32 tickets (one per N tile) shared by every fused split-K launch on ``device``;
    each launch leaves them at zero. Made outside any CUDA-graph memory pool (``persistent``); None
    while a CUDA graph is being captured and none big enough exist yet: the caller then sums the
    partials with the reduction kernel. A buffer that grows keeps the old one alive, since a
    captured graph may still point at it. Launches on two streams at once must not share them
    (one stream per device, as inference runs)."""
    idx = device.index if device.index is not None else torch.cuda.current_device() if device.type == "cuda" else -1
    buf = COUNTERS.get(idx)
    if buf is None or buf.numel() < n:
        fresh = persistent(lambda: torch.zeros(max(n, 4096), dtype=torch.int32, device=device), device)
        if fresh is None:
            return None
        if buf is not None:
            RETIRED.append(buf)
        buf = COUNTERS[idx] = fresh
    return buf


RETIRED: list[torch.Tensor] = []  # grown-out buffers a captured graph may still point at
