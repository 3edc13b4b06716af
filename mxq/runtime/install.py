"""The one place mxq gives a module of a user's model another forward, and takes it back.

Fusion (``mxq.runtime.fuse``) and tensor parallelism (``mxq.runtime.tp``) change how a module computes by setting a
forward on the instance, never on its class. ``install_forward`` does it for both and records who
did (``OWNER``), so that:

- under an accelerate hook (``add_hook_to_module``: the hook's wrapper in ``forward``, the wrapped
  one in ``_old_forward``; a model dispatched with ``device_map`` before it was quantized) the new
  forward replaces the wrapped one, and the hook keeps moving the module's inputs and weights;
- a forward someone else set on the instance (a user's patch, another library's wrapper, or mxq's
  other owner) is left alone: mxq steps aside for that module with a warning naming its class and
  the owner that stepped aside, and the module keeps computing what it computed;
- ``restore_forward`` undoes only what the same owner installed.

Submodules are swapped with ``nn.Module.set_submodule`` (quantization, GPTQ's temporary experts).

Whether a class computes what mxq's replacement assumes is decided on its forward's source
(``normalized_source``, ``forward_hash``): a transformers release that changes it keeps its own
forward, and ``warn_unknown_forward`` says so, naming the class.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
import types
import warnings

from torch import nn

OWNER = "_mxq_forward"  # instance attribute: the owner ("fuse", "tp") of the forward mxq installed


def _slot(module: nn.Module) -> str:
    """Where the module's effective forward lives on the instance: accelerate's ``_old_forward``
    under its hook, else ``forward``."""
    d = module.__dict__
    return "_old_forward" if "_hf_hook" in d and "_old_forward" in d else "forward"


def _is_class_forward(module: nn.Module, fn) -> bool:
    return getattr(fn, "__func__", None) is type(module).forward and getattr(fn, "__self__", None) is module


def install_forward(module: nn.Module, forward, owner: str) -> bool:
    """``forward`` (a function of ``(self, ...)``) as ``module``'s own, on behalf of ``owner``;
    False, with a warning, where another forward sits on the instance (module doc)."""
    d = module.__dict__
    where = _slot(module)
    current = d.get(where)
    mine = d.get(OWNER)
    if current is not None and mine != owner and not (mine is None and _is_class_forward(module, current)):
        who = f"mxq's {mine}" if mine else "another library or the user"
        warnings.warn(f"mxq: {type(module).__name__} has a forward installed by {who}; mxq's {owner} leaves that "
                      "module as it is (it computes what it did, without this speed-up)", stacklevel=3)  # fmt: skip
        return False
    d[where] = types.MethodType(forward, module)
    d[OWNER] = owner
    return True


def restore_forward(module: nn.Module, owner: str) -> None:
    """The class's forward again where ``owner`` installed one (an accelerate hook around it kept)."""
    d = module.__dict__
    if d.get(OWNER) != owner:
        return
    del d[OWNER]
    if _slot(module) == "_old_forward":
        d["_old_forward"] = types.MethodType(type(module).forward, module)
    else:
        d.pop("forward", None)


def installed_by(module: nn.Module) -> str | None:
    """The owner of the forward mxq installed on ``module``, if any."""
    return module.__dict__.get(OWNER)


def normalized_source(source: str) -> str | None:
    """A function's source without annotations, docstring, comments or layout (``ast.unparse``): what
    mxq compares to decide whether a class computes what mxq knows."""
    try:
        fn = ast.parse(textwrap.dedent(source)).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(fn, ast.FunctionDef):
        return None
    a = fn.args
    for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
        if arg is not None:
            arg.annotation = None
    fn.returns, fn.decorator_list, fn.name = None, [], "forward"
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        fn.body = body[1:]
    return ast.unparse(fn)


def forward_hash(cls: type) -> str:
    """The sha256 (16 hex digits) of ``cls.forward``'s ``normalized_source``."""
    try:
        source = normalized_source(inspect.getsource(cls.forward)) or ""
    except (OSError, TypeError):
        source = ""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def warn_unknown_forward(cls: type, what: str) -> None:
    """A class mxq knows by name whose forward is not the known one: it keeps its own (callers cache,
    so this is said once a class)."""
    warnings.warn(f"mxq: {cls.__name__}.forward is not the one mxq knows (a new transformers release?); "
                  f"it runs as transformers wrote it, without mxq's {what}", stacklevel=3)  # fmt: skip
