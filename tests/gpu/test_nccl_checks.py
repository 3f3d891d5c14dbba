"""What is checked before a NCCL communicator is made (pure rows), the environment that keeps
torch's NCCL watchdog from ending a worker, and, where CUDA is present, a real one made,
used and aborted (marked ``cuda``: skipped with the reason elsewhere)."""

from __future__ import annotations

import datetime
import re
import threading

import pytest
import torch

from elastic.runtime.worker_config import WorkerConfig
from elastic.torchdist import device_backend, device_store
from elastic.torchdist.device_backend import (MIN_NCCL, NCCL_ENVIRONMENT, nccl_environment, nccl_problem,
                                              resolve_kind)


@pytest.mark.parametrize("version, torch_version, has_abort, nonblocking, expect", [
    ((2, 27, 5), "2.13.0", True, True, None),
    ((2, 26, 2), "2.7.0", True, True, None),
    ((2, 26, 1), "2.7.0", True, True, "NCCL >= 2.26.2 .* found torch 2.7.0, NCCL 2.26.1"),
    ((2, 21, 5), "2.5.1", True, True, "found torch 2.5.1, NCCL 2.21.5"),
    (None, "2.13.0+cpu", False, False, "this torch has no NCCL .*NCCL not found"),
    ((2, 27, 5), "2.13.0", False, True, r"no abort\(\)"),
    ((2, 27, 5), "2.13.0", True, False, "no non-blocking option"),
])
def test_the_versions_where_abort_works_are_checked_and_named(version, torch_version, has_abort, nonblocking,
                                                              expect):
    got = nccl_problem(version, torch_version, has_abort, nonblocking)
    if expect is None:
        assert got is None
    else:
        assert got is not None
        assert re.search(expect, got), got


def test_the_watchdog_may_never_end_or_block_the_worker():
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "5"}
    out = nccl_environment(env, collective_timeout=30)
    assert out["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"      # 3 (the default) tears the process down
    assert out["TORCH_NCCL_ENABLE_MONITORING"] == "0"         # the heartbeat monitor kills a stuck watchdog
    assert out["TORCH_NCCL_BLOCKING_WAIT"] == "0"
    assert "TORCH_NCCL_NONBLOCKING_TIMEOUT" not in out        # the user's own is kept
    assert nccl_environment({}, 30)["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "30"
    assert set(NCCL_ENVIRONMENT) <= set(out)
    assert MIN_NCCL == (2, 26, 2)


def test_auto_is_nccl_only_where_cuda_is_and_a_bad_kind_is_named():
    assert resolve_kind("auto", lambda: True) == "nccl"
    assert resolve_kind("auto", lambda: False) == "off"
    assert resolve_kind("gloo", lambda: True) == "gloo"
    with pytest.raises(ValueError, match="ELASTIC_DEVICE_BACKEND='mpi'"):
        resolve_kind("mpi", lambda: True)


def test_the_worker_settings_are_read_and_checked():
    base = {"ELASTIC_JOB_ID": "j", "ELASTIC_RENDEZVOUS": "127.0.0.1:1", "ELASTIC_WORKER_ID": "w"}
    cfg = WorkerConfig.from_env({**base, "ELASTIC_DEVICE_BACKEND": " GLOO ", "ELASTIC_DEVICE_ABORT_TIMEOUT": "2.5"})
    assert (cfg.device_backend, cfg.device_abort_timeout) == ("gloo", 2.5)
    assert WorkerConfig.from_env(base).device_abort_timeout == 10.0
    with pytest.raises(ValueError, match="ELASTIC_DEVICE_BACKEND='nvlink'"):
        WorkerConfig.from_env({**base, "ELASTIC_DEVICE_BACKEND": "nvlink"})
    with pytest.raises(ValueError, match="ELASTIC_DEVICE_ABORT_TIMEOUT=0 must be positive"):
        WorkerConfig.from_env({**base, "ELASTIC_DEVICE_ABORT_TIMEOUT": "0"})


def test_on_a_torch_without_nccl_the_first_nccl_communicator_names_the_versions():
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        pytest.skip("this torch has NCCL: the refusal is for builds without it")
    with pytest.raises(RuntimeError, match=r"need an abortable NCCL communicator: this torch has no NCCL \(torch "):
        device_backend.check_nccl()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and a CUDA build of torch")


@pytest.mark.cuda
@pytest.mark.slow
@needs_cuda
def test_a_real_nccl_communicator_of_one_rank_reduces_and_aborts_within_the_bound():
    host = device_store.HostedStore("127.0.0.1", datetime.timedelta(seconds=30))
    try:
        meeting = device_store.Meeting("127.0.0.1", host.port, device_store.new_nonce())
        store = device_store.SignedStore(host.store, device_store.world_key(b"k" * 32, "j", 1, meeting.nonce),
                                         meeting.prefix("j", 1))
        env: dict = {}
        backend = device_backend.make_nccl(store, 1, 0, 1, timeout=30, env=env)
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
        backend.connect()
        t = torch.ones(1024, device="cuda")
        opts = torch.distributed.AllreduceOptions()
        backend.finish(backend.run("allreduce", [t], opts))
        assert torch.equal(t.cpu(), torch.ones(1024))
        done = threading.Event()
        threading.Thread(target=lambda: (backend.abort(), done.set()), daemon=True).start()
        assert done.wait(10), "ProcessGroupNCCL.abort() did not return within 10 s"
        backend.close()
    finally:
        host.close()


def test_device_mesh_takes_cpu_or_cuda_and_names_the_choice():
    from elastic.torchdist.mesh import device_mesh
    with pytest.raises(ValueError, match=r"device_type 'xpu'; use 'cpu' \(the ring\) or 'cuda'"):
        device_mesh("xpu")
