import itertools

import pytest

from disagmoe.config import TrainConfig
from disagmoe.model_ref import load_model
from disagmoe.runtime.schedule.roles import Layout, RoleKind


@pytest.mark.parametrize("a, e, p", [(1, 1, 1), (4, 3, 2), (6, 7, 3), (3, 3, 3)])
def test_every_rank_has_one_role_and_maps_back(a, e, p):
    layout = Layout(attention_ranks=a, expert_ranks=e, pipeline_groups=p, num_layers=2 * p)
    seen = []
    for group in range(p):
        for d, rank in enumerate(layout.attention_group(group)):
            role = layout.role(rank)
            assert (role.kind, role.group, role.index) == (RoleKind.ATTENTION, group, d)
            seen.append(rank)
        for j, rank in enumerate(layout.expert_group(group)):
            role = layout.role(rank)
            assert (role.kind, role.group, role.index) == (RoleKind.EXPERT, group, j)
            seen.append(rank)
    assert sorted(seen) == list(range(layout.world_size))
    sizes = [len(layout.expert_group(g)) for g in range(p)]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == e


def test_layers_interleave_over_groups_and_head_follows_last_layer():
    layout = Layout(attention_ranks=3, expert_ranks=3, pipeline_groups=3, num_layers=7)
    owned = sorted(itertools.chain.from_iterable(layout.layers_of_group(g) for g in range(3)))
    assert owned == list(range(7))
    assert list(layout.layers_of_group(1)) == [1, 4]
    assert layout.head_group == layout.next_group(layout.group_of_layer(6))


@pytest.mark.parametrize(
    "args, fragment",  # (attention, expert ranks, pipeline groups, layers[, dense layers])
    [
        ((3, 2, 2, 4), "multiple of pipeline_groups"),
        ((2, 1, 2, 4), "at least one expert rank"),
        ((2, 2, 2, 1), "fewer than pipeline_groups"),
        ((1, 1, 1, 2, 3), "num_dense_layers"),
        ((0, 1, 1, 2), "at least 1"),
    ],
)
def test_invalid_layouts_say_what_to_fix(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        Layout(*args)


def test_rank_outside_layout_is_rejected():
    layout = Layout(attention_ranks=2, expert_ranks=2, pipeline_groups=1, num_layers=2)
    with pytest.raises(ValueError, match="outside"):
        layout.role(4)


def test_layout_from_train_config_takes_totals_and_the_models_layers():
    model = load_model("tiny")
    train = TrainConfig(model="tiny", attention_ranks=4, expert_ranks=3, pipeline_groups=2)
    layout = Layout.from_config(train, model)
    assert layout.world_size == 7 and layout.data_parallel == 2
    assert (layout.num_layers, layout.num_dense_layers) == (model.num_layers, model.num_dense_layers)
    assert not layout.is_moe(0) and layout.is_moe(model.num_layers - 1)
