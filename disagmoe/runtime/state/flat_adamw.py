"""Mixed-precision AdamW over flat buffers: compute parameters, fp32 masters and main gradients.

The fast path of every mode but the CPU oracle (DESIGN 3c). A module's parameters are re-seated
as views of one flat buffer per *bucket* in the compute dtype (bf16 on GPUs), beside flat fp32
buffers of the same layout for the master weights, the main gradients and AdamW's two moments.
A bucket is a set of parameters reduced together (e.g. the attention side's replicated
parameters, all-reduced over the data-parallel group, or this rank's experts) with one weight
decay. With an fp32 compute dtype the parameters *are* the masters (no copy) and their `.grad` is
the main gradient's view, so autograd accumulates in place; with bf16 each parameter's gradient
is added into its fp32 view by a post-accumulate hook as soon as autograd has it, and freed.
A kernel that finds `param.main_grad` may add its weight gradient into it directly and return
none (the Triton experts backend does).

Moments in bf16 (`optim.state_dtype: bf16`, 4 bytes per parameter fewer): the masters and main
gradients stay fp32 and so does the update. `_step_rounded_moments` upcasts a chunk of each moment
to fp32, runs torch's AdamW on it (the same call as the fp32 path: fused on CUDA), and rounds the
new moments back to bf16, round-to-nearest-even (`adamw_chunk`, which the offloaded step shares).
That rounding is the only difference from the fp32 path, and it reaches the parameters one step
later: step t's update uses its unrounded fp32 moments, step t + 1 starts from the rounded ones.
Transformer Engine's FusedAdam (`exp_avg_dtype=torch.bfloat16`, what Megatron-Core's precision-aware
optimizer uses) does the same, over whole fp32 copies and with no stochastic rounding. exp_avg_sq
holds squares of gradients (1e-20 and below is common): bf16 keeps fp32's 8-bit exponent, so they
neither underflow nor overflow; only the significand drops to 8 bits (relative error <= 2^-8 per
rounding).

One step, from the caller's side (nothing here waits on the host):

    opt.zero_grad()                        one memset per bucket (first-touch gradients skipped, below)
    ... micro-batches: forward, backward (gradients land in `bucket.grad_N`)
    ... the caller reduces `bucket.grad_N` (all-reduce) or `opt.reduce_scatter(...)` (ZeRO-1)
    squares = opt.grad_squares(...)        per bucket, on the device
    opt.set_lr(lr)                         the step's learning rate into the device scalar `opt.lr`
    opt.step(clip_coef=...)                one AdamW update per bucket, then masters -> parameters

First touch (`first_touch`, `kernels.first_touch`): the main gradients of parameters whose own code
writes them whole on its first weight-gradient launch of a step (the Triton experts' w13 and w2,
`model.experts.first_touch_params`; about 90% of an MoE's parameters) are not zeroed by `zero_grad`,
only marked untouched: that launch stores its result instead of adding it to zeros (4 B per parameter
neither written by the fill nor read by the add). `zero_grad` fills the rest, the spans between them,
in one foreach launch on CUDA. A gradient that autograd brings to an opted-in parameter anyway (a cast
operand's, another backend's) zeroes an untouched main gradient in a tensor hook that runs before autograd
accumulates it (into the main gradient's view in place, fp32 parameters; into a new `.grad` that the
post-accumulate hook adds, bf16 ones), and `settle_grads`, which `grad_squares`, `step` and
`reduce_scatter` call first, zeroes the ones no writer touched: the gradients read are
zero_grad-then-add's, bit for bit.

Update kernel (`optim.update_kernel`, CUDA buckets): torch's fused AdamW, then the masters copied
into the parameters (bf16 moments: `_step_rounded_moments`), or `kernels.adamw` (the default): one
Triton pass per bucket over master, gradient and moments that writes the parameters too (the same
arithmetic, in torch's order: within a few fp32 ulps of the operands, `kernels.adamw`). The moments
stay in the inner AdamW's state either way, so checkpoints, and a resume with the other kernel, see
one format. CPU buckets take torch's path.

The learning rate is a device tensor (`opt.lr`), not a host float: every inner AdamW holds that one
tensor as its `lr` and the kernels read it from device memory, so a CUDA graph of `step` replays with
whatever `set_lr` last wrote (outside the graph). `step` itself takes no host value of the lr.

ZeRO-1 (`shard=(group, rank, size)` for a bucket): the bucket's length is padded to a multiple of
the group size D and rank d keeps the masters and moments of the d-th slice only; `step` updates
the slice and all-gathers the updated slices (in the compute dtype) into every rank's parameters.

Checkpoints see per-parameter fp32 masters and AdamW state (`masters_by_name`, `state_by_name`,
`load_state`): the same layout-independent format as the oracle's `torch.optim.AdamW` writes, so
either loads the other's checkpoints. The moments are fp32 there whatever `state_dtype` is.
Loading casts them to the run's dtype, so a run resumes with either dtype, in any layout.

Offload (`offload_bucket_bytes`, the run's `offload_optimizer`): the masters (bf16 compute; with fp32
compute the parameters are the masters and stay on the device) and the moments of every bucket live
in pinned host memory, and `step` streams them through two device slots (`runtime.state.offload`),
one chunk at a time, each through `adamw_chunk` as the on-device bf16-moment step's chunks: the same
update, bit for bit. The step counters stay on the device; checkpoints read and write the host copies.

Shapes: N a bucket's flat length (padded to a multiple of D when sharded), S = N / D.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.adamw import adamw  # the functional step torch.optim.AdamW runs

from disagmoe.config import OptimConfig
from disagmoe.kernels.first_touch import mark_untouched, take_first_touch, touch
from disagmoe.roofline.optimizer_state import slot_elements
from disagmoe.runtime.state.offload import StagingArea, host_empty

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
GATHER_CHUNK = 1 << 24  # elements per rank per collective when gathering slices for a checkpoint
MOMENT_CHUNK = 1 << 24  # elements per fp32 copy of a bf16-moment step: at most 2 x 64 MiB held at a time
STATE_KEYS = ("exp_avg", "exp_avg_sq")
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # optim.state_dtype -> the moments' dtype


def lr_dtype(device: torch.device) -> torch.dtype:
    """The learning-rate tensor's dtype: fp32 on CUDA, what torch's fused AdamW reads (`const float*`;
    the lr is then rounded to fp32, 2^-24 relative, where a Python float went in as a double);
    float64 elsewhere, so the CPU for-loop AdamW computes `1 - lr * wd` and `lr / bias_correction`
    in the same doubles as with a Python float: bit for bit the float-lr step."""
    return torch.float32 if device.type == "cuda" else torch.float64


@dataclass(frozen=True)
class Shard:
    """ZeRO-1 split of a bucket over a process group: this rank is `rank` of `size`."""

    group: dist.ProcessGroup | None
    rank: int
    size: int


@dataclass
class Bucket:
    """Parameters reduced together, with one weight decay, as views of flat buffers."""

    name: str
    weight_decay: float
    names: list[str]
    params: list[nn.Parameter]
    compute_N: torch.Tensor  # the parameters' storage, compute dtype
    grad_N: torch.Tensor  # fp32 main gradients
    master_S: torch.Tensor  # fp32 masters of this rank's slice (all of it unsharded; may alias compute_N)
    shard: Shard | None = None
    grad_S: torch.Tensor | None = None  # sharded: this slice's reduced gradient
    inner: torch.optim.AdamW | None = field(default=None, repr=False)  # bf16 moments: holds the state only
    hyper_4: torch.Tensor | None = None  # optim.update_kernel triton: fp64 (beta1, beta2, weight_decay, eps)
    first_touch: list[torch.Tensor] = field(default_factory=list)  # main gradients zero_grad leaves to their writer
    zero_spans: list[torch.Tensor] = field(default_factory=list)  # with first_touch: the views of grad_N it zeroes

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def slice_start(self) -> int:
        return 0 if self.shard is None else self.shard.rank * self.master_S.numel()

    def views(self, flat_N: torch.Tensor) -> list[torch.Tensor]:
        """One view per parameter, shaped like it, of a bucket-shaped flat tensor."""
        parts = flat_N[:self.numel].split([p.numel() for p in self.params])
        return [part.view_as(p) for part, p in zip(parts, self.params, strict=True)]

    def step_grad(self) -> torch.Tensor:
        """The gradient the optimizer steps: the slice's reduced one when sharded."""
        return self.grad_N if self.shard is None else self.grad_S


class FlatAdamW:
    """AdamW over flat fp32 masters of a module's parameters (see the module docstring).

    `bucket_of(name)` names the reduce bucket of a parameter (default: one bucket); each bucket is
    further split by weight decay (matrices decay, gains and biases do not, as `build_optimizer`).
    `shards`: bucket name -> ZeRO-1 split of that bucket's state. `offload_bucket_bytes`: keep the
    masters and moments in host memory, stepped through two device slots of about this many bytes.
    `first_touch`: parameters whose main gradient the step's first writer writes whole (module
    docstring).
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        optim: OptimConfig,
        compute_dtype: torch.dtype,
        bucket_of: Callable[[str], str] = lambda name: "params",
        shards: dict[str, Shard] | None = None,
        offload_bucket_bytes: int | None = None,
        first_touch: Iterable[nn.Parameter] = (),
    ) -> None:
        self.optim = optim
        self.offloaded = offload_bucket_bytes is not None
        self.compute_dtype = compute_dtype
        self.state_dtype = STATE_DTYPES[optim.state_dtype]
        shards = shards or {}
        grouped: dict[tuple[str, bool], list[tuple[str, nn.Parameter]]] = {}
        for name, p in named_params:
            if p.requires_grad:
                grouped.setdefault((bucket_of(name), p.ndim >= 2), []).append((name, p))
        device = next((named[0][1].device for named in grouped.values()), torch.device("cpu"))
        self.lr = torch.full((), optim.lr, dtype=lr_dtype(device), device=device)  # every bucket's AdamW reads it
        self.buckets = [self._bucket(f"{base}.{'decay' if decays else 'no_decay'}",
                                     optim.weight_decay if decays else 0.0, named, shards.get(base))
                        for (base, decays), named in sorted(grouped.items())]
        self._hooks = [p.register_post_accumulate_grad_hook(_add_to_main_grad)
                       for b in self.buckets for p in b.params]
        chosen = {id(p) for p in first_touch}
        for b in self.buckets:
            _split_first_touch(b, [id(p) in chosen for p in b.params])
            # a gradient autograd brings zeroes an untouched main gradient before it is accumulated
            self._hooks += [p.register_hook(functools.partial(_touch_before_accumulate, p.main_grad))
                            for p in b.params if id(p) in chosen]
        self.steps_taken = 0
        self.staging: StagingArea | None = None
        if self.offloaded and self.buckets:
            has_master = compute_dtype != torch.float32
            elements = slot_elements(offload_bucket_bytes, optim.state_dtype, "bf16" if has_master else "fp32",
                                     max(b.master_S.numel() for b in self.buckets))
            self.staging = StagingArea(device, elements, self.state_dtype, has_master)
            # the host moments now: pinning memory (cudaHostAlloc) inside the first step would be a host call there
            self._host_moments = {b.name: {k: host_empty(b.master_S.numel(), self.state_dtype, device.type == "cuda")
                                           for k in STATE_KEYS} for b in self.buckets}

    def set_lr(self, lr: float) -> None:
        """Write the next step's learning rate into `self.lr`, the device scalar every bucket's AdamW
        reads: the one place it changes. Eager callers call it before `step`; a CUDA-graph replay loop
        calls it before each replay, outside the graph (a fill captured in the graph would replay the
        first value). On CUDA a fill kernel with the value as its argument: no copy, no host wait."""
        self.lr.fill_(lr)

    def _bucket(self, name: str, weight_decay: float, named: list[tuple[str, nn.Parameter]],
                shard: Shard | None) -> Bucket:
        params = [p for _, p in named]
        device = params[0].device
        assert self.lr.device == device, f"bucket {name} is on {device}, the learning rate on {self.lr.device}"
        numel = sum(p.numel() for p in params)
        size, rank = (1, 0) if shard is None else (shard.size, shard.rank)
        padded = -(-numel // size) * size
        S = padded // size
        # Built in place, in an order that keeps the construction's peak at the original parameters
        # plus the masters plus the compute copy: no cat/pad temporaries, no clone of an unsharded
        # master, the original parameters released (p.data rebound) before the main gradient exists.
        # (A cat, a pad and a clone held five copies at once: 63 GiB for a 3.8 B-parameter model
        # whose steady state with bf16 moments is 49, docs/benchmarks.md.)
        # Offloaded (bf16 compute): the masters are built in pinned host memory and never exist whole on
        # the device; with fp32 compute the parameters are the masters, on the device either way.
        host = self.offloaded and self.compute_dtype != torch.float32
        pin = host and device.type == "cuda"
        with torch.no_grad():
            masters_N = (host_empty(padded, torch.float32, pin) if host  # the padding stays zero
                         else torch.zeros(padded, dtype=torch.float32, device=device))
            for part, p in zip(masters_N[:numel].split([p.numel() for p in params]), params, strict=True):
                part.copy_(p.detach().reshape(-1))
            if self.compute_dtype == torch.float32:  # the parameters are the masters
                compute_N = masters_N
                master_S = compute_N if shard is None else compute_N[rank * S:(rank + 1) * S]
            elif host:
                compute_N = masters_N.to(self.compute_dtype).to(device)  # cast on the host: no fp32 copy on the device
                master_S = (masters_N if shard is None
                            else host_empty(S, torch.float32, pin).copy_(masters_N[rank * S:(rank + 1) * S]))
            else:
                compute_N = masters_N.to(self.compute_dtype, copy=True)
                master_S = masters_N if shard is None else masters_N[rank * S:(rank + 1) * S].clone()
            del masters_N  # a sharded bucket keeps only its slice
        bucket = Bucket(name, weight_decay, [n for n, _ in named], params, compute_N,
                        torch.empty(0, dtype=torch.float32, device=device), master_S, shard)
        for p, view in zip(params, bucket.views(compute_N), strict=True):
            p.data = view  # the original parameter's storage is released here
        bucket.grad_N = torch.zeros(padded, dtype=torch.float32, device=device)
        bucket.grad_S = None if shard is None else torch.zeros_like(master_S)
        for p, grad in zip(params, bucket.views(bucket.grad_N), strict=True):
            p.main_grad = grad
        master = nn.Parameter(master_S, requires_grad=True)
        # capturable: torch's AdamW.step refuses CUDA-graph capture without it; the fused kernel ignores
        # it (the same math). Off on the CPU, where it would pick another path (and other roundings).
        # Offloaded: the inner AdamW holds the hyperparameters and the (host) state only; `step` never calls it.
        cuda = device.type == "cuda" and not host
        bucket.inner = torch.optim.AdamW([master], lr=self.lr, betas=(self.optim.beta1, self.optim.beta2),
                                         eps=self.optim.eps, weight_decay=weight_decay, fused=cuda, capturable=cuda)
        if self.optim.update_kernel == "triton" and cuda:  # made here: a host-to-device copy has no place in a captured step
            from disagmoe.kernels.adamw import hyperparameters  # triton: only for runs that ask for its kernel

            bucket.hyper_4 = hyperparameters(self.optim.beta1, self.optim.beta2, weight_decay, self.optim.eps, device)
        return bucket

    # -- gradients -----------------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Zero every main gradient but the first-touch ones, which are marked untouched instead
        (module docstring); fp32 parameters get their views as `.grad` (autograd then accumulates
        into the flat buffer in place), others none (their hook adds and frees)."""
        for b in self.buckets:
            if b.first_touch:
                if b.zero_spans:
                    torch._foreach_zero_(b.zero_spans)  # one launch on CUDA for every span
                for main in b.first_touch:
                    mark_untouched(main)
            else:
                b.grad_N.zero_()
            for p in b.params:
                p.grad = p.main_grad if p.dtype == torch.float32 else None

    def settle_grads(self, bucket: Bucket | None = None) -> None:
        """Zero the first-touch main gradients (of `bucket`, or of every bucket) that no writer has
        touched since `zero_grad`, so what is read next is zeros, not a former step's gradient: before
        the gradients are reduced, their norm taken or the step made. `grad_squares`, `step` and
        `reduce_scatter` call it; a caller that reduces `grad_N` itself calls it first. Nothing to do
        (no launch) once every such gradient was written."""
        stale = [main for b in (self.buckets if bucket is None else [bucket])
                 for main in b.first_touch if take_first_touch(main)]
        if stale:
            torch._foreach_zero_(stale)

    def reduce_scatter(self, bucket: Bucket, async_op: bool = False) -> dist.Work | None:
        """ZeRO-1: sum a sharded bucket's main gradients over its group into this rank's slice
        (`async_op`: return the work to wait later)."""
        assert bucket.shard is not None and bucket.grad_S is not None
        self.settle_grads(bucket)
        return _reduce_scatter(bucket.grad_S, bucket.grad_N, group=bucket.shard.group, async_op=async_op)

    def grad_squares(self) -> torch.Tensor:
        """float64 sum of squares of the gradients this rank steps (a sharded bucket: its slice)."""
        self.settle_grads()
        total = torch.zeros((), dtype=torch.float64, device=self.buckets[0].grad_N.device)
        for b in self.buckets:
            total += flat_squares(b.step_grad())
        return total

    # -- the step ------------------------------------------------------------------------------

    def step(self, *, clip_coef: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> None:
        """AdamW at the learning rate `self.lr` (`set_lr`) on every bucket with gradients scaled by
        `clip_coef` (a device scalar, <= 1), then the updated masters into the compute parameters
        (all-gathered where sharded; the Triton update writes an unsharded bucket's itself). `skip` (a
        CUDA fp32 scalar, 1.0 or 0.0): where 1, the fused kernels (torch's or the Triton update) leave
        masters, moments and step counts as they were (torch's `found_inf`, as GradScaler uses it),
        decided on the device: no host wait. CUDA only (the fused kernels). A `record_function` range
        names the step's kernels in a profile (`bench profile`'s ops)."""
        with torch.profiler.record_function("FlatAdamW.step"):
            self._step(clip_coef, skip)

    def _step(self, clip_coef: torch.Tensor | None, skip: torch.Tensor | None) -> None:
        self.settle_grads()
        inverse = None if clip_coef is None else (1.0 / clip_coef).float()  # the fused kernels' grad_scale
        if skip is not None and not self.lr.is_cuda:
            raise ValueError("FlatAdamW.step(skip=...) runs in the fused CUDA kernels; on the CPU pass skip=None")
        if self.staging is not None:
            self._step_offloaded(clip_coef, inverse, skip)
            self.steps_taken += 1
            return
        for b in self.buckets:
            inner = b.inner
            master = inner.param_groups[0]["params"][0]
            if skip is not None and not master.is_cuda:
                raise ValueError("FlatAdamW.step(skip=...) runs in the fused CUDA kernels; on the CPU pass skip=None")
            if self._uses_update_kernel(b):
                fresh_copy = self._step_in_one_pass(b, master, inverse, skip)
            else:
                self._step_torch(b, master, clip_coef, inverse, skip)
                fresh_copy = False
            with torch.no_grad():
                if b.shard is not None:
                    _all_gather(b.compute_N, b.master_S.to(self.compute_dtype, copy=True), group=b.shard.group)
                elif b.master_S is not b.compute_N and not fresh_copy:
                    b.compute_N.copy_(b.master_S)
        self.steps_taken += 1

    def _uses_update_kernel(self, b: Bucket) -> bool:
        """Whether `step` updates `b` with the one-pass Triton kernel: `optim.update_kernel: triton` and
        the bucket's masters on a GPU (offloaded buckets take `_step_offloaded`, CPU ones torch's path)."""
        return self.optim.update_kernel == "triton" and b.master_S.is_cuda

    def _step_torch(self, b: Bucket, master: torch.Tensor, clip_coef: torch.Tensor | None,
                    grad_scale: torch.Tensor | None, skip: torch.Tensor | None) -> None:
        """torch's AdamW on `b`'s masters (`optim.update_kernel: torch`, and every CPU bucket): fused on
        CUDA (dividing the gradient by `grad_scale`, its 1 / clip_coef), with bf16 moments through fp32
        copies (`_step_rounded_moments`); on the CPU the gradient is scaled by `clip_coef` first."""
        inner = b.inner
        master.grad = b.step_grad()
        if clip_coef is not None:
            if master.is_cuda:  # the fused kernel divides by grad_scale in registers
                inner.grad_scale = grad_scale
            else:
                master.grad.mul_(clip_coef.to(master.grad.dtype))
        if self.state_dtype == torch.float32:
            inner.found_inf = skip
            inner.step()
        else:
            self._step_rounded_moments(b, master, grad_scale, skip)
        inner.grad_scale = inner.found_inf = None
        master.grad = None

    def _step_in_one_pass(self, b: Bucket, master: torch.Tensor, grad_scale: torch.Tensor | None,
                          skip: torch.Tensor | None) -> bool:
        """`optim.update_kernel: triton`: `kernels.adamw.adamw_update` on `b`'s masters, moments (either
        dtype, in the inner AdamW's state where checkpoints read them) and, unsharded with a separate
        compute copy, the compute parameters in the same pass; then the step is counted. Returns
        whether the compute copy was written (a sharded bucket's is all-gathered by the caller)."""
        from disagmoe.kernels.adamw import adamw_update  # triton: imported where a GPU bucket first needs it

        state = self._moments(b, master)
        compute = b.compute_N if b.shard is None and b.compute_N is not b.master_S else None
        with torch.no_grad():
            adamw_update(b.master_S, b.step_grad(), state["exp_avg"], state["exp_avg_sq"], state["step"], self.lr,
                         b.hyper_4, grad_scale, skip, compute)
            count_step(state, skip)
        return compute is not None

    def _moments(self, b: Bucket, master: torch.Tensor) -> dict[str, torch.Tensor]:
        """`b`'s AdamW state, started as torch's AdamW starts a parameter's (a zero fp32 step count on the
        master's device, CPU for a CPU one) with zero moments in the moments' dtype."""
        state = b.inner.state[master]
        if not state:
            step_device = master.device if master.is_cuda else torch.device("cpu")
            state.update(step=torch.zeros((), dtype=torch.float32, device=step_device),
                         exp_avg=torch.zeros_like(master, dtype=self.state_dtype),
                         exp_avg_sq=torch.zeros_like(master, dtype=self.state_dtype))
        return state

    def _offloaded_state(self, b: Bucket) -> dict[str, torch.Tensor]:
        """An offloaded bucket's AdamW state: moments in (pinned) host memory, the step on the device."""
        master = b.inner.param_groups[0]["params"][0]
        state = b.inner.state[master]
        if not state:  # the first step: the zeroed host moments made at construction
            state.update(step=torch.zeros((), dtype=torch.float32, device=self.lr.device), **self._host_moments[b.name])
        return state

    def _step_offloaded(self, clip_coef: torch.Tensor | None, grad_scale: torch.Tensor | None,
                        skip: torch.Tensor | None) -> None:
        """`step` with the masters and moments in host memory (module docstring, `runtime.state.offload`):
        chunks of at most one slot, over every bucket in order, loaded two ahead into the slots, updated
        by `adamw_chunk` as `_step_rounded_moments`'s chunks are (fp32 moments: the same elementwise
        update `inner.step()` makes), the compute parameters written from the updated masters on the
        device, stored back. The sharded buckets' all-gathers follow the last chunk."""
        area = self.staging
        assert area is not None
        C, cuda = area.elements, self.lr.is_cuda
        chunks = [(b, start, min(C, b.master_S.numel() - start))
                  for b in self.buckets for start in range(0, b.master_S.numel(), C)]
        states = {b.name: self._offloaded_state(b) for b in self.buckets}

        def pairs(i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:  # (slot view, host view) of chunk i
            b, start, n = chunks[i]
            slot, state = area.slots[i % 2], states[b.name]
            out = [(slot.exp_avg_C[:n], state["exp_avg"][start:start + n]),
                   (slot.exp_avg_sq_C[:n], state["exp_avg_sq"][start:start + n])]
            if slot.master_C is not None:
                out.append((slot.master_C[:n], b.master_S[start:start + n]))
            return out

        with torch.no_grad():
            if clip_coef is not None and not cuda:  # as `step`: the CPU path scales the gradient itself
                for b in self.buckets:
                    b.step_grad().mul_(clip_coef.to(b.step_grad().dtype))
            area.begin()
            for i in range(min(2, len(chunks))):
                area.load(i, pairs(i))
            for i, (b, start, n) in enumerate(chunks):
                slot, state = area.slots[i % 2], states[b.name]
                area.wait_loaded(i)
                master = b.master_S[start:start + n] if slot.master_C is None else slot.master_C[:n]
                adamw_chunk(b.inner.param_groups[0], master, b.step_grad()[start:start + n], slot.exp_avg_C[:n],
                            slot.exp_avg_sq_C[:n], state["step"], grad_scale, skip, area.scratch_2C)
                if slot.master_C is not None:  # the compute copy from the updated masters, on the device
                    at = b.slice_start + start
                    b.compute_N[at:at + n].copy_(master)
                area.store(i, [(host, dev) for dev, host in pairs(i)])
                if i + 2 < len(chunks):
                    area.load(i + 2, pairs(i + 2))
                if start + n == b.master_S.numel():
                    count_step(state, skip)
            for b in self.buckets:
                if b.shard is not None:  # this rank's slice of compute_N is fresh: gather the others'
                    at, S = b.slice_start, b.master_S.numel()
                    _all_gather(b.compute_N, b.compute_N[at:at + S].clone(), group=b.shard.group)

    def _step_rounded_moments(self, b: Bucket, master: torch.Tensor, grad_scale: torch.Tensor | None,
                              skip: torch.Tensor | None = None) -> None:
        """AdamW on `master` with its moments held in `state_dtype` (module docstring): per
        MOMENT_CHUNK elements, fp32 copies of both moments go through torch's AdamW (fused on CUDA,
        dividing the gradient by `grad_scale` there; the CPU caller has scaled it already). Then
        the new moments are rounded back to nearest-even. Deterministic: no random rounding. `skip`
        as `step`'s: the kernel leaves the chunk's moments (rounded back unchanged) and master."""
        state = self._moments(b, master)
        group, grad = b.inner.param_groups[0], master.grad
        with torch.no_grad():
            for start in range(0, master.numel(), MOMENT_CHUNK):
                part = slice(start, start + MOMENT_CHUNK)
                adamw_chunk(group, master[part], grad[part], state["exp_avg"][part], state["exp_avg_sq"][part],
                            state["step"], grad_scale, skip)
            count_step(state, skip)

    # -- checkpoints ---------------------------------------------------------------------------

    def _full(self, b: Bucket, slice_S: torch.Tensor, keep: bool) -> torch.Tensor | None:
        """A bucket-shaped fp32 tensor on the CPU from this rank's slice (gathered over the shard
        group, in chunks, onto the rank that `keep`s it; a collective when sharded)."""
        if b.shard is None:
            return slice_S.detach().float().cpu()
        S, D = slice_S.numel(), b.shard.size
        full_N = torch.empty(S * D, dtype=torch.float32) if keep else None
        for start in range(0, S, GATHER_CHUNK):
            n = min(GATHER_CHUNK, S - start)
            device = self.lr.device  # an offloaded slice is on the host: gather through the device (nccl)
            chunks_Dn = torch.empty(D * n, dtype=slice_S.dtype, device=device)
            _all_gather(chunks_Dn, slice_S[start:start + n].to(device).contiguous(), group=b.shard.group)
            if full_N is not None:
                chunks_Dn = chunks_Dn.view(D, n).cpu()
                for r in range(D):
                    full_N[r * S + start:r * S + start + n] = chunks_Dn[r]
        return full_N

    def _keeps(self, b: Bucket) -> bool:
        return b.shard is None or b.shard.rank == 0

    def masters_by_name(self) -> dict[str, torch.Tensor]:
        """fp32 master weights per parameter name, on the CPU (sharded buckets: on shard rank 0
        only; a collective over the shard group)."""
        self._drain()
        out: dict[str, torch.Tensor] = {}
        for b in self.buckets:
            full_N = self._full(b, b.master_S, self._keeps(b))
            if full_N is not None:
                out.update(zip(b.names, (v.clone() for v in b.views(full_N)), strict=True))
        return out

    def state_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        """AdamW's per-parameter state (step, exp_avg, exp_avg_sq) as `torch.optim.AdamW` keeps it,
        on the CPU (sharded: shard rank 0 only; a collective); empty before the first step."""
        self._drain()
        out: dict[str, dict[str, torch.Tensor]] = {}
        for b in self.buckets:
            state = b.inner.state.get(b.inner.param_groups[0]["params"][0])
            if not state:
                continue
            fulls = {k: self._full(b, state[k], self._keeps(b)) for k in STATE_KEYS}
            if fulls["exp_avg"] is None:
                continue
            step = state["step"].detach().float().cpu().reshape(())
            views = {k: b.views(full) for k, full in fulls.items()}
            for i, name in enumerate(b.names):
                out[name] = {"step": step.clone(), **{k: views[k][i].clone() for k in STATE_KEYS}}
        return out

    def load_state(self, masters: dict[str, torch.Tensor], state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Take masters (every parameter) and AdamW state (all parameters of a bucket or none of
        them: saved before any step) in the per-parameter form above; only this rank's slices go
        to the device (offloaded: the masters and moments to their host copies)."""
        self._drain()  # no store of a step may land after these writes
        with torch.no_grad():
            for b in self.buckets:
                missing = [n for n in b.names if n not in masters]
                if missing:
                    raise ValueError(f"the checkpoint lacks master weights of {len(missing)} parameters, "
                                     f"e.g. {missing[:3]}")
                S, start = b.master_S.numel(), b.slice_start
                full = self._flat([masters[n] for n in b.names], b.compute_N.numel())
                b.compute_N.copy_(full.to(b.compute_N.device))
                if self.compute_dtype != torch.float32:
                    b.master_S.copy_(full[start:start + S].to(b.master_S.device))
                have = [n for n in b.names if n in state]
                if not have:
                    continue
                if len(have) != len(b.names):
                    raise ValueError(f"the checkpoint has optimizer state for some but not all parameters of "
                                     f"bucket {b.name} (missing e.g. {[n for n in b.names if n not in state][:3]})")
                master = b.inner.param_groups[0]["params"][0]
                device = master.device
                # the step counter on the compute device (CUDA: the fused kernel reads it there; offloaded too)
                entry = {"step": state[b.names[0]]["step"].detach().float().reshape(()).clone().to(self.lr.device)}
                for k in STATE_KEYS:  # fp32 in every checkpoint: cast to this run's moments
                    full_k = self._flat([state[n][k] for n in b.names], b.compute_N.numel())
                    if self.staging is not None:  # into the pinned host copies the step streams
                        entry[k] = self._host_moments[b.name][k].copy_(full_k[start:start + S])
                    else:
                        entry[k] = full_k[start:start + S].to(device, self.state_dtype, copy=True)
                b.inner.state[master] = entry

    def _drain(self) -> None:
        if self.staging is not None:
            self.staging.drain()

    @staticmethod
    def _flat(tensors: list[torch.Tensor], padded: int) -> torch.Tensor:
        flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])
        return torch.nn.functional.pad(flat, (0, padded - flat.numel()))

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def adamw_chunk(group: dict, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, step: torch.Tensor, grad_scale: torch.Tensor | None,
                skip: torch.Tensor | None, scratch_2C: torch.Tensor | None = None) -> None:
    """One chunk of AdamW in place, the arithmetic of both the on-device bf16-moment step
    (`FlatAdamW._step_rounded_moments`) and the offloaded step (`FlatAdamW._step_offloaded`): torch's
    functional AdamW with `group`'s hyperparameters (fused on CUDA, dividing the gradient by
    `grad_scale` and leaving everything as it was where `skip` is 1; the CPU caller has scaled the
    gradient already) from a copy of the bucket's `step` (every chunk starts from the same count:
    the caller counts it once, `count_step`). Moments in fp32 update in place; in bf16 through fp32
    copies (into `scratch_2C`'s rows when given, else fresh tensors: the same values) rounded back
    to nearest-even. Elementwise, so chunking changes no bit; no host sync.

    Shapes: master, grad, exp_avg, exp_avg_sq [C]; scratch_2C [2, >= C] fp32."""
    if exp_avg.dtype == torch.float32:
        avg_C, sq_C = exp_avg, exp_avg_sq
    elif scratch_2C is not None:
        avg_C, sq_C = scratch_2C[0, :exp_avg.numel()], scratch_2C[1, :exp_avg.numel()]
        avg_C.copy_(exp_avg)
        sq_C.copy_(exp_avg_sq)
    else:
        avg_C, sq_C = exp_avg.float(), exp_avg_sq.float()
    fused = master.is_cuda
    beta1, beta2 = group["betas"]
    adamw([master], [grad], [avg_C], [sq_C], [], [step.clone()], foreach=False, fused=fused,
          grad_scale=grad_scale if fused else None, found_inf=skip, amsgrad=False, beta1=beta1, beta2=beta2,
          lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
    if avg_C is not exp_avg:  # fp32 -> bf16: round to nearest even
        exp_avg.copy_(avg_C)
        exp_avg_sq.copy_(sq_C)


def count_step(state: dict, skip: torch.Tensor | None) -> None:
    """One more step in a bucket's AdamW state, on the device (none where `skip` is 1: the fused
    kernel left the bucket as it was)."""
    state["step"].add_(1)
    if skip is not None:
        state["step"].sub_(skip)


def flat_squares(flat: torch.Tensor) -> torch.Tensor:
    """float64 sum of squares of a long flat tensor: an fp32 reduction on a GPU (a tree: exact
    enough), float64 on the CPU, whose fp32 sums drift by 1e-5 over a million elements."""
    if flat.is_cuda:
        return torch.linalg.vector_norm(flat).double() ** 2
    return torch.linalg.vector_norm(flat, dtype=torch.float64) ** 2


def _split_first_touch(b: Bucket, opted_P: list[bool]) -> None:
    """`b.first_touch`, the main gradients of the opted-in parameters (`opted_P`, in bucket order), and
    `b.zero_spans`, the views of `b.grad_N` between them (and the padding) that zero_grad still fills:
    contiguous runs of the other parameters merged into one span each."""
    b.first_touch = [p.main_grad for p, opted in zip(b.params, opted_P, strict=True) if opted]
    if not b.first_touch:
        return
    spans, start, at = [], None, 0
    for p, opted in zip(b.params, opted_P, strict=True):
        if opted and start is not None:
            spans.append((start, at))
            start = None
        elif not opted and start is None:
            start = at
        at += p.numel()
    end = b.grad_N.numel()  # the padding of a sharded bucket is zeroed with the last span
    if start is not None or at < end:
        spans.append((at if start is None else start, end))
    b.zero_spans = [b.grad_N[lo:hi] for lo, hi in spans]


def _touch_before_accumulate(main: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Tensor hook of a first-touch parameter, run before autograd accumulates `grad`: zero its main
    gradient `main` if no writer touched it yet this step (`kernels.first_touch.touch`). An fp32
    parameter's `.grad` is `main` itself, into which autograd then adds in place. torch calls the
    hook with None where the op returned no gradient (the experts' held-back weight gradients,
    `deferred_weight_grads`): nothing is added then, so the mark stays for the held-back launch to
    store into."""
    if grad is not None:
        touch(main)


def _add_to_main_grad(param: torch.Tensor) -> None:
    """Post-accumulate hook: a gradient autograd did not accumulate into the main gradient in
    place (bf16 parameters, or an fp32 one whose `.grad` was replaced) is added into it (a first-touch
    one was zeroed before, if untouched: `_touch_before_accumulate`); a bf16 gradient is then freed,
    an fp32 parameter gets its view back."""
    grad, main = param.grad, param.main_grad
    if grad is None or grad.data_ptr() == main.data_ptr():  # None: a kernel added into main_grad itself
        return
    main.add_(grad)
    param.grad = main if param.dtype == main.dtype else None
