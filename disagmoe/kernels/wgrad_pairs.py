"""Expert weight gradients over pairs of micro-batches: one launch, one main-gradient pass, for two.

Why (issue 20 item 2): the Triton experts' weight-gradient launch (`grouped_gemm.ragged_weight_grad`)
adds into its weight's fp32 main gradient, reading and writing it whole: 8 bytes per expert parameter
per micro-batch. With many small micro-batches that traffic, not the FLOPs, bounds the launch (the
Qwen3 config at 8 micro-batches on one H100: 257.7 GB a step, 90 ms of the launches' 125.6 ms).

Inside `paired_weight_grads` (the single-GPU step's micro-batch loop, and a distributed rank's step up to its
optimizer step, `runtime.cluster.worker`; `TrainConfig.expert_wgrad_pairs`)
a launch into a main gradient (`weight_grad_into`) does not run: its rows wait until the next
micro-batch's launch into the same main gradient, and the two run as one launch over both row sets
(`ragged_weight_grad`'s `second`), which reads and writes the main gradient once. A launch left
without a partner (an odd number of micro-batches) runs alone when the block exits, before anything
reads the gradients. The cost is memory: the waiting rows (x, d y, act and d h13 of one micro-batch,
every MoE layer's) live through the next micro-batch's forward and backward
(`roofline.memory.paired_wgrad_held_bytes`, in the single trainer's memory check).

The all-FP8 backward (`fp8_expert_backward: fp8`) pairs the same way (`fp8_weight_grad_into`): what
waits is its token-group copies (one byte a value and a scale per 128 tokens, each expert group padded to a
multiple of 128 rows: what the memory model counts for them), and `fp8_gluon.gluon_fp8_weight_grad` sums
both sets in one launch (the Triton `fp8.fp8_weight_grad` by a second launch into the main gradient: the
unpaired order).

The sum: each output element adds the first micro-batch's rows then the second's in one fp32
accumulator, then adds that into the main gradient; unpaired, each micro-batch's sum is added on its
own. The two differ by fp32 rounding order only. Which launches pair is host state decided by call
order, the same every step, so a captured step replays the same pairs; nothing held outlives the
block (a captured step body keeps nothing it allocated).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from disagmoe.kernels import grouped_gemm as gg
from disagmoe.kernels.first_touch import adds_into
from disagmoe.kernels.tile_configs import TileConfig


@dataclass(frozen=True)
class _RowsLaunch:
    """A bf16 rows launch (`grouped_gemm.ragged_weight_grad`) waiting for the next micro-batch's launch
    into the same main gradient."""

    a_NK: torch.Tensor
    b_NC: torch.Tensor
    offsets_E: torch.Tensor
    config: TileConfig
    main: torch.Tensor
    weights: int
    num_programs: int | None

    @property
    def banded(self) -> bool:
        """Whether its rows hold several groups a weight (pair rows in bands): such a launch runs alone."""
        return self.offsets_E.shape != (self.weights,)

    def pairs_with(self, other: _Launch) -> bool:
        """Whether one launch can take both row sets (`ragged_weight_grad`'s `second`)."""
        return (isinstance(other, _RowsLaunch) and not self.banded and not other.banded
                and other.a_NK.shape[1:] == self.a_NK.shape[1:] and other.b_NC.shape[1:] == self.b_NC.shape[1:]
                and other.a_NK.dtype == self.a_NK.dtype and other.b_NC.dtype == self.b_NC.dtype
                and other.a_NK.stride() == self.a_NK.stride() and other.b_NC.stride() == self.b_NC.stride())

    def run(self, second: _RowsLaunch | None = None) -> None:
        gg.ragged_weight_grad(self.a_NK, self.b_NC, self.offsets_E, self.config, out=self.main,
                              accumulate=adds_into(self.main), weights=self.weights, num_programs=self.num_programs,
                              second=None if second is None else (second.a_NK, second.b_NC, second.offsets_E))


# an FP8 weight-gradient launch: (a, b, padded_E, out, accumulate, second) -> None, the FFN's kernel choice
TokenGroupKernel = Callable[..., object]


@dataclass(frozen=True)
class _TokenGroupLaunch:
    """An FP8 launch over token-group operands (`fp8.quantize_token_groups`' (q_KP, s_KC) pairs and
    padded offsets) waiting for the next micro-batch's launch into the same main gradient; `kernel` runs
    it (`fp8.fp8_weight_grad` or `fp8_gluon.gluon_fp8_weight_grad`, as the FFN chose), taking `second`."""

    a: tuple[torch.Tensor, torch.Tensor]
    b: tuple[torch.Tensor, torch.Tensor]
    padded_E: torch.Tensor
    kernel: TokenGroupKernel
    main: torch.Tensor
    weights: int

    @property
    def banded(self) -> bool:
        """Whether its token groups hold several groups a weight: such a launch runs alone."""
        return self.padded_E.shape != (self.weights,)

    def pairs_with(self, other: _Launch) -> bool:
        """Whether one launch can take both row sets: the same kernel, one group an expert, the same
        KA and C (the token counts may differ)."""
        return (isinstance(other, _TokenGroupLaunch) and other.kernel == self.kernel
                and not self.banded and not other.banded
                and other.a[0].shape[0] == self.a[0].shape[0] and other.b[0].shape[0] == self.b[0].shape[0])

    def run(self, second: _TokenGroupLaunch | None = None) -> None:
        self.kernel(self.a, self.b, self.padded_E, out=self.main, accumulate=adds_into(self.main),
                    second=None if second is None else (second.a, second.b, second.padded_E))


_Launch = _RowsLaunch | _TokenGroupLaunch


class _Pairing:
    """The launches waiting inside `paired_weight_grads`, by their main gradient (None outside it). A
    global, not a thread-local: on CUDA the autograd engine runs backward functions on its own thread."""

    waiting: dict[int, _Launch] | None = None


@contextlib.contextmanager
def paired_weight_grads(enabled: bool = True) -> Iterator[None]:
    """Pair the weight-gradient launches into main gradients made inside the block (module
    docstring); on a normal exit the launches still waiting run alone. `enabled` False: a no-op."""
    if not enabled:
        yield
        return
    previous, _Pairing.waiting = _Pairing.waiting, {}
    try:
        yield
        waiting = _Pairing.waiting
        _Pairing.waiting = None  # the flush below runs its launches
        for launch in waiting.values():
            launch.run()
    finally:
        _Pairing.waiting = previous


def run_waiting() -> None:
    """Run the launches waiting inside `paired_weight_grads` now, each alone (a no-op outside one): before
    anything reads their main gradients while the block stays open (a rank's optimizer step inside its
    step's block, `runtime.cluster.worker`)."""
    waiting = _Pairing.waiting
    if not waiting:
        return
    launches = list(waiting.values())
    waiting.clear()
    for launch in launches:
        launch.run()


def launches_waiting() -> int:
    """How many launches wait for a partner now (0 outside `paired_weight_grads`)."""
    return len(_Pairing.waiting or ())


def pairing() -> bool:
    """Whether a launch into a main gradient waits for its partner now (inside `paired_weight_grads`)."""
    return _Pairing.waiting is not None


def weight_grad_into(a_NK: torch.Tensor, b_NC: torch.Tensor, offsets_E: torch.Tensor, config: TileConfig, *,
                     main: torch.Tensor | None, weights: int, num_programs: int | None = None) -> torch.Tensor | None:
    """A Triton expert weight gradient (`ragged_weight_grad` of a, b over `offsets_E`'s groups, E_W =
    `weights`): into `main` (an fp32 main gradient: stored at the step's first write, else added,
    `kernels.first_touch`), returning None, now or, inside `paired_weight_grads`, paired with the
    next micro-batch's launch into `main` (module docstring); `main` None: a new [E_W, K, C] tensor,
    returned."""
    if main is None:
        return gg.ragged_weight_grad(a_NK, b_NC, offsets_E, config, weights=weights, num_programs=num_programs)
    _submit(_RowsLaunch(a_NK, b_NC, offsets_E, config, main, weights, num_programs))
    return None


def fp8_weight_grad_into(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                         padded_E: torch.Tensor, kernel: TokenGroupKernel, *, main: torch.Tensor, weights: int) -> None:
    """An FP8 expert weight gradient over token groups (`kernel`, the FFN's choice, taking `out`,
    `accumulate` and `second`) into the fp32 main gradient `main` (stored at the step's first write, else
    added), now or, inside `paired_weight_grads`, paired with the next micro-batch's launch into `main`:
    the token-group copies wait, not the bf16 rows (one byte a value and a scale per 128 tokens)."""
    _submit(_TokenGroupLaunch(a, b, padded_E, kernel, main, weights))


def _submit(launch: _Launch) -> None:
    """Run `launch` now (outside `paired_weight_grads`, or banded groups), or keep it waiting for the
    next launch into its main gradient, or run the one waiting there with it as its second row set."""
    waiting = _Pairing.waiting
    if waiting is None or launch.banded:  # outside the block, or banded groups: now
        launch.run()
        return
    first = waiting.pop(id(launch.main), None)
    if first is None:
        waiting[id(launch.main)] = launch
    elif first.pairs_with(launch):
        first.run(second=launch)
    else:  # rows of another width, layout or kernel (not one model's micro-batches): one launch each
        first.run()
        launch.run()
