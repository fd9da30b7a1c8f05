"""One rank's part of the model (disagmoe/runtime/rank_model.py): names and values of the full model."""

import torch

from disagmoe.model_ref import load_model
from disagmoe.model import MoETransformer
from disagmoe.runtime.rank_model import RankModel

SEED = 11


def tiny():
    m = load_model("tiny")
    return m.model_copy(update={"router": m.router.model_copy(update={"bias_balancing": True})})


def test_parts_initialise_like_the_full_model():
    cfg = tiny()
    full = MoETransformer(cfg)
    full.init_weights(SEED)
    want = full.state_dict()
    attention = RankModel(cfg, "loop", [0, 2], {}, holds_embedding=True, holds_head=False).materialise(
        torch.device("cpu"), SEED)
    experts = RankModel(cfg, "loop", [], {1: (3, 4, 5), 2: (3, 4, 5)}, False, False).materialise(torch.device("cpu"), SEED)
    for name, tensor in attention.state_dict().items():
        assert torch.equal(tensor, want[name]), name
    for name, tensor in experts.state_dict().items():
        assert torch.equal(tensor, want[name][3:6]), name
    assert set(attention.state_dict()) == {n for n in want if n.startswith(("embed.", "layers.0.", "layers.2."))
                                           and ".moe.experts." not in n}
    assert set(experts.state_dict()) == {f"layers.{l}.moe.experts.{p}" for l in (1, 2) for p in ("w13_EH2F", "w2_EFH")}
    assert experts.experts(1).expert_ids == (3, 4, 5) and attention.norm is None and attention.lm_head is None


def test_colocated_part_holds_attention_and_an_expert_slice():
    cfg = tiny()
    part = RankModel(cfg, "loop", [0, 1, 2], {1: (0, 1, 2, 3), 2: (0, 1, 2, 3)}, True, True).materialise(torch.device("cpu"), 0)
    expert_names = {n for n, _ in part.named_parameters() if ".moe.experts." in n}
    assert {id(p) for p in part.expert_parameters()} == {id(p) for n, p in part.named_parameters() if n in expert_names}
    assert len(list(part.replicated_parameters())) + len(expert_names) == len(list(part.parameters()))
    assert part.experts(2).num_experts == 4 and part.head_weight() is part.lm_head.weight
    assert [b for b in part.moe_blocks] == [part.block(1), part.block(2)]
