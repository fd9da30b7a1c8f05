import pytest

from disagmoe.comm import make_transport


@pytest.mark.parametrize(
    "kind, fragment", [("nvshmem", "not available"), ("carrier-pigeon", "unknown transport")]
)
def test_unavailable_transports_are_user_errors(kind, fragment):
    with pytest.raises(ValueError, match=fragment):
        make_transport(kind, default_timeout_s=1.0)


@pytest.mark.parametrize("kind", ["local", "nccl"])
def test_transports_refuse_to_start_without_a_process_group(kind):
    with pytest.raises(ValueError, match="torch.distributed"):
        make_transport(kind, default_timeout_s=1.0)
