"""Process groups freed, their C++ threads joined, before the interpreter's teardown.

torch's destroy_process_group() forgets a group without stopping it: a gloo group's shutdown() is
c10d::Backend's no-op, and only its destructor joins its worker threads ("pt_gloo_runloop") and
its transport loop ("gloo_tcp_loop"). The destructor runs when the last Python reference goes,
and after destroy_process_group() references remain that only the interpreter's teardown drops:

- default arguments evaluated at import, in a module imported after the group was made:
  torch.distributed.nn.functional's collectives (`group=group.WORLD`; DCP's sharded tensors import
  it) and DeepSpeed's TorchBackend.barrier and monitored_barrier (`group=GroupMember.WORLD`);
- DeepSpeed's module globals: its copy of the world group (deepspeed.utils.groups._WORLD_GROUP),
  which only deepspeed.comm's destroy_process_group() lets go of, and ZeRO-3's FWD_MODULE_STACK
  and its parameter coordinator's class-wide lru_cache, which keep the last ZeRO-3 model and, by
  its hooks, the DeepSpeed engine and every group it holds;
- device meshes (FSDP2's parameters are DTensors on one), which hold their groups
  (`_pg_registry`) and which DTensor's caches of sharding decisions keep alive.

A thread that wants the GIL while the interpreter finalizes is ended by CPython (3.11) with
pthread_exit, and a C++ thread unwound that way through a noexcept frame calls std::terminate
("terminate called without an active exception"): the likely end of the rank of
test_resharding.py that aborted at exit, after destroying its group, once in 17 CI runs (never
reproduced). release_process_groups() drops those references once no group is in use;
tests/integration/test_clean_exit.py and test_resharding.py check that no gloo thread is left at
the teardown (a new holder, in another torch or DeepSpeed, fails them).
"""

from __future__ import annotations

import atexit
import gc
import logging
import sys
import types

import torch.distributed as dist

log = logging.getLogger("vldist.train")

# modules whose functions may hold a group as a default argument (see above)
_GROUP_DEFAULTS = ("torch.distributed.nn.functional", "deepspeed.comm.torch")


def release_process_groups() -> None:
    """When every process group is destroyed: drop what still holds them (above) and collect, so
    that their threads are joined now. A group still in use is left alone. Never raises: what it
    cannot free ends with the process, as before."""
    if not dist.is_available() or dist.is_initialized() or not _groups_made:
        return
    try:
        for name in _GROUP_DEFAULTS:
            _drop_group_defaults(sys.modules.get(name))
        _release_deepspeed_groups()
        if _meshes:
            _release_mesh_groups()
        gc.collect()  # DeepSpeed's engine, optimizer and hooks hold the groups in reference cycles
    except Exception as err:  # noqa: BLE001 - freeing early is a precaution; it must not fail a finished run
        log.warning("could not free the destroyed process groups (%s); their threads end with the process", err)


def leave_process_group(keep_process_group: bool, peers_lost: bool) -> None:
    """An engine's close() once its model is gone: a closing barrier (unless a peer is lost), the
    group destroyed (unless the next stage of the job joins it) and its threads joined."""
    if dist.is_available() and dist.is_initialized():
        if not peers_lost:
            dist.barrier()
        if not keep_process_group:
            dist.destroy_process_group()
    release_process_groups()  # once they are all destroyed: threads joined now


def _drop_group_defaults(module) -> None:
    """A ProcessGroup default of the module's functions (and its classes' methods) becomes None,
    which torch.distributed and DeepSpeed take for the default group."""
    if module is None:
        return
    found = list(vars(module).values())
    found += [m for cls in found if isinstance(cls, type) for m in vars(cls).values()]
    for fn in found:
        if isinstance(fn, (staticmethod, classmethod)):
            fn = fn.__func__
        while type(fn) is types.FunctionType:  # and what it wraps (functools.wraps' __wrapped__)
            if fn.__module__ == module.__name__ and fn.__defaults__:
                fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in fn.__defaults__)
            fn = getattr(fn, "__wrapped__", None)


def _release_deepspeed_groups() -> None:
    """DeepSpeed's own references (0.19.8; each looked up, so that another version skips what it lacks)."""
    groups = sys.modules.get("deepspeed.utils.groups")
    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:  # what deepspeed.comm.destroy_process_group() calls after destroying
        release()
    elif hasattr(groups, "_WORLD_GROUP"):
        groups._WORLD_GROUP = None
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    stack = getattr(offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):  # no forward runs without a process group
        stack.clear()
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    cached = getattr(
        getattr(coordinator, "PartitionedParameterCoordinator", None),
        "_PartitionedParameterCoordinator__params_to_release",
        None,
    )
    code = getattr(cached, "__code__", None)
    if code is not None and "func" in code.co_freevars:  # under instrument_w_nvtx, which keeps it as `func`
        cached = cached.__closure__[code.co_freevars.index("func")].cell_contents
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()


def _release_mesh_groups() -> None:
    """The destroyed groups that device meshes still hold (DTensor's many caches of sharding
    decisions keep the meshes of FSDP2's parameters; torch 2.14), dropped from every mesh alive."""
    device_mesh = sys.modules.get("torch.distributed.device_mesh")
    mesh_class = getattr(device_mesh, "DeviceMesh", None)
    if not isinstance(mesh_class, type):
        return
    objects = gc.get_objects()
    # by type: isinstance() would call DeviceMesh's metaclass (torch's custom-class base), which
    # checks in Python, once for each of some 300,000 objects
    mesh_types = {kind for kind in {type(obj) for obj in objects} if issubclass(kind, mesh_class)}
    for obj in objects:
        if type(obj) in mesh_types and isinstance(getattr(obj, "_pg_registry", None), dict):
            obj._pg_registry.clear()


_at_exit = False
# What release_process_groups() may have to free, noted by each engine when made: whether this
# process has had a process group (a one-process run of Accelerate has none), and whether it made
# device meshes (FSDP2's; DeepSpeed's and Accelerate's where their parallelism settings make
# them). Without them it skips its collection and its scan of every object for meshes, 0.18 s and
# 0.15 s of CPU a call on this project's 2-core host once torch._dynamo is loaded (some 300,000
# objects), at each close and again at exit.
_groups_made = False
_meshes = False


def release_process_groups_at_exit(meshes: bool = False) -> None:
    """Every engine calls it when made, its process group made (`meshes`: it made device meshes).
    Once per process: release_process_groups() at exit, before the teardown, for groups that a
    script destroys itself (torch's destroy_process_group() after close(keep_process_group=True))
    or that close() could not free (the caller still held the model, whose hooks hold the engine)."""
    global _at_exit, _groups_made, _meshes
    _groups_made = _groups_made or (dist.is_available() and dist.is_initialized())
    _meshes = _meshes or meshes
    if not _at_exit:
        atexit.register(release_process_groups)
        _at_exit = True
