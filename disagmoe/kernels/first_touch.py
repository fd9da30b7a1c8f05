"""First touch of an fp32 main gradient: the step's first weight-gradient write stores, later ones add.

Why (issue 20, step efficiency): FlatAdamW's `zero_grad` fills every main gradient with zeros each
step (4 B per parameter written), and the first weight-gradient GEMM of the step into each then
reads those zeros back to add to them (4 B per parameter read). A writer that writes every element
of a main gradient on each call (the Triton experts' ragged weight-gradient launch,
`grouped_gemm.ragged_weight_grad`: every output tile, zeros for an expert without rows) can store
its result instead the first time in a step, and `zero_grad` can leave that gradient alone. In fp32
a store of x is 0 + x bit for bit (x is never -0: the GEMM's sums start from +0), so the step's
gradients, and everything after them, are unchanged.

The protocol is host state decided by the order of calls within a step, the same every step (so a
CUDA graph that captured the step replays the same stores and adds):

- the optimizer opts a main gradient in once, for a parameter whose own code says it writes the
  gradient whole (`model.experts.first_touch_params`); everything else is zeroed as before;
- `zero_grad` skips the opted-in gradients and marks them untouched (`mark_untouched`);
- a writer of the whole gradient asks `take_first_touch(main)` right before it launches: True (the
  mark is cleared) means store, False means add;
- any other writer calls `touch(main)` before adding into it: an untouched gradient is zeroed
  first, the old order (FlatAdamW's post-accumulate hook, for the backends whose gradients go
  through autograd);
- before anything reads the gradients (norm, step, all-reduce, reduce-scatter) the optimizer zeroes
  every gradient still untouched (`FlatAdamW.settle_grads`): a step in which no writer ran (an
  expert rank that received nothing, a layer whose backward never ran) leaves zeros, never the last
  step's values.

The mark is an attribute of the main-gradient tensor object itself (the view FlatAdamW attaches as
`param.main_grad`), so every holder of that tensor (an autograd context, a held-back weight-gradient
closure, `kernels.deferral`) sees the same state whenever its work runs.
"""

from __future__ import annotations

import torch

_UNTOUCHED = "_disagmoe_untouched"  # on a main-gradient tensor: True from zero_grad until its first writer


def mark_untouched(main: torch.Tensor) -> None:
    """`main` holds stale values until its first writer of this step (set by the optimizer's zero_grad)."""
    setattr(main, _UNTOUCHED, True)


def is_untouched(main: torch.Tensor | None) -> bool:
    """Whether `main` (None: no main gradient) still waits for its first writer of the step."""
    return main is not None and getattr(main, _UNTOUCHED, False)


def take_first_touch(main: torch.Tensor | None) -> bool:
    """For a writer about to write every element of `main`: True if this is the step's first write (the
    writer must then store, not add; the mark is cleared here), False to add as usual."""
    if not is_untouched(main):
        return False
    setattr(main, _UNTOUCHED, False)
    return True


def adds_into(main: torch.Tensor | None) -> bool:
    """For a writer of every element about to launch into `main` (None: a fresh output): whether
    it adds (a main gradient already written this step) or stores (a fresh output, or the step's
    first write into `main`: `take_first_touch`, which clears the mark)."""
    return main is not None and not take_first_touch(main)


def touch(main: torch.Tensor | None) -> None:
    """For a writer about to add into `main` (not necessarily everywhere): zero it first if it is
    still untouched, so the add sees zeros, as after a full zero_grad."""
    if take_first_touch(main):
        main.zero_()
