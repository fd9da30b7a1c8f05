"""`disagmoe bench first-step`: does a config's first optimizer step lower its loss?

AdamW's first step moves every weight by about the learning rate, whatever the gradient's size
(bias-corrected, m / sqrt(v) = g / |g| on step one), so how far it moves the model's output grows
with each layer's fan-in. At the Qwen3-30B layer shape (hidden 2,048) the warm-up's first step of
`configs/h200x2-qwen3-30b.yaml` (lr 1e-4 = 1e-3 / 10) raised the loss by two nats, where a tenth
of it lowered it by one: the jump at step 2 of its runs (docs/benchmarks.md, session 30). This
command measures that before a GPU hour is spent: it builds the config's model (one process, fp32 weights: an update of 1e-5 is below a bf16
weight's rounding step, which is why training keeps fp32 masters), takes the gradient of the first
batch as the trainer does (the same micro-batches, loss = cross-entropy + router losses, the
config's gradient clip), and for each learning rate applies that first AdamW step (the config's
betas, eps and weight decay; fp32 moments: bf16 ones round the same step's values) and reads the
loss on the second batch, the one step 2 trains on, against its loss before the step.
`by_group`: the same at one learning rate with each parameter family (a projection, the experts'
w13, the norms, ...) stepped alone, which says where the overshoot comes from.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from disagmoe.config import TrainConfig
from disagmoe.model_ref import load_model

# the default learning rates: the config's peak over these factors (with the warm-up's first one)
SWEEP = (1000, 300, 100, 30, 10, 3, 1)


def lr_sweep(cfg: TrainConfig, lrs: list[float] | None) -> list[float]:
    """The learning rates to try, ascending: `lrs`, else the peak over `SWEEP` and the warm-up's first."""
    from disagmoe.runtime.state.optim import lr_at

    chosen = lrs or [cfg.optim.lr / f for f in SWEEP] + [lr_at(0, cfg.optim, cfg.steps)]
    bad = [lr for lr in chosen if not (lr > 0 and math.isfinite(lr))]
    if bad:
        raise ValueError(f"learning rates must be positive and finite; got {bad}")
    return sorted(set(chosen))


def parameter_group(name: str) -> str:
    """A parameter's family across layers: 'layers.3.attention.wq.weight' -> 'attention.wq',
    'layers.0.moe.experts.w13_EH2F' -> 'moe.experts.w13_EH2F', 'lm_head.weight' -> 'lm_head'."""
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) > 2:
        parts = parts[2:]
    if parts[-1] == "weight" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


class _Probe:
    """The model at its initialisation, the first batch's gradient, and the loss on the second batch."""

    def __init__(self, cfg: TrainConfig, log: Callable[[str], None]) -> None:
        from disagmoe.data import TokenDataset, load_splits
        from disagmoe.kernels.tile_configs import loads_of_routing, set_expert_loads
        from disagmoe.model.experts import check_backend_device
        from disagmoe.model.init import materialise
        from disagmoe.model.transformer import MoETransformer
        from disagmoe.runtime.training.trainer import resolve_device, resolve_single_micro_batches

        self.model_cfg = load_model(cfg.model)
        self.device = resolve_device(cfg.device)
        # micro_batches: auto as the single trainer chooses it (for its bf16 step: give a number where
        # these fp32 weights, their gradients and AdamW's moments need more room)
        self.cfg = resolve_single_micro_batches(cfg, self.model_cfg, self.device)[0]
        check_backend_device(cfg.experts_backend, self.device.type)
        splits = load_splits(cfg.data, self.model_cfg.vocab_size, cfg.seq_len)
        data = TokenDataset(splits.train, cfg.seq_len, cfg.batch_size, cfg.data_seed, "train")
        self.first, self.second = (data.batch(step).to(self.device) for step in (0, 1))
        with torch.device("meta"):
            model = MoETransformer(self.model_cfg, experts_backend=cfg.experts_backend)
        self.model = materialise(model, self.device, cfg.seed)
        self.model.set_routing(cfg.routing)
        set_expert_loads(loads_of_routing(cfg.routing))  # the expert tiles tuned for its loads, as the trainer's
        log(f"{sum(p.numel() for p in self.model.parameters()):,} parameters on {self.device}, seed {cfg.seed}, "
            f"batches 1 and 2 of data seed {cfg.data_seed}")

    def losses(self, tokens_BS1: torch.Tensor, backward: bool = False) -> tuple[float, float]:
        """(loss, cross-entropy) of a batch as the trainer sums its micro-batches; `backward`: their
        gradients into .grad too (divided by the micro-batch count, as the trainer's)."""
        from disagmoe.runtime.training.trainer import micro_batch_losses

        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        micro = self.cfg.micro_batches
        with torch.enable_grad() if backward else torch.no_grad():
            for loss, ce, _ in micro_batch_losses(self.model, tokens_BS1, micro):
                if backward:
                    (loss / micro).backward()
                total += torch.stack([loss.detach(), ce.detach()]).double()
        loss, ce = (total / micro).tolist()
        return loss, ce


def _first_adamw_step(probe: _Probe, params: list[tuple[str, torch.nn.Parameter]], lr: float,
                      saved: dict[str, torch.Tensor]) -> tuple[float, float]:
    """The second batch's (loss, ce) after one AdamW step of `params` at `lr`, the weights put back after."""
    from disagmoe.runtime.state.optim import build_optimizer, set_lr

    optimizer = build_optimizer(params, probe.cfg.optim.model_copy(update={"state_dtype": "fp32"}))
    set_lr(optimizer, lr)
    try:
        optimizer.step()
        return probe.losses(probe.second)
    finally:
        with torch.no_grad():
            for name, p in params:
                p.copy_(saved[name])


def run(cfg: TrainConfig, lrs: list[float] | None, by_group: bool, group_lr: float | None,
        log: Callable[[str], None]) -> dict:
    """The record `disagmoe bench first-step` prints (module docstring)."""
    from disagmoe.runtime.state.optim import clip_grad_norm, lr_at

    sweep = lr_sweep(cfg, lrs)
    if group_lr is not None and not (group_lr > 0 and math.isfinite(group_lr)):
        raise ValueError(f"--group-lr {group_lr}: give a positive learning rate (or leave it out: the warm-up's first)")
    first_lr = lr_at(0, cfg.optim, cfg.steps)
    probe = _Probe(cfg, log)
    before, before_ce = probe.losses(probe.second)
    first, first_ce = probe.losses(probe.first, backward=True)
    params = [(n, p) for n, p in probe.model.named_parameters() if p.grad is not None]
    grad_norm = clip_grad_norm([p for _, p in params], cfg.optim.grad_clip)
    log(f"batch 1: loss {first:.4f}, gradient norm {grad_norm:.3g}; batch 2 before any step: loss {before:.4f}")
    saved = {n: p.detach().clone() for n, p in params}
    rows = []
    for lr in sweep:
        loss, ce = _first_adamw_step(probe, params, lr, saved)
        rows.append({"lr": lr, "loss": loss, "ce": ce, "change": loss - before, "warmup_first": lr == first_lr})
        log(f"lr {lr:.3g}: batch 2's loss {loss:.4f} ({loss - before:+.4f})")
    groups, at = [], (group_lr or first_lr) if by_group else None
    if by_group:
        families: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
        for name, p in params:
            families.setdefault(parameter_group(name), []).append((name, p))
        for family, members in families.items():
            loss, ce = _first_adamw_step(probe, members, at, saved)
            groups.append({"group": family, "tensors": len(members), "params": sum(p.numel() for _, p in members),
                           "loss": loss, "ce": ce, "change": loss - before})
            log(f"{family} alone at lr {at:.3g}: {loss:.4f} ({loss - before:+.4f})")
    best = min(rows, key=lambda r: r["loss"])
    return {"model": probe.model_cfg.name, "device": str(probe.device),
            "seed": cfg.seed, "data_seed": cfg.data_seed, "micro_batches": probe.cfg.micro_batches,
            "optim": {"lr": cfg.optim.lr, "warmup_steps": cfg.optim.warmup_steps, "beta1": cfg.optim.beta1,
                      "beta2": cfg.optim.beta2, "eps": cfg.optim.eps, "weight_decay": cfg.optim.weight_decay,
                      "grad_clip": cfg.optim.grad_clip},
            "first_batch": {"loss": first, "ce": first_ce, "grad_norm": grad_norm},
            "before": {"loss": before, "ce": before_ce}, "warmup_first_lr": first_lr, "rows": rows,
            "best_lr": best["lr"], "group_lr": at, "groups": groups,
            "advice": advice(cfg, first_lr, rows)}


def advice(cfg: TrainConfig, first_lr: float, rows: list[dict]) -> str:
    """One line: whether the warm-up's first step lowers the loss, and if not the warm-up that starts
    at the best learning rate tried (or below the lowest that still lowered it)."""
    first = next((r for r in rows if r["warmup_first"]), None)
    best = min(rows, key=lambda r: r["loss"])
    if first is None:
        return (f"the warm-up's first learning rate ({first_lr:.3g}) was not among those tried; of those, "
                f"{best['lr']:.3g} lowered batch 2's loss most ({best['change']:+.4f})")
    if best["change"] >= 0:
        return (f"no learning rate tried lowered batch 2's loss (best {best['lr']:.3g}: {best['change']:+.4f}): "
                "try smaller ones (--lr)")
    if first["change"] < 0 and first["lr"] <= best["lr"]:
        return (f"the warm-up's first step (lr {first_lr:.3g}) lowers the loss ({first['change']:+.4f}); "
                f"the best tried is {best['lr']:.3g}")
    steps = math.ceil(cfg.optim.lr / best["lr"])
    verb = "raises" if first["change"] >= 0 else "lowers less than a smaller one"
    return (f"the warm-up's first step (lr {first_lr:.3g} = optim.lr / optim.warmup_steps) {verb} "
            f"({first['change']:+.4f}); {best['lr']:.3g} lowered it most ({best['change']:+.4f}): "
            f"optim.warmup_steps={steps} starts there (or lower optim.lr)")
