"""A rank's mailbox and message keys (disagmoe/runtime/stages/messages.py)."""

import pytest
import torch

from disagmoe.wire import Direction, message_key, Payload
from disagmoe.runtime.stages.messages import Mailbox


def test_posts_to_oneself_arrive_at_once_and_others_wait_for_a_send():
    mail = Mailbox(rank=1)
    mine, theirs = [torch.ones(2)], [torch.zeros(3)]
    mail.post(Payload.RESIDUAL, 0, 0, 1, mine)
    mail.post(Payload.DISPATCH, 0, 0, 2, theirs)
    assert mail.has(Payload.RESIDUAL, 0, 0, 1) and not mail.has(Payload.DISPATCH, 0, 0, 2)
    assert mail.take(Payload.RESIDUAL, 0, 0, 1) is mine
    assert mail.outgoing(Payload.DISPATCH, 0, 0, 2) is theirs
    assert mail.empty()


def test_delivered_messages_are_taken_once():
    mail = Mailbox(rank=0)
    mail.deliver(Payload.COMBINE, 2, 1, 3, [torch.ones(1)])
    assert not mail.empty()
    mail.take(Payload.COMBINE, 2, 1, 3)
    with pytest.raises(AssertionError, match="no COMBINE"):
        mail.take(Payload.COMBINE, 2, 1, 3)


def test_message_keys_separate_payloads_of_one_layer():
    keys = {p: message_key(7, p, 3, 1) for p in Payload}
    assert keys[Payload.DISPATCH] != keys[Payload.COMBINE]
    assert keys[Payload.DISPATCH_GRAD] != keys[Payload.COMBINE_GRAD]
    assert all(k.step == 7 and k.micro_batch == 1 for k in keys.values())
    assert keys[Payload.COMBINE_GRAD].direction is Direction.BACKWARD


def _run(**fields):
    from disagmoe.config import TrainConfig
    from disagmoe.model_ref import load_model
    from disagmoe.runtime.topology import Topology

    cfg = TrainConfig(model="tiny", **fields)
    model = load_model("tiny")
    return cfg, model, Topology.from_config(cfg, model)


@pytest.mark.parametrize("fields, hop", [
    (dict(hop="pair_rows"), "pair_rows"),  # as configured (local: the CPU emulation)
    (dict(expert_ranks=4, transport="nvshmem", experts_backend="triton", device="cuda"), "pair_rows"),  # 4 > top-2
    (dict(expert_ranks=2, transport="nvshmem", experts_backend="triton", device="cuda"), "partial_sums"),  # 2 <= 2
    (dict(expert_ranks=4, transport="nccl", device="cuda"), "partial_sums"),  # needs the one-sided transport
])
def test_the_hop_is_pair_rows_where_it_moves_fewer_bytes_and_can_run(fields, hop):
    from disagmoe.runtime.stages.messages import hop_mode

    got, why = hop_mode(*_run(**fields))
    assert got == hop and why


def test_pair_rows_change_combine_the_residual_and_dispatch_grad():
    from disagmoe.comm.base import TensorSpec
    from disagmoe.runtime.stages.messages import MessageShapes

    cfg, model, topology = _run(hop="pair_rows", expert_ranks=2, batch_size=4, seq_len=8, pair_segment_tokens=5)
    pairs, plain = MessageShapes.of_run(cfg, model, topology), MessageShapes.of_run(
        cfg.model_copy(update={"hop": "partial_sums"}), model, topology)
    T, K, H = pairs.tokens, model.top_k, model.hidden_size
    assert pairs.specs(Payload.COMBINE, True) == [TensorSpec((T * K, H), pairs.dtype)]
    assert pairs.specs(Payload.RESIDUAL, True)[-1] == TensorSpec((T, K), pairs.dtype)  # the weights ride along
    assert pairs.specs(Payload.RESIDUAL_GRAD, False) == plain.specs(Payload.RESIDUAL_GRAD, False)  # dense layers
    for payload in (Payload.DISPATCH, Payload.COMBINE_GRAD):
        assert pairs.specs(payload, True) == plain.specs(payload, True)
    load = TensorSpec((model.num_experts,), torch.int64)
    assert pairs.specs(Payload.DISPATCH_GRAD, True) == [TensorSpec((T * K, H), pairs.dtype), load]
    spec = pairs.pair_spec(Payload.COMBINE, (1, 2))
    assert spec.segments == -(-T // 5) and spec.sources == (1, 2) and spec.rows.shape == (T * K, H)
    assert spec.extras == () and pairs.pair_spec(Payload.DISPATCH_GRAD, (1, 2)).extras == (load,)
    for payload in (Payload.COMBINE, Payload.DISPATCH_GRAD):
        assert pairs.is_pair(payload, True) and not pairs.is_pair(payload, False)
        assert not plain.is_pair(payload, True)
    assert not pairs.is_pair(Payload.DISPATCH, True)


def test_pair_row_targets_and_landings_are_taken_once():
    from disagmoe.comm.base import PairLanding, PairTarget

    mail = Mailbox(rank=0)
    target = PairTarget(torch.zeros(4, 2), torch.zeros(1, 1, dtype=torch.int64), 0)
    mail.aim(Payload.COMBINE, 1, 0, 3, target)
    assert mail.target(Payload.COMBINE, 1, 0, 3) is target and not mail.empty()
    with pytest.raises(AssertionError, match="no pair-row target for rank 3 in DISPATCH_GRAD"):
        mail.target(Payload.DISPATCH_GRAD, 1, 0, 3)  # the payload is part of the key
    assert mail.release_target(Payload.COMBINE, 1, 0, 3) is target
    mail.land(Payload.COMBINE, 1, 0, PairLanding(torch.zeros(4, 2), torch.ones(1, 1, dtype=torch.int64), None, None))
    mail.landing(Payload.COMBINE, 1, 0)
    assert mail.empty()
    with pytest.raises(AssertionError, match="no pair rows"):
        mail.landing(Payload.COMBINE, 1, 0)


@pytest.mark.parametrize("fields, needle", [
    (dict(hop="pair_rows", transport="nccl", device="cuda"), "needs transport: nvshmem"),
    (dict(hop="pair_rows", transport="nvshmem", device="cuda", experts_backend="loop"), "experts_backend: triton"),
])
def test_pair_rows_that_cannot_run_are_refused_naming_the_fix(fields, needle):
    from disagmoe.config import TrainConfig

    with pytest.raises(ValueError, match=needle):
        TrainConfig(model="tiny", **fields)


@pytest.mark.parametrize("fields, dispatch", [
    (dict(dispatch="sparse"), "sparse"),  # as configured (local: the worst-case buffer with a count)
    (dict(dispatch="dense", expert_ranks=4, transport="nvshmem", device="cuda"), "dense"),
    (dict(expert_ranks=2, transport="nvshmem", device="cuda"), "sparse"),  # auto: more than one expert rank
    (dict(expert_ranks=1, transport="nvshmem", device="cuda"), "dense"),  # one expert rank: every token goes there
    (dict(expert_ranks=4, transport="nccl", device="cuda"), "dense"),  # auto: sparse saves bytes on nvshmem only
    (dict(expert_ranks=4, transport="nvshmem", experts_backend="triton", device="cuda"), "sparse"),  # with pair rows
    (dict(expert_ranks=4, hop="pair_rows"), "dense"),  # pair rows on local: the worst-case buffer either way
    (dict(dispatch="sparse", hop="pair_rows"), "sparse"),  # as configured, with pair rows
])
def test_auto_dispatch_is_sparse_on_nvshmem_with_several_expert_ranks(fields, dispatch):
    """Auto: sparse on nvshmem with several expert ranks per set, with partial sums or pair rows
    (auto's hop there with triton experts)."""
    from disagmoe.runtime.stages.messages import dispatch_mode

    got, why = dispatch_mode(*_run(**fields))
    assert got == dispatch and why


def test_unknown_dispatch_is_refused():
    from pydantic import ValidationError

    from disagmoe.config import TrainConfig

    with pytest.raises(ValidationError, match="dispatch"):
        TrainConfig(model="tiny", dispatch="sometimes")


def test_sparse_pair_rows_change_residual_and_dispatch_grad_only():
    """With pair rows, sparse dispatch sends DISPATCH as without them; RESIDUAL also carries the
    top-k ids (RESIDUAL_GRAD does not), DISPATCH_GRAD is d x of the received rows with the load
    (not pair rows: `is_pair`), COMBINE and COMBINE_GRAD keep their shapes."""
    from disagmoe.comm.base import TensorSpec
    from disagmoe.runtime.stages.messages import MessageShapes

    cfg, model, topology = _run(dispatch="sparse", hop="pair_rows", expert_ranks=2, batch_size=4, seq_len=8)
    both = MessageShapes.of_run(cfg, model, topology)
    pairs = MessageShapes.of_run(cfg.model_copy(update={"dispatch": "dense"}), model, topology)
    sparse = MessageShapes.of_run(cfg.model_copy(update={"hop": "partial_sums"}), model, topology)
    assert both.sparse and both.pair_rows
    T, K, H, E = both.tokens, model.top_k, model.hidden_size, model.num_experts
    assert both.specs(Payload.DISPATCH, True) == sparse.specs(Payload.DISPATCH, True)
    assert both.specs(Payload.RESIDUAL, True) == [*pairs.specs(Payload.RESIDUAL, True), TensorSpec((T, K), torch.int32)]
    assert both.specs(Payload.DISPATCH_GRAD, True) == [TensorSpec((T, H), torch.float32), TensorSpec((E,), torch.int64)]
    for payload in (Payload.COMBINE, Payload.COMBINE_GRAD, Payload.RESIDUAL_GRAD):
        assert both.specs(payload, True) == pairs.specs(payload, True)
    for payload in (Payload.RESIDUAL, Payload.RESIDUAL_GRAD):  # a dense layer's, as with dense dispatch
        assert both.specs(payload, False) == pairs.specs(payload, False)
    assert both.is_pair(Payload.COMBINE, True) and not both.is_pair(Payload.DISPATCH_GRAD, True)
    assert pairs.is_pair(Payload.DISPATCH_GRAD, True)
    stored = {p for p in Payload if both.is_peer_stored(p, True)}
    assert stored == {Payload.DISPATCH, Payload.DISPATCH_GRAD, Payload.COMBINE_GRAD}
    four = {Payload.DISPATCH, Payload.COMBINE, Payload.COMBINE_GRAD, Payload.DISPATCH_GRAD}
    assert {p for p in Payload if sparse.is_peer_stored(p, True)} == four, "partial sums: COMBINE by peer stores too"
    assert not any(both.is_peer_stored(p, False) or pairs.is_peer_stored(p, True) for p in Payload)
    # the byte count covers the four but a pair-row message (sparse pair rows: COMBINE is one)
    assert {p for p in Payload if sparse.is_counted(p, True)} == four and not any(sparse.is_counted(p, False)
                                                                                  for p in Payload)
    assert {p for p in Payload if both.is_counted(p, True)} == four - {Payload.COMBINE}


def test_a_row_s_bytes_are_what_a_token_adds_to_its_message():
    from disagmoe.runtime.stages.messages import MessageShapes

    cfg, model, topology = _run(dispatch="sparse", expert_ranks=2, batch_size=4, seq_len=8)
    shapes = MessageShapes.of_run(cfg, model, topology)
    H, K, size = model.hidden_size, model.top_k, 4  # fp32 on CPU
    sparse = {Payload.DISPATCH: H * size + K * (4 + size) + 4, Payload.COMBINE: H * size + 4,
              Payload.COMBINE_GRAD: H * size, Payload.DISPATCH_GRAD: H * size + K * size}
    dense = {Payload.DISPATCH: H * size + K * (4 + size), Payload.COMBINE: H * size,
             Payload.COMBINE_GRAD: H * size, Payload.DISPATCH_GRAD: H * size + K * size}
    assert {p: shapes.row_bytes(p, True) for p in sparse} == sparse, "rows with their index where one rides"
    assert {p: shapes.row_bytes(p, False) for p in dense} == dense
    assert shapes.dispatch_row_bytes(True) == sparse[Payload.DISPATCH]


def test_sparse_dispatch_changes_dispatch_and_combine_only():
    from disagmoe.comm.base import TensorSpec
    from disagmoe.runtime.stages.messages import MessageShapes

    cfg, model, topology = _run(dispatch="sparse", expert_ranks=2, batch_size=4, seq_len=8)
    sparse = MessageShapes.of_run(cfg, model, topology)
    dense = MessageShapes.of_run(cfg.model_copy(update={"dispatch": "dense"}), model, topology)
    T, K, E = sparse.tokens, model.top_k, model.num_experts
    index, count = TensorSpec((T,), torch.int32), TensorSpec((1,), torch.int32)
    assert sparse.specs(Payload.DISPATCH, True) == [*dense.specs(Payload.DISPATCH, True), index, count,
                                                    TensorSpec((E,), torch.int64)]
    assert sparse.specs(Payload.COMBINE, True) == [*dense.specs(Payload.COMBINE, True), index, count]
    for payload in (Payload.DISPATCH_GRAD, Payload.COMBINE_GRAD, Payload.RESIDUAL, Payload.RESIDUAL_GRAD):
        assert sparse.specs(payload, True) == dense.specs(payload, True)
    assert sparse.dispatch_row_bytes(True) == dense.dispatch_row_bytes(False) + 4 == (
        model.hidden_size * 4 + K * 8 + 4)  # fp32 on CPU: the row, ids, weights, then the token index


def test_the_arenas_hold_the_sparse_messages_whole():
    """nvshmem's symmetric arena and nccl's buffers are sized from the specs, so a sparse DISPATCH
    slot holds its worst case (T rows) with the index, count and load beside them."""
    from disagmoe.comm.base import TensorSpec
    from disagmoe.runtime.stages.messages import MessageShapes, receive_layouts

    cfg, model, topology = _run(dispatch="sparse", expert_ranks=2, batch_size=4, seq_len=8, device="cuda",
                                transport="nvshmem")
    shapes = MessageShapes.of_run(cfg, model, topology)
    assert shapes.sparse
    T = shapes.tokens
    for transport in ("nvshmem", "nccl"):
        layouts = receive_layouts(cfg.model_copy(update={"transport": transport}), shapes, topology)
        rank = topology.expert_groups[0][0]
        dispatch = [seg for seg in layouts[rank].segments if seg.slot[1] is Payload.DISPATCH]  # (source, payload, ...)
        assert dispatch and all(seg.specs == tuple(shapes.specs(Payload.DISPATCH, True)) for seg in dispatch)
        assert dispatch[0].specs[3:5] == (TensorSpec((T,), torch.int32), TensorSpec((1,), torch.int32))
