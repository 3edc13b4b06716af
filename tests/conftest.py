"""Without a GPU, run Triton kernels through the interpreter (must be set before triton loads)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist the workers share the machine's cores: one worker's torch threads would
# otherwise contend with the other's.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def _repair_interpreter_scalar_masks() -> None:
    """Triton 3.9's interpreter types a scalar comparison by its operands (an int32 handle holding
    numpy bools), so ``(k < k_hi) & (offs >= 0)`` splats it into an int32 array and every masked
    load with it fails ("mask has unsupported dtype"); compiled kernels type it int1 and are not
    affected. Probed by running such a load: the splat of a boolean handle is kept boolean only
    where the probe fails, so an interpreter that gets it right is left as it is."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import numpy as np
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return

    @triton.jit
    def _probe(p, o, n):
        offs = tl.arange(0, 4)
        tl.store(o + offs, tl.load(p + offs, mask=(offs >= 0) & (1 < n), other=0))

    x = torch.arange(4, dtype=torch.int32)
    try:
        _probe[(1,)](x, torch.empty_like(x), 2)
        return
    except Exception as e:  # noqa: BLE001 - only the known failure is repaired
        if "mask has unsupported dtype" not in repr(e):
            raise
    splat = interpreter.InterpreterBuilder.create_splat

    def create_splat(self, ret_ty, arg):
        out = splat(self, ret_ty, arg)
        if arg.data.dtype == np.bool_ and out.data.dtype != np.bool_:
            return interpreter.TensorHandle(out.data.astype(np.bool_), tl.int1)
        return out

    interpreter.InterpreterBuilder.create_splat = create_splat
    _probe[(1,)](x, torch.empty_like(x), 2)  # now it must run


_repair_interpreter_scalar_masks()
