"""FlatAdamW (disagmoe/runtime/state/flat_adamw.py): the flat fp32 step equals torch's AdamW on the
parameters themselves (CPU, fp32: to rounding), micro-batch gradients accumulate in fp32 main
gradients for bf16 parameters, clipping scales like clip_grad_norm_, state round-trips, and the
ZeRO-1 split over two gloo processes takes the same step. bf16 moments: each step is the fp32
update with the moments rounded after it, the trajectory stays near the fp32 one, and the
checkpoint form (fp32 moments) resumes either dtype from either."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from disagmoe.config import OptimConfig
from disagmoe.runtime.state.flat_adamw import FlatAdamW, Shard
from disagmoe.runtime.state.optim import build_optimizer, lr_at
from tests.runtime.state.gloo_pair import run_pair
from tests.ulps import adamw_master_tolerance, bf16_moment_apart, operand_half_ulps, over_tolerance

OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3, bias=False))


def _step_alike(pairs, steps, lr_of) -> None:
    """Step each (FlatAdamW, model) pair through `steps` on the same losses, at `lr_of(step)`."""
    for step in steps:
        for f, m in pairs:
            f.zero_grad()
            _loss(m, step, 0).backward()
            f.set_lr(lr_of(step))
            f.step()


def _loss(model: nn.Module, step: int, mb: int) -> torch.Tensor:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + mb))
    first = next(model.parameters())
    return model(x.to(first.device, first.dtype)).float().square().mean()


def test_flat_step_equals_adamw_on_the_parameters() -> None:
    oracle, fast = _model(), _model()
    reference = build_optimizer(oracle.named_parameters(), OPTIM)
    flat = FlatAdamW(fast.named_parameters(), OPTIM, torch.float32)
    for step in range(4):
        reference.zero_grad(set_to_none=True)
        flat.zero_grad()
        for mb in range(3):
            (_loss(oracle, step, mb) / 3).backward()
            (_loss(fast, step, mb) / 3).backward()
        reference.step()
        flat.set_lr(OPTIM.lr)
        flat.step()
    for (name, a), b in zip(oracle.named_parameters(), fast.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


def test_bf16_parameters_accumulate_fp32_main_gradients() -> None:
    model = _model().to(torch.bfloat16)
    flat = FlatAdamW(model.named_parameters(), OPTIM, torch.bfloat16)
    flat.zero_grad()
    expected = [torch.zeros(p.shape) for p in model.parameters()]
    for mb in range(3):
        grads = torch.autograd.grad(_loss(model, 0, mb), list(model.parameters()))
        expected = [e + g.float() for e, g in zip(expected, grads)]
        _loss(model, 0, mb).backward()
    for p, e in zip(model.parameters(), expected, strict=True):
        assert p.grad is None and p.dtype == torch.bfloat16
        assert p.main_grad.dtype == torch.float32
        torch.testing.assert_close(p.main_grad, e, rtol=1e-6, atol=1e-7)
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    flat.set_lr(OPTIM.lr)
    flat.step()
    masters = flat.masters_by_name()
    for name, p in model.named_parameters():
        assert not torch.equal(p.float(), before[name]), name
        torch.testing.assert_close(p.float(), masters[name].to(torch.bfloat16).float(), rtol=0, atol=0)


def test_clip_coefficient_scales_like_clip_grad_norm() -> None:
    oracle, fast = _model(), _model()
    reference = build_optimizer(oracle.named_parameters(), OPTIM)
    flat = FlatAdamW(fast.named_parameters(), OPTIM, torch.float32)
    flat.zero_grad()
    _loss(oracle, 0, 0).backward()
    _loss(fast, 0, 0).backward()
    norm = torch.nn.utils.clip_grad_norm_(list(oracle.parameters()), 0.01)
    squares = flat.grad_squares()
    torch.testing.assert_close(squares.sqrt().float(), norm, rtol=1e-6, atol=0)
    coef = torch.clamp(0.01 / (squares.sqrt().float() + 1e-6), max=1.0)
    reference.step()
    flat.set_lr(OPTIM.lr)
    flat.step(clip_coef=coef)
    for a, b in zip(oracle.parameters(), fast.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_state_round_trips_through_the_per_parameter_form() -> None:
    model = _model()
    flat = FlatAdamW(model.named_parameters(), OPTIM, torch.float32)
    assert flat.state_by_name() == {}
    for step in range(2):
        flat.zero_grad()
        _loss(model, step, 0).backward()
        flat.set_lr(OPTIM.lr)
        flat.step()
    masters, state = flat.masters_by_name(), flat.state_by_name()
    assert set(masters) == set(state) == {n for n, _ in model.named_parameters()}
    assert all(float(s["step"]) == 2 for s in state.values())
    other = _model(seed=1)
    fresh = FlatAdamW(other.named_parameters(), OPTIM, torch.float32)
    fresh.load_state(masters, state)
    for (name, a), b in zip(model.named_parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b), name
    _step_alike(((flat, model), (fresh, other)), range(2, 4), lambda step: OPTIM.lr)
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)


def test_partial_state_is_refused() -> None:
    model = _model()
    flat = FlatAdamW(model.named_parameters(), OPTIM, torch.float32)
    flat.zero_grad()
    _loss(model, 0, 0).backward()
    flat.set_lr(OPTIM.lr)
    flat.step()
    state = flat.state_by_name()
    state.pop(next(iter(state)))
    with pytest.raises(ValueError, match="some but not all"):
        FlatAdamW(_model().named_parameters(), OPTIM, torch.float32).load_state(flat.masters_by_name(), state)


BF16 = OptimConfig(lr=1e-2, weight_decay=0.1, state_dtype="bf16")


def _moments(flat: FlatAdamW) -> list[dict[str, torch.Tensor]]:
    """Each bucket's live AdamW state (step, exp_avg, exp_avg_sq), in the optimizer's own dtypes."""
    return [b.inner.state[b.inner.param_groups[0]["params"][0]] for b in flat.buckets]


@pytest.mark.parametrize("chunk", [None, 7])  # None: one chunk per bucket; 7: many, with a ragged last one
def test_bf16_moments_take_the_fp32_update_then_round_the_moments(monkeypatch, chunk) -> None:
    """Every step of a bf16-moment run against a plain fp32 torch AdamW of the same update: from
    the run's masters and its moments (bf16 values, upcast exactly), with the same (clipped)
    gradient. Tolerance, per step: the masters are equal bit for bit, because the update runs in
    fp32 on the same ops and values. The new moments are the reference's rounded to nearest bf16,
    exactly, because that rounding is the only thing the bf16 path adds."""
    from disagmoe.runtime.state import flat_adamw

    if chunk is not None:
        monkeypatch.setattr(flat_adamw, "MOMENT_CHUNK", chunk)
    model = _model()
    flat = FlatAdamW(model.named_parameters(), BF16, torch.float32)
    for step in range(6):
        flat.zero_grad()
        _loss(model, step, 0).backward()
        before = [(b.master_S.detach().clone(), b.grad_N.clone(), {k: v.clone() for k, v in s.items()}) for b, s in
                  zip(flat.buckets, _moments(flat), strict=True)]
        coef = torch.tensor(0.5)
        flat.set_lr(BF16.lr)
        flat.step(clip_coef=coef)
        for b, state, (master, grad, old) in zip(flat.buckets, _moments(flat), before, strict=True):
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
            ref = nn.Parameter(master)
            ref.grad = grad * coef
            reference = torch.optim.AdamW([ref], lr=BF16.lr, betas=(BF16.beta1, BF16.beta2), eps=BF16.eps,
                                          weight_decay=b.weight_decay)
            if old:
                reference.state[ref] = {"step": old["step"].clone(), "exp_avg": old["exp_avg"].float(),
                                        "exp_avg_sq": old["exp_avg_sq"].float()}
            reference.step()
            expected = reference.state[ref]
            assert torch.equal(b.master_S, ref.detach()), b.name
            assert torch.equal(state["exp_avg"], expected["exp_avg"].to(torch.bfloat16)), b.name
            assert torch.equal(state["exp_avg_sq"], expected["exp_avg_sq"].to(torch.bfloat16)), b.name
            assert float(state["step"]) == float(expected["step"]) == step + 1


def test_bf16_moments_stay_near_the_fp32_moment_trajectory() -> None:
    """Over 40 steps the parameters move by nearly the same amount as with fp32 moments. Each
    rounding is off by at most 2^-8 relative. An error in m lives about 1 / (1 - beta1) = 10
    steps, one in v 1 / (1 - beta2) = 20 steps (half of it reaching the step through the square
    root). So in the worst case the update is off by (10 + 10) x 2^-8, about 8%; the rounding
    errors' signs vary, and in norm the distance travelled differs by far less. Bound: 2%."""
    runs = []
    for optim in (OPTIM, BF16):
        model = _model()
        start = [p.detach().clone() for p in model.parameters()]
        flat = FlatAdamW(model.named_parameters(), optim, torch.float32)
        for step in range(40):
            flat.zero_grad()
            _loss(model, step, 0).backward()
            flat.set_lr(optim.lr)
            flat.step()
        runs.append(torch.cat([(p.detach() - s).flatten() for p, s in zip(model.parameters(), start, strict=True)]))
    fp32, bf16 = runs
    assert float((bf16 - fp32).norm() / fp32.norm()) < 2e-2


@pytest.mark.parametrize(("saved", "loaded"), [("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "bf16")])
def test_moments_resume_across_state_dtypes(saved: str, loaded: str) -> None:
    """The per-parameter (checkpoint) form holds fp32 moments whatever the run kept. Loading casts
    them to the loading run's dtype: bf16 -> fp32 is exact, fp32 -> bf16 rounds to nearest. A
    bf16 run resumed as bf16 continues bit for bit."""
    dtype = {"fp32": OPTIM, "bf16": BF16}
    model = _model()
    flat = FlatAdamW(model.named_parameters(), dtype[saved], torch.float32)
    for step in range(3):
        flat.zero_grad()
        _loss(model, step, 0).backward()
        flat.set_lr(OPTIM.lr)
        flat.step()
    masters, state = flat.masters_by_name(), flat.state_by_name()
    assert all(s[k].dtype == torch.float32 for s in state.values() for k in ("exp_avg", "exp_avg_sq"))
    other = _model(seed=1)
    fresh = FlatAdamW(other.named_parameters(), dtype[loaded], torch.float32)
    fresh.load_state(masters, state)
    want = torch.bfloat16 if loaded == "bf16" else torch.float32
    for b, live in zip(fresh.buckets, _moments(fresh), strict=True):
        for k in ("exp_avg", "exp_avg_sq"):
            flat_k = torch.cat([state[n][k].flatten() for n in b.names])
            assert live[k].dtype == want and torch.equal(live[k][:flat_k.numel()], flat_k.to(want)), (b.name, k)
    assert fresh.state_by_name().keys() == state.keys()
    if saved == loaded:
        _step_alike(((flat, model), (fresh, other)), range(3, 5), lambda step: OPTIM.lr)
        for a, b in zip(model.parameters(), other.parameters(), strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_bf16_moments_take_the_fused_fp32_update_then_round_the_moments() -> None:
    """The CUDA path (bf16 compute, torch's fused AdamW over the fp32 copies, the clip as its
    grad_scale) against torch's fused AdamW on the same fp32 master, moments and scaled gradient:
    the same per-step tolerance as on the CPU (masters bit for bit, moments exactly rounded)."""
    model = _model().to("cuda", torch.bfloat16)
    # torch's update, not the default Triton one (whose bounds are tests/kernels/test_adamw.py's)
    flat = FlatAdamW(model.named_parameters(), BF16.model_copy(update={"update_kernel": "torch"}), torch.bfloat16)
    for step in range(3):
        flat.zero_grad()
        _loss(model, step, 0).backward()
        before = [(b.master_S.detach().clone(), b.grad_N.clone(), {k: v.clone() for k, v in s.items()})
                  for b, s in zip(flat.buckets, _moments(flat), strict=True)]
        coef = torch.tensor(0.5, device="cuda")
        flat.set_lr(BF16.lr)
        flat.step(clip_coef=coef)
        for b, state, (master, grad, old) in zip(flat.buckets, _moments(flat), before, strict=True):
            ref = nn.Parameter(master)
            ref.grad = grad
            reference = torch.optim.AdamW([ref], lr=flat.lr.clone(), betas=(BF16.beta1, BF16.beta2), eps=BF16.eps,
                                          weight_decay=b.weight_decay, fused=True)  # the fp32 lr the kernel reads
            if old:
                reference.state[ref] = {"step": old["step"].clone(), "exp_avg": old["exp_avg"].float(),
                                        "exp_avg_sq": old["exp_avg_sq"].float()}
            reference.grad_scale = (1.0 / coef).float()
            reference.step()
            expected = reference.state[ref]
            assert torch.equal(b.master_S, ref.detach()), b.name
            assert torch.equal(state["exp_avg"], expected["exp_avg"].to(torch.bfloat16)), b.name
            assert torch.equal(state["exp_avg_sq"], expected["exp_avg_sq"].to(torch.bfloat16)), b.name
            assert state["step"].is_cuda and float(state["step"]) == step + 1


def test_the_oracle_optimizer_refuses_bf16_moments() -> None:
    with pytest.raises(ValueError, match="optim.state_dtype=bf16: .*FlatAdamW .* or set optim.state_dtype=fp32"):
        build_optimizer(_model().named_parameters(), BF16)


# -- the learning rate as a device scalar -----------------------------------------------------------

SCHEDULE = {"fp32": OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=3, min_lr_ratio=0.1),
            "bf16": OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=3, min_lr_ratio=0.1, state_dtype="bf16")}
SCHEDULE_STEPS = 8


def _float_lr_step(flat: FlatAdamW, lr: float, clip_coef: torch.Tensor | None = None) -> None:
    """The step as it was before the lr became a tensor: a Python float in every inner AdamW's group."""
    for b in flat.buckets:
        b.inner.param_groups[0]["lr"] = lr
    flat.step(clip_coef=clip_coef)


def _scheduled_pair(state_dtype: str, dtype: torch.dtype, shards=None, rank: int = 0):
    """(device-lr run, float-lr run) of the same model over SCHEDULE_STEPS steps of the schedule
    with a clip coefficient below 1, checking their masters and moments are equal after each step."""
    optim = SCHEDULE[state_dtype]
    runs = []
    for _ in range(2):
        model = _model().to(dtype)
        runs.append((model, FlatAdamW(model.named_parameters(), optim, dtype, shards=shards)))
    for step in range(SCHEDULE_STEPS):
        lr = lr_at(step, optim, SCHEDULE_STEPS)
        for i, (model, flat) in enumerate(runs):
            flat.zero_grad()
            _loss(model, step, rank).backward()
            for b in flat.buckets:
                if b.shard is not None:
                    flat.reduce_scatter(b)
            coef = torch.tensor(0.75)
            if i == 0:
                flat.set_lr(lr)
                flat.step(clip_coef=coef)
            else:
                _float_lr_step(flat, lr, coef)
        (_, tensor_lr), (_, float_lr) = runs
        for a, b, sa, sb in zip(tensor_lr.buckets, float_lr.buckets, _moments(tensor_lr), _moments(float_lr),
                                strict=True):
            assert torch.equal(a.master_S, b.master_S), (step, a.name)
            assert torch.equal(a.compute_N, b.compute_N), (step, a.name)
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(sa[k], sb[k]), (step, a.name, k)
    return runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_the_device_lr_takes_the_float_lr_step_bit_for_bit(state_dtype: str, dtype: torch.dtype) -> None:
    """Over a warmup + cosine schedule with clipping: masters, parameters and moments equal those of
    the float-lr step after every step (CPU: the lr tensor is float64, the doubles a float gives)."""
    (_, flat), _ = _scheduled_pair(state_dtype, dtype)
    assert flat.lr.dtype == torch.float64 and flat.lr.device.type == "cpu"
    assert all(b.inner.param_groups[0]["lr"] is flat.lr for b in flat.buckets)  # one tensor for every bucket
    assert float(flat.lr) == lr_at(SCHEDULE_STEPS - 1, SCHEDULE[state_dtype], SCHEDULE_STEPS)


def test_set_lr_changes_the_next_step_and_nothing_else() -> None:
    """set_lr touches no master, moment or step count; the step after it runs at the new lr (as the
    float-lr step at that lr), and the lr stays until the next set_lr."""
    runs = []
    for _ in range(3):
        model = _model()
        runs.append((model, FlatAdamW(model.named_parameters(), OPTIM, torch.float32)))
    lrs = {0: [1e-2, 1e-2, 1e-2], 1: [1e-2, 3e-3, 3e-3], 2: [1e-2, 3e-3, 3e-3]}
    for step in range(3):
        for i, (model, flat) in enumerate(runs):
            flat.zero_grad()
            _loss(model, step, 0).backward()
            if i == 2:
                _float_lr_step(flat, lrs[i][step])
                continue
            if step == 1 and i == 1:
                before = [(b.master_S.clone(), {k: v.clone() for k, v in s.items()})
                          for b, s in zip(flat.buckets, _moments(flat), strict=True)]
                flat.set_lr(3e-3)
                for b, s, (master, state) in zip(flat.buckets, _moments(flat), before, strict=True):
                    assert torch.equal(b.master_S, master) and all(torch.equal(s[k], state[k]) for k in state)
            elif step == 0:
                flat.set_lr(1e-2)
            flat.step()  # run 1 at step 2: still 3e-3, no set_lr since
        (_, same), (_, changed), (_, reference) = runs
        for a, b, c in zip(same.buckets, changed.buckets, reference.buckets, strict=True):
            assert torch.equal(b.master_S, c.master_S), (step, b.name)
            assert torch.equal(a.master_S, b.master_S) == (step == 0), (step, a.name)


def test_the_lr_is_not_checkpoint_state() -> None:
    """A run resumed from the per-parameter form (which holds no lr) and fed the same schedule
    through set_lr continues bit for bit; loading leaves the lr tensor as it was."""
    optim = SCHEDULE["fp32"]
    model = _model()
    flat = FlatAdamW(model.named_parameters(), optim, torch.float32)
    for step in range(3):
        flat.zero_grad()
        _loss(model, step, 0).backward()
        flat.set_lr(lr_at(step, optim, SCHEDULE_STEPS))
        flat.step()
    state = flat.state_by_name()
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in state.values())
    other = _model(seed=1)
    fresh = FlatAdamW(other.named_parameters(), optim, torch.float32)
    fresh.set_lr(0.5)
    fresh.load_state(flat.masters_by_name(), state)
    assert float(fresh.lr) == 0.5
    _step_alike(((flat, model), (fresh, other)), range(3, SCHEDULE_STEPS), lambda step: lr_at(step, optim, SCHEDULE_STEPS))
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)


def _sharded_run(rank: int, dtype: torch.dtype, optim: OptimConfig):
    """One rank's 3 ZeRO-1 steps: (parameters, masters, gathered state, squared gradient norm)."""
    group = dist.new_group([0, 1])
    model = _model()
    flat = FlatAdamW(model.named_parameters(), optim, dtype, shards={"params": Shard(group, rank, 2)})
    for step in range(3):
        flat.zero_grad()
        _loss(model, step, rank).backward()  # each rank its own micro-batch
        for b in flat.buckets:
            flat.reduce_scatter(b)
        squares = flat.grad_squares()
        dist.all_reduce(squares, group=group)
        flat.set_lr(OPTIM.lr)
        flat.step()
    masters, state = flat.masters_by_name(), flat.state_by_name()
    return ({n: p.detach().float().clone() for n, p in model.named_parameters()}, masters, state, float(squares))


def _sharded_lr_run(rank: int, state_dtype: str) -> None:
    _scheduled_pair(state_dtype, torch.bfloat16, shards={"params": Shard(dist.new_group([0, 1]), rank, 2)}, rank=rank)


ZERO1_DTYPES = {"dtype0": torch.float32, "dtype1": torch.bfloat16}
ZERO1_OPTIMS = {"fp32-moments": OPTIM, "bf16-moments": BF16}


@pytest.fixture(scope="module")
def zero1_pair():
    """Every ZeRO-1 case of this module in one pair of gloo processes (tests/runtime/state/gloo_pair.py)."""
    split = [(f"split-{o}-{d}", _sharded_run, (dtype, optim))
             for o, optim in ZERO1_OPTIMS.items() for d, dtype in ZERO1_DTYPES.items()]
    return run_pair(split + [(f"lr-{state_dtype}", _sharded_lr_run, (state_dtype,)) for state_dtype in SCHEDULE])


@pytest.mark.slow  # more than a few seconds on 2 cores (`pytest -m 'not slow'` skips it)
@pytest.mark.parametrize("dtype", list(ZERO1_DTYPES))
@pytest.mark.parametrize("optim", list(ZERO1_OPTIMS))
def test_zero1_split_takes_the_unsharded_step(zero1_pair, dtype: str, optim: str) -> None:
    """Each rank steps its slice (with bf16 moments: its slice of them) and the gathered
    checkpoint state is the whole bucket's, in fp32."""
    params0, masters0, state0, squares0 = zero1_pair.of(f"split-{optim}-{dtype}", 0)
    params1, _, state1, _ = zero1_pair.of(f"split-{optim}-{dtype}", 1)
    dtype, optim = ZERO1_DTYPES[dtype], ZERO1_OPTIMS[optim]
    model = _model().to(dtype)
    flat = FlatAdamW(model.named_parameters(), optim, dtype)
    for step in range(3):
        flat.zero_grad()
        for rank in range(2):
            _loss(model, step, rank).backward()
        squares = flat.grad_squares()
        flat.set_lr(OPTIM.lr)
        flat.step()
    assert state1 == {} and set(state0) == {n for n, _ in model.named_parameters()}
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-2}  # bf16 forward
    torch.testing.assert_close(squares0, float(squares), rtol=tol["rtol"], atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(params0[name], p.float(), **tol)
        torch.testing.assert_close(params1[name], params0[name], rtol=0, atol=0)  # replicas stay identical
        torch.testing.assert_close(masters0[name], flat.masters_by_name()[name], **tol)
    unsharded = flat.state_by_name()
    # bf16 moments: a gradient summed in another order may round a moment to the next bf16 value (2^-7 relative)
    moment_tol = {**tol, "rtol": max(tol["rtol"], 2**-7 if optim.state_dtype == "bf16" else 0)}
    for name, state in state0.items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert state[k].dtype == torch.float32
            torch.testing.assert_close(state[k], unsharded[name][k], **moment_tol)


@pytest.mark.slow  # two gloo processes
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_zero1_slices_take_the_float_lr_step_bit_for_bit(zero1_pair, state_dtype: str) -> None:
    """Each rank's slice, stepped at the device lr over the schedule, equals its float-lr step
    (`_scheduled_pair` checks it after every step, on both ranks)."""
    for rank in range(2):
        zero1_pair.of(f"lr-{state_dtype}", rank)


class _AddsIntoMainGrad(torch.autograd.Function):
    """y = x @ w whose backward adds dw into `w.main_grad` itself and returns None for w (as the
    Triton experts backend does)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        w.main_grad.add_((x.T @ dy).float())
        return dy @ w.T, None


def test_kernels_may_add_into_main_gradients_themselves() -> None:
    w = nn.Parameter(torch.randn(4, 3).to(torch.bfloat16))
    flat = FlatAdamW([("w", w)], OPTIM, torch.bfloat16)
    flat.zero_grad()
    x = torch.randn(5, 4).to(torch.bfloat16)
    for _ in range(2):
        _AddsIntoMainGrad.apply(x, w).float().sum().backward()
    expected = 2 * (x.T @ torch.ones(5, 3, dtype=torch.bfloat16)).float()
    assert w.grad is None
    torch.testing.assert_close(w.main_grad, expected)


@pytest.mark.gpu
def test_cuda_construction_holds_at_most_the_parameters_masters_and_compute_copy() -> None:
    """Building the flat buffers from fp32 parameters peaks at the parameters + the fp32 masters
    + the bf16 compute copy (10 bytes per parameter), and the parameters' own storage is released
    before the main gradient exists: with bf16 moments the construction was the run's peak (a cat,
    a pad and a clone held five copies at once, 63 GiB on a 49 GiB model state)."""
    model = nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(8))).to("cuda")
    params = sum(p.numel() for p in model.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    flat = FlatAdamW(model.named_parameters(), BF16, torch.bfloat16)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= 6 * params + (1 << 20)  # masters + compute copy
    # the parameters' fp32 storage is gone: masters (4) + compute (2) + main gradient (4) per parameter
    assert torch.cuda.memory_allocated() - before <= (10 - 4) * params + (1 << 20)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters()) and len(flat.buckets) == 1


def test_a_skip_flag_is_refused_on_the_cpu() -> None:
    model = _model()
    flat = FlatAdamW(model.named_parameters(), OPTIM, torch.float32)
    _loss(model, 0, 0).backward()
    with pytest.raises(ValueError, match="fused CUDA kernels; on the CPU pass skip=None"):
        flat.step(skip=torch.tensor(1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_cuda_a_skip_flag_leaves_masters_moments_and_steps_and_a_clear_one_steps_alike(state_dtype: str) -> None:
    """`step(skip=1.0)` (decided on the device, precision fp8's non-finite scale) leaves every master,
    moment and step count as they were, with a NaN gradient in place; `skip=0.0` takes the plain step
    bit for bit. Both moment dtypes (fused AdamW's found_inf, and the chunked bf16-moments call)."""
    optim = OPTIM.model_copy(update={"state_dtype": state_dtype})
    models = [_model().to("cuda", torch.bfloat16) for _ in range(2)]
    flats = [FlatAdamW(m.named_parameters(), optim, torch.bfloat16) for m in models]
    for step in range(2):  # a first plain step gives the moments something to keep
        for f, m, skip in zip(flats, models, (None, 0.0), strict=True):
            f.zero_grad()
            _loss(m, step, 0).backward()
            f.set_lr(optim.lr)
            f.step(clip_coef=torch.tensor(0.5, device="cuda"),
                   skip=None if skip is None else torch.tensor(skip, device="cuda"))
    for a, b in zip(flats[0].buckets, flats[1].buckets, strict=True):
        assert torch.equal(a.master_S, b.master_S), a.name
    flat, model = flats[1], models[1]
    before = [(b.master_S.clone(), {k: v.clone() for k, v in s.items()}) for b, s in
              zip(flat.buckets, _moments(flat), strict=True)]
    flat.zero_grad()
    _loss(model, 5, 0).backward()
    flat.buckets[0].grad_N[0] = float("nan")
    flat.step(clip_coef=torch.tensor(0.5, device="cuda"), skip=torch.tensor(1.0, device="cuda"))
    for b, state, (master, old) in zip(flat.buckets, _moments(flat), before, strict=True):
        assert torch.equal(b.master_S, master), b.name
        for key, value in old.items():
            assert torch.equal(state[key], value), (b.name, key)


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_the_on_device_and_offloaded_steps_share_one_chunk_update(moments) -> None:
    """`adamw_chunk` as the two steps call it, on the same inputs: the on-device bf16-moment step's
    (whole chunks, fresh fp32 copies of the moments) and the offloaded step's (slot-sized chunks,
    the staging area's fp32 scratch) give the same masters and moments bit for bit, and both are
    torch's AdamW on fp32 moments with the moments then rounded to the storage dtype. (FlatAdamW
    on-device against offloaded: tests/runtime/state/test_offload.py.)"""
    from disagmoe.runtime.state.flat_adamw import adamw_chunk

    gen = torch.Generator().manual_seed(5)
    n, chunk = 23, 5
    master = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen)
    avg, sq = (torch.randn(n, generator=gen) * 1e-2).to(moments), (torch.rand(n, generator=gen) * 1e-4).to(moments)
    step = torch.tensor(3.0)
    group = {"betas": (0.9, 0.95), "lr": torch.tensor(1e-2, dtype=torch.float64), "weight_decay": 0.1, "eps": 1e-8}
    whole = [t.clone() for t in (master, avg, sq)]
    adamw_chunk(group, whole[0], grad, whole[1], whole[2], step, None, None)
    chunked = [t.clone() for t in (master, avg, sq)]
    scratch_2C = torch.full((2, chunk), float("nan"))
    for start in range(0, n, chunk):
        part = slice(start, start + chunk)
        adamw_chunk(group, chunked[0][part], grad[part], chunked[1][part], chunked[2][part], step, None, None,
                    scratch_2C if moments != torch.float32 else None)
    ref = nn.Parameter(master.clone())
    ref.grad = grad.clone()
    reference = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    reference.state[ref] = {"step": step.clone(), "exp_avg": avg.float(), "exp_avg_sq": sq.float()}
    reference.step()
    state = reference.state[ref]
    expected = (ref.detach(), state["exp_avg"].to(moments), state["exp_avg_sq"].to(moments))
    for a, b, c in zip(whole, chunked, expected, strict=True):
        assert a.dtype == c.dtype and torch.equal(a, b) and torch.equal(a, c)
    assert float(step) == 3.0  # the caller counts the step (`count_step`), once per bucket


# -- optim.update_kernel: triton (the one-pass kernel, disagmoe/kernels/adamw.py) --------------------------


def _with_kernel(optim: OptimConfig, kernel: str = "triton") -> OptimConfig:
    return optim.model_copy(update={"update_kernel": kernel})


@pytest.mark.parametrize("optim", [OPTIM, BF16], ids=["fp32-moments", "bf16-moments"])
def test_the_triton_update_kernel_takes_torchs_path_on_the_cpu(optim: OptimConfig) -> None:
    """On the CPU `update_kernel: triton` changes nothing: torch's path runs, bit for bit."""
    runs = []
    for kernel in ("torch", "triton"):
        model = _model().to(torch.bfloat16)
        runs.append((FlatAdamW(model.named_parameters(), _with_kernel(optim, kernel), torch.bfloat16), model))
    assert not any(runs[1][0]._uses_update_kernel(b) for b in runs[1][0].buckets)
    assert all(b.hyper_4 is None for b in runs[1][0].buckets)  # no triton import where it never runs
    _step_alike(runs, range(3), lambda step: optim.lr)
    (torch_run, _), (triton_run, _) = runs
    for a, b in zip(torch_run.buckets, triton_run.buckets, strict=True):
        assert torch.equal(a.master_S, b.master_S) and torch.equal(a.compute_N, b.compute_N)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-compute", "fp32-compute"])
@pytest.mark.parametrize("optim", [OPTIM, BF16], ids=["fp32-moments", "bf16-moments"])
def test_the_update_kernel_steps_every_bucket_in_one_pass(interpreted, monkeypatch, optim, dtype) -> None:
    """FlatAdamW with the kernel (made to run on CPU tensors, under Triton's interpreter) over 3 steps
    with a clip: each bucket's masters and moments (in the inner AdamW's state, in the moments'
    dtype) are `adamw_reference`'s from the step's inputs, bit for bit; the compute copy is the
    masters' bf16 cast; each step is counted once; the checkpoint form loads into a torch-kernel run
    with the same masters, compute copy, moments and step counts."""
    adamw = interpreted("disagmoe.kernels.adamw")
    monkeypatch.setattr(FlatAdamW, "_uses_update_kernel", lambda self, b: True)
    model = _model().to(dtype)
    flat = FlatAdamW(model.named_parameters(), _with_kernel(optim), dtype)
    for b in flat.buckets:  # what construction makes for a CUDA bucket
        b.hyper_4 = adamw.hyperparameters(optim.beta1, optim.beta2, b.weight_decay, optim.eps, "cpu")
    coef = torch.tensor(0.5)
    for step in range(3):
        flat.zero_grad()
        _loss(model, step, 0).backward()
        before = []
        for b in flat.buckets:
            state = flat._moments(b, b.inner.param_groups[0]["params"][0])
            before.append([b.master_S.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone(),
                           state["step"].clone(), b.grad_N.clone()])
        flat.set_lr(optim.lr)
        flat.step(clip_coef=coef)
        for b, state, (master, avg, sq, count, grad) in zip(flat.buckets, _moments(flat), before, strict=True):
            adamw.adamw_reference(master, grad, avg, sq, count, flat.lr, b.hyper_4, (1.0 / coef).float())
            assert torch.equal(b.master_S, master), (step, b.name)
            assert state["exp_avg"].dtype == flat.state_dtype
            assert torch.equal(state["exp_avg"], avg) and torch.equal(state["exp_avg_sq"], sq), (step, b.name)
            assert float(state["step"]) == step + 1
            if dtype == torch.bfloat16:
                assert torch.equal(b.compute_N, b.master_S.to(torch.bfloat16)), (step, b.name)
            else:
                assert b.compute_N is b.master_S
    masters, state = flat.masters_by_name(), flat.state_by_name()
    other = _model(seed=1).to(dtype)
    resumed = FlatAdamW(other.named_parameters(), optim, dtype)
    resumed.load_state(masters, state)
    assert resumed.state_by_name().keys() == state.keys()
    for a, b in zip(flat.buckets, resumed.buckets, strict=True):
        assert torch.equal(a.master_S, b.master_S) and torch.equal(a.compute_N, b.compute_N)
    for live, loaded in zip(_moments(flat), _moments(resumed), strict=True):
        assert all(torch.equal(live[k], loaded[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def _gpu_pair(optim: OptimConfig):
    """Two FlatAdamW (bf16 compute, CUDA) of the same model: torch's update kernel, and triton."""
    pair = []
    for kernel in ("torch", "triton"):
        model = _model().to("cuda", torch.bfloat16)
        pair.append(FlatAdamW(model.named_parameters(), _with_kernel(optim, kernel), torch.bfloat16))
    return pair


@pytest.mark.gpu
@pytest.mark.parametrize("optim", [OPTIM, BF16], ids=["fp32-moments", "bf16-moments"])
def test_cuda_the_triton_update_is_within_a_few_operand_ulps_of_torchs(optim: OptimConfig) -> None:
    """Per step from the same state and gradients (the triton run re-seated on the torch run's state
    after each comparison), with a clip: the masters within `adamw_master_tolerance` of torch's path
    (fused AdamW; with bf16 moments `_step_rounded_moments`), fp32 moments within 4 ulps of their
    operands (beta |moment before| + (1 - beta) |gradient term|), bf16 moments that and one bf16 ulp
    of rounding (`bf16_moment_apart`); the step counts equal, and the compute copy the masters' bf16
    cast bit for bit (written by the kernel, no copy pass). On an H200 (2026-12-03, 2026-12-04) raw-ulp bounds
    failed: masters 2 raw ulps apart, fp32 exp_avg 4, where the terms nearly cancel
    (tests/kernels/test_adamw.py: raw ulps of a cancelling result are no bound)."""
    torch_run, triton_run = _gpu_pair(optim)
    assert all(triton_run._uses_update_kernel(b) for b in triton_run.buckets)
    gen = torch.Generator(device="cuda").manual_seed(0)
    beta1, beta2 = optim.beta1, optim.beta2
    for step in range(4):
        coef = torch.tensor(0.5, device="cuda")
        grads = []
        for a, b in zip(torch_run.buckets, triton_run.buckets, strict=True):
            grad = torch.randn(a.grad_N.shape, device="cuda", generator=gen) * 1e-2
            a.grad_N.copy_(grad)
            b.grad_N.copy_(grad)
            grads.append(grad * coef)  # what the update sees: the clipped gradient
        before = [a.master_S.clone() for a in torch_run.buckets]
        moments_before = [{k: m[k].float().clone() if k in m else torch.zeros_like(a.master_S)  # none before step 1
                           for k in ("exp_avg", "exp_avg_sq")} for a, m in zip(torch_run.buckets, _moments(torch_run),
                                                                                strict=True)]
        for flat in (torch_run, triton_run):
            flat.set_lr(optim.lr)
            flat.step(clip_coef=coef)
        for a, b, sa, sb, old, was, g in zip(torch_run.buckets, triton_run.buckets, _moments(torch_run),
                                             _moments(triton_run), before, moments_before, grads, strict=True):
            assert torch.equal(b.compute_N, b.master_S.to(torch.bfloat16)), (step, b.name)
            operands = {"exp_avg": beta1 * was["exp_avg"].abs() + (1 - beta1) * g.abs(),
                        "exp_avg_sq": beta2 * was["exp_avg_sq"] + (1 - beta2) * g * g}
            tolerance = adamw_master_tolerance(old, a.master_S, sa["exp_avg"], operands["exp_avg"],
                                               sa["exp_avg_sq"], operands["exp_avg_sq"],
                                               decay=optim.lr * b.weight_decay)
            assert over_tolerance(b.master_S, a.master_S, tolerance) <= 1.0, (step, b.name)
            for k in ("exp_avg", "exp_avg_sq"):
                assert sb[k].dtype == sa[k].dtype, (step, b.name, k)
                if sa[k].dtype == torch.float32:
                    assert float(operand_half_ulps(sb[k], sa[k], operands[k]).max()) <= 8.0, (step, b.name, k)
                else:
                    assert bool((bf16_moment_apart(sb[k], sa[k], operands[k]) <= 1.0).all()), (step, b.name, k)
            assert torch.equal(sa["step"], sb["step"]) and float(sb["step"]) == step + 1
            with torch.no_grad():  # the next step from the same state
                b.master_S.copy_(a.master_S)
                b.compute_N.copy_(a.compute_N)
                for k in ("exp_avg", "exp_avg_sq"):
                    sb[k].copy_(sa[k])


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_cuda_a_captured_triton_step_replays_the_eager_steps_bit_for_bit(state_dtype: str) -> None:
    """`step(clip_coef, skip)` with the triton kernel captured once in a CUDA graph (after an eager
    warm-up step on a side stream, as GraphedStep does), replayed with new gradients, clip
    coefficients, skip flags and learning rates written outside the graph: masters, compute
    copies, moments and step counts equal those of the same steps run eagerly, bit for bit (one of
    them skipped)."""
    optim = _with_kernel(OPTIM.model_copy(update={"state_dtype": state_dtype}))
    runs = []
    for _ in range(2):
        model = _model().to("cuda", torch.bfloat16)
        runs.append(FlatAdamW(model.named_parameters(), optim, torch.bfloat16))
    eager, graphed = runs
    gen = torch.Generator(device="cuda").manual_seed(1)
    grads = [[torch.randn(b.grad_N.shape, device="cuda", generator=gen) * 1e-2 for b in eager.buckets]
             for _ in range(4)]
    coefs, skips, lrs = [0.5, 0.75, 1.0, 0.25], [0.0, 0.0, 1.0, 0.0], [1e-2, 5e-3, 2e-3, 1e-3]
    coef, skip = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")  # the graph's static inputs

    def load(flat: FlatAdamW, i: int) -> None:
        for b, g in zip(flat.buckets, grads[i], strict=True):
            b.grad_N.copy_(g)
        coef.fill_(coefs[i])
        skip.fill_(skips[i])
        flat.set_lr(lrs[i])

    for i in range(4):
        load(eager, i)
        eager.step(clip_coef=coef.clone(), skip=skip.clone())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up: compiles the kernel, makes the state
        load(graphed, 0)
        graphed.step(clip_coef=coef, skip=skip)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step(clip_coef=coef, skip=skip)
    for i in range(1, 4):
        load(graphed, i)
        graph.replay()
    torch.cuda.synchronize()
    for a, b, sa, sb in zip(eager.buckets, graphed.buckets, _moments(eager), _moments(graphed), strict=True):
        assert torch.equal(a.master_S, b.master_S) and torch.equal(a.compute_N, b.compute_N), a.name
        assert all(torch.equal(sa[k], sb[k]) for k in ("step", "exp_avg", "exp_avg_sq")), a.name
        assert float(sb["step"]) == 3


# -- first touch (`first_touch`, kernels/first_touch.py) ----------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_zero_grad_leaves_first_touch_gradients_to_their_first_writer() -> None:
    """zero_grad fills only the spans of the parameters that did not opt in (runs of them merged,
    a sharded bucket's padding with them) and marks the opted-in main gradients untouched; a writer
    that stores (first touch) finds them untouched once, and the norm zeroes the one no writer
    touched (NaN-poisoned before: a read of stale values would show)."""
    from disagmoe.kernels.first_touch import is_untouched, take_first_touch

    model = _model()  # decay: 0.weight [5, 6], 2.weight [3, 5]; no decay: 0.bias, 1.weight, 1.bias [5] each
    params = dict(model.named_parameters())
    opted = [params["2.weight"], params["1.weight"]]
    flat = FlatAdamW(model.named_parameters(), OPTIM, torch.bfloat16, shards={"params": Shard(None, 0, 4)},
                     first_touch=opted)
    no_decay, decay = flat.buckets
    assert [b.name for b in flat.buckets] == ["params.no_decay", "params.decay"]
    assert decay.grad_N.numel() == 48 and no_decay.grad_N.numel() == 16  # padded to a multiple of 4
    spans = lambda b: [(v.storage_offset() - b.grad_N.storage_offset(), v.numel()) for v in b.zero_spans]  # noqa: E731
    assert spans(decay) == [(0, 30), (45, 3)]  # 0.weight, then the padding after 2.weight
    assert spans(no_decay) == [(0, 5), (10, 6)]  # 0.bias; 1.bias merged with the padding
    for b in flat.buckets:
        b.grad_N.fill_(float("nan"))
    flat.zero_grad()
    for p in model.parameters():
        main = p.main_grad
        if any(p is o for o in opted):
            assert main.isnan().all() and is_untouched(main)
        else:
            assert not main.any() and not is_untouched(main)
    assert not decay.grad_N[45:].any() and not no_decay.grad_N[15:].any()
    stored = torch.randn(3, 5)
    assert take_first_touch(params["2.weight"].main_grad)  # a whole writer: stores
    params["2.weight"].main_grad.copy_(stored)
    assert not take_first_touch(params["2.weight"].main_grad)  # the next one adds
    assert torch.isfinite(flat.grad_squares())  # 1.weight, untouched: zeroed first
    assert not params["1.weight"].main_grad.any() and not is_untouched(params["1.weight"].main_grad)
    assert torch.equal(params["2.weight"].main_grad, stored)


def test_no_first_touch_keeps_one_fill_per_bucket() -> None:
    flat = FlatAdamW(_model().named_parameters(), OPTIM, torch.float32)
    assert all(not b.first_touch and not b.zero_spans for b in flat.buckets)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_autograd_gradients_into_first_touch_parameters_equal_zero_then_add(dtype) -> None:
    """Opted-in parameters whose gradients come from autograd anyway (not a whole writer: another
    backend, a cast operand): the hook before accumulation zeroes the untouched main gradient, so two
    steps of three micro-batches give the very gradients and parameters of the run that zeroes it
    (fp32: autograd adds into the main gradient's view in place; bf16: the post-accumulate hook adds)."""
    runs = []
    for opt_in in (False, True):
        model = _model().to(dtype)
        flat = FlatAdamW(model.named_parameters(), OPTIM, dtype, first_touch=model.parameters() if opt_in else ())
        assert all(bool(b.first_touch) == opt_in for b in flat.buckets)
        grads = []
        for step in range(2):
            for b in flat.buckets:
                b.grad_N.fill_(float("nan"))  # whatever zero_grad leaves unfilled must not be read
            flat.zero_grad()
            for mb in range(3):
                (_loss(model, step, mb) / 3).backward()
            grads.append([b.grad_N.clone() for b in flat.buckets])
            flat.set_lr(OPTIM.lr)
            flat.step()
        runs.append((grads, [b.master_S.clone() for b in flat.buckets]))
    (grads_a, masters_a), (grads_b, masters_b) = runs
    for step_a, step_b in zip(grads_a, grads_b, strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            assert torch.isfinite(b).all() and torch.equal(_bits(a), _bits(b))
    assert all(torch.equal(a, b) for a, b in zip(masters_a, masters_b, strict=True))


class _HeldBackWeight(torch.autograd.Function):
    """y = x @ w whose backward returns no gradient for w (as the experts' ops do while their weight
    gradients are held back, `kernels.deferral.deferred_weight_grads`)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x @ w

    @staticmethod
    def backward(ctx, dy):
        (w,) = ctx.saved_tensors
        return dy @ w.t(), None


def test_a_held_back_weight_gradient_leaves_the_first_touch_mark_for_its_launch() -> None:
    """torch calls a leaf's tensor hook with None where the op returned no gradient: the hook then
    leaves the main gradient untouched, so the held-back launch that runs after the backward still
    stores into it (first touch), instead of the hook zeroing it and the launch adding to zeros."""
    from disagmoe.kernels.first_touch import is_untouched, take_first_touch

    model = _model()
    weight = dict(model.named_parameters())["2.weight"]  # [3, 5]
    flat = FlatAdamW(model.named_parameters(), OPTIM, torch.float32, first_touch=[weight])
    flat.zero_grad()
    x = torch.randn(4, 3, requires_grad=True)
    _HeldBackWeight.apply(x, weight).sum().backward()
    assert x.grad is not None and is_untouched(weight.main_grad)
    assert take_first_touch(weight.main_grad)  # the held-back launch: stores
