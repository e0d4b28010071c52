"""shoal's layers are called straight into their ``forward``: no hook machinery, and a hook
cannot be registered on them without an error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shoal.workers.layers.hookless import HooklessModule
from shoal.workers.layers.norm import RMSNorm


class Doubling(HooklessModule):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


class Tripling(Doubling):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 3 * x


def test_a_call_is_the_subclass_s_own_forward() -> None:
    x = torch.ones(2)
    assert type(Doubling()).__call__ is Doubling.forward
    assert torch.equal(Doubling()(x), 2 * x)
    assert torch.equal(Tripling()(x), 3 * x)


def test_the_model_layers_skip_nn_module_s_call() -> None:
    norm = RMSNorm(8, 1e-6, dtype=torch.float32, device=torch.device("cpu"))
    assert type(norm).__call__ is RMSNorm.forward
    assert type(norm).__call__ is not nn.Module.__call__


def test_hooks_are_refused_not_silently_skipped() -> None:
    layer = Doubling()
    with pytest.raises(NotImplementedError, match="runs no hooks"):
        layer.register_forward_hook(lambda *args: None)
    with pytest.raises(NotImplementedError, match="runs no hooks"):
        layer.register_forward_pre_hook(lambda *args: None)
