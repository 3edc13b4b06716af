"""Without a GPU, run Triton kernels through the interpreter (must be set before triton loads)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
