"""Runs a function in several processes of one gloo process group on the CPU, and returns what each returned.

    results = run_ranks(worker, args, world_size=2, timeout=300)   # worker(rank, world_size, *args) -> picklable

The processes are spawned (``torch.multiprocessing``), set up as ``tests/conftest.py`` sets up the test process,
meet at a free localhost port, run ``worker`` with one intra-op thread, and hand their return values back through
files. A rank that raises fails the calling test with the rank's own traceback; a group that runs past
``timeout`` seconds is killed and fails the test.
"""
from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, worker, world_size, port, out_dir, timeout, args):
    import tests.conftest  # noqa: F401  (the test run's process set-up: the interpreter, one intra-op thread)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        result = worker(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(worker, args=(), *, world_size: int = 2, timeout: float = 300.0) -> list:
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_rank_main, args=(worker, world_size, free_port(), out_dir, timeout, args),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(1.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    pytest.fail(f"{worker.__name__} ran past {timeout:.0f} s in {world_size} processes")
        except mp.ProcessRaisedException as e:  # its message holds the rank's traceback
            pytest.fail(f"{worker.__name__} failed in a rank:\n{e}", pytrace=False)
        except mp.ProcessExitedException as e:
            pytest.fail(f"{worker.__name__}: a rank exited without a result: {e}", pytrace=False)
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        return [torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False) for rank in range(world_size)]
