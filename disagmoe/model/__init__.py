"""Reference MoE transformer in plain torch, and Hugging Face import/export.

    from disagmoe.model import MoETransformer, ModelOutput
    model = MoETransformer(cfg, experts_backend="loop")   # "loop" | "grouped_mm" | "triton"
    model.init_weights(seed)
    out = model(tokens_BS)          # logits_BSV, aux_loss, z_loss, expert_load_LE, topk_idx_LNK
    model.update_router_bias(load_LE)                      # after optimizer.step()

Decomposition used by the disaggregated runtime (one MoE layer, `block = model.layers[i]`):

    h_BSH, xn_BSH  = block.attention_part_normed(x_BSH)   # attention side: norm + attention + residual + FFN norm
    routing        = block.route(h_BSH, xn_BSH=xn_BSH)    # attention side: Routing(xn_NH, topk_idx_NK,
                                                          #   topk_w_NK, aux_loss, z_loss, load_E)
    x_PH, grouping = block.dispatch(routing)              # attention side: pair rows grouped by expert
    y_PH           = block.moe.experts(x_PH, grouping.offsets_E)   # expert side
    shared_NH      = block.shared_ffn(routing)            # attention side (None without shared experts)
    out_BSH        = block.combine(h_BSH, routing, y_PH, grouping, shared_NH)

An expert rank holds `RoutedExperts.from_indices(block.moe.experts, expert_ids)` (or calls an
`expert_ffn(x_NH, offsets_E, w13_EH2F, w2_EFH)` backend on its own tensors); `init_weights` draws
every expert from its own seeded stream, so any subset initialises exactly like the full model.
Dense layers (`DenseBlock`) run whole on the attention side. Routing can be held fixed for
gradient checks and oracles: `model(tokens, fixed_topk_idx_LNK=out.topk_idx_LNK)`.

Modules: layers (RMSNorm, RoPE, SwiGLU, DeferrableLinear), attention (GQA, MLA), router, dispatch
(permute / combine), experts (stacked weights, backends), block, transformer (the LM), hf (HF checkpoints).
"""

from disagmoe.model.block import DenseBlock, MoEBlock
from disagmoe.model.dispatch import ExpertGrouping, combine, group_by_expert, permute
from disagmoe.model.experts import RoutedExperts, get_expert_ffn
from disagmoe.model.router import Router, Routing
from disagmoe.model.transformer import ModelOutput, MoETransformer

__all__ = [
    "DenseBlock",
    "ExpertGrouping",
    "ModelOutput",
    "MoEBlock",
    "MoETransformer",
    "RoutedExperts",
    "Router",
    "Routing",
    "combine",
    "get_expert_ffn",
    "group_by_expert",
    "permute",
]
