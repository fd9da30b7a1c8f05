"""A rank's mailbox and message keys (disagmoe/runtime/messages.py)."""

import pytest
import torch

from disagmoe.comm.base import Direction
from disagmoe.runtime.messages import Mailbox, message_key
from disagmoe.runtime.schedule import Payload


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
