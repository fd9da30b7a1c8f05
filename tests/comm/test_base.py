import pickle

import pytest

from disagmoe.comm.base import PeerFailure, TransportError, TransportTimeout
from disagmoe.wire import Direction, MessageKey

KEY = MessageKey(step=3, micro_batch=1, layer=7, direction=Direction.BACKWARD)


@pytest.mark.parametrize("err", [TransportTimeout(4, KEY, 2.5, "receive from"), PeerFailure(4, KEY, "reset")])
def test_transport_errors_name_peer_and_key_and_survive_pickling(err):
    assert isinstance(err, TransportError)
    assert "rank 4" in str(err) and "layer=7" in str(err)
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is type(err)
    assert (str(copy), copy.peer, copy.key) == (str(err), 4, KEY)


def test_timeout_message_says_what_to_do():
    err = TransportTimeout(2, KEY, 1.0, "receive from")
    assert str(err).startswith("timed out after 1 s waiting to receive from rank 2 for key (step=3")
    assert "recv_timeout_s" in str(err) and err.timeout_s == 1.0


def test_traffic_counts_live_bytes_beside_the_dense_figure_and_resets():
    import torch

    from disagmoe.comm.base import Traffic

    traffic = Traffic()
    traffic.add("dispatch", torch.tensor([3]) * 10, 8 * 10)  # a device count of 3 rows of 10 bytes, of 8
    traffic.add("dispatch", 80, 80)  # a dense message
    traffic.add("combine", torch.tensor([0]), 40)
    assert traffic.names == ["dispatch", "dispatch_dense", "combine", "combine_dense"]
    assert traffic.words().tolist() == [110, 160, 0, 40]
    traffic.reset()
    assert traffic.words().tolist() == [0, 0, 0, 0] and Traffic().words().numel() == 0
