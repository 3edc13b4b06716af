"""kernels/buffers.py: device memory the kernels keep between calls (split-K tickets, transposed
scales) is made once, zeroed, grown without freeing what a captured graph may still use, and
outside any CUDA-graph memory pool."""

from __future__ import annotations

import pytest
import torch

from mxq.kernels import buffers


def test_split_counters_are_kept_zeroed_and_grow(monkeypatch):
    monkeypatch.setattr(buffers, "COUNTERS", {})
    monkeypatch.setattr(buffers, "RETIRED", [])
    cpu = torch.device("cpu")
    a = buffers.split_counters(cpu, 10)
    assert a.dtype == torch.int32 and a.numel() == 4096 and not a.any()
    assert buffers.split_counters(cpu, 4096) is a  # kept while big enough
    b = buffers.split_counters(cpu, 5000)
    assert b is not a and b.numel() == 5000 and not b.any()
    assert buffers.RETIRED == [a] and buffers.split_counters(cpu, 1) is b


def test_persistent_makes_off_cuda_and_raises_the_makers_error():
    t = buffers.persistent(lambda: torch.ones(3), torch.device("cpu"))
    assert torch.equal(t, torch.ones(3))
    if torch.cuda.is_available():

        def boom():
            raise RuntimeError("no memory for you")

        with pytest.raises(RuntimeError, match="no memory for you"):  # raised on the caller's thread
            buffers.persistent(boom, torch.device("cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_gpu_kept_buffers_live_outside_graph_pools():
    """What the kernels keep between calls (split-K tickets, transposed scales) is made outside a
    CUDA-graph memory pool even when the first call runs while that pool takes the thread's
    allocations (inductor's CUDA-graph trees warm up and record that way); a control tensor made
    in the same window lands in the pool, so the check can see the difference."""
    pytest.importorskip("triton")
    from torch._inductor.cudagraph_trees import _use_cuda_memory_pool_manager

    from mxq.kernels import gemm_prefill_ws

    dev = torch.device("cuda", torch.cuda.current_device())
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()
    x = torch.randn(64, device=dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(g, pool=pool):
        y = x * 2
    ws = torch.randint(100, 140, (96, 8), dtype=torch.uint8, device=dev)
    need = max(t.numel() for t in buffers.COUNTERS.values()) + 1 if buffers.COUNTERS else 8192
    with _use_cuda_memory_pool_manager(dev.index, pool, side):
        control = torch.empty(1000, device=dev)
        counters = buffers.split_counters(dev, need)
        st = gemm_prefill_ws.scales_kn_cached(ws)
    live = {y.untyped_storage().data_ptr(), control.untyped_storage().data_ptr()}
    assert torch._C._cuda_checkPoolLiveAllocations(dev.index, pool, live)
    assert not torch._C._cuda_checkPoolLiveAllocations(dev.index, pool, {y.untyped_storage().data_ptr()})
    assert counters.numel() >= need and not counters.any()
    assert torch.equal(st[:, :96].cpu(), ws.t().cpu()) and gemm_prefill_ws.scales_kn_cached(ws) is st
