"""An outside baseline for `disagmoe bench train --baseline hf`: Hugging Face transformers' own
model of the config's family (`MixtralForCausalLM`, `Qwen3MoeForCausalLM` or
`DeepseekV3ForCausalLM`) trained on one GPU with the same shape, batch and data as our run.

The family is the first architecture whose config.json expresses the model exactly
(`model.hf.hf_config_from_model`, which checks the round trip): the one a user of that library
would train. What it runs, per step, as such a user would: bf16 parameters, sdpa attention, its
grouped_mm experts implementation (where the installed version has one), the router's aux loss
where the family computes one (Mixtral, Qwen3-MoE; DeepSeek-V3 balances with its bias instead),
one forward/backward per micro-batch (gradients accumulate in the bf16 `.grad`), global-norm
clipping, `torch.optim.AdamW(fused=True)`. The loss is our next-token CE over the same [B, S + 1]
batches (`disagmoe.data`), so both runs see the same tokens. Timed like ours: the median step
after `warmup` steps, the device synchronised around each step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from disagmoe.config import ModelConfig, TrainConfig
from disagmoe.model_ref import load_model
from disagmoe.data import TokenDataset, load_splits
from disagmoe.runtime.batching import batch_rows, inputs_and_targets
from disagmoe.runtime.state.optim import lr_at

NAME = "hf-transformers"
FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")  # tried in this order; the first that fits wins
WITH_AUX_LOSS = ("qwen3_moe", "mixtral")  # families whose model returns a router aux loss


def hf_family(m: ModelConfig) -> tuple[str, dict[str, Any]]:
    """(model_type, config.json dict) of the first family that expresses `m` exactly; ValueError
    naming each family's reason when none does."""
    from disagmoe.model.hf import hf_config_from_model

    reasons = []
    for model_type in FAMILIES:
        try:
            return model_type, hf_config_from_model(m, model_type)
        except ValueError as err:
            reasons.append(f"{model_type}: {err}")
    raise ValueError(f"--baseline hf runs transformers' own model of the config's family, but no family expresses "
                     f"model {m.name!r} exactly ({'; '.join(reasons)}); drop --baseline for this model")


def hf_config(m: ModelConfig) -> tuple[str, Any]:
    """(model_type, transformers config) for training `m` as that library's users do."""
    from transformers import AutoConfig

    model_type, data = hf_family(m)
    data = {k: v for k, v in data.items() if k not in ("architectures", "model_type")}
    extra: dict[str, Any] = dict(use_cache=False, max_position_embeddings=max(m.seq_len, 4096))
    if model_type in WITH_AUX_LOSS:
        extra["output_router_logits"] = m.router.aux_loss_coef > 0
    return model_type, AutoConfig.for_model(model_type, **{**data, **extra})


def build_model(m: ModelConfig, device: torch.device,
                dtype: torch.dtype = torch.bfloat16) -> tuple[torch.nn.Module, str, str]:
    """(transformers' model of `m`'s family on `device`, its model_type, the experts implementation it runs)."""
    from transformers import AutoModelForCausalLM

    model_type, hf_cfg = hf_config(m)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=dtype,
                                                     experts_implementation="grouped_mm")
        except (TypeError, ValueError):  # a version or family without a selectable experts implementation
            model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=dtype)
    used = getattr(model.config, "_experts_implementation", None) or "default"
    return model, model_type, str(used)


def train_steps(model: torch.nn.Module, model_type: str, m: ModelConfig, cfg: TrainConfig, data: TokenDataset,
                steps: int, device: torch.device,
                on_step: Callable[[int], object] | None = None) -> tuple[list[float], list[float]]:
    """(losses, seconds) of `steps` optimizer steps, as the module docstring says; the device is
    synchronised around each step (on CUDA); `on_step(n)` is called as step n ends, and `on_step(0)`
    immediately before the first (`bench.gpu_clocks`' marks: the set-up is no step's)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                  eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay,
                                  fused=device.type == "cuda")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _device: None)
    times, losses = [], []
    if on_step is not None:
        on_step(0)
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.optim, steps)
        tokens_BS1 = data.batch(step).to(device)
        sync(device)
        start = time.perf_counter()
        total = torch.zeros((), device=device)
        for mb in range(cfg.micro_batches):
            inputs_BS, targets_BS = inputs_and_targets(tokens_BS1[batch_rows(cfg.batch_size, cfg.micro_batches, 1, mb, 0)])
            out = model(input_ids=inputs_BS)
            loss = F.cross_entropy(out.logits.float().flatten(0, 1), targets_BS.flatten())
            if model_type in WITH_AUX_LOSS and getattr(out, "aux_loss", None) is not None:
                loss = loss + m.router.aux_loss_coef * out.aux_loss.float()
            (loss / cfg.micro_batches).backward()
            total += loss.detach() / cfg.micro_batches
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))
        sync(device)
        times.append(time.perf_counter() - start)
        if on_step is not None:
            on_step(step + 1)
    return losses, times


def run(cfg: TrainConfig, steps: int, warmup: int, log: Callable[[str], None],
        on_step: Callable[[int], object] | None = None) -> dict[str, Any]:
    """Train the baseline for `steps` steps on GPU 0; the bench row (as `bench.train` rows); `on_step`
    called with the step's number as each step ends, and with 0 once the model is built, immediately
    before the first (`train_steps`; `bench.gpu_clocks`' marks)."""
    if cfg.device != "cuda" or not torch.cuda.is_available():
        raise ValueError("--baseline hf times a GPU training step; run it with device=cuda on a GPU host")
    if warmup >= steps:
        raise ValueError(f"no steps left to time after {warmup} warm-up steps; pass more --steps")
    m = load_model(cfg.model)
    device = torch.device("cuda", 0)
    torch.cuda.reset_peak_memory_stats(device)
    model, model_type, experts_impl = build_model(m, device)
    import transformers

    log(f"{NAME} {transformers.__version__} {type(model).__name__} (experts: {experts_impl}): {steps} steps")
    splits = load_splits(cfg.data, m.vocab_size, cfg.seq_len)
    data = TokenDataset(splits.train, cfg.seq_len, cfg.batch_size, cfg.data_seed, "train")
    losses, times = train_steps(model, model_type, m, cfg, data, steps, device, on_step)
    step_s = statistics.median(times[warmup:])
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    architecture = type(model).__name__
    del model
    torch.cuda.empty_cache()
    return {"mode": NAME, "ranks": 1, "micro_batches": cfg.micro_batches, "median_step_s": step_s, "tokens_per_s": cfg.batch_size * cfg.seq_len / step_s,
            "final_loss": losses[-1], "losses": losses, "busy": {}, "routing": "learned", "experts_implementation": experts_impl,
            "architecture": architecture, "transformers": transformers.__version__, "peak_memory_gib": peak}
