"""The one place mxq gives a module of a user's model another forward, and takes it back.

Fusion (``mxq.fuse``) and tensor parallelism (``mxq.tp``) change how a module computes by setting a
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
"""

from __future__ import annotations

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
