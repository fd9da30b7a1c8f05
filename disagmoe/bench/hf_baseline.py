"""An outside baseline for `disagmoe bench train --baseline hf`: Hugging Face transformers'
`Qwen3MoeForCausalLM` trained on one GPU with the same shape, batch and data as our run.

What it runs, per step, as a user of that library would: bf16 parameters, sdpa attention, its
grouped_mm experts implementation (where the installed version has one), the router's aux loss
on, one forward/backward per micro-batch (gradients accumulate in the bf16 `.grad`), global-norm
clipping, `torch.optim.AdamW(fused=True)`. The loss is our next-token CE over the same [B, S + 1]
batches (`disagmoe.data`), so both runs see the same tokens. Timed like ours: the median step
after `warmup` steps, the device synchronised around each step.

Only Qwen3-MoE-shaped models (GQA with qk-norm, softmax top-k routing, no shared or dense
layers) have this baseline; others are refused with the reason.
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


def qwen3_moe_config(m: ModelConfig) -> Any:
    """Our model as a transformers `Qwen3MoeConfig`; ValueError if it is not Qwen3-MoE-shaped."""
    problems = [why for bad, why in (
        (m.attention != "gqa", "attention is not GQA"), (not m.qk_norm, "no qk-norm"),
        (m.router.score != "softmax", "the router is not softmax top-k"),
        (m.num_shared_experts > 0, "it has shared experts"), (m.num_dense_layers > 0, "it has dense layers"),
        (m.rope_scaling is not None, "it scales RoPE")) if bad]
    if problems:
        raise ValueError(f"--baseline hf runs Qwen3MoeForCausalLM, but model {m.name!r} is not Qwen3-MoE-shaped "
                         f"({', '.join(problems)}); drop --baseline for this model")
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim,
        num_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.expert_ffn_size,
        intermediate_size=m.expert_ffn_size, norm_topk_prob=m.router.normalize_topk,
        router_aux_loss_coef=m.router.aux_loss_coef, output_router_logits=m.router.aux_loss_coef > 0,
        rms_norm_eps=m.norm_eps, max_position_embeddings=max(m.seq_len, 4096), tie_word_embeddings=m.tie_embeddings,
        rope_theta=m.rope_theta, use_cache=False,
    )


def build_model(m: ModelConfig, device: torch.device) -> tuple[torch.nn.Module, str]:
    """(bf16 Qwen3MoeForCausalLM on `device`, the experts implementation it runs)."""
    from transformers import Qwen3MoeForCausalLM

    hf_cfg = qwen3_moe_config(m)
    with torch.device(device):
        try:
            model = Qwen3MoeForCausalLM._from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.bfloat16,
                                                     experts_implementation="grouped_mm")
        except (TypeError, ValueError):  # a version without a selectable experts implementation
            model = Qwen3MoeForCausalLM._from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.bfloat16)
    used = getattr(model.config, "_experts_implementation", None) or "default"
    return model, str(used)


def run(cfg: TrainConfig, steps: int, warmup: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Train the baseline for `steps` steps on GPU 0; the bench row (as `bench.train` rows)."""
    if cfg.device != "cuda" or not torch.cuda.is_available():
        raise ValueError("--baseline hf times a GPU training step; run it with device=cuda on a GPU host")
    m = load_model(cfg.model)
    device = torch.device("cuda", 0)
    torch.cuda.reset_peak_memory_stats(device)
    model, experts_impl = build_model(m, device)
    import transformers

    log(f"{NAME} {transformers.__version__} Qwen3MoeForCausalLM (experts: {experts_impl}): {steps} steps")
    splits = load_splits(cfg.data, m.vocab_size, cfg.seq_len)
    data = TokenDataset(splits.train, cfg.seq_len, cfg.batch_size, cfg.seed, "train")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                  eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay, fused=True)
    times, losses = [], []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.optim, steps)
        tokens_BS1 = data.batch(step).to(device)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        total = torch.zeros((), device=device)
        for mb in range(cfg.micro_batches):
            inputs_BS, targets_BS = inputs_and_targets(tokens_BS1[batch_rows(cfg.batch_size, cfg.micro_batches, 1, mb, 0)])
            out = model(input_ids=inputs_BS)
            loss = F.cross_entropy(out.logits.float().flatten(0, 1), targets_BS.flatten())
            if getattr(out, "aux_loss", None) is not None:
                loss = loss + m.router.aux_loss_coef * out.aux_loss.float()
            (loss / cfg.micro_batches).backward()
            total += loss.detach() / cfg.micro_batches
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    timed = times[warmup:]
    if not timed:
        raise ValueError(f"no steps left to time after {warmup} warm-up steps; pass more --steps")
    step_s = statistics.median(timed)
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    del model, optimizer
    torch.cuda.empty_cache()
    return {"mode": NAME, "ranks": 1, "median_step_s": step_s, "tokens_per_s": cfg.batch_size * cfg.seq_len / step_s,
            "final_loss": losses[-1], "busy": {}, "routing": "learned", "experts_implementation": experts_impl,
            "transformers": transformers.__version__, "peak_memory_gib": peak}
