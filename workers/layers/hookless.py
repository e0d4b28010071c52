"""The base of shoal's model layers: an ``nn.Module`` whose call goes straight to ``forward``.

``nn.Module.__call__`` runs the hook machinery (global and per-module forward hooks and
pre-hooks) on every call, ~1-2 us each time, and a one-token step of a 30-layer model makes some
330 module calls: about 4% of the step of the default model. shoal registers no hooks on its
layers, so a subclass's ``__call__`` is its own ``forward``, bound when the class is made (a
``forward`` patched onto the class later is not called: patch ``__call__``); registering a
forward hook or pre-hook on one raises rather than being silently skipped.
"""

from __future__ import annotations

from typing import Any, NoReturn

from torch import nn


class HooklessModule(nn.Module):
    """``module(...)`` is ``module.forward(...)``: no hooks run, none can be registered."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        setattr(cls, "__call__", cls.forward)  # noqa: B010  (mypy refuses a method assigned)

    def register_forward_hook(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"{type(self).__name__} runs no hooks (layers/hookless.py)")

    def register_forward_pre_hook(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"{type(self).__name__} runs no hooks (layers/hookless.py)")
