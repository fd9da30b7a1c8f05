"""`bench tune-experts`' block check: a shape's new tiles against the table's, timed as the whole expert block.

The search ranks each GEMM's tiles launch by launch, each repeated alone. The block runs the six GEMMs one after
another with the permute and combine between them, and a tile can rank otherwise there: in session 49 an H100's
Zipf-routed Mixtral retune moved the down data gradient from the library's grouped GEMM to our Triton kernel with
its result stored by TMA (3.449 ms against 3.466 alone), and `bench experts`' fwd+bwd on the new table ran 5%
slower than on the one it replaced (585 against 613 TFLOP/s, same machine, same run). So once a shape's GEMMs are
tuned, `block_check` times the block (`bench experts`' triton block, forward and backward, weight gradients into
fp32 main gradients) on the new tiles and on those the table gave before, twice each in turn (the faster of each
pair counts, so one slow median cannot undo a tune); where the new ones are slower by more than `MARGIN`, each GEMM
whose tile changed is given its old tile back in turn, kept where that makes the block faster by more than `MARGIN`,
and all of them where no single one does (`together`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from disagmoe.bench.experts import ExpertShape, make_block, make_inputs, make_output_grad, time_block
from disagmoe.kernels.moe_ffn import FFNTiles
from disagmoe.kernels.tile_configs import ROLES

# What a block timing must gain to count: about the spread between two timings of one unchanged kernel in one call
# (session 49: `bench experts`' grouped_mm Mixtral fwd+bwd at 436 and 432 TFLOP/s, 0.9% apart)
MARGIN = 0.01


@dataclasses.dataclass(frozen=True)
class BlockVerdict:
    """The tiles a shape keeps (`tiles`), the GEMMs given their old tile back (`kept_old`; `together`: all the
    changed ones, since no single one explained the slower block), and a line each for the log."""

    tiles: FFNTiles
    kept_old: tuple[str, ...]
    lines: tuple[str, ...]
    together: bool = False


def block_check(before: FFNTiles, after: FFNTiles, block_ms: Callable[[FFNTiles], float],
                margin: float = MARGIN, roles: tuple[str, ...] = ROLES) -> BlockVerdict:
    """The tiles of `after` (the search's winners) the block keeps against `before` (the table's), timed by
    `block_ms` (module docstring); only `roles`' tiles are compared (the others the same on both sides)."""
    changed = [role for role in roles if getattr(before, role) != getattr(after, role)]
    if not changed:
        which = "tile" if roles == ROLES else f"tile of {', '.join(roles)}"
        return BlockVerdict(after, (), (f"  block check: the search kept every {which} the table had",))
    timed = [block_ms(tiles) for tiles in (after, before, after, before)]  # in turn: drift hits both alike
    new_ms, old_ms = min(timed[0::2]), min(timed[1::2])
    lines = [f"  block check: fwd+bwd {new_ms:.3f} ms on the new tiles, {old_ms:.3f} ms on the table's "
             f"({', '.join(changed)} changed)"]
    if new_ms <= old_ms * (1 + margin):
        return BlockVerdict(after, (), (*lines, "  block check: the new tiles stay"))
    tiles, best_ms, kept = after, new_ms, []
    for role in changed:
        trial = dataclasses.replace(tiles, **{role: getattr(before, role)})
        trial_ms = block_ms(trial)
        lines.append(f"  block check: {role}'s old tile back: {trial_ms:.3f} ms")
        if trial_ms < best_ms * (1 - margin):
            tiles, best_ms, kept = trial, trial_ms, [*kept, role]
    together = best_ms > old_ms * (1 + margin)
    if together:  # no single GEMM explains it: the table's tiles, all of them
        tiles, best_ms, kept = before, old_ms, changed
    lines.append(f"  block check: the old tile kept for {', '.join(kept) or 'none'} ({best_ms:.3f} ms)"
                 + (": no single GEMM's new tile explained the slower block" if together else ""))
    return BlockVerdict(tiles, tuple(kept), tuple(lines), together)


def block_timer(shape: ExpertShape, device: torch.device, warmup: int,
                iters: int) -> Callable[[FFNTiles], float]:
    """Median ms of the shape's triton expert block forward and backward at given tiles, weight gradients added
    into fp32 main gradients, on inputs made at its first call and kept (`bench experts --main-grads`' fwd+bwd
    row)."""
    made = []

    def block_ms(tiles: FFNTiles) -> float:
        if not made:
            inputs = make_inputs(shape, device)
            made.append((inputs, make_output_grad(inputs)))
        inputs, dy = made[0]
        return time_block(make_block("triton", tiles), inputs, dy, "fwd+bwd", warmup, iters, main_grads=True)
    return block_ms
