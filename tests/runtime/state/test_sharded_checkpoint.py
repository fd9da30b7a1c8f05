"""Checkpoints written rank by rank (disagmoe/runtime/state/sharded_checkpoint.py), read by any layout."""

import torch

from disagmoe.config import OptimConfig
from disagmoe.model_ref import load_model
from disagmoe.model import MoETransformer
from disagmoe.runtime.state.checkpoint import (
    TrainerState, latest_checkpoint, load_checkpoint, optimizer_state_by_name, read_manifest, save_checkpoint,
)
from disagmoe.runtime.state.optim import build_optimizer
from disagmoe.runtime.rank_model import RankModel
from disagmoe.runtime.state.sharded_checkpoint import (
    finish_checkpoint, load_rank_state, rank_shard, read_trainer_state, staging_dir, write_shard,
)

OPTIM = OptimConfig(lr=1e-2, warmup_steps=0)


def trained_model(seed: int = 0):
    """The tiny model after one AdamW step on random gradients (so the optimizer has state)."""
    cfg = load_model("tiny")
    model = MoETransformer(cfg)
    model.init_weights(seed)
    optimizer = build_optimizer(model.named_parameters(), OPTIM)
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    optimizer.step()
    return cfg, model, optimizer


FIRST_EXPERT_RANK = {1: (0, 2, 5, 7), 2: (1, 3)}  # non-contiguous, different per MoE layer
SECOND_EXPERT_RANK = {1: (1, 3, 4, 6), 2: (0, 2, 4, 5, 6, 7)}


def parts(cfg):
    """A disaggregated layout: one attention rank, two expert ranks sharing each layer's experts."""
    specs = [([0, 1, 2], {}, True, True), ([], FIRST_EXPERT_RANK, False, False),
             ([], SECOND_EXPERT_RANK, False, False)]
    out = []
    for layers, expert_ids, embed, head in specs:
        model = RankModel(cfg, "loop", layers, expert_ids, embed, head).materialise(torch.device("cpu"), seed=99)
        out.append((model, build_optimizer(model.named_parameters(), OPTIM)))
    return out


def test_rank_parts_load_a_single_checkpoint_and_write_one_it_reads_back(tmp_path):
    cfg, model, optimizer = trained_model()
    single = save_checkpoint(tmp_path / "single", model, optimizer, cfg, TrainerState.capture(1))
    want, want_optim = model.state_dict(), optimizer_state_by_name(model, optimizer)
    ranks = parts(cfg)
    for part, part_optim in ranks:
        load_rank_state(single, part, part_optim, cfg)
        ids = {n: list(part.experts(int(n.split(".")[1])).expert_ids)
               for n in part.state_dict() if ".moe.experts." in n}
        for name, tensor in part.state_dict().items():
            ref = want[name] if name not in ids else want[name][ids[name]]
            assert torch.equal(tensor, ref), name
        for name, state in optimizer_state_by_name(part, part_optim).items():
            ref = want_optim[name]["exp_avg"]
            ref = ref if name not in ids else ref[ids[name]]
            assert torch.equal(state["exp_avg"], ref), name

    root = tmp_path / "sharded"
    listings = [write_shard(staging_dir(root, 1), f"rank-{r:05d}.pt", rank_shard(p, o, include_replicated=True))
                for r, (p, o) in enumerate(ranks)]
    assert latest_checkpoint(root) is None  # staged shards are not a checkpoint yet
    directory = finish_checkpoint(root, 1, listings, cfg, TrainerState.capture(1))
    assert latest_checkpoint(root) == directory and not staging_dir(root, 1).exists()
    assert [e["file"] for e in read_manifest(directory)["shards"]] == [
        "rank-00000.pt", "rank-00001.pt", "rank-00002.pt", "trainer.pt"]
    assert read_trainer_state(directory).step == 1

    restored = MoETransformer(cfg)
    restored_optim = build_optimizer(restored.named_parameters(), OPTIM)
    load_checkpoint(directory, restored, restored_optim, cfg)
    for name, tensor in restored.state_dict().items():
        assert torch.equal(tensor, want[name]), name
    for name, state in optimizer_state_by_name(restored, restored_optim).items():
        for key, value in state.items():
            assert torch.equal(value, want_optim[name][key]), (name, key)


def test_replicas_leave_out_what_data_parallel_index_0_writes():
    cfg = load_model("tiny")
    (attention, attention_optim), (experts, experts_optim), _ = parts(cfg)
    assert rank_shard(attention, attention_optim, include_replicated=False)["model"] == {}
    keys = set(rank_shard(experts, experts_optim, include_replicated=False)["model"])
    assert keys == {f"{l}/moe.experts/{e}/{p}"
                    for l in (1, 2) for e in FIRST_EXPERT_RANK[l] for p in ("w13_EH2F", "w2_EFH")}
