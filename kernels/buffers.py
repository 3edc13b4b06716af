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
