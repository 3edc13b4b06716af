"""Kernel lanes: an ``MXLinear``'s eager calls of one input signature, with the host's work done once.

At decode sizes a projection's kernel takes tens of microseconds and the host work of a call as
long: ``mx_linear`` works out which path runs, the path finds its plan by a key of ~25 fields and
builds the weight's TMA descriptor, and Triton's launcher expands the descriptors in Python. A
lane (``dispatch.linear_lane``, kept by ``MXLinear`` per input signature and made after one call
through ``mx_linear``) holds the outcome for the Hopper decode GEMM (``gemm_decode_ws``): the plan,
the int32 view of the weight scales, the weight's expanded descriptor, and the compiled kernels'
C launchers (``launch.RawLauncher``). Measured in BENCHMARKS.md ("Host time per projection call").
A lane serves one device (its input signature holds it) and launches with that device current
(``launch``, "Which device").
"""

from __future__ import annotations

import torch

from mxq.kernels import gemm_decode_ws as WS
from mxq.kernels import gluon_api, launch
from mxq.kernels.buffers import split_counters
from mxq.kernels.launch import descriptor
from mxq.kernels.splitk import split_k_finish


def lane(x, weight, weight_scale, bias, act_elem, act_rule, out_dtype, block_size: int, pre: bool) -> DecodeLane | None:
    """A ``DecodeLane`` for calls like this one (X of ``x``'s shape, dtype and alignment on its device,
    these weight tensors, these options), made from the plan the call just used; None where the plan
    has not been made (``launch.FAST`` off) or takes copies."""
    if not x.is_contiguous():
        return None
    x2 = x.reshape(-1, x.shape[-1])
    plan = WS.PLANS.get(WS.plan_key(x2, weight, weight_scale, bias, act_elem, act_rule, out_dtype, None, block_size, pre))
    if plan is None or plan.trivial or plan.copy_x or plan.copy_w or plan.copy_s:
        return None
    return DecodeLane(plan, x, weight, weight_scale, bias)


class DecodeLane:
    """One module's calls of one input signature, as short as the host can make them.

    ``mx_linear`` works out per call which path runs, finds the plan by a key of ~25 fields and
    builds the weight's TMA descriptor; the launcher expands descriptors in Python. A lane (kept by
    ``MXLinear`` per input signature, made after a call through ``mx_linear``) holds the outcome:
    the plan, the int32 view of the weight scales, the weight's expanded TMA descriptor (and, with X
    quantized inside the kernel, the X position's, made from the same weight as the plan passes
    it), and the compiled kernels' C launchers (``launch.RawLauncher``). A call allocates Y (and
    the split-K partials), encodes the producer's X codes' descriptor when there are codes, and
    launches once. Anything it does not hold yet (a kernel variant not compiled, a profiler's
    launch hooks) goes through the plan: the same kernels, the same bits."""

    __slots__ = ("plan", "weight", "weight_scale", "bias", "s32", "device", "dev_index", "out_shape",
                 "ws_shape", "x2_shape", "exp", "xs_stride", "stream")  # fmt: skip

    def __init__(self, plan, x, weight, weight_scale, bias):
        self.plan, self.weight, self.weight_scale, self.bias = plan, weight, weight_scale, bias
        self.s32 = weight_scale.view(torch.int32)
        self.device, self.dev_index = x.device, x.get_device()
        m, n, k = plan.m, plan.n, plan.k
        self.out_shape = (*x.shape[:-1], n)
        self.ws_shape = (plan.split, m, n)
        self.x2_shape = (m, k)
        self.exp = {}  # fused variant -> (weight's expanded descriptor, X position's for fuse_x, X fill args)
        self.xs_stride = k // WS.BS // 4
        self.stream = launch.stream_getter()

    def _expanded(self, fused: bool, raw):
        """The weight descriptor expanded as the C launcher takes it (and the X position's when X is
        quantized inside), and the constants to encode the producer codes' descriptor per call."""
        plan = self.plan
        (iw, mw), (ix, mx) = raw.descs
        if (iw, ix) != (0, 1) or mw is None or mx is None or mx.get("fp4_padded"):
            return None
        w_desc = descriptor(gluon_api.TensorDescriptor, self.weight, [plan.n, plan.k], [self.weight.stride(0), 1], plan.w_block,
                            plan.w_layout)  # fmt: skip
        w_exp = tuple(launch.nv_tensordesc_arg(w_desc, mw))
        x_exp = tuple(launch.nv_tensordesc_arg(w_desc, mx)) if not plan.pre else None
        fill = launch.tma_fill_args(mx) if plan.pre else None
        got = self.exp[fused] = (w_exp, x_exp, fill)
        return got

    def slow(self, x, x_mx):
        m, k = self.x2_shape
        y = self.plan(x.view(m, k), self.weight, self.weight_scale, self.bias, x_mx)
        return y.view(self.out_shape)

    def __call__(self, x: torch.Tensor, x_mx=None) -> torch.Tensor:
        if self.dev_index != launch.current_device():  # the launch runs in its device's context
            with torch.cuda.device(self.dev_index):
                return self(x, x_mx)
        plan = self.plan
        if not (plan.fuse_x or plan.pre) or launch.hooks_attached():
            return self.slow(x, x_mx)
        counters = split_counters(self.device, plan.tiles) if plan.want_fused else None
        fused = counters is not None
        go = plan.gemm[fused]
        raw = go.raw
        if raw is None or go.template is not None:
            return self.slow(x, x_mx)
        exp = self.exp.get(fused) or self._expanded(fused, raw)
        if exp is None:
            return self.slow(x, x_mx)
        w_exp, x_exp, fill = exp
        m, n, k = plan.m, plan.n, plan.k
        if plan.pre:
            xq, xs = map(WS.tma_rows, x_mx)
            x_exp = (fill[0](xq.data_ptr(), *fill[1:], [m, k], [k, 1], 0), m, k, k, 1)
            xs_arg, xs_stride = xs, self.xs_stride
        else:
            xs_arg, xs_stride = self.s32, self.s32.stride(0)
        dev = self.device
        y = torch.empty(self.out_shape, dtype=plan.out_dtype, device=dev)
        ws = torch.empty(self.ws_shape, dtype=torch.float32, device=dev) if plan.split > 1 else None
        args = plan.args(x, self.s32, xs_arg, self.bias, y, ws, counters, k, xs_stride)
        raw.go(plan.tiles, plan.split, 1, self.stream(self.dev_index), (*w_exp, *x_exp, *args, *go.tail))
        if plan.split > 1 and not fused:
            split_k_finish(ws, y.view(m, n), self.bias, plan.split)
        return y
