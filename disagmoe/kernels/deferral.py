"""Weight-gradient work a backward may hold back (`deferred_weight_grads`) and run later: the
deferrable linear layers (`model.layers.DeferrableLinear`) and the Triton experts with fp32 main
gradients (`kernels.moe_ffn`) put their d W here, so a rank sends d x first (DESIGN 3c)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


class _HeldBack:
    """The weight-gradient work held back inside `deferred_weight_grads` (None outside it). A
    global, not a thread-local: on CUDA the autograd engine runs backward functions on its own
    device thread."""

    work: list[Callable[[], None]] | None = None


@contextlib.contextmanager
def deferred_weight_grads() -> Iterator[list[Callable[[], None]]]:
    """Inside the block, a backward computes only the input gradients of the layers that can defer
    (`DeferrableLinear`; the Triton experts with fp32 main gradients) and appends their weight-
    gradient work to the yielded list; each item, run later, puts its gradient where the backward
    would have. A rank sends d x first: the peer waits for it, while d w is needed only by the
    optimizer step (DESIGN 3c's backward critical path)."""
    previous, _HeldBack.work = _HeldBack.work, []
    try:
        yield _HeldBack.work
    finally:
        _HeldBack.work = previous


def hold_back(work: Callable[[], None]) -> bool:
    """Append `work` to the innermost `deferred_weight_grads` list; False outside one (run it now)."""
    if _HeldBack.work is None:
        return False
    _HeldBack.work.append(work)
    return True
