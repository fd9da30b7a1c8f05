"""Ranks and expert ownership of distributed runs (disagmoe/runtime/topology.py)."""

import pytest

from disagmoe.config import TrainConfig
from disagmoe.model_ref import load_model
from disagmoe.runtime.schedule.roles import Layout, RoleKind
from disagmoe.runtime.plan_layout import partition_owners
from disagmoe.runtime.topology import Topology, contiguous_expert_ids


@pytest.mark.parametrize(("experts", "ranks"), [(8, 1), (8, 3), (7, 7), (64, 5)])
def test_contiguous_ranges_tile_the_experts_evenly(experts, ranks):
    per_rank = contiguous_expert_ids(experts, ranks)
    assert len(per_rank) == ranks and [e for ids in per_rank for e in ids] == list(range(experts))
    sizes = [len(ids) for ids in per_rank]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_more_expert_ranks_than_experts_is_refused():
    with pytest.raises(ValueError, match="only 8 experts"):
        contiguous_expert_ids(8, 9)


def test_disaggregated_topology_follows_the_layout():
    layout = Layout(attention_ranks=4, expert_ranks=3, pipeline_groups=2, num_layers=5, num_dense_layers=1)
    topo = Topology.disaggregated(layout, num_experts=8)
    assert topo.world_size == layout.world_size and topo.data_parallel == 2 and topo.head_group == 1
    for rank in range(topo.world_size):
        role = layout.role(rank)
        if role.kind is RoleKind.ATTENTION:
            assert topo.attention_role(rank) == (role.group, role.index) and topo.expert_role(rank) is None
            assert topo.attention_layers(rank) == list(layout.layers_of_group(role.group))
        else:
            assert topo.expert_role(rank) == (role.group, role.index) and topo.attention_role(rank) is None
    # group 0 has expert ranks 4, 5 (experts 0-3, 4-7), group 1 has rank 6 (all experts)
    assert topo.experts_of(4) == {2: (0, 1, 2, 3), 4: (0, 1, 2, 3)}  # layer 0 is dense
    assert topo.experts_of(6) == {1: tuple(range(8)), 3: tuple(range(8))}
    assert topo.describe(1) == "A0.1" and topo.describe(5) == "E0.1" and topo.group_name(6) == "E1"


def test_a_placement_gives_each_rank_its_experts_per_layer():
    layout = Layout(attention_ranks=1, expert_ranks=2, pipeline_groups=1, num_layers=3, num_dense_layers=1)
    placement = {1: partition_owners(((0, 2, 5), (1, 3, 4, 6, 7)), 8), 2: partition_owners(((7,), tuple(range(7))), 8)}
    topo = Topology.disaggregated(layout, num_experts=8, placement=placement)
    assert topo.experts_of(1) == {1: (0, 2, 5), 2: (7,)}
    assert topo.experts_of(2) == {1: (1, 3, 4, 6, 7), 2: tuple(range(7))}
    assert topo.expert_ids(1) == ((0, 2, 5), (1, 3, 4, 6, 7)) and topo.experts_of(0) == {}
    assert topo.replica_groups() == []


def test_replicated_experts_are_held_by_every_owner_and_grouped_for_their_gradients():
    layout = Layout(attention_ranks=2, expert_ranks=3, pipeline_groups=1, num_layers=3, num_dense_layers=1)
    # layer 1: expert 0 on expert ranks 0 and 2, expert 3 on 1 and 2; layer 2: expert 7 on all three
    owners_1 = ((0, 2), (0,), (1,), (1, 2), (2,), (0,), (1,), (2,))
    owners_2 = ((0,), (0,), (1,), (1,), (2,), (2,), (0,), (2, 0, 1))
    topo = Topology.disaggregated(layout, num_experts=8, placement={1: owners_1, 2: owners_2})
    assert topo.experts_of(2) == {1: (0, 1, 5), 2: (0, 1, 6, 7)}  # global rank 2 = expert rank 0
    assert topo.experts_of(4) == {1: (0, 3, 4, 7), 2: (4, 5, 7)}
    assert topo.owner_ranks(2, 7) == (4, 2, 3)  # replica order kept: the first is the primary
    assert topo.replica_groups() == [(2, 3, 4), (2, 4), (3, 4)]  # as sets: one group per set of owners


def test_a_placement_that_leaves_an_expert_rank_idle_is_rejected():
    layout = Layout(attention_ranks=1, expert_ranks=2, pipeline_groups=1, num_layers=2, num_dense_layers=1)
    with pytest.raises(AssertionError, match="every expert rank holds an expert"):
        Topology.disaggregated(layout, num_experts=2, placement={1: ((0,), (0,))})
    with pytest.raises(AssertionError, match="distinct owners"):
        Topology.disaggregated(layout, num_experts=2, placement={1: ((0, 0), (1,))})


def test_colocated_ranks_run_attention_and_hold_an_expert_slice():
    topo = Topology.colocated_ranks(3, num_layers=3, num_dense_layers=1, num_experts=8)
    assert topo.world_size == 3 and topo.data_parallel == 3 and topo.pipeline_groups == 1
    assert [topo.attention_role(r) for r in range(3)] == [(0, 0), (0, 1), (0, 2)]
    assert [topo.experts_of(r)[1] for r in range(3)] == [(0, 1, 2), (3, 4, 5), (6, 7)]
    assert {topo.group_name(r) for r in range(3)} == {"colocated"}


def test_colocated_pipeline_groups_split_the_ranks_and_the_layers():
    """Group g's ranks g * n + d run attention for index d and hold experts of group g's layers only."""
    topo = Topology.colocated_ranks(4, num_layers=3, num_dense_layers=0, num_experts=8, pipeline_groups=2)
    assert topo.world_size == 4 and topo.data_parallel == 2 and topo.pipeline_groups == 2
    assert topo.attention_groups == topo.expert_groups == ((0, 1), (2, 3))
    assert [topo.describe(r) for r in range(4)] == ["C0.0", "C0.1", "C1.0", "C1.1"]
    assert [topo.group_name(r) for r in range(4)] == ["C0", "C0", "C1", "C1"]  # busy fractions per group
    assert [topo.attention_layers(r) for r in range(4)] == [[0, 2], [0, 2], [1], [1]]
    assert topo.experts_of(1) == {0: (4, 5, 6, 7), 2: (4, 5, 6, 7)} and topo.experts_of(2) == {1: (0, 1, 2, 3)}
    model = load_model("tiny")
    cfg = TrainConfig(model="tiny", batch_size=8, mode="colocated", colocated_ranks=3, pipeline_groups=3)
    assert Topology.from_config(cfg, model).attention_groups == ((0,), (1,), (2,))


def test_from_config_picks_the_mode():
    model = load_model("tiny")
    base = dict(model="tiny", batch_size=8)
    colocated = Topology.from_config(TrainConfig(**base, mode="colocated", colocated_ranks=2), model)
    disaggregated = Topology.from_config(TrainConfig(**base, attention_ranks=2, expert_ranks=2), model)
    assert colocated.colocated and colocated.world_size == 2
    assert not disaggregated.colocated and disaggregated.world_size == 4
    with pytest.raises(ValueError, match="no distributed topology"):
        Topology.from_config(TrainConfig(**base, mode="single"), model)


def no_aux_model():
    """The tiny preset without its auxiliary loss: sources dispatch only to the ranks they feed."""
    m = load_model("tiny")
    return m.model_copy(update={"router": m.router.model_copy(update={"aux_loss_coef": 0.0})})


def test_ep_blocks_hold_every_expert_once_each_on_the_strided_ranks():
    """4 colocated ranks in 2 EP blocks of 2: block c is ranks c and c + 2, each expert replicated in
    both (replica c in block c: experts 0-3 on ranks 0 and 1, 4-7 on 2 and 3), and the blocks sum
    their experts' gradients pairwise."""
    topo = Topology.colocated_ranks(4, 3, 1, 8, sets=2)
    assert topo.expert_owners[1] == tuple((0, 1) if e < 4 else (2, 3) for e in range(8))
    assert topo.experts_of(0) == topo.experts_of(1) == {1: (0, 1, 2, 3), 2: (0, 1, 2, 3)}
    assert topo.experts_of(2) == topo.experts_of(3) == {1: (4, 5, 6, 7), 2: (4, 5, 6, 7)}
    assert topo.replica_groups() == [(0, 1), (2, 3)]


@pytest.mark.parametrize("global_load", [False, True])
def test_a_source_serves_its_own_block_with_or_without_the_global_load(global_load):
    """2 EP blocks of 4 colocated ranks (ranks 0, 2 and 1, 3): each source dispatches to its own
    block; where the router needs the global load, each rank swaps its block's load with the other
    block's rank at its position (0 with 1, 2 with 3), and only then."""
    topo = Topology.colocated_ranks(4, 3, 1, 8, sets=2, global_load=global_load)
    for layer in (1, 2):
        assert topo.blocks(layer) == ((0, 2), (1, 3))
        for d in range(4):
            assert topo.served(layer, d) == (d % 2, d % 2 + 2)
        for rank in range(4):
            assert topo.sources_of(layer, rank) == (rank % 2, rank % 2 + 2)
            assert topo.load_peers(layer, rank) == (((1,), (0,), (3,), (2,))[rank] if global_load else ())
    assert topo.dispatch_width == 2


def test_the_load_is_swapped_among_the_blocks_of_replica_sets_at_one_position():
    """A2-E4 in 2 sets (ranks 2, 4 and 3, 5): expert rank 2 swaps with 3, 4 with 5; with 3 sets of
    A3-E6 each rank with the two others at its position."""
    two = Topology.disaggregated(Layout(2, 4, 1, 2, 0), 8, sets=2, global_load=True)
    assert [two.load_peers(1, rank) for rank in range(2, 6)] == [(3,), (2,), (5,), (4,)]
    three = Topology.disaggregated(Layout(3, 6, 1, 2, 0), 8, sets=3, global_load=True)
    assert three.blocks(1) == ((3, 6), (4, 7), (5, 8))
    assert three.load_peers(1, 7) == (6, 8) and three.served(1, 1) == (4, 7)


def test_a_layer_whose_sources_overlap_dispatches_to_the_whole_group_under_the_global_load():
    """A plan's layer 1 replicates expert 0 over both expert ranks and keeps the rest on one each
    (both serve both sources: one block, nothing to swap); layer 2's uneven replicas make rank 2
    serve sources {0, 1} and rank 3 only {1}: no blocks, so every source dispatches it to both.
    Layer 3 holds every expert on both: two blocks of one rank, which swap their loads."""
    owners = {1: ((0, 1),) + tuple((e % 2,) for e in range(1, 8)),
              2: ((0,),) + ((0, 1),) * 7, 3: ((0, 1),) * 8}
    topo = Topology.disaggregated(Layout(2, 2, 1, 4, 1), 8, owners, global_load=True)
    assert topo.blocks(1) == ((2, 3),) and topo.load_peers(1, 2) == ()
    assert topo.blocks(2) is None and topo.served(2, 0) == topo.served(2, 1) == (2, 3)
    assert topo.load_peers(2, 2) == ()
    assert topo.blocks(3) == ((2,), (3,)) and topo.load_peers(3, 2) == (3,) and topo.served(3, 1) == (3,)


def test_disaggregated_replica_sets_serve_data_parallel_index_d_from_set_d_mod_sets():
    """2 attention and 4 expert ranks in 2 sets (ranks 2, 4 and 3, 5); with one attention rank, it
    splits a replicated expert's rows over both sets, so it serves all four."""
    topo = Topology.disaggregated(Layout(2, 4, 1, 2, 0), 8, sets=2)
    assert [topo.served(1, d) for d in range(2)] == [(2, 4), (3, 5)]
    assert [topo.sources_of(1, rank) for rank in range(2, 6)] == [(0,), (1,), (0,), (1,)]
    one = Topology.disaggregated(Layout(1, 4, 1, 2, 0), 8, sets=2)
    assert one.served(1, 0) == (1, 2, 3, 4) and one.sources_of(1, 3) == (0,)


def test_a_plans_replicas_decide_who_is_served_per_layer():
    """Layer 1 replicates expert 0 on both ranks (each source feeds its own replica, the other experts
    each on one rank): both serve both sources; layer 2 holds every expert on both: source d feeds rank d."""
    owners = {1: ((0, 1),) + tuple((e % 2,) for e in range(1, 8)), 2: ((0, 1),) * 8}
    topo = Topology.disaggregated(Layout(2, 2, 1, 3, 1), 8, owners)
    assert [topo.served(1, d) for d in range(2)] == [(2, 3), (2, 3)]
    assert [topo.served(2, d) for d in range(2)] == [(2,), (3,)]
    assert topo.sources_of(2, 3) == (1,) and topo.sources_of(1, 3) == (0, 1)


@pytest.mark.parametrize("aux", [False, True])
def test_from_config_blocks_the_experts_and_swaps_their_loads_under_an_aux_loss(aux):
    model = load_model("tiny") if aux else no_aux_model()
    cfg = TrainConfig(model=model, mode="colocated", colocated_ranks=8, pipeline_groups=2, expert_replica_sets=2)
    topo = Topology.from_config(cfg, model)
    assert topo.global_load is aux and topo.pipeline_groups == 2
    assert topo.expert_owners[1] == tuple((0, 1) if e < 4 else (2, 3) for e in range(8))  # group 1's ranks 4-7
    assert topo.served(1, 1) == (5, 7)  # its block only, aux loss or not
    assert topo.load_peers(1, 5) == ((4,) if aux else ())


@pytest.mark.parametrize(("fields", "fragment"), [
    (dict(mode="colocated", colocated_ranks=6, pipeline_groups=2, expert_replica_sets=2), "multiple of pipeline_groups"),
    (dict(mode="disaggregated", expert_ranks=3, expert_replica_sets=2), "expert_ranks=3"),
])
def test_replica_sets_that_do_not_split_a_group_evenly_are_refused(fields, fragment):
    with pytest.raises(ValueError, match=fragment):
        TrainConfig(model="tiny", **fields)
