import pytest

from disagmoe.comm import make_transport
from disagmoe.comm.nvshmem import available as nvshmem_available


@pytest.mark.parametrize("kind, fragment", [
    pytest.param("nvshmem", "needs nvshmem4py .*use transport: nccl",
                 marks=pytest.mark.skipif(nvshmem_available(), reason="nvshmem4py is installed here")),
    ("carrier-pigeon", "unknown transport"),
])
def test_unavailable_transports_are_user_errors(kind, fragment):
    with pytest.raises(ValueError, match=fragment):
        make_transport(kind, default_timeout_s=1.0)


@pytest.mark.parametrize("kind", ["local", "nccl"])
def test_transports_refuse_to_start_without_a_process_group(kind):
    with pytest.raises(ValueError, match="torch.distributed"):
        make_transport(kind, default_timeout_s=1.0)
