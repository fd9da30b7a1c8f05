"""Predicted step time and memory of a layout: the solver's cost model.

A layout is described by numpy arrays (one element per candidate), so the solver prices every
candidate at once; the same code prices a single layout when given 1-element arrays.

Disaggregated layout (DESIGN section 3): `attn` attention GPUs and `expert` expert GPUs, split
into `p` pipeline groups (group g owns layers g, g+p, ...); a step is `rounds` rounds of `m`
micro-batches, each micro-batch carrying `seqs` sequences per attention GPU. In one round every
micro-batch travels the ring A_0 -> E_0 -> A_1 -> ... once per layer; the attention pool works on
micro-batch i+1 while the expert pool works on micro-batch i, and transfers run on the copy
engines beside the math. Colocated: every GPU runs attention and its share of the experts, with
an all-to-all dispatch and combine that the GPU waits for (no overlap); with p > 1 the combine
goes to the next group's EP block, as the disaggregated ring's does.

Pipeline time of one pass over a round (forward or backward):
    R      = p * (a + d + e + c)        one ring cycle of one micro-batch (mean per layer)
    s_max  = max(a, d, e, c)            the busiest resource's time per micro-batch per cycle
    T      = (L / p) * max(R, m * s_max) + (R - s_max  if m * s_max >= R  else  (m - 1) * s_max)
i.e. resource-bound when the busiest resource has more work per cycle than one micro-batch's
trip around the ring, latency-bound otherwise; plus the fill and drain of the ring.

Memory per GPU: each parameter's training state (`roofline.optimizer_state.state_bytes`: bf16
weight 2 B, fp32 master 4, fp32 gradient 4, two AdamW moments 8 in fp32 or 4 in bf16; ZeRO-1
splits the attention side's master and moments over dp and adds the reduced slice), plus the activations of the m micro-batches
of one round (all kept until their backward) and the larger of the head's and one layer's
backward transient, in `roofline.memory`'s per-token terms (`activations`). The combine's
rows sit on the expert GPU (the runtime's compact hop keeps them there). An expert GPU's rows
are every (token, k) pair of every attention GPU that dispatches to it, not its share of them:
the runtime's buffers span them all (`activations` says why), so its memory is priced on
`pairs`, its time on the rows it computes (`rows`, the busiest GPU's share). Every GPU also holds
the transport's message buffers (`transport_buffers`: nvshmem's symmetric arena, the largest
rank's on every GPU, from `roofline.transport_memory`, which the runtime's memory check shares),
its rings rounded up to a step's messages where the candidate's rank steps are captured in CUDA
graphs (`rank_steps`: the problem's `cuda_graphs` and the layout, as `disagmoe train` decides it).
Under `cuda_graphs: on` a layout whose rank steps cannot be captured never fits: train refuses it.
Paired expert weight gradients (`Problem.wgrad_pairs`, `kernels.wgrad_pairs`) leave each expert backward's rows
waiting for its layer's next: one GPU holds one micro-batch's beside the next, a distributed GPU what its
schedule's replay holds at its peak (`placement.waiting_rows`, the closed form of the runtime's count); auto
settles them per candidate as the run will (`_pairs_fit`, `_settled_recomputation`).

Recomputation (`Problem.recompute`, `Problem.recompute_modules`): the expert modules
(`roofline.memory.SELECTIVE`) leave what the expert side keeps and its expert backward pays
`stages.selective_recompute`'s bytes; `attention` leaves what the attention side keeps
(`memory.attention_recomputed_bytes`) and its attention backward pays `stages.attention_recompute`
(the projections before the core once more per layer: the core's output is kept). Selective drops the modules as given; auto takes,
per candidate, the least that fits: a split drops the expert modules only where the expert GPU
overflows without them and attention only where the attention GPU does (each side's memory
depends on its own modules only), a colocated GPU the fitting variant whose recompute costs
least. Recomputation is never faster for a fixed candidate, only leaner: the search picks it
only through a faster candidate that fits only so. `recompute: full` (`memory.FULL`, asked for,
never auto's choice) prices both sides' activations as `roofline.memory`'s FULL terms (each layer
keeps its input and routing, one layer's backward holds it again) and every attention and expert
stage's forward once more in its backward (`full_recompute_stages`). With FP8 experts
(`Problem.expert_precision`, whatever their rate: the calibration's measured FP8 curve, else
`fp8_speedup` times the bf16 one, `fp8_stages`) the expert
rows keep and hold `roofline.memory`'s `fp8` terms (the backward's by its recipe, `Problem.fp8_backward`),
the weights' e4m3 copies are held, the expert modules are expert_input and expert_swiglu only
(`solver._recompute_of`: no fused FP8 combine for expert_output) and their recompute reads an index,
and under the bf16-wgrad (default) and bf16 backwards gathers the input rows again
(`stages.selective_recompute`'s `fp8`, `fp8_backward`);
on one GPU, whose layer quantises each token once, expert_input also spares the permute its bf16
row copy (`fp8_stages`).

Offload (`Problem.offload_optimizer`): the masters and moments move to host memory (`host_state_bytes`,
which must fit `host_capacity_bytes` per GPU) and the optimizer pays the host link; like
selective recomputation it is never faster for a fixed candidate, only leaner, so the solver's
auto prices every candidate both ways and keeps the faster plan that fits (`solver.choose`).

Links: traffic among GPUs spread evenly over a span wider than an NVLink domain leaves the
domain in proportion (1 - domain / span). Pipeline groups are laid out so that a group (or one
of its replica sets) stays inside a domain when it fits; with p > 1, the hop to the next group
(combine and residual hand-off) stays in a domain when one slice of the ring (a replica set of
every group with its attention GPUs) fits in it, and is priced as scale-out traffic otherwise,
the pessimistic case (`_ring_hop_fraction`). Idle GPUs of the cluster never enter a price.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple

import numpy as np

from disagmoe.config import (DEFAULT_FP8_EXPERT_BACKWARD, FP8_DENSE_SCALING, RUN_FP8_EXPERT_FORWARD, Calibration,
                             ModelConfig)
from disagmoe.roofline import calibration as cal, memory as mem, stages as st, transport_memory as tm
from disagmoe.roofline.ceilings import Ceilings
from disagmoe.roofline.optimizer_state import StateBytes, host_link_bytes, slot_elements, staging_bytes, state_bytes
from disagmoe.roofline.params import (attention_norm_params, attention_params, count_params, expert_params,
                                      router_params, swiglu_params)
from disagmoe.roofline.stages import BF16, FP32, Num, Work
from disagmoe.placement.waiting_rows import colocated_rank_rise, expert_rank_rise
from disagmoe.runtime.schedule.step_capture import StepSettings, resolve


def zero1_ranks(dp: np.ndarray | float, shard_optimizer: bool) -> np.ndarray | float:
    """The ZeRO-1 group splitting a replicated (attention-side) parameter's state on a GPU of a
    data-parallel group of `dp`: dp with `shard_optimizer`, else 1 (unsharded)."""
    return np.maximum(dp, 1) if shard_optimizer else 1 + 0 * dp


def attention_state_bytes(dp: np.ndarray | float, prob: Problem) -> StateBytes:
    """Training-state bytes per replicated (attention-side) parameter on one GPU of a data-parallel
    group of `dp` (bf16 compute: the runtime's precision on GPUs)."""
    return state_bytes(prob.optimizer_state_dtype, "bf16", zero1_ranks(dp, prob.shard_optimizer),
                       offload=prob.offload_optimizer)


def expert_state_bytes(prob: Problem) -> StateBytes:
    """Training-state bytes per expert parameter (never sharded)."""
    return state_bytes(prob.optimizer_state_dtype, "bf16", offload=prob.offload_optimizer)


def offload_staging_bytes(prob: Problem, params: Num) -> Num:
    """Device bytes of the offloaded optimizer's two staging slots on a GPU of `params` parameters
    (the runtime's default bucket; 0 without offload)."""
    if not prob.offload_optimizer:
        return 0.0 * params
    dtype, unbounded = prob.optimizer_state_dtype, 1 << 62
    full = staging_bytes(OFFLOAD_BUCKET_BYTES, dtype, "bf16", unbounded)
    per_element = full / slot_elements(OFFLOAD_BUCKET_BYTES, dtype, "bf16", unbounded)
    return np.minimum(full, per_element * params)  # slots no larger than the GPU's parameters need


GIB = 2.0**30
ATTENTION: frozenset[str] = frozenset({"attention"})  # `recompute_modules: [attention]` (`kernels.recompute`)
OFFLOAD_BUCKET_BYTES = 256 * 2**20  # TrainConfig.offload_bucket_mib's default


@dataclass
class Candidates:
    """Layouts to price; every field an integer array of the same length."""

    attn: np.ndarray  # attention GPUs (all groups); 0 for colocated
    expert: np.ndarray  # expert GPUs (all groups); for colocated, the GPU count
    p: np.ndarray  # pipeline groups (1 for colocated)
    m: np.ndarray  # micro-batches per round
    seqs: np.ndarray  # sequences per attention GPU per micro-batch
    sets: np.ndarray  # expert replica sets per pipeline group (each holds every expert once);
    # colocated: EP blocks per group, EP degree gcd(experts, GPUs per group / sets)
    colocated: bool = False

    def __len__(self) -> int:
        return len(self.m)

    def take(self, idx: np.ndarray | int) -> Candidates:
        idx = np.atleast_1d(idx)
        return Candidates(self.attn[idx], self.expert[idx], self.p[idx], self.m[idx],
                          self.seqs[idx], self.sets[idx], self.colocated)

    @classmethod
    def one(cls, attn: int, expert: int, p: int, m: int, seqs: int, sets: int = 1,
            colocated: bool = False) -> Candidates:
        a = lambda v: np.array([v], dtype=np.int64)  # noqa: E731
        return cls(a(attn), a(expert), a(p), a(m), a(seqs), a(sets), colocated)


@dataclass(frozen=True)
class Stage:
    """One stage's work on one GPU of `group` (attention, expert or link), forward and backward.

    `runs` says how often: per micro-batch of every `layer`, of `moe` or `dense` layers only,
    once per `micro-batch` (the LM head), or once per `step` (gradient reduction, optimizer:
    their work sits in `bwd`)."""

    group: str
    runs: str
    fwd: Work
    bwd: Work
    fwd_ceilings: Ceilings | None = None  # a calibrated stage's own rates (None: the problem's)
    bwd_ceilings: Ceilings | None = None

    def work(self, bwd: bool) -> Work:
        return self.bwd if bwd else self.fwd

    def ceilings(self, bwd: bool, default: Ceilings) -> Ceilings:
        """The rates this stage's pass is priced at: its calibrated ones, else `default`."""
        own = self.bwd_ceilings if bwd else self.fwd_ceilings
        return default if own is None else own

    def time(self, bwd: bool, default: Ceilings) -> Num:
        return self.ceilings(bwd, default).time(self.work(bwd))

    def repeats(self, model: ModelConfig, p: int, micro_batches_per_step: float) -> float:
        """How often this stage runs in a step on the busiest GPU of its group."""
        if self.runs == "step":
            return 1.0
        if self.runs == "micro-batch":
            return micro_batches_per_step
        layers = {"layer": model.num_layers, "moe": model.num_moe_layers, "dense": model.num_dense_layers}[self.runs]
        return -(-layers // p) * micro_batches_per_step


@dataclass(frozen=True)
class RankSteps:
    """How each candidate's rank steps run under the problem's `cuda_graphs`, as `disagmoe train`
    decides it for the planned config (`rank_steps`); arrays aligned with the `Candidates`."""

    captured: np.ndarray  # bool: captured in CUDA graphs (`transport_buffers` prices their rings RING_STEP)
    refused: np.ndarray  # bool: `cuda_graphs: on` cannot capture them, so `train` refuses the layout
    lines: np.ndarray  # object: the one line saying which and why (where refused, the refusal); None on one GPU


@dataclass
class Cost:
    """Predicted figures for each candidate (arrays aligned with the `Candidates`)."""

    step_s: np.ndarray
    fwd_round_s: np.ndarray
    bwd_round_s: np.ndarray
    rounds: np.ndarray  # rounds of m micro-batches per step
    tokens_per_round: np.ndarray
    dp: np.ndarray  # data-parallel attention replicas per pipeline group
    attn_mem_bytes: np.ndarray  # per attention GPU (colocated: per GPU)
    expert_mem_bytes: np.ndarray  # per expert GPU (colocated: same as attn)
    fits: np.ndarray  # in device (and host) memory, and not refused (`rank_steps`)
    imbalance: np.ndarray
    attn_params: np.ndarray  # parameters held per attention GPU (colocated: non-expert part)
    expert_params: np.ndarray  # parameters held per expert GPU (colocated: expert part)
    attn_act_bytes: np.ndarray
    expert_act_bytes: np.ndarray
    attn_transport_bytes: np.ndarray  # the transport's message buffers (`transport_buffers`), in attn_mem_bytes
    expert_transport_bytes: np.ndarray  # in expert_mem_bytes (colocated: same as attn)
    selective: np.ndarray  # bool per candidate: priced with the expert modules recomputed (`Problem.recompute`)
    lean_expert_mem_bytes: np.ndarray  # expert_mem_bytes with the leanest recomputation the problem allows
    lean_fits: np.ndarray  # fits with the leanest recomputation the problem allows
    rank_steps: RankSteps  # whether each candidate's rank steps are captured, or refused (then it never fits)
    wgrad_pairs: np.ndarray  # bool per candidate: its expert weight gradients priced over pairs of micro-batches
    round_floor_s: np.ndarray
    """A lower bound on fwd_round_s + bwd_round_s that depends only on (p, m, seqs), whatever
    the layout: the attention work of one GPU (the solver prunes with it)."""
    stages: dict[str, Stage] = field(default_factory=dict)
    """Every stage's work on one GPU; the step time above is built from exactly these."""
    host_state_bytes: np.ndarray | None = None
    """Offloaded: the fp32 masters and moments in host memory on the fuller GPU of the layout
    (fits requires it within `Problem.host_capacity_bytes`); None without offload."""
    recompute_attention: np.ndarray | None = None
    """bool per candidate: priced with the attention block recomputed (None: all False)."""
    recompute_block: bool = False
    """Every candidate priced with `recompute: full` (`memory.FULL`)."""
    expert_modules: frozenset[str] = mem.SELECTIVE
    """The expert modules a `selective` candidate is priced as dropping (`Problem.recompute_modules`'
    expert ones: under FP8 experts expert_input and expert_swiglu, `solver._recompute_of`)."""

    def dropped(self, i: int = 0) -> frozenset[str]:
        """The modules candidate `i` is priced as recomputing (`roofline.memory` names)."""
        if self.recompute_block:
            return mem.FULL
        attention = self.recompute_attention is not None and bool(self.recompute_attention[i])
        return (self.expert_modules if bool(self.selective[i]) else mem.NOTHING_DROPPED) | (
            ATTENTION if attention else mem.NOTHING_DROPPED)


@dataclass(frozen=True)
class Problem:
    """The fixed inputs of a placement search."""

    model: ModelConfig
    ceilings: Ceilings
    gpus: int
    nvlink_domain: int
    seq_len: int
    global_batch_tokens: int
    capacity_bytes: float
    load_peak_ratio: float = 1.0  # hottest expert's load over the mean (1 = uniform routing)
    replica_slots: int = 0  # spare expert slots per expert GPU for hot-expert replicas
    shard_optimizer: bool = False  # ZeRO-1 over each data-parallel group for the replicated parameters
    optimizer_state_dtype: str = "fp32"  # AdamW's moments: fp32 or bf16
    optimizer_update_kernel: str = "triton"  # what runs AdamW's update on the GPU: torch or triton
    clip_gradients: bool = True  # a gradient clip each step (torch's update then writes the gradient back)
    offload_optimizer: bool = False  # masters and moments in host memory, copied over the host link each step
    calibration: Calibration | None = None  # measured curves and fixed costs (None: the plain roofline)
    recompute: str = "none"  # none, selective, full or auto (per candidate: see the module docstring)
    recompute_modules: frozenset[str] = mem.SELECTIVE  # selective: what it drops; auto: what it may drop; full: FULL
    expert_precision: str = "bf16"  # the routed experts' GEMMs: bf16 or fp8 (the FP8 memory and passes follow it)
    fp8_speedup: float = 1.0  # expert_precision fp8: its GEMMs' rate over bf16's (fp8_tflops / bf16_tflops), any value
    fp8_dense: bool = False  # with expert_precision fp8: the dense projections' GEMMs in FP8 too
    fp8_dense_scaling: str = FP8_DENSE_SCALING  # with fp8_dense: rowwise or blockwise (`fp8_dense_stages`)
    fp8_backward: str = DEFAULT_FP8_EXPERT_BACKWARD  # with expert_precision fp8: which expert backward GEMMs
    # (`fp8_stages`), and what the backward holds and regathers (`roofline.memory`, `stages.selective_recompute`)
    fp8_forward: str = RUN_FP8_EXPERT_FORWARD  # with expert_precision fp8: which expert forward GEMMs (`fp8_stages`)
    first_touch: bool = False  # the bf16 Triton experts store their main gradient at a step's first launch (unzeroed)
    host_capacity_bytes: float = float("inf")  # offloaded: host memory per GPU for masters and moments
    experts_backend: str = "triton"  # the run's expert FFN: loop, grouped_mm or triton (`rank_steps`)
    cuda_graphs: str = "auto"  # the run's cuda_graphs: auto, on or off (`rank_steps`)
    fused_loss: bool = True  # the LM head's loss as the fused kernel runs it (`stages.lm_head`, `memory.head_bytes`)
    # expert weight gradients over pairs of micro-batches (`kernels.wgrad_pairs`; `paired_micro_batches`: one GPU's
    # step, m x rounds, a distributed rank's round): half the main-gradient passes, and the rows waiting for the
    # next held (one GPU: one micro-batch's beside the next, `mem.paired_wgrad_held_bytes`; a distributed rank: as
    # its replay holds them, `placement.waiting_rows`)
    wgrad_pairs: bool = False
    # expert_wgrad_pairs auto: a candidate pairs only where its peak with the waiting rows is within these bytes
    # (`mem.MEMORY_HEADROOM` of the device: the single trainer's rule, `_pairs_fit`), or, distributed, where they
    # do not raise its fullest GPU's peak (the driver's, `_settled_recomputation`); inf: on or off as asked
    wgrad_pairs_budget: float = float("inf")


def expert_layout(model: ModelConfig, per_set: np.ndarray, peak_ratio: float,
                  replica_slots: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(expert slots per expert GPU, load imbalance max/mean over the GPUs of a replica set).

    Loads are in units of the mean expert load, the hottest expert `peak_ratio` (1 = uniform),
    the others sharing the rest evenly. Fewer GPUs than experts: each GPU has ceil(n / g) slots
    (plus `replica_slots` spare ones for hot-expert replicas, which only add memory here), and
    the fullest GPU may hold the hot expert beside ceil(n / g) - 1 others. At least as many GPUs
    as experts: every expert gets g // n replicas, the g mod n leftover GPUs replicate the
    hottest experts, and each replica serves an equal share of its expert's tokens. This follows
    `placement.experts.map_layer` (tests/placement/test_cost.py checks it against the mapping).
    """
    n = model.num_experts
    g = np.maximum(per_set, 1).astype(np.int64)
    peak = max(peak_ratio, 1.0)
    others = (n - peak) / (n - 1) if n > 1 else 0.0  # load of each of the other experts
    # Fewer GPUs than experts: the hot expert's GPU, plus any experts the other GPUs' slots
    # cannot take, against the fullest of the other GPUs.
    slots = -(-n // g)
    overflow = np.maximum(0, n - 1 - (g - 1) * slots)
    spread = np.minimum(slots, -(-(n - 1) // np.maximum(g - 1, 1)))
    busiest_few = np.maximum(peak + overflow * others, spread * others)
    # At least as many GPUs as experts: r replicas each; the leftover GPUs go one at a time to
    # the expert with the most load per replica: the hot one until it is no hotter than the
    # rest, then one to each of the others.
    r = np.maximum(g // n, 1)
    leftover = np.where(g >= n, g - n * r, 0)
    hot_extra = np.minimum(leftover, np.maximum(0, np.ceil(peak * r / max(others, 1e-12) - r)))
    others_extra = leftover - hot_extra
    busiest_many = np.maximum(peak / (r + hot_extra), np.where(others_extra >= n - 1, others / (r + 1), others / r))
    few = g < n
    local = np.where(few, slots + replica_slots, 1)
    busiest = np.where(few, busiest_few, busiest_many)
    return local, np.maximum(busiest * g / n, 1.0)


def _scaleout_fraction(span: np.ndarray, domain: int) -> np.ndarray:
    """Fraction of traffic among `span` GPUs (spread evenly) that leaves an NVLink domain."""
    return np.where(span <= domain, 0.0, 1.0 - domain / np.maximum(span, 1))


def _ring_hop_fraction(slice_gpus: np.ndarray, p: np.ndarray, f_link: np.ndarray, domain: int) -> np.ndarray:
    """Scale-out fraction of the hop to the next pipeline group (combine, residual hand-off).

    The ring's traffic stays inside one slice: replica set r of every group with the attention
    GPUs it serves (colocated: EP block b of every group), `slice_gpus` GPUs in all. A slice that
    fits in an NVLink domain keeps the hop inside it; a wider one is priced all scale-out (the
    pessimistic case). Only the GPUs the layout uses count, never idle ones of a larger cluster,
    so a layout costs the same on any cluster that holds it. p = 1: the hop is the combine
    within the group (`f_link`)."""
    return np.where(p > 1, np.where(slice_gpus > domain, 1.0, 0.0), f_link)


def _layer_counts(model: ModelConfig, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(MoE layers, dense layers) owned by the busiest pipeline group."""
    return -(-model.num_moe_layers // p), -(-model.num_dense_layers // p)


def _pass_time(a, d, e, c, p, m, layers):
    """Ring pipeline time of one pass (see the module docstring)."""
    ring = p * (a + d + e + c)
    s_max = np.maximum(np.maximum(a, e), np.maximum(d, c))
    busy = m * s_max
    edge = np.where(busy >= ring, ring - s_max, (m - 1) * s_max)
    return layers / p * np.maximum(ring, busy) + edge


def _group_layers(model: ModelConfig, p: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """(MoE layers, dense layers) of pipeline group g (layer l belongs to group l mod p; zero
    where g >= p)."""
    def below(n: int) -> np.ndarray:  # layers l < n with l mod p == g
        return np.where(g < p, np.maximum(0, -(-(n - g) // p)), 0)

    dense = below(model.num_dense_layers)
    return below(model.num_layers) - dense, dense


def activations(m: ModelConfig, tokens: Num, pairs: Num, in_flight: Num, p: np.ndarray, colocated: bool,
                dropped: frozenset[str] = mem.NOTHING_DROPPED, attention: Num | None = None,
                fp8: bool = False, fp8_backward: str = DEFAULT_FP8_EXPERT_BACKWARD,
                waits: Num = 0.0, *, fused: Num, fused_loss: bool = True) -> tuple[Num, Num]:
    """(attention GPU, expert GPU) activation bytes at the peak, in `roofline.memory`'s per-token
    terms, as the runtime's memory check counts them (`runtime.activation_memory.rank_activations`,
    pinned by tests/runtime/test_activation_memory.py; `dropped`: what recomputation does not keep).
    The distributed schedules run every forward of a round before the first backward, so a GPU
    keeps the `in_flight` micro-batches of all its group's layers and holds on top what one op
    does: the head's peak (on the head group, the one after the last layer's, `Layout.head_group`)
    or one layer's backward on the attention side (`attention_activations`), one layer's expert
    backward on the expert side; the busiest group's sum is the answer. The combine's rows are the
    expert GPU's (the runtime's compact hop). Colocated: one GPU holds both sides' kept bytes and
    the larger of the head and one whole layer's backward (`memory.activation_bytes`; one process
    keeps one micro-batch), all in the first element.

    `pairs`: the (token, k) rows one expert GPU's activations span per micro-batch and layer: every
    pair of every source that dispatches to it (`tokens * k` times the sources), not the share its
    experts serve. The runtime has no host read of the routing counts (DESIGN 3c), so the permute
    groups all of a source's pairs, those served elsewhere into a spare bucket, and the experts'
    saved rows (input rows, gate/up pre-activations, SwiGLU output, the combine's rows) and the
    backward's gradients are allocated for all of them: any routing may send every pair here.
    `attention`: `attention_activations` of these arguments, if already computed. `fp8`: the
    experts in FP8 (`roofline.memory`'s `fp8` terms), their backward recipe `fp8_backward`. `waits`: what one
    expert backward leaves waiting under paired weight gradients (`paired_waits`; 0 unpaired), added as the
    rank's replay adds it (`placement.waiting_rows`; a colocated GPU's bytes above are the conservative one
    process's, so the replay's rise with the waits is added to them). `fused` (per candidate): the FP8
    backward's kernels write their e4m3 copies beside their work (`memory.fp8_expert_row_grad_bytes`' fused_copies:
    one GPU, whose steps mostly do not count their numerics; a distributed rank counts every step). `fused_loss`:
    the head's loss as the fused kernel runs it (`memory.head_bytes`, `Problem.fused_loss`)."""
    row_grad = _row_grad_bytes(m, dropped, fp8, fp8_backward, fused)
    moe_l, dense_l = _layer_counts(m, np.asarray(p))
    if not colocated:
        attention = (attention_activations(m, tokens, in_flight, p, dropped, fused_loss=fused_loss) if attention is None
                     else attention)
        return attention, expert_activations(m, pairs, in_flight, p, dropped, fp8, fp8_backward, waits, fused=fused)
    exp_kept = in_flight * moe_l * expert_kept_bytes(m, pairs, dropped, fp8)
    attn_kept = in_flight * tokens * (moe_l * mem.attention_bytes(m, True, BF16, dropped)
                                      + dense_l * mem.attention_bytes(m, False, BF16, dropped))
    kinds = [moe for moe, n in ((True, m.num_moe_layers), (False, m.num_dense_layers)) if n]
    grads = [tokens * mem.attention_grad_bytes(m, moe, BF16, dropped) + (pairs * row_grad if moe else 0)
             for moe in kinds]
    head = mem.head_bytes(m, tokens, BF16, fused=fused_loss)
    rise = colocated_rank_rise(
        attn_kept + exp_kept, tokens * mem.attention_bytes(m, True, BF16, dropped),
        expert_kept_bytes(m, pairs, dropped, fp8), tokens * mem.attention_grad_bytes(m, True, BF16, dropped),
        pairs * row_grad, tokens * (in_flight * dense_l * mem.attention_bytes(m, False, BF16, dropped)
                                    + mem.attention_grad_bytes(m, False, BF16, dropped)),
        head, moe_l, dense_l, in_flight, waits, paired_first_held(m, pairs, waits, dropped, fp8, fp8_backward,
                                                                   fused=fused))
    return attn_kept + exp_kept + np.maximum(head, np.maximum.reduce(grads)) + rise, 0.0 * exp_kept


def expert_row_kept_bytes(m: ModelConfig, dropped: frozenset[str], fp8: bool = False) -> int:
    """Bytes one (token, k) pair keeps on its expert GPU per layer: its rows and the combine's share."""
    return mem.expert_row_bytes(m, BF16, dropped, fp8) + mem.combine_bytes(m, BF16, dropped) // m.top_k


def expert_kept_bytes(m: ModelConfig, pairs: Num, dropped: frozenset[str], fp8: bool = False) -> Num:
    """Bytes one layer of one micro-batch keeps on its expert GPU: its `pairs` rows and, under
    `recompute: full`, each received token's row and partial sum (`memory.expert_token_bytes`)."""
    return (pairs * expert_row_kept_bytes(m, dropped, fp8)
            + pairs / m.top_k * mem.expert_token_bytes(m, BF16, dropped))


def expert_activations(m: ModelConfig, pairs: Num, in_flight: Num, p: np.ndarray,
                       dropped: frozenset[str] = mem.NOTHING_DROPPED, fp8: bool = False,
                       fp8_backward: str = DEFAULT_FP8_EXPERT_BACKWARD, waits: Num = 0.0, *, fused: Num) -> Num:
    """A disaggregated expert GPU's activation peak (`activations`): every pair of every layer of
    its group in flight, and one expert backward's gradients; under paired weight gradients what
    their `waits` add (`placement.waiting_rows.expert_rank_rise`). Only the expert modules (or full),
    the experts' precision (`fp8`, with its backward recipe `fp8_backward`; `fused` as `activations`) and the
    pairs change it."""
    moe_l, _ = _layer_counts(m, np.asarray(p))
    kept = expert_kept_bytes(m, pairs, dropped, fp8)
    return (in_flight * moe_l * kept + pairs * _row_grad_bytes(m, dropped, fp8, fp8_backward, fused)
            + expert_rank_rise(kept, waits, moe_l, in_flight, paired_first_held(m, pairs, waits, dropped, fp8,
                                                                                fp8_backward, fused=fused)))


def _row_grad_bytes(m: ModelConfig, dropped: frozenset[str], fp8: bool, fp8_backward: str, fused: Num) -> Num:
    """`memory.expert_row_grad_bytes` per candidate: with the fused e4m3 copies where `fused`, without elsewhere."""
    return np.where(fused, mem.expert_row_grad_bytes(m, BF16, dropped, fp8, fp8_backward, True),
                    mem.expert_row_grad_bytes(m, BF16, dropped, fp8, fp8_backward, False))


def paired_first_held(m: ModelConfig, pairs: Num, waits: Num, dropped: frozenset[str], fp8: bool,
                      fp8_backward: str, *, fused: Num) -> Num:
    """What the first expert backward of a pair holds more over its own span, per candidate: its `pairs` rows'
    `memory.paired_first_held_bytes` where they pair (`waits` > 0, `paired_waits`), as the runtime's replay
    adds it (`replay_peak`'s `first_holds`); 0 unpaired. `fused` as `activations`."""
    per_row = np.where(fused, mem.paired_first_held_bytes(m, BF16, dropped, fp8, fp8_backward, True),
                       mem.paired_first_held_bytes(m, BF16, dropped, fp8, fp8_backward, False))
    return np.where(np.asarray(waits) > 0, pairs * per_row, 0.0)


def paired_waits(m: ModelConfig, pairs: Num, paired: np.ndarray, groups: Num, fp8_token_groups: bool) -> np.ndarray:
    """What one expert backward of a distributed rank leaves waiting for its layer's next under paired weight
    gradients (`paired`, per candidate): its `pairs` rows' operands in its `groups` local experts
    (`memory.paired_wgrad_waiting_bytes`: their e4m3 token-group copies under the all-FP8 backward,
    `fp8_token_groups`), as `runtime.activation_memory.rank_activations` counts them; 0 where unpaired."""
    return np.where(paired, mem.paired_wgrad_waiting_bytes(m, pairs, groups, BF16, fp8_token_groups), 0.0)


def attention_activations(m: ModelConfig, tokens: Num, in_flight: Num, p: np.ndarray,
                          dropped: frozenset[str] = mem.NOTHING_DROPPED, fused_loss: bool = True) -> Num:
    """A disaggregated attention GPU's activation peak (`activations`): the largest over the
    pipeline groups of what the group's layers keep plus what one of its ops holds. Of the
    recomputation only `attention` in `dropped` changes it. Per p, each group's bytes are a sum of
    terms fixed by p times `in_flight * tokens` (kept), `tokens` (a backward's gradients) or the
    head's peak (`fused_loss`: as the fused kernel runs it)."""
    p = np.asarray(p)
    ps = np.unique(p)
    top = int(ps.max())
    kept, grads, heads = (np.zeros((top + 1, top)) for _ in range(3))  # [p, group]: per-token bytes, head flag
    for q in ps.tolist():
        for g in range(q):
            moe_g, dense_g = (int(n) for n in _group_layers(m, np.array(q), g))
            kept[q, g] = (moe_g * mem.attention_bytes(m, True, BF16, dropped)
                          + dense_g * mem.attention_bytes(m, False, BF16, dropped))
            grads[q, g] = max(mem.attention_grad_bytes(m, True, BF16, dropped) if moe_g else 0,
                              mem.attention_grad_bytes(m, False, BF16, dropped) if dense_g else 0)
            heads[q, g] = m.num_layers % q == g
    head = mem.head_bytes(m, tokens, BF16, fused=fused_loss)
    out = 0.0
    for g in range(top):  # groups beyond a candidate's p have no layers and no head: zero
        here = in_flight * tokens * kept[p, g] + np.maximum(tokens * grads[p, g], heads[p, g] * head)
        out = np.maximum(out, here)
    return out


def capture_settings(prob: Problem) -> StepSettings:
    """The run's settings `step_capture` asks, as the planner prices the run: on a GPU over nvshmem
    (its fast path), bf16 or fp8 parameters (never fp32's reference AdamW), the problem's experts
    backend, offload, expert precision and `cuda_graphs`."""
    return StepSettings(cuda_graphs=prob.cuda_graphs, device="cuda", transport="nvshmem",
                        experts_backend=prob.experts_backend, reference_adamw=False,
                        offload_optimizer=prob.offload_optimizer, expert_precision=prob.expert_precision)


def replicates_experts(prob: Problem, c: Candidates, ranks: np.ndarray) -> np.ndarray:
    """bool per candidate: its plan holds some expert on more than one GPU (its topology's
    `replica_groups` are not empty). A split: more than one replica set per group, more expert GPUs
    in a set than experts, or fewer with spare slots for hot-expert replicas (`Problem.replica_slots`,
    `placement.experts.map_layer`). Colocated: more than one EP block per group. `ranks`: expert
    GPUs per replica set (colocated: the EP degree)."""
    ranks = np.asarray(ranks)
    if c.colocated:
        return c.expert // c.p > ranks
    n = prob.model.num_experts
    return (c.sets > 1) | (ranks > n) | ((prob.replica_slots > 0) & (ranks < n))


def rank_steps(prob: Problem, c: Candidates, dp: Num, ranks: np.ndarray) -> RankSteps:
    """Whether each candidate's rank steps are captured in CUDA graphs, as `disagmoe train` decides
    it for the planned config (`runtime.schedule.step_capture.resolve`, what `resolve_rank_graphs`
    asks): from the problem's settings (`capture_settings`) and two facts of the layout, its
    data-parallel attention GPUs per pipeline group (`dp`, `Topology.data_parallel` of its plan;
    colocated: every GPU of the group) and whether it replicates an expert (`replicates_experts`).
    Those take few values, so each pair is asked once. `on` where a step cannot be captured:
    refused, with the refusal's line. One GPU (the single layout) has no rank steps."""
    settings, mode = capture_settings(prob), "colocated" if c.colocated else "disaggregated"
    dp_i = np.round(np.broadcast_to(np.asarray(dp, dtype=float), (len(c),))).astype(np.int64)
    layouts, which = np.unique(2 * dp_i + replicates_experts(prob, c, ranks), return_inverse=True)
    outcomes = [_rank_step(settings, mode, key // 2, bool(key % 2)) for key in layouts.tolist()]
    captured = np.array([o.captured for o in outcomes], dtype=bool)
    refused = np.array([o.refused for o in outcomes], dtype=bool)
    lines = np.array([o.line for o in outcomes], dtype=object)
    single = c.colocated & (c.expert == 1)
    return RankSteps(captured[which] & ~single, refused[which] & ~single,
                     np.where(single, None, lines[which]))


class RankStep(NamedTuple):
    """One layout's `RankSteps` entry."""

    captured: bool
    refused: bool
    line: str


def _rank_step(settings: StepSettings, mode: str, data_parallel: int, replicated: bool) -> RankStep:
    """One layout's rank steps: `step_capture.resolve`, its ValueError a refusal."""
    try:
        captured, line = resolve(settings, mode, data_parallel, replicated)
    except ValueError as refusal:
        return RankStep(False, True, str(refusal))
    return RankStep(captured, False, line)


def transport_buffers(prob: Problem, c: Candidates, dp: np.ndarray, ranks: np.ndarray,
                      captured: np.ndarray) -> tuple[Num, Num]:
    """(attention GPU, expert GPU) bytes of the transport's message buffers
    (`roofline.transport_memory.layout_transport_bytes`), as the runtime allocates them on the fast
    path the planner prices: nvshmem's symmetric arena (a ring of segments per receive pool,
    `roofline.transport_memory` RING, rounded up to a step's messages, RING_STEP, for the candidates
    whose rank steps are `captured`: `rank_steps`; the largest rank's on every GPU), partial sums,
    dispatch sparse where a set has more than one expert rank; under a router's auxiliary loss the sets
    (EP blocks) also swap their loads (`roofline.transport_memory` swaps_load).
    `ranks`: expert ranks per replica set (colocated: the EP block). None on one GPU."""
    dp = np.broadcast_to(np.asarray(dp), (len(c),))
    ranks = np.broadcast_to(np.asarray(ranks, dtype=np.int64), (len(c),))
    attn, exp = np.zeros(len(c)), np.zeros(len(c))
    for reuse, idx in ((tm.RING_STEP, np.flatnonzero(captured)), (tm.RING, np.flatnonzero(~captured))):
        if len(idx):
            attn[idx], exp[idx] = _arena(prob, c.take(idx), dp[idx], ranks[idx], reuse)
    return attn, exp


def _arena(prob: Problem, c: Candidates, dp: np.ndarray, ranks: np.ndarray, reuse: str) -> tuple[Num, Num]:
    """`transport_buffers` of candidates whose rings are all `reuse` (RING or RING_STEP)."""
    m = prob.model
    dp_i = np.round(dp).astype(np.int64)
    attn, exp = tm.layout_receives(m.num_layers, m.num_dense_layers, c.p, dp_i, ranks, c.sets, c.m, c.colocated,
                                   reuse=reuse, swaps_load=m.router.needs_every_source_load)
    dense, sparse = (tm.transport_bytes(attn, exp, tm.HopShape(c.seqs.astype(np.int64), prob.seq_len, m.hidden_size,
                                                               m.top_k, m.num_experts, "bf16", m.shared_ffn_size > 0,
                                                               False, kind))
                     for kind in (False, True))
    pick = ranks > 1
    return (np.where(pick, sparse[0], dense[0]).astype(float), np.where(pick, sparse[1], dense[1]).astype(float))


def evaluate(prob: Problem, c: Candidates, misfits_exact: bool = True) -> Cost:
    """Price every candidate: step time, memory per GPU, fit. `misfits_exact=False` (the search's
    pruning pass, where about 1 in 100 candidates fits): the transport buffers are priced only for
    the candidates that fit without them with their leanest recomputation (in a split: whose expert
    GPU does, what the pass prunes by); every other one fits with them neither, and its memory is
    understated by them (its fit, lean fit and the pass's pruning are as exact)."""
    m, ceil = prob.model, prob.ceilings
    S, H, k = prob.seq_len, m.hidden_size, m.top_k
    p = c.p.astype(float)
    mb = c.m.astype(float)
    tokens = (c.seqs * S).astype(float)  # per attention GPU per micro-batch
    if c.colocated:
        dp = c.expert / p  # GPUs per pipeline group, each a data-parallel attention replica
        ep = colocated_ep(m.num_experts, c.expert // (c.p * c.sets))
        local = (m.num_experts // ep).astype(float)
        imbalance = np.full(len(c), max(prob.load_peak_ratio, 1.0))
        rows = tokens * k * imbalance
        pairs = ep * tokens * k  # every GPU of the EP block dispatches its tokens to every other (`activations`)
        f_link = _scaleout_fraction(ep.astype(float), prob.nvlink_domain)
        f_next = _ring_hop_fraction(p * ep, p, f_link, prob.nvlink_domain)  # EP block b of every group
        expert_replicas = dp / ep
        f_replicas = _scaleout_fraction(dp, prob.nvlink_domain)
    else:
        # Each pipeline group: `sets` replica sets of e_pg / sets expert GPUs, each set holding
        # every expert and serving dp / sets of the group's attention GPUs (DP index mod sets).
        dp = c.attn / p
        e_pg = c.expert / p
        sets = c.sets.astype(float)
        per_set = c.expert // (c.p * c.sets)
        local, imbalance = expert_layout(m, per_set, prob.load_peak_ratio, prob.replica_slots)
        local = local.astype(float)
        rows = dp * tokens * k / e_pg * imbalance  # computed by the busiest expert GPU
        # held by each: every pair of every attention GPU its set serves (`activations`; fewer attention GPUs than
        # sets: one each, `plan_layout.fed_replicas`), aux loss or not (the sets swap their loads instead)
        pairs = np.maximum(dp / sets, 1.0) * tokens * k
        f_link = _scaleout_fraction((dp + e_pg) / sets, prob.nvlink_domain)
        f_next = _ring_hop_fraction(p * (dp + e_pg) / sets, p, f_link, prob.nvlink_domain)  # set r of every group
        expert_replicas = sets * np.maximum(per_set / m.num_experts, 1.0)
        f_replicas = _scaleout_fraction(e_pg, prob.nvlink_domain)

    n_moe, n_dense, L = m.num_moe_layers, m.num_dense_layers, m.num_layers
    token_row = BF16 * H + (4 + BF16) * k  # a dispatched token: its row, int32 top-k ids, bf16 weights
    if c.colocated:
        # The runtime's compact hop: each GPU sends its tokens once to every other GPU of its EP block that
        # serves them (`st.dispatch_rows`: sparse dispatch), the busier of the sending and receiving ends.
        sent, busiest, index = st.dispatch_rows(m, ep)
        remote = np.maximum(sent * (ep - 1.0) / ep, busiest * (ep - 1.0))
        dispatch = st.all_to_all(tokens * (token_row + index) * remote, f_link, ep)  # ep = 1: no peer, no call
        # The partial sums go back within the block (p = 1), or with p > 1 to the next group's block, as the
        # disaggregated ring's combine: every row received, none to itself, over the ring's link.
        combine = _either(p > 1, st.transfer(tokens * (BF16 * H + index) * np.maximum(sent, busiest * ep), f_next),
                          st.all_to_all(tokens * (BF16 * H + index) * remote, f_link, ep))
    else:
        # The runtime's compact hop (`runtime.stages.messages`): a token once to each expert GPU of its replica
        # set that serves it (`st.dispatch_rows`: sparse dispatch), one partial sum per token received back,
        # whatever k; the busier end of each hop.
        sources = dp / sets  # attention GPUs an expert GPU serves
        sent, busiest, index = st.dispatch_rows(m, per_set, imbalance)
        residual = np.where(p > 1, BF16 * tokens * (H + 2 * k), 0.0)  # the attention GPU's other send
        dispatch = st.transfer(np.maximum(sent * tokens * (token_row + index) + residual,
                                          sources * busiest * tokens * (token_row + index)), f_link)
        combine = st.transfer((BF16 * H + index) * tokens * np.maximum(sources * busiest, sent), f_next)
    handoff = st.transfer(BF16 * tokens * H, f_next)  # residual stream to the next pipeline group

    # Parameters each GPU holds (the busiest pipeline group's share).
    counts = count_params(m)
    emb_params = np.where(p > 1, m.vocab_size * H, counts.embedding)
    moe_l, dense_l = _layer_counts(m, c.p)
    attn_layer = attention_params(m)
    moe_side = H * m.num_experts + H + swiglu_params(H, m.shared_ffn_size)
    dense_side = swiglu_params(H, m.dense_ffn_size) + H
    attn_params = emb_params + moe_l * (attn_layer + moe_side) + dense_l * (attn_layer + dense_side)
    exp_params = moe_l * local * expert_params(m)
    f_dp = _scaleout_fraction(dp, prob.nvlink_domain)

    # The projections' weight gradients (bf16, under fp8_dense too) go into their fp32 main gradients
    # inside the weight-gradient GEMM (`model.layers.add_weight_grad_into_main`: fp32 C, beta 1; its C
    # traffic is small against the GEMM's FLOPs): FlatAdamW's hook adds the rest (norm gains, routers).

    # Memory: each parameter's state and the activations at their peak, without and with
    # selective recomputation; `selective` says which one each candidate is priced with.
    attn_bytes, exp_bytes = attention_state_bytes(dp, prob).total, expert_state_bytes(prob).total
    fp8 = prob.expert_precision == "fp8"  # the setting, not the speedup: FP8's memory is held at any rate
    fp8_copies = mem.fp8_weight_copy_bytes(exp_params, prob.fp8_forward, prob.fp8_backward) if fp8 else 0.0
    dense_fp8 = prob.fp8_dense and fp8  # the FP8 dense linears' two e4m3 copies (1 byte each)
    attn_fp8_copies = 2.0 * st.dense_fp8_weights(m, moe_l, dense_l, prob.fp8_dense_scaling) if dense_fp8 else 0.0
    if c.colocated:
        attn_state = (attn_bytes * attn_params + exp_bytes * exp_params + fp8_copies + attn_fp8_copies
                      + offload_staging_bytes(prob, attn_params + exp_params))
        exp_state = 0.0
    else:
        attn_state = attn_bytes * attn_params + attn_fp8_copies + offload_staging_bytes(prob, attn_params)
        exp_state = exp_bytes * exp_params + fp8_copies + offload_staging_bytes(prob, exp_params)
    single = c.colocated & (c.expert == 1)
    in_flight = np.where(single, 1.0, mb)  # one GPU: mode single accumulates
    rounds = np.ceil(prob.global_batch_tokens / (mb * dp * tokens))
    step_mb = rounds * mb
    pair_span = paired_micro_batches(single, mb, step_mb)
    may_pair = np.broadcast_to((pair_span >= 2) & prob.wgrad_pairs, (len(c),))
    # one GPU (mode single) with paired expert weight gradients: one micro-batch's expert rows wait beside the next
    single_pairs = may_pair & single
    all_fp8 = fp8 and prob.fp8_backward == "fp8"  # what waits is the backward's e4m3 token-group copies
    if c.colocated:
        held = mem.paired_wgrad_held_bytes(m, tokens, BF16, all_fp8)
        single_pairs = _pairs_fit(prob, c, single_pairs, tokens, in_flight, pairs, rows, attn_state + held)
        attn_state = attn_state + np.where(single_pairs, held, 0.0)
    # a distributed rank's: what its replay says its expert backwards leave waiting (`activations`), settled
    # against the fullest device once its transport buffers are priced (`_settled_recomputation`)
    rank_pairs = may_pair & ~single
    ranks = per_set if not c.colocated else ep
    steps = rank_steps(prob, c, dp, ranks)
    if misfits_exact:
        transport_attn, transport_exp = transport_buffers(prob, c, dp, ranks, steps.captured)
    else:
        # the leanest: unpaired where auto may settle the pairs off (`_settled_recomputation`)
        lean_waits = paired_waits(m, pairs, rank_pairs & np.isinf(prob.wgrad_pairs_budget), local, all_fp8)
        *_, lean_exp_mem, lean_fits = _recomputation(prob, c, tokens, in_flight, pairs, rows, attn_state, exp_state,
                                                     lean_waits)
        idx = np.flatnonzero(lean_fits if c.colocated else lean_exp_mem <= prob.capacity_bytes)
        transport_attn, transport_exp = np.zeros(len(c)), np.zeros(len(c))
        if len(idx):
            each = lambda v: np.broadcast_to(np.asarray(v), (len(c),))[idx]  # noqa: E731
            transport_attn[idx], transport_exp[idx] = transport_buffers(prob, c.take(idx), each(dp), each(ranks),
                                                                        steps.captured[idx])
    attn_state = attn_state + transport_attn
    exp_state = exp_state + (0.0 if c.colocated else transport_exp)
    rank_pairs, (selective, attention, act_attn, act_exp, fits, lean_exp_mem, lean_fits) = _settled_recomputation(
        prob, c, rank_pairs, tokens, in_flight, pairs, rows, attn_state, exp_state, local, all_fp8)
    paired_wgrads = single_pairs | rank_pairs
    attn_mem = attn_state + act_attn
    exp_mem = attn_mem if c.colocated else exp_state + act_exp
    host_state = None
    if prob.offload_optimizer:  # the masters and moments must fit the host memory of each GPU
        attn_host = attention_state_bytes(dp, prob).host * attn_params
        exp_host = expert_state_bytes(prob).host * exp_params
        host_state = (attn_host + exp_host if c.colocated else np.maximum(attn_host, exp_host)) * np.ones(len(c))
        on_host = host_state <= prob.host_capacity_bytes
        fits, lean_fits = fits & on_host, lean_fits & on_host
    fits = fits & ~steps.refused  # `train` refuses it: never proposed

    # The optimizer's passes; offloaded, its copies over the host link too (per parameter, each way).
    attention_link = host_link_bytes(prob.optimizer_state_dtype, "bf16", zero1_ranks(dp, prob.shard_optimizer))
    expert_link = host_link_bytes(prob.optimizer_state_dtype, "bf16")

    def optimizer(params: Num, link_bytes: Num, first_touch: Num = 0, shards: Num = 1) -> Work:
        """The optimizer step over `params` parameters (`first_touch` of them not zeroed; ZeRO-1 over
        `shards` GPUs) as the run's settings make it; offloaded, torch's update on the staging slots
        (whatever the update kernel) and the host-link copies."""
        if prob.offload_optimizer:
            return st.offloaded_optimizer_step(params, link_bytes, prob.optimizer_state_dtype, prob.clip_gradients,
                                               first_touch, shards)
        return st.optimizer_step(params, prob.optimizer_state_dtype, prob.optimizer_update_kernel, prob.clip_gradients,
                                 first_touch, shards)

    # Every stage once: per GPU, per micro-batch and layer (or per micro-batch / per step).
    head = st.lm_head(m, tokens, prob.fused_loss) + st.embedding(m, tokens)
    # the passes `bench calibrate` fits its expert curve against; first touch: a step's first launch stores
    # (one of the rounds x micro-batches launches a step makes per layer)
    # paired: ceil(span / 2) weight-gradient launches over the micro-batches a rank's pairs span
    # (`paired_micro_batches`), each one main-gradient pass for two (the odd one's for one); the share of
    # micro-batches in paired launches (the curves' rates)
    wgrad_paired_share = st.paired_share(pair_span, paired_wgrads)
    experts = st.expert_passes(m, rows, local, 1.0 / step_mb if prob.first_touch else 0.0,
                               st.main_grad_passes(pair_span, paired_wgrads))
    stages = {
        "attention projections": Stage("attention", "layer", *st.attention_projection_passes(m, tokens)),
        "attention core": Stage("attention", "layer", *st.attention_core_passes(m, tokens, S)),
        "norms, RoPE, residual adds": Stage("attention", "layer", *st.norms_and_residuals(m, tokens)),
        "router": Stage("attention", "moe", st.router(m, tokens), st.router(m, tokens).backward()),
        "shared experts": Stage("attention", "moe", st.shared_experts(m, tokens),
                                st.shared_experts(m, tokens).backward()),
        "permute / combine sum": Stage("attention", "moe", st.permute(m, tokens * k), st.permute(m, tokens * k)),
        "dense ffn": Stage("attention", "dense", st.dense_ffn(m, tokens), st.dense_ffn(m, tokens).backward()),
        "dispatch": Stage("link", "moe", dispatch, combine),
        "routed experts": Stage("expert", "moe", *experts["routed experts"]),
        "expert weight grads": Stage("expert", "moe", *experts["expert weight grads"]),
        "selective recompute": Stage("expert", "moe", Work(), st.selective_recompute(m, rows * selective, fp8,
                                                                                     prob.fp8_backward,
                                                                                     _expert_modules(prob))),
        "combine": Stage("link", "moe", combine, dispatch),
        "main-grad adds": Stage("attention", "moe", Work(), st.main_grad_add(
            attention_norm_params(m) + H + router_params(m))),
        "main-grad adds (dense layers)": Stage("attention", "dense", Work(), st.main_grad_add(
            attention_norm_params(m) + H)),
        "lm head + embedding": Stage("attention", "micro-batch", head, head.backward()),
        "main-grad adds (embedding, head)": Stage("attention", "micro-batch", Work(), st.main_grad_add(emb_params)),
        # under ZeRO-1 the reduce-scatter of the gradients (the updated slices' all-gather follows the update)
        "grad all-reduce (attention)": Stage("link", "step", Work(), st.ring_reduce_scatter(
            FP32 * attn_params, dp, f_dp) if prob.shard_optimizer else st.ring_allreduce(FP32 * attn_params, dp, f_dp)),
        "grad all-reduce (experts)": Stage("link", "step", Work(),
                                           st.ring_allreduce(FP32 * exp_params, expert_replicas, f_replicas)),
        "optimizer (attention)": Stage("attention", "step", Work(), optimizer(
            attn_params, attention_link, shards=zero1_ranks(dp, prob.shard_optimizer))),
        "optimizer (experts)": Stage("expert", "step", Work(), optimizer(exp_params, expert_link,
                                                                         exp_params if prob.first_touch else 0)),
    }
    if prob.shard_optimizer:  # ZeRO-1: the updated slices' compute parameters gathered after the update
        stages["param all-gather (attention)"] = Stage("link", "step", Work(), st.ring_all_gather(
            BF16 * attn_params, dp, f_dp))
    if n_dense == 0:
        del stages["dense ffn"], stages["main-grad adds (dense layers)"]
    if not selective.any():
        del stages["selective recompute"]
    if attention.any():  # after the attention core (the stages' order is the report's)
        at = list(stages).index("attention core") + 1
        items = list(stages.items())
        items.insert(at, ("attention recompute", Stage("attention", "layer", Work(), st.attention_recompute(
            m, tokens).scale(attention.astype(float)))))
        stages = dict(items)
    if prob.calibration is not None:
        stages = calibrated_stages(stages, m, prob.calibration, ceil, rows / local, float(S), c.colocated, tokens,
                                   crosses_groups=c.colocated & (c.p > 1),
                                   wgrad_paired_share=wgrad_paired_share)
    if fp8:  # the measured FP8 curve where the calibration holds one; else the passes and copies at any rate,
        # the GEMMs at fp8_speedup times theirs (`fp8_stages`)
        stages = fp8_stages(stages, ceil, prob.fp8_speedup, m, rows, exp_params, prob.calibration, rows / local,
                            backward=prob.fp8_backward, forward=prob.fp8_forward,
                            tokens_once=np.where(c.colocated & (c.expert == 1), tokens, 0.0),
                            input_rows_recomputed=selective & ("expert_input" in prob.recompute_modules),
                            wgrad_paired_share=wgrad_paired_share, single=single)
        if prob.fp8_dense:
            stages = fp8_dense_stages(stages, ceil, prob.fp8_speedup, m, tokens, moe_l, dense_l,
                                      prob.calibration, prob.fp8_dense_scaling)
    if prob.recompute == "full":
        stages = full_recompute_stages(stages)

    def time_of(name: str, bwd: bool):
        stage = stages.get(name)
        return 0.0 if stage is None else stage.time(bwd, ceil)

    rounds_time = []
    floor = 0.0  # the attention GPU's own work per round: _pass_time never undercuts L/p * m * a
    for bwd in (False, True):
        a_moe, a_dense = (group_time(stages, "attention", runs, bwd, ceil) for runs in (MOE_OP, DENSE_OP))
        t_d, t_c = time_of("dispatch", bwd), time_of("combine", bwd)
        t_e = group_time(stages, "expert", EXPERT_OP, bwd, ceil)
        t_head = group_time(stages, "attention", HEAD_OP, bwd, ceil)
        floor = floor + L / p * mb * (n_moe * a_moe + n_dense * a_dense) / L + mb * t_head
        if c.colocated:  # attention, dispatch, experts, combine back to back on each GPU
            a = (n_moe * (a_moe + t_d + t_e + t_c) + n_dense * a_dense) / L
            hop = np.where(p > 1, ceil.time(handoff), 0.0)
            rounds_time.append(_pass_time(a, hop, 0.0, 0.0, p, mb, L) + mb * t_head)
        else:
            a = (n_moe * a_moe + n_dense * a_dense) / L
            frac = n_moe / L
            rounds_time.append(_pass_time(a, frac * t_d, frac * t_e, frac * t_c, p, mb, L) + mb * t_head)
    fwd_round, bwd_round = rounds_time

    tokens_per_round = mb * dp * tokens
    ar_attn = time_of("grad all-reduce (attention)", True)
    ar_exp = time_of("grad all-reduce (experts)", True)
    opt_attn, opt_exp = time_of("optimizer (attention)", True), time_of("optimizer (experts)", True)
    if "param all-gather (attention)" in stages:  # after the update, before the next forward: not overlapped
        opt_attn = opt_attn + time_of("param all-gather (attention)", True)
    if c.colocated:  # one GPU does both halves' reductions and updates
        exposed = np.maximum(ar_attn + ar_exp - bwd_round, 0.0)
        opt = opt_attn + opt_exp
    else:
        exposed = np.maximum(np.maximum(ar_attn, ar_exp) - bwd_round, 0.0)
        opt = np.maximum(opt_attn, opt_exp)
    step = rounds * (fwd_round + bwd_round) + exposed + opt

    ones = np.ones(len(c))
    return Cost(step_s=step, fwd_round_s=fwd_round, bwd_round_s=bwd_round, rounds=rounds,
                tokens_per_round=tokens_per_round * ones, dp=dp * ones,
                attn_mem_bytes=attn_mem, expert_mem_bytes=exp_mem, fits=fits,
                imbalance=np.asarray(imbalance, dtype=float) * ones,
                attn_params=attn_params * ones, expert_params=exp_params * ones,
                attn_act_bytes=act_attn * ones, expert_act_bytes=act_exp * ones, selective=selective,
                attn_transport_bytes=transport_attn * ones, expert_transport_bytes=transport_exp * ones,
                lean_expert_mem_bytes=lean_exp_mem * ones, lean_fits=lean_fits, rank_steps=steps,
                wgrad_pairs=paired_wgrads.copy(),
                round_floor_s=floor * ones, stages=stages, host_state_bytes=host_state, recompute_attention=attention,
                recompute_block=prob.recompute == "full",
                expert_modules=_expert_modules(prob))


def _recomputation(prob: Problem, c: Candidates, tokens: Num, in_flight: Num, pairs: Num, rows: Num,
                   attn_state: Num, exp_state: Num, waits: Num = 0.0) -> tuple[np.ndarray, ...]:
    """Per candidate: (expert modules dropped, attention dropped, attention GPU and expert GPU
    activation bytes, fits, the expert GPU's bytes and fit with the leanest recomputation allowed),
    as the module docstring's recomputation paragraph says. In a split auto prices the attention
    side recomputed only for the candidates whose attention GPU overflows without it and whose
    expert GPU fits with its leanest modules (no other can fit: the search stays as fast). `waits`: the
    distributed ranks' paired weight gradients (`paired_waits`), in every variant's activations."""
    m, cap, n, fp8 = prob.model, prob.capacity_bytes, len(c), prob.expert_precision == "fp8"
    if prob.recompute == "full":
        return _full_recomputation(prob, c, tokens, in_flight, pairs, attn_state, exp_state, waits)
    may = mem.NOTHING_DROPPED if prob.recompute == "none" else frozenset(prob.recompute_modules)
    experts_may, attention_may = may & mem.SELECTIVE, "attention" in may
    fixed = prob.recompute != "auto"
    full = lambda v: np.broadcast_to(np.asarray(v, dtype=float), (n,)).copy()  # noqa: E731
    tokens, in_flight, waits = full(tokens), full(in_flight), full(waits)
    if c.colocated:  # one GPU holds both sides: the fitting variant whose recompute costs least
        variants = [may] if fixed else list(dict.fromkeys((mem.NOTHING_DROPPED, experts_may, may & ATTENTION, may)))
        moe_l, dense_l = _layer_counts(m, c.p)
        t_sel = prob.ceilings.time(st.selective_recompute(m, rows, fp8, prob.fp8_backward,
                                                            _expert_modules(prob))) * moe_l
        t_att = prob.ceilings.time(st.attention_recompute(m, tokens)) * (moe_l + dense_l)
        single = c.expert == 1  # one GPU: its steps write the fused e4m3 copies (`activations`' fused)
        act = [full(activations(m, tokens, pairs, in_flight, c.p, True, d, fp8=fp8, fp8_backward=prob.fp8_backward,
                                waits=waits, fused=single, fused_loss=prob.fused_loss)[0]) for d in variants]
        fit = [attn_state + a <= cap for a in act]
        price = [np.where(f, t_sel * bool(d & mem.SELECTIVE) + t_att * ("attention" in d), np.inf)
                 for f, d in zip(fit, variants, strict=True)]
        pick = np.argmin(np.stack(price), axis=0)  # none fits: the first (no recomputation, or the one asked)
        rows_of = np.arange(n)
        chosen = np.stack(act)[pick, rows_of]
        selective = np.array([bool(d & mem.SELECTIVE) for d in variants])[pick]
        attention = np.array(["attention" in d for d in variants])[pick]
        fits = np.stack(fit)[pick, rows_of]
        return (selective, attention, chosen, 0.0 * chosen, fits, attn_state + act[-1] + 0.0 * chosen,
                fit[-1] & np.ones(n, dtype=bool))
    # a disaggregated expert GPU is a distributed rank: its steps count their numerics, no fused e4m3 copies
    exp_plain = full(expert_activations(m, pairs, in_flight, c.p, fp8=fp8, fp8_backward=prob.fp8_backward,
                                        waits=waits, fused=False))
    exp_lean = (full(expert_activations(m, pairs, in_flight, c.p, experts_may, fp8, prob.fp8_backward, waits,
                                        fused=False))
                if experts_may else exp_plain)
    exp_fit_plain, exp_fit_lean = exp_state + exp_plain <= cap, exp_state + exp_lean <= cap
    attn_plain = full(attention_activations(m, tokens, in_flight, c.p, fused_loss=prob.fused_loss))
    attn_fit_plain = attn_state + attn_plain <= cap
    attn_lean = attn_plain.copy()
    if attention_may:
        # auto: only where the attention GPU overflows without it and the expert GPU can fit at all
        idx = np.arange(n) if fixed else np.flatnonzero(~attn_fit_plain & exp_fit_lean)
        if len(idx):
            attn_lean[idx] = attention_activations(m, tokens[idx], in_flight[idx], c.p[idx], ATTENTION,
                                                   fused_loss=prob.fused_loss)
    attn_fit_lean = attn_state + attn_lean <= cap
    if fixed:
        selective, attention = np.full(n, bool(experts_may)), np.full(n, attention_may)
    else:
        selective, attention = ~exp_fit_plain & exp_fit_lean, ~attn_fit_plain & attn_fit_lean
    act_attn, act_exp = np.where(attention, attn_lean, attn_plain), np.where(selective, exp_lean, exp_plain)
    fits = (attn_state + act_attn <= cap) & (exp_state + act_exp <= cap)
    return selective, attention, act_attn, act_exp, fits, exp_state + exp_lean, attn_fit_lean & exp_fit_lean


def _pairs_fit(prob: Problem, c: Candidates, paired: np.ndarray, tokens: Num, in_flight: Num, pairs: Num, rows: Num,
               state_with_rows: Num) -> np.ndarray:
    """`paired` (per candidate: one GPU whose expert weight gradients may pair) as `expert_wgrad_pairs` settles
    it: on or off as asked; auto (`Problem.wgrad_pairs_budget` finite) the single trainer's rule
    (`runtime.training.single_memory.resolve_wgrad_pairs`), on only where the peak with the waiting rows
    (`state_with_rows` and the activations of the recomputation priced with them) is within the budget."""
    idx = np.flatnonzero(paired)
    if np.isinf(prob.wgrad_pairs_budget) or not len(idx):
        return paired
    act = _recomputation_at(prob, c, idx, tokens, in_flight, pairs, rows, state_with_rows, 0.0)[2]
    fit = np.zeros(len(c), dtype=bool)
    fit[idx] = _taken(state_with_rows, len(c), idx) + act <= prob.wgrad_pairs_budget
    return fit


def _recomputation_at(prob: Problem, c: Candidates, idx: np.ndarray, tokens: Num, in_flight: Num, pairs: Num,
                      rows: Num, attn_state: Num, exp_state: Num, waits: Num = 0.0) -> tuple[np.ndarray, ...]:
    """`_recomputation` of the candidates `idx` of `c` alone (each per-candidate argument taken at `idx`)."""
    per_candidate = (tokens, in_flight, pairs, rows, attn_state, exp_state, waits)
    return _recomputation(prob, c.take(idx), *(_taken(v, len(c), idx) for v in per_candidate))


def _taken(value: Num, n: int, idx: np.ndarray) -> np.ndarray:
    """`value` (a number or one per candidate of `n`) at the candidates `idx`."""
    return np.broadcast_to(np.asarray(value, dtype=float), (n,))[idx]


def paired_micro_batches(single: np.ndarray, micro_batches: Num, step_micro_batches: Num) -> Num:
    """The micro-batches one GPU's expert weight-gradient pairs span: a step's on one GPU (the single trainer
    runs its rounds as more micro-batches of one accumulation, `plan_layout.planned_micro_batches`: m x rounds),
    one round's m on a distributed rank (its schedule runs one round a step, the last launches before its
    optimizer step: `runtime.cluster.worker`)."""
    return np.where(single, step_micro_batches, micro_batches)


def _settled_recomputation(prob: Problem, c: Candidates, paired: np.ndarray, tokens: Num, in_flight: Num,
                           pairs: Num, rows: Num, attn_state: Num, exp_state: Num, groups: Num,
                           fp8_token_groups: bool) -> tuple[np.ndarray, tuple]:
    """(`paired`, per candidate: distributed ranks whose expert weight gradients may pair, as `expert_wgrad_pairs`
    settles it; `_recomputation`'s answer with them). On or off as asked; auto (`Problem.wgrad_pairs_budget`
    finite) the driver's rule (`runtime.cluster.driver.resolve_distributed_wgrad_pairs`): off only where the
    waiting rows raise the fullest GPU's peak (state and transport buffers in `attn_state`, `exp_state`; the
    activations of the recomputation priced with or without them) and take it past the budget; there the
    lean figures are the unpaired ones, the leanest the problem allows. (The planner prices partial sums, never
    pair rows, so the driver's other off, pair rows in bands, never arises in a priced layout.) `groups`: the
    ranks' local experts; `fp8_token_groups`: the all-FP8 backward's e4m3 copies wait (`paired_waits`)."""
    result = _recomputation(prob, c, tokens, in_flight, pairs, rows, attn_state, exp_state,
                            paired_waits(prob.model, pairs, paired, groups, fp8_token_groups))
    idx = np.flatnonzero(paired & np.isfinite(prob.wgrad_pairs_budget))
    if not len(idx):
        return paired, result
    unpaired = _recomputation_at(prob, c, idx, tokens, in_flight, pairs, rows, attn_state, exp_state)

    def fullest(act_attn: np.ndarray, act_exp: np.ndarray) -> np.ndarray:
        return np.maximum(_taken(attn_state, len(c), idx) + act_attn, _taken(exp_state, len(c), idx) + act_exp)

    with_rows = fullest(result[2][idx], result[3][idx])
    off = (with_rows > fullest(unpaired[2], unpaired[3])) & (with_rows > prob.wgrad_pairs_budget)
    settled = paired.copy()
    settled[idx[off]] = False
    chosen = [_replaced(mine, idx[off], theirs[off]) for mine, theirs in zip(result[:5], unpaired[:5], strict=True)]
    lean = [_replaced(mine, idx, theirs) for mine, theirs in zip(result[5:], unpaired[5:], strict=True)]
    return settled, (*chosen, *lean)


def _replaced(values: np.ndarray, at: np.ndarray, new: np.ndarray) -> np.ndarray:
    """A copy of `values` (one per candidate) with `new` at the candidates `at`."""
    out = np.array(values, copy=True)
    out[at] = new
    return out


def _full_recomputation(prob: Problem, c: Candidates, tokens: Num, in_flight: Num, pairs: Num,
                        attn_state: Num, exp_state: Num, waits: Num = 0.0) -> tuple[np.ndarray, ...]:
    """`_recomputation`'s answer under `recompute: full`: both sides' activations with `memory.FULL`
    (no module of selective's) and the ranks' `waits`, the lean figures the same."""
    m, cap, n = prob.model, prob.capacity_bytes, len(c)
    none = np.zeros(n, dtype=bool)
    if c.colocated:  # a rank recomputes its attention half and its experts' share apart; one GPU, whole blocks
        # (FP8 experts refuse `recompute: full`: no e4m3 copies here)
        ranks = activations(m, tokens, pairs, in_flight, c.p, True, mem.FULL, waits=waits, fused=False,
                            fused_loss=prob.fused_loss)[0]
        one = _one_process_full(m, tokens, prob.fused_loss)
        act = np.broadcast_to(np.where(c.expert == 1, one, ranks).astype(float), (n,)).copy()
        fits = attn_state + act <= cap
        return none, none, act, 0.0 * act, fits, attn_state + act, fits
    act_attn = np.broadcast_to(np.asarray(attention_activations(m, tokens, in_flight, c.p, mem.FULL,
                                                                fused_loss=prob.fused_loss), dtype=float), (n,)).copy()
    act_exp = np.broadcast_to(np.asarray(expert_activations(m, pairs, in_flight, c.p, mem.FULL, waits=waits,
                                                            fused=False),
                                         dtype=float), (n,)).copy()
    fits = (attn_state + act_attn <= cap) & (exp_state + act_exp <= cap)
    return none, none, act_attn, act_exp, fits, exp_state + act_exp, fits


def _one_process_full(m: ModelConfig, tokens: Num, fused_loss: bool = True) -> Num:
    """`memory.activation_bytes` under `recompute: full` for `tokens` (numbers or arrays): one
    GPU (mode single) recomputes whole blocks, each keeping its input and routing."""
    kinds = [moe for moe, n in ((True, m.num_moe_layers), (False, m.num_dense_layers)) if n]
    kept = tokens * (m.num_moe_layers * mem.layer_bytes(m, True, BF16, mem.FULL)
                     + m.num_dense_layers * mem.layer_bytes(m, False, BF16, mem.FULL))
    held = tokens * max(mem.layer_grad_bytes(m, moe, BF16, mem.FULL) for moe in kinds)
    return kept + np.maximum(mem.head_bytes(m, tokens, BF16, fused=fused_loss), held)


FULL_RECOMPUTED = " (recomputed)"  # the suffix of a stage `full_recompute_stages` adds


def full_recompute_stages(stages: dict[str, Stage]) -> dict[str, Stage]:
    """`stages` with `recompute: full`'s price: beside every attention and expert stage that runs
    per layer, its forward once more in the backward (`<name> (recomputed)`, at the stage's own
    forward rates): each block runs again when its backward reaches it. Transfers are not repeated
    (an expert GPU recomputes from the rows it received), nor an op's fixed cost (the recompute
    runs inside the backward op)."""
    out = {}
    for name, s in stages.items():  # each beside its stage (the stages' order is the report's)
        out[name] = s
        per_layer = s.group in ("attention", "expert") and s.runs in ("layer", "moe", "dense")
        if per_layer and name not in (ATTENTION_FIXED, EXPERT_FIXED) and _does_work(s.fwd):
            out[name + FULL_RECOMPUTED] = Stage(s.group, s.runs, Work(), s.fwd, bwd_ceilings=s.fwd_ceilings)
    return out


def _does_work(work: Work) -> bool:
    """Whether `work` asks anything of a GPU (for any candidate)."""
    return any(np.any(np.asarray(getattr(work, f.name)) != 0) for f in fields(Work))


ATTENTION_FIXED, EXPERT_FIXED = "fixed cost (attention ops)", "fixed cost (expert ops)"
# The stages one schedule op runs, by how often they run (`Stage.runs`) on its group: an attention
# op of a MoE or a dense layer, an expert op, the head's work of one micro-batch.
MOE_OP, DENSE_OP, EXPERT_OP, HEAD_OP = ("layer", "moe"), ("layer", "dense"), ("moe",), ("micro-batch",)


def group_time(stages: dict[str, Stage], group: str, runs: tuple[str, ...], bwd: bool, default: Ceilings) -> Num:
    """Seconds of one pass (`bwd`) of one schedule op of `group` whose stages run as `runs` says:
    the sum of those stages (each a separate launch), fixed costs included. The closed form
    (`evaluate`) and the replay (`placement.replay.op_times`) both price ops with this."""
    return sum((s.time(bwd, default) for s in stages.values() if s.group == group and s.runs in runs), 0.0)


def fp8_stages(stages: dict[str, Stage], ceil: Ceilings, speedup: float, m: ModelConfig, rows: Num,
               exp_params: Num, calib: Calibration | None = None, rows_per_expert: Num | None = None,
               backward: str = "bf16-wgrad", forward: str = RUN_FP8_EXPERT_FORWARD, tokens_once: Num = 0.0,
               input_rows_recomputed: Num = False, wgrad_paired_share: Num = 0.0,
               single: Num = True) -> dict[str, Stage]:
    """`stages` with the routed experts in FP8 (`precision: fp8`), their weights' e4m3 copies (those
    the recipe reads, `roofline.memory.fp8_weight_copy_shares`: two a parameter by default) made once
    per step (in the experts' optimizer stage, the pass after which they are made) either way.

    Measured (`calib` holds `expert_gemm_fp8`, `bench calibrate` on an FP8 GPU): the expert stages
    at the FP8 curve's rates for their `rows_per_expert`, the forward at its forward rate, the
    backward stages at its whole-backward rate as `backward` and the recipe the curve was measured
    under (`Calibration.fp8_curve_backward`: "fp8" to probe version 5, "bf16-wgrad" from 6) allow
    (`fp8_measured_backward` says which); no quantisation stage, the quantisers' passes being inside
    the measured times. (On an H200, 2026-12-04, our FP8 expert GEMMs ran at about the bf16 rate, the
    FP8 block's forward and backward at 0.39-0.77x of bf16's: the datasheet ratio below promises 2x.)

    Otherwise (`fp8_pricing` says which): the datasheet's. Their compute rate (the bf16 one, or the
    calibrated bf16 one) times `speedup` = fp8_tflops / bf16_tflops, and the passes FP8 adds
    (`kernels.fp8_ffn`), priced by their HBM bytes: forward, the x rows quantised 1 x 128 (read bf16,
    write e4m3 and scales; the SwiGLU output is quantised in its GEMM's epilogue), or where
    `tokens_once` (per candidate: one GPU's tokens, 0 elsewhere) and the top-k make it the fewer bytes
    (`kernels.permute.quantises_tokens_once`) each token's row quantised once and copied to its
    pairs (`fp8_expert_input_bytes`); backward, dy
    quantised twice (1 x 128 and 128 x 1), dh13 twice, the SwiGLU output and x once each along tokens (on
    one GPU dy's 1 x 128 rows written by the combine's backward beside dy, not read back).

    `backward` (`TrainConfig.fp8_expert_backward`, `kernels.fp8_ffn.BACKWARD_PRECISIONS`) says which
    backward stages are FP8: "fp8" both; "bf16-wgrad" the data gradients ("routed experts"'
    backward) only, the weight gradients left at their bf16 (or calibrated) rate, dy and dh13
    quantised once each (1 x 128) and no token-group copies; "bf16" neither (the forward alone).
    The measured curve's one backward rate was fitted on the two stages together under its own
    recipe, so that recipe prices both stages at it: the time measured. Another recipe, the nearest
    the curve allows: "bf16-wgrad" from an "fp8" curve (version 5) the data gradients at the curve's
    rate and the weight gradients at their bf16 rate (pessimistic: the curve's rate is the all-FP8
    backward's, its token-group quantisers inside it); "fp8" from a "bf16-wgrad" curve (version 6)
    both stages at the curve's rate plus the token-group quantisers the curve did not run (dy, dh13,
    the SwiGLU output and x along tokens) as an "fp8 quantise" stage by their HBM bytes (optimistic:
    the FP8 weight-gradient GEMMs at the rate the bf16 ones measured in their place; the block's
    all-FP8 forward+backward measured 0.72-0.88x of bf16-wgrad's TFLOP/s, session 19); "bf16" the
    backward at the bf16 rates, whatever the curve.

    `forward` (`TrainConfig.fp8_expert_forward`, `kernels.fp8_ffn.FORWARD_GEMMS`): "both", or one
    GEMM alone in FP8 ("gate-up": 2/3 of the forward's FLOPs, "down": 1/3), the forward then
    priced at the harmonic blend of the FP8 and bf16 rates by those shares, its one quantiser
    reading x (gate-up) or, on a distributed rank (not `single`, per candidate), the SwiGLU output (down; on
    one GPU the SwiGLU epilogue writes its e4m3 output, no quantiser of its own). A measured curve's forward
    rate is the FP8 GEMMs' where it was measured all-FP8 (`Calibration.fp8_curve_forward` "both", to probe
    version 8), else the blend it measured ("down" from version 9: the run's default, then priced as
    measured), from which the FP8 GEMMs' own rate is recovered for another forward (`_unblend`). (The
    probe's FP8 block runs the one-GPU path: from da7d030 its "down" forward quantises in the epilogue.)

    Either pricing: where the tokens are quantised once for a gate/up GEMM in FP8 and
    `input_rows_recomputed` (per candidate: expert_input recomputed), nothing reads the bf16 grouped
    rows, and the permute's forward loses its row copy (`stages.permute_rows` of the one GPU's
    pairs: `model.experts.RoutedExperts.reads_rows`).

    `wgrad_paired_share` (`stages.paired_share`; 0: none): the micro-batches whose weight gradients launch in
    pairs (`kernels.wgrad_pairs`, under every recipe): a measured curve prices the weight
    gradients at its rate for each launch's size (`_wgrad_ceilings`), as `calibrated_stages` does."""
    if backward not in ("fp8", "bf16-wgrad", "bf16"):
        raise ValueError(f"FP8 experts' backward {backward!r}: choose fp8, bf16-wgrad or bf16")
    if forward not in FP8_FORWARD_SHARES:
        raise ValueError(f"FP8 experts' forward {forward!r}: choose {', '.join(FP8_FORWARD_SHARES)}")
    share = FP8_FORWARD_SHARES[forward]
    out = dict(stages)
    H, F, k = m.hidden_size, m.expert_ffn_size, m.top_k
    scales = FP32 / 128  # one fp32 scale per 128 values of a quantised row (1 x 128 or 128 x 1)
    per_pair = st.fp8_expert_input_bytes(H, rows / k, k, False)
    once = st.fp8_expert_input_bytes(H, tokens_once, k, True)
    quantised_once = (np.asarray(tokens_once) > 0) & (once < per_pair)  # the runtime takes the fewer bytes
    fp8_bwd = {"routed experts": backward != "bf16", "expert weight grads": backward == "fp8"}
    # the rows each backward quantises (H or F elements a row): dy and dh13 1 x 128; under fp8 also
    # 128 x 1, and the SwiGLU output and x along tokens (the FP8 weight-gradient GEMMs' operands)
    quantised = {"fp8": 2 * H + 2 * 2 * F + F + H, "bf16-wgrad": H + 2 * F, "bf16": 0}
    if fp8_pricing(calib) == "measured":
        curve, measured = calib.expert_gemm_fp8, calib.fp8_curve_backward
        fwd_ceil = cal.compute_ceilings(ceil, cal.curve_fraction(curve, rows_per_expert, False))
        bwd_ceil = cal.compute_ceilings(ceil, cal.curve_fraction(curve, rows_per_expert, True))
        wgrad_ceil = _wgrad_ceilings(ceil, curve, rows_per_expert, wgrad_paired_share)
        at_curve = fp8_measured_backward(backward, measured)
        for name in ("routed experts", "expert weight grads"):
            if name in out:
                s = out[name]
                rate = wgrad_ceil if name == "expert weight grads" else bwd_ceil
                bf16_fwd = s.ceilings(False, ceil)
                fp8_fwd = _unblend(fwd_ceil, bf16_fwd, FP8_FORWARD_SHARES[calib.fp8_curve_forward])
                out[name] = replace(s, fwd_ceilings=_blend(fp8_fwd, bf16_fwd, share),
                                    bwd_ceilings=rate if name in at_curve else s.bwd_ceilings)
        unmeasured = quantised[backward] - quantised[measured] if len(at_curve) == 2 else 0
        if unmeasured > 0:  # fp8 from a bf16-wgrad curve: the token-group quantisers it did not run
            bwd = Work(hbm_bytes=rows * unmeasured * (BF16 + 1 + scales))
            out["fp8 quantise"] = Stage("expert", "moe", Work(), bwd)
    else:
        for name in ("routed experts", "expert weight grads"):
            if name in out:
                s = out[name]
                faster = [replace(s.ceilings(bwd, ceil), flops_per_s=s.ceilings(bwd, ceil).flops_per_s * speedup)
                          for bwd in (False, True)]
                out[name] = replace(s, fwd_ceilings=_blend(faster[0], s.ceilings(False, ceil), share),
                                    bwd_ceilings=faster[1] if fp8_bwd[name] else s.bwd_ceilings)
        if forward == "down":  # one GPU (`single`): the bf16 gate/up GEMM's SwiGLU epilogue writes the e4m3 act
            # itself (`grouped_gemm.ragged_rows_gemm(quantized_out=)`), no pass of its own (a step that counts its
            # numerics quantises in one: one step in `fp8_counters_every`, not priced); a distributed rank counts
            # every step (`TrainConfig.counters_every`): the bf16 act read back and quantised in a pass
            fwd = Work(hbm_bytes=np.where(single, 0.0, rows * F * (BF16 + 1 + scales)))
        else:
            fwd = Work(hbm_bytes=np.where(quantised_once, once, per_pair))
        # dy's 1 x 128 rows: on one GPU the combine's backward writes them beside dy (`permute.Fp8RowGradSlot`),
        # nothing read back; a distributed rank counts every step, quantising dy in a pass
        dy_unread = np.where(single, rows * H * BF16, 0.0) if backward != "bf16" else 0.0
        bwd = Work(hbm_bytes=rows * quantised[backward] * (BF16 + 1 + scales) - dy_unread)
        out["fp8 quantise"] = Stage("expert", "moe", fwd, bwd)
    if forward != "down" and "permute / combine sum" in out:
        unwritten = np.where(quantised_once & np.asarray(input_rows_recomputed), np.asarray(tokens_once) * k, 0.0)
        permute = out["permute / combine sum"]
        out["permute / combine sum"] = replace(permute, fwd=permute.fwd + st.permute_rows(m, unwritten).scale(-1.0))
    quantised, held = mem.fp8_weight_copy_shares(forward, backward)
    # read in bf16, written in e4m3 with one fp32 scale per 128 x 128 block
    copies = Work(hbm_bytes=exp_params * (BF16 * quantised + held * (1 + mem.FP8_BLOCK_SCALE_BYTES)))
    if "optimizer (experts)" in out:
        optimizer = out["optimizer (experts)"]
        out["optimizer (experts)"] = replace(optimizer, bwd=optimizer.bwd + copies)
    return out


def fp8_measured_backward(backward: str, measured: str) -> tuple[str, ...]:
    """The expert backward stages `fp8_stages` prices at a measured FP8 curve's whole-backward rate
    when the run asks for `backward` and the curve was measured under `measured`
    (`Calibration.fp8_curve_backward`): both where the two agree, or where the run asks "fp8" (its
    weight gradients FP8 too: the curve's is the nearest rate measured); the data gradients alone for
    "bf16-wgrad" from an "fp8" curve (its weight gradients at their bf16 rate); none for "bf16"."""
    if backward == "bf16":
        return ()
    if backward in (measured, "fp8"):
        return ("routed experts", "expert weight grads")
    return ("routed experts",)


# the share of the routed experts' forward FLOPs in FP8 by `fp8_stages`' forward: gate/up 4NHF, down 2NFH
FP8_FORWARD_SHARES = {"both": 1.0, "gate-up": 2 / 3, "down": 1 / 3}


def _blend(fp8: Ceilings, bf16: Ceilings, share: float) -> Ceilings:
    """`fp8` with its FLOP rate the harmonic blend of `share` of the FLOPs at fp8's rate, the rest at `bf16`'s."""
    if share == 1.0:
        return fp8
    return replace(fp8, flops_per_s=1.0 / (share / fp8.flops_per_s + (1 - share) / bf16.flops_per_s))


def _unblend(curve: Ceilings, bf16: Ceilings, share: float) -> Ceilings:
    """`curve` (a forward measured with `share` of its FLOPs in FP8 and the rest at `bf16`'s rate: the FP8 curve
    from probe version 9, `Calibration.fp8_curve_forward`) with the FP8 GEMMs' own rate: the inverse of `_blend`.
    Where the measured forward is no faster than its bf16 part alone explains (no positive FP8 rate solves it),
    the measured rate itself, as a curve of the all-FP8 forward is read."""
    if share == 1.0:
        return curve
    rest = 1.0 / np.asarray(curve.flops_per_s) - (1 - share) / np.asarray(bf16.flops_per_s)
    ok = rest > 0
    return replace(curve, flops_per_s=np.where(ok, share / np.where(ok, rest, 1.0), curve.flops_per_s))


def fp8_pricing(calib: Calibration | None) -> str:
    """How `fp8_stages` prices FP8 experts under `calib`: "measured" (its FP8 expert curve) or
    "datasheet" (fp8_tflops / bf16_tflops times the bf16 rate, plus the quantisers' HBM passes)."""
    return "measured" if calib is not None and calib.expert_gemm_fp8 else "datasheet"


# the dense stages FP8 dense projections speed up (`kernels.fp8_dense`), with how often they run
FP8_DENSE_STAGES = {"attention projections": "layer", "shared experts": "moe", "dense ffn": "dense"}


def fp8_dense_pricing(calib: Calibration | None, scaling: str) -> str:
    """How `fp8_dense_stages` prices FP8 dense projections of recipe `scaling` under `calib`, as
    `fp8_pricing` says for the experts: "measured" where it holds the FP8 projection curve
    (`Calibration.projections_fp8`, probe version 7 on) measured under that scaling
    (`projections_fp8_scaling`: rowwise up to version 7, the run's default from version 8) and the
    bf16 curve of the same shape (`projections`) it is read against, else "datasheet". A curve of
    the other recipe prices nothing: its GEMMs and quantisers are another recipe's (probe version 7's
    rowwise quantisers cost more than the FP8 GEMMs saved on an H100, which says nothing of the
    blockwise ones), so the datasheet path prices it, unmeasured, and the plan's note names the curve
    it left out (`other_fp8_dense_curve`) rather than pricing one recipe at the other's rate."""
    return ("measured" if calib is not None and calib.projections_fp8 and calib.projections
            and calib.projections_fp8_scaling == scaling else "datasheet")


def other_fp8_dense_curve(calib: Calibration | None, scaling: str) -> str | None:
    """The scaling of `calib`'s FP8 projection curve where it is another than `scaling` (so
    `fp8_dense_pricing` leaves it out); None where there is no curve or it is of `scaling`."""
    if calib is None or not calib.projections_fp8 or calib.projections_fp8_scaling == scaling:
        return None
    return calib.projections_fp8_scaling


def fp8_dense_speedups(calib: Calibration | None, tokens: Num, speedup: float, scaling: str) -> tuple[Num, Num, bool]:
    """(forward, backward) factors by which FP8 dense projections of recipe `scaling` run faster
    than their bf16 rate at `tokens` per micro-batch, and whether their quantisers are inside those
    factors. Measured (`fp8_dense_pricing`): the FP8 projection curve over the bf16 `projections`
    curve at `tokens`, both at the calibration model's attention projections (so the ratio of one
    shape, whatever `attention_curves` prices an MLA model's bf16 stage with), every quantiser
    running (below 1 where they cost more than the FP8 GEMMs save); applied to every FP8 dense stage,
    the shared experts' and dense FFN layers' wider GEMMs too, where the quantisers weigh less
    (pessimistic there). Else the datasheet's `speedup` = fp8_tflops / bf16_tflops for the forward
    and 2 speedup / (1 + speedup) for the backward (the FP8 data gradient and the bf16 weight
    gradient, equal FLOPs: `kernels.fp8_dense.RECIPE`), the quantisers priced as stages of their own."""
    if fp8_dense_pricing(calib, scaling) == "measured":
        return tuple(cal.curve_fraction(calib.projections_fp8, tokens, bwd)
                     / cal.curve_fraction(calib.projections, tokens, bwd) for bwd in (False, True)) + (True,)
    return speedup, 2.0 * speedup / (1.0 + speedup), False


def fp8_dense_stages(stages: dict[str, Stage], ceil: Ceilings, speedup: float, m: ModelConfig,
                     tokens: Num, moe_layers: Num, dense_layers: Num,
                     calib: Calibration | None, scaling: str) -> dict[str, Stage]:
    """`stages` with the dense projections in FP8 (`precision: fp8`, `fp8_dense`) of recipe
    `scaling` (`kernels.fp8_dense.SCALINGS`): the attention projections', shared experts' and dense
    FFN layers' forward and backward at their compute rate (bf16 or calibrated) times
    `fp8_dense_speedups` (measured, the quantisers inside, where the calibration holds the FP8
    projection curve of that recipe; else the datasheet's, with their quantisation passes,
    `roofline.stages.dense_fp8_quantise_passes` of the recipe: the quantisers of the activations and
    the output gradients, as one stage beside each, run as often as it), the FLOPs of the linears the
    recipe keeps in bf16 (blockwise: off its 512 grid, MLA's kv_a) at the bf16 rate
    (`stages.dense_fp8_share`, a harmonic blend, as `_blend` prices a partly FP8 expert forward); the
    weights' two e4m3 copies once per step, in the attention optimizer's stage
    (`dense_fp8_weight_copies` of the recipe: two launches rowwise, one blockwise; of the busiest
    group's `moe_layers` / `dense_layers`)."""
    out = dict(stages)
    *rates, measured = fp8_dense_speedups(calib, tokens, speedup, scaling)
    for name, runs in FP8_DENSE_STAGES.items():
        if name not in out or (name == "shared experts" and not m.shared_ffn_size):
            continue
        s = out[name]
        part = "attention" if name == "attention projections" else name
        share = st.dense_fp8_share(m, part, scaling)
        faster = [_blend(replace(s.ceilings(bwd, ceil), flops_per_s=s.ceilings(bwd, ceil).flops_per_s * rates[bwd]),
                         s.ceilings(bwd, ceil), share) for bwd in (False, True)]
        out[name] = replace(s, fwd_ceilings=faster[0], bwd_ceilings=faster[1])
        if not measured:
            out[f"fp8 quantise ({part})"] = Stage("attention", runs,
                                                  *st.dense_fp8_quantise_passes(m, tokens, part, scaling))
    if "optimizer (attention)" in out:
        optimizer = out["optimizer (attention)"]
        copies = st.dense_fp8_weight_copies(st.dense_fp8_weights(m, moe_layers, dense_layers, scaling), scaling)
        out["optimizer (attention)"] = replace(optimizer, bwd=optimizer.bwd + copies)
    return out


def calibrated_stages(stages: dict[str, Stage], m: ModelConfig, calib: Calibration, ceil: Ceilings,
                      rows_per_expert: Num, seq_len: float, colocated: bool, tokens: Num = None,
                      crosses_groups: np.ndarray | bool = False, wgrad_paired_share: Num = 0.0) -> dict[str, Stage]:
    """`stages` priced with measured terms (`roofline.calibration`): the routed experts at the GEMM
    rates measured for their rows per expert (forward, data gradients, and the weight gradients
    into the fp32 main gradients at their own rate where the calibration holds it), the attention
    projections at the GEMM rate measured for their `tokens` per micro-batch, the attention core at the rate measured for the
    sequence length (both on MLA's curves for an MLA model `m` where the calibration holds them: `attention_curves`),
    dispatch and combine at the measured P2P transport (colocated: all-to-all within the EP block; the
    partial sums to the next pipeline group's block, where `crosses_groups`, at the P2P transport),
    the gradient all-reduces at the measured all-reduce, the optimizer's passes and the permute /
    combine kernels at their measured HBM rates (`Calibration.hbm_fraction`), and each schedule op's fixed cost as its
    own stage (attention, expert ops) or inside the stage that is the op (loss, optimizer).
    A term the calibration lacks leaves its stages as they were. `wgrad_paired_share`
    (`stages.paired_share`; 0: none): the micro-batches whose weight gradients launch in pairs
    (`kernels.wgrad_pairs`), each launch at the curve's rate for its own rows (`_wgrad_ceilings`)."""
    out = dict(stages)

    def rated(name: str, curve: list, at: Num, bwd_field: str = "bwd") -> None:
        if curve and name in out:
            out[name] = replace(out[name], fwd_ceilings=cal.compute_ceilings(ceil, cal.curve_fraction(curve, at, False)),
                                bwd_ceilings=cal.compute_ceilings(ceil, cal.curve_fraction(curve, at, True, bwd_field)))

    def linked(names: tuple[str, ...], link, collective: bool) -> None:
        if link is None:
            return
        link_ceil = cal.link_ceilings(ceil, link, collective)
        for name in names:
            if name in out:
                out[name] = replace(out[name], fwd_ceilings=link_ceil, bwd_ceilings=link_ceil)

    def fixed(kind: str) -> Work:
        return Work(fixed_s=cal.op_fixed_s(calib, kind))

    rated("routed experts", calib.expert_gemm, rows_per_expert)
    # probe version 3 on: the weight gradients' own rate, measured adding into fp32 main gradients;
    # an older file's backward rate (data and weight gradients together, bf16) prices both stages
    wgrad_measured = bool(calib.expert_gemm) and all(p.wgrad is not None for p in calib.expert_gemm)
    wgrad_field = "wgrad" if wgrad_measured else "bwd"
    rated("expert weight grads", calib.expert_gemm, rows_per_expert, wgrad_field)
    if calib.expert_gemm and "expert weight grads" in out:
        out["expert weight grads"] = replace(out["expert weight grads"], bwd_ceilings=_wgrad_ceilings(
            ceil, calib.expert_gemm, rows_per_expert, wgrad_paired_share, wgrad_field))
    attention, projections = cal.attention_curves(calib, m)
    rated("attention core", attention, seq_len)
    if tokens is not None:  # tokens per attention GPU per micro-batch
        rated("attention projections", projections, tokens)
    # memory-bound stages at their measured HBM rate: FlatAdamW's passes, the permute and combine kernels
    for kind, names in (("optimizer", ("optimizer (attention)", "optimizer (experts)")),
                        ("permute", ("permute / combine sum",)), ("norms", ("norms, RoPE, residual adds",))):
        if kind in calib.hbm_fraction:
            hbm_ceil = cal.hbm_ceilings(ceil, calib.hbm_fraction[kind])
            for name in names:
                if name in out:
                    out[name] = replace(out[name], fwd_ceilings=hbm_ceil, bwd_ceilings=hbm_ceil)
    if colocated:
        _link_colocated_hop(out, ceil, calib, crosses_groups)
    else:
        linked(("dispatch", "combine"), calib.p2p, collective=False)
    linked(("grad all-reduce (attention)", "grad all-reduce (experts)", "param all-gather (attention)"),
           calib.all_reduce, collective=True)
    out[ATTENTION_FIXED] = Stage("attention", "layer", fixed("AttentionForward"), fixed("AttentionBackward"))
    out[EXPERT_FIXED] = Stage("expert", "moe", fixed("ExpertForward"), fixed("ExpertBackward"))
    head = out["lm head + embedding"]
    out["lm head + embedding"] = replace(head, fwd=head.fwd + fixed("Loss"))
    # One OptimizerStep op per rank: a colocated rank steps both halves in it, so it pays once.
    for name in ("optimizer (attention)",) if colocated else ("optimizer (attention)", "optimizer (experts)"):
        out[name] = replace(out[name], bwd=out[name].bwd + fixed("OptimizerStep"))
    return out


def _wgrad_ceilings(ceil: Ceilings, curve: list, rows_per_expert: Num, paired_share: Num,
                    field: str = "bwd") -> Ceilings:
    """`ceil` at `curve`'s weight-gradient rate (its `field`) for a step's launches: `paired_share` of the
    micro-batches (`stages.paired_share`) in paired launches (`kernels.wgrad_pairs`) at the curve's rate for
    two micro-batches' rows per expert, the rest (unpaired, or an odd count's last) at its rate for one's,
    blended by their FLOPs: m = 3 is one paired launch and one alone. A probe launch bound by its main
    gradient's traffic fits its time as compute (`roofline.calibration.fitted_fraction`), so each launch's
    rate carries the one main-gradient pass it pays, and the blend prices the launches' sum (exactly where
    each is priced by its rate, not by the stage's other roofs)."""
    alone = cal.compute_ceilings(ceil, cal.curve_fraction(curve, rows_per_expert, True, field))
    share = np.asarray(paired_share, dtype=float)
    if not share.any():
        return alone
    paired = cal.compute_ceilings(ceil, cal.curve_fraction(curve, 2 * np.asarray(rows_per_expert), True, field))
    blended = 1.0 / (share / paired.flops_per_s + (1 - share) / alone.flops_per_s)
    return replace(alone, flops_per_s=np.where(share == 1, paired.flops_per_s,
                                               np.where(share == 0, alone.flops_per_s, blended)))


def _link_colocated_hop(out: dict[str, Stage], ceil: Ceilings, calib: Calibration,
                        crosses_groups: np.ndarray | bool) -> None:
    """A colocated hop's measured link terms: the dispatch (and its gradient) is an all-to-all
    within the EP block; the partial sums (and their gradient) too at p = 1, but one-sided messages
    to the next group's block where `crosses_groups` (p > 1: `st.transfer`), at the P2P transport.
    Each stage's forward and backward carry one of the two works (`evaluate`'s "dispatch" and
    "combine" stages), so each gets its own ceilings."""
    if calib.all_to_all is None and calib.p2p is None:
        return
    within = cal.link_ceilings(ceil, calib.all_to_all, collective=True) if calib.all_to_all else ceil
    partial_sums = within
    if calib.p2p is not None:
        ring = cal.link_ceilings(ceil, calib.p2p, collective=False)
        crosses = np.asarray(crosses_groups)
        partial_sums = replace(within, nvlink_bytes_per_s=np.where(crosses, ring.nvlink_bytes_per_s, within.nvlink_bytes_per_s),
                               nvlink_latency_s=np.where(crosses, ring.nvlink_latency_s, within.nvlink_latency_s))
    if "dispatch" in out:
        out["dispatch"] = replace(out["dispatch"], fwd_ceilings=within, bwd_ceilings=partial_sums)
    if "combine" in out:
        out["combine"] = replace(out["combine"], fwd_ceilings=partial_sums, bwd_ceilings=within)


def _expert_modules(prob: Problem) -> frozenset[str]:
    """The expert modules a selective candidate drops: `Problem.recompute_modules`' expert ones (all
    of `memory.SELECTIVE` where it names none: such a candidate is never priced selective)."""
    return frozenset(prob.recompute_modules) & mem.SELECTIVE or mem.SELECTIVE


def _either(where: np.ndarray, yes: st.Work, no: st.Work) -> st.Work:
    """Per candidate, `yes`'s work where `where` holds, else `no`'s."""
    return st.Work(*(np.where(where, getattr(yes, f.name), getattr(no, f.name)) for f in fields(st.Work)))


def colocated_ep(num_experts: int, gpus: np.ndarray | int) -> np.ndarray:
    """Expert-parallel degree of a colocated EP block of `gpus` GPUs: the largest divisor of both
    counts (a group of GPUs split into `sets` blocks passes GPUs per group / sets)."""
    return np.gcd(num_experts, np.asarray(gpus, dtype=np.int64))
