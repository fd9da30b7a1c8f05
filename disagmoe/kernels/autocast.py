"""Operands cast as autocast casts a matmul's, for the ops autocast does not cover."""

from __future__ import annotations

import torch


def autocast_operands(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under autocast on the tensors' device: the tensors cast to the autocast dtype, as autocast
    casts a matmul's operands (the casts' backward hands fp32 weights fp32 gradients); otherwise
    unchanged. For ops autocast does not cover: `torch._grouped_mm` is not on its lists (pytorch
    issue 174763), so fp32 master weights would make it run in fp32, far below the bf16 peak."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.dtype in (torch.float32, torch.float16, torch.bfloat16) else t for t in tensors)
