"""An embedded cluster leaves no Ray session folder behind once it shuts down (they piled up in
/tmp/ray, one per run). Runs in its own process: the other cluster tests share one Ray."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # starts a Ray cluster in a process of its own: the quick subset skips it

SCRIPT = """
from pathlib import Path
from disagmoe.runtime.cluster.cluster import WorkerGroup, _session_dir
group = WorkerGroup.start(world_size=1, device="cpu", log_to_driver=False, cpus_per_worker=0.25)
session = _session_dir()
assert session is not None and session.is_dir(), session
group.shutdown()
print("left", session.exists())
"""


def test_an_embedded_clusters_session_folder_goes_with_it():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "left False"
