"""Interop with other FP8 libraries (optional dependencies, imported on first use: the
first eager call of a public op with a torchao tensor imports ``qmoe.interop.torchao``,
whose import registers the rules; import it yourself before compiling)."""

from __future__ import annotations

from typing import Any

import torch

from qmoe.ops.checks import register_foreign_rules


def from_torchao(t: torch.Tensor) -> torch.Tensor:
    """qmoe tensor sharing ``t``'s data (torchao's Float8Tensor, MXTensor or
    Float8TrainingTensor); see :func:`qmoe.interop.torchao.from_torchao`."""
    from qmoe.interop import torchao as _ao

    return _ao.from_torchao(t)


def to_torchao(t: torch.Tensor, cls: type, **kwargs: Any) -> torch.Tensor:
    """torchao tensor of class ``cls`` sharing qmoe tensor ``t``'s data; see
    :func:`qmoe.interop.torchao.to_torchao`."""
    from qmoe.interop import torchao as _ao

    return _ao.to_torchao(t, cls, **kwargs)


def _load_torchao_rules() -> None:
    """Register qmoe's rules for torchao's tensor types (importing torchao)."""
    from qmoe.interop import torchao  # noqa: F401


register_foreign_rules("torchao", _load_torchao_rules)
