"""Megatron-Core 0.19.2 on the CPU: the only shims the Megatron tests apply, all in this module.

Megatron's GDN layer and its checkpointing assume CUDA in four places, none of them numeric:

- the GDN layer allocates ``conv1d``, ``A_log`` and ``dt_bias`` (and the CP head permutation) on
  ``torch.cuda.current_device()``: ``cuda_calls_on_cpu()`` makes that ``torch.device("cpu")``;
- ``dist_checkpointing``'s file writer calls ``torch.cuda.synchronize()`` after copying tensors to the host:
  ``cuda_calls_on_cpu()`` makes it a no-op (there is nothing to wait for on the CPU);
- ``reset_parameters`` draws inside ``get_cuda_rng_tracker().fork()``, which saves and restores the
  CUDA generator: ``cpu_rng_tracker()`` installs Megatron's own inference tracker, whose ``fork()`` is a
  no-op context, so the draws come from the CPU generator (dropout is 0 in every test model);
- process groups are NCCL in Megatron's examples: ``model_parallel(...)`` builds gloo groups
  (``initialize_model_parallel`` takes the default group's backend).

The linear layers need no shim: ``use_cpu_initialization=True`` is a Megatron config option. Megatron's
code is not patched; the laqat frontend is not involved in any of this.
"""
from __future__ import annotations

import contextlib
import socket

import torch
import torch.distributed as dist


@contextlib.contextmanager
def cuda_calls_on_cpu():
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved


def cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int = 0, world_size: int = 1, port: int | None = None, timeout_s: float = 120.0) -> None:
    """The default process group: gloo over TCP on 127.0.0.1:``port``, or an in-process store for one rank."""
    import datetime

    timeout = datetime.timedelta(seconds=timeout_s)
    if world_size == 1 and port is None:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timeout)


@contextlib.contextmanager
def model_parallel(tp: int = 1, cp: int = 1):
    """Megatron's parallel state over the default (gloo) group; destroyed on exit."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    cpu_rng_tracker()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def megatron_on_cpu(tp: int = 1, cp: int = 1):
    """One process: gloo default group (in-process store), Megatron's parallel state, the shims above."""
    init_gloo()
    try:
        with cuda_calls_on_cpu(), model_parallel(tp, cp):
            yield
    finally:
        dist.destroy_process_group()
