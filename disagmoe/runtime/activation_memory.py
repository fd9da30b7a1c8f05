"""Each rank's activation memory at its peak, from its own program: the schedule replayed op by op.

    rank_activations(cfg, model_cfg, topology, pair_rows, sparse, peer_stores) -> [RankActivations] per rank
    single_activation_bytes(cfg, model_cfg) -> bytes of one process (`mode: single`)

A forward op adds what its autograd segment keeps until its backward (`roofline.memory`'s per-token
terms times the rank's tokens or rows of one micro-batch); the matching backward holds its
layer's gradients on top (deferred weight gradients keep them until the held-back work runs, at
the op's end) and then releases the segment; a `Loss` op holds the head's peak for its span (its
backward runs inside it). The peak is the largest sum on the way, so how many micro-batches are in
flight there is the schedule's: in the disaggregated schedule every forward of a step runs before
the first backward, so an attention rank holds all M micro-batches of all its layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from disagmoe.config import DEFAULT_FP8_EXPERT_BACKWARD, ModelConfig, TrainConfig
from disagmoe.roofline import memory as mem
from disagmoe.runtime.schedule.schedule import (
    AttentionBackward,
    AttentionForward,
    ExpertBackward,
    ExpertForward,
    Loss,
    Op,
)
from disagmoe.runtime.topology import Topology

FORWARD_OF = {AttentionBackward: AttentionForward, ExpertBackward: ExpertForward}


@dataclass(frozen=True)
class RankActivations:
    """One rank's activation peak: its bytes, the micro-batches whose activations it holds there
    and the op it happens in."""

    peak_bytes: int
    micro_batches_in_flight: int
    at_op: str


def value_bytes(cfg: TrainConfig) -> int:
    """Bytes of one activation value in this run's compute dtype."""
    return 2 if cfg.compute_dtype_name == "bf16" else 4


def fp8_backward_of(cfg: TrainConfig) -> str:
    """The FP8 experts' backward recipe `roofline.memory` prices for the run
    (`TrainConfig.expert_backward_precision`; the default where the experts are not FP8: unread)."""
    return cfg.expert_backward_precision or DEFAULT_FP8_EXPERT_BACKWARD


def replay_peak(program: tuple[Op, ...], kept: Callable[[Op], int], held: Callable[[Op], int],
                waits: Callable[[ExpertBackward], int] | None = None,
                first_holds: Callable[[ExpertBackward], int] | None = None) -> RankActivations:
    """Walk `program`: a forward op adds `kept(op)` until its backward; every compute op holds
    `held(op)` on top for its own span (a backward's gradients, the loss's head); the peak of the
    running sum. `waits` (paired expert weight gradients, `kernels.wgrad_pairs`): the rows a layer's
    expert backward leaves waiting for the layer's next one, which runs both launches and frees them
    (the first, third, ... backward of a layer leaves them; an odd last one's wait until the optimizer step);
    `first_holds`: what such a backward, one that leaves its rows, holds more over its own span
    (`roofline.memory.paired_first_held_bytes`)."""
    if first_holds is not None and waits is None:
        raise ValueError("replay_peak: first_holds is what the first backward of a pair holds: give the pairs' waits")
    live: dict[tuple[type, int, int], int] = {}
    waiting: dict[int, int] = {}  # layer -> bytes of the rows waiting for its next expert backward
    total, best = 0, RankActivations(0, 0, "none")
    for op in program:
        if isinstance(op, (AttentionForward, ExpertForward)):
            live[(type(op), op.layer, op.micro_batch)] = kept(op)
            total += kept(op)
        if isinstance(op, (AttentionForward, ExpertForward, Loss, AttentionBackward, ExpertBackward)):
            here = total + held(op)
            if first_holds is not None and isinstance(op, ExpertBackward) and op.layer not in waiting:
                here += first_holds(op)
            if here > best.peak_bytes:
                in_flight = len({mb for _, _, mb in live})
                best = RankActivations(here, in_flight, type(op).__name__ + _where(op))
        if isinstance(op, (AttentionBackward, ExpertBackward)):
            total -= live.pop((FORWARD_OF[type(op)], op.layer, op.micro_batch), 0)
        if waits is not None and isinstance(op, ExpertBackward):
            if op.layer in waiting:  # the pair's launch ran at this op's end: both row sets freed
                total -= waiting.pop(op.layer)
            else:
                waiting[op.layer] = waits(op)
                total += waiting[op.layer]
    return best


def _where(op: Op) -> str:
    layer = getattr(op, "layer", None)
    return (f" L{layer}" if layer is not None else "") + f" mb{op.micro_batch}"


def rank_activations(cfg: TrainConfig, model_cfg: ModelConfig, topology: Topology,
                     pair_rows: bool = False, sparse: bool = False, peer_stores: bool = False) -> list[RankActivations]:
    """Every rank's activation peak over one training step (module docstring).

    Per micro-batch an attention rank runs its tokens (batch_size / micro_batches / D x seq_len);
    an expert rank (or a colocated rank's experts) keeps rows for every (token, k) pair of every
    source it serves (`Topology.sources_of`), whether or not its experts serve the pair: the permute groups all T K pairs,
    those served elsewhere into a spare bucket the experts' buffers still span. With the compact hop
    the expert rank also keeps the combine's rows (`roofline.memory.combine_bytes`); with pair rows
    the combine runs on the attention rank over the receive arena (counted with the buffers), and
    its output [T, H] stays with the next layer's segment (its gradient goes back to the experts);
    so does sparse dispatch's sum of the received partial sums (`sparse_dispatch.scatter_sum`),
    with COMBINE's token index per expert rank (int32 [Q, T]: COMBINE_GRAD's order).
    With `sparse` dispatch a MoE layer's forward also holds, for its span, each expert rank's copy
    of the rows it sends (Q worst-case messages: rows, ids, weights and token index), until the
    sends after it have left, and the op posting a MoE layer's COMBINE_GRAD (its Loss or the next
    layer's backward) each expert rank's dy rows; with `peer_stores` (nvshmem: the kernels store
    the rows into the peers' buffers) only a colocated rank's message to itself. Under `recompute:
    full` a forward keeps its segment's input and routing (and the outputs it sends, its backward's
    roots) and the backward holds its layer's half again (`roofline.memory`'s FULL terms). FP8
    experts (precision fp8) keep and hold their own rows' terms (`roofline.memory`'s `fp8`, their
    backward's by its recipe, `fp8_expert_backward`); emulated (`fp8_emulate`), an expert forward
    holds its dequantised operands for its span (`emulate_transient`). Paired expert weight gradients
    (`pairs_wgrads`): a layer's expert backward leaves its received rows' weight-gradient operands waiting
    for the layer's next one (`replay_peak`'s `waits`, `roofline.memory.paired_wgrad_waiting_bytes`: under the
    all-FP8 backward their e4m3 token-group copies)."""
    m, vb, dropped, fp8 = model_cfg, value_bytes(cfg), cfg.recompute_set, cfg.expert_precision == "fp8"
    all_fp8 = cfg.expert_backward_precision == "fp8"  # the waiting operands are e4m3 token-group copies
    tokens = cfg.batch_size // cfg.micro_batches // topology.data_parallel * cfg.seq_len
    row = mem.expert_row_bytes(m, vb, dropped, fp8) + (0 if pair_rows else mem.combine_bytes(m, vb, dropped) // m.top_k)
    token_row = mem.expert_token_bytes(m, vb, dropped, pair_rows)  # `recompute: full`: received row (and partial sum)
    # a distributed rank counts its FP8 numerics every step: no kernel writes an e4m3 copy beside its work
    fused = cfg.counters_every > 1
    row_grad = mem.expert_row_grad_bytes(m, vb, dropped, fp8, fp8_backward_of(cfg), fused)
    first_row = mem.paired_first_held_bytes(m, vb, dropped, fp8, fp8_backward_of(cfg), fused)  # paired: the first's
    programs = topology.programs(cfg.micro_batches)
    out = []
    for rank, program in enumerate(programs):
        attention = topology.attention_role(rank)
        local = topology.experts_of(rank)

        def received(layer: int) -> int:
            """The tokens this rank's experts receive in `layer`: every one of its sources'."""
            return len(topology.sources_of(layer, rank)) * tokens

        def served(layer: int) -> tuple[int, ...]:
            """The expert ranks this rank dispatches `layer` to (`Topology.served`; none without attention)."""
            return () if attention is None else topology.served(layer, attention[1])

        def kept(op: Op) -> int:
            if isinstance(op, ExpertForward):
                return received(op.layer) * (m.top_k * row + token_row)
            prev_moe = op.layer > 0 and topology.is_moe(op.layer - 1)
            combined = vb * m.hidden_size if (pair_rows or sparse) and prev_moe else 0
            if sparse and not pair_rows and prev_moe:  # COMBINE's index per expert rank, for COMBINE_GRAD's order
                combined += 4 * len(served(op.layer - 1))
            return tokens * (mem.attention_bytes(m, topology.is_moe(op.layer), vb, dropped) + combined)

        def staged(layer: int, row_bytes: int) -> int:
            """A sparse MoE layer's messages to its expert ranks staged by one op (`peer_stores`: its own)."""
            if not (sparse and layer >= 0 and topology.is_moe(layer)):
                return 0
            ranks = served(layer)
            return (int(rank in ranks) if peer_stores else len(ranks)) * tokens * row_bytes

        def held(op: Op) -> int:
            dy = vb * m.hidden_size  # sparse: COMBINE_GRAD's dy rows
            if isinstance(op, AttentionForward):
                return staged(op.layer, vb * m.hidden_size + m.top_k * (4 + vb) + 4)
            if isinstance(op, ExpertForward):  # `fp8_emulate`: the layer's dequantised operands, for its span
                return emulate_transient(cfg, m, received(op.layer) * m.top_k, len(local[op.layer]))
            if isinstance(op, Loss):
                return mem.head_bytes(m, tokens, vb, fused=cfg.runs_fused_loss) + staged(topology.num_layers - 1, dy)
            if isinstance(op, ExpertBackward):
                return received(op.layer) * m.top_k * row_grad
            if isinstance(op, AttentionBackward):
                return (tokens * mem.attention_grad_bytes(m, topology.is_moe(op.layer), vb, dropped)
                        + staged(op.layer - 1, dy))
            return 0

        def waits(op: ExpertBackward) -> int:
            """The rows one expert backward leaves waiting for the layer's next (paired weight gradients)."""
            return mem.paired_wgrad_waiting_bytes(m, received(op.layer) * m.top_k, len(local[op.layer]), vb,
                                                  all_fp8)

        def first_holds(op: ExpertBackward) -> int:
            """What a backward that leaves its rows waiting holds more over its own span."""
            return received(op.layer) * m.top_k * first_row

        paired = pairs_wgrads(cfg, pair_rows)
        out.append(replay_peak(program, kept, held, waits if paired else None,
                               first_holds if paired and first_row else None))
    return out


def pairs_wgrads(cfg: TrainConfig, pair_rows: bool = False) -> bool:
    """Whether a distributed run's expert ranks pair their weight-gradient launches (`kernels.wgrad_pairs`):
    `TrainConfig.pairs_expert_wgrads`, except under pair rows in bands (`pair_bands` > 1: each band's rows are
    a group of their own, and launches over banded groups run alone)."""
    return cfg.pairs_expert_wgrads and not (pair_rows and cfg.pair_bands > 1)


def single_activation_bytes(cfg: TrainConfig, model_cfg: ModelConfig) -> int:
    """One process's activation peak (`runtime.training.trainer`): gradient accumulation runs each
    micro-batch's forward and backward before the next, so one micro-batch of batch_size /
    micro_batches sequences is in flight; the fp32 oracle (`precision: fp32`) takes the whole
    logits' cross-entropy, every other path the chunked loss; FP8 experts their own rows' terms (their
    backward's by its recipe, with the e4m3 copies its kernels write beside their work where its steps do not
    all count their numerics, `TrainConfig.counters_every`); with paired expert weight gradients
    (`TrainConfig.pairs_expert_wgrads`)
    one micro-batch's expert rows waiting beside the next one's whole forward and backward."""
    tokens = cfg.batch_size // cfg.micro_batches * cfg.seq_len
    transient = emulate_transient(cfg, model_cfg, tokens * model_cfg.top_k) if model_cfg.num_moe_layers else 0
    waiting = mem.paired_wgrad_held_bytes(model_cfg, tokens, value_bytes(cfg),
                                          cfg.expert_backward_precision == "fp8") if cfg.pairs_expert_wgrads else 0
    return waiting + mem.activation_bytes(model_cfg, tokens, value_bytes(cfg), chunked=cfg.compute_dtype_name != "fp32",
                                dropped=cfg.recompute_set, fp8=cfg.expert_precision == "fp8",
                                fp8_backward=fp8_backward_of(cfg), forward_transient=transient,
                                fused_copies=cfg.counters_every > 1, fused_loss=cfg.runs_fused_loss)


def emulate_transient(cfg: TrainConfig, model_cfg: ModelConfig, rows: int, experts: int | None = None) -> int:
    """What one layer's emulated FP8 expert forward holds for its span (`fp8_emulate`:
    `roofline.memory.fp8_emulate_transient_bytes` of `rows` rows of `experts` experts); 0 otherwise."""
    if not (cfg.fp8_emulate and cfg.expert_precision == "fp8"):
        return 0
    return mem.fp8_emulate_transient_bytes(model_cfg, rows, value_bytes(cfg), cfg.expert_forward_precision, experts)

