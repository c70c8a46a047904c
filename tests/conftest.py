"""The suite is hermetic about the cluster ``mc.compile`` prices its default schedule on.

Without ``cluster=``, ``mc.compile`` reads this machine's calibration (``$MICSCOMPILE_CLUSTER``,
./local_cluster.json, ~/.cache/micscompile/local_cluster.json) and otherwise uses the built-in CPU
estimate. A calibration left by ``make bench`` would change the schedule the tests assert on (a
different prefetch distance splits the two blocks' Inductor regions differently), so every test,
and every rank and command it launches, prices on the built-in estimate, written to a file
``$MICSCOMPILE_CLUSTER`` names. Tests of the lookup itself unset it (test_cost_model)."""

import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
import torch.distributed as dist

from micscompile.cost_model import specs

_DIR = Path(tempfile.mkdtemp(prefix="micscompile-tests-"))


def pytest_configure(config: pytest.Config) -> None:
    path = _DIR / "builtin_estimate.json"
    specs._cpu_estimate(1, 1).save(path)  # noqa: SLF001 - default_cluster reshapes it to the run
    os.environ["MICSCOMPILE_CLUSTER"] = str(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_DIR, ignore_errors=True)


@pytest.fixture
def one_rank(monkeypatch):
    """A one-rank world under torchrun's environment (a free port), destroyed after the test; the test starts it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
