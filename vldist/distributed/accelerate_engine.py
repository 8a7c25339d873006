"""The Accelerate backend: DDP over gloo (CPU) or NCCL (CUDA), autocast for bf16/fp16 on CUDA and for bf16 on CPU."""

from __future__ import annotations

import gc
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from vldist.checkpoint import sharded_state
from vldist.distributed.cuda_settings import configure_fp32_math
from vldist.distributed.dcp_checkpoints import DcpCheckpoints
from vldist.distributed.engine import OPTIMIZER_FILE, Engine, copied_to_cpu, grad_norm, pick_device
from vldist.distributed.precision import effective_precision
from vldist.distributed.teardown import release_process_groups, release_process_groups_at_exit
from vldist.launch.environment import adopt_slurm_environment
from vldist.launch.network import choose_gloo_interface


class AccelerateEngine(DcpCheckpoints, Engine):
    def __init__(self, job):
        """job: the JobConfig (train.device, engine.mixed_precision)."""
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs

        adopt_slurm_environment()  # srun tasks -> RANK/WORLD_SIZE/...; torchrun sets them itself
        choose_gloo_interface()  # multi-host without GLOO_SOCKET_IFNAME: the interface towards MASTER_ADDR
        device = pick_device(job.train.device)
        on_cpu = device.type == "cpu"
        precision = effective_precision(job.engine.mixed_precision, device)
        # bf16 autocast on CPU too (AMX's or AVX512-BF16's bf16 GEMMs); Accelerate autocasts fp16 on accelerators only
        precision = "no" if on_cpu and precision == "fp16" else precision
        _forget_other_precision(precision)
        self.precision = precision
        self.accelerator = Accelerator(
            cpu=on_cpu,
            mixed_precision=precision,
            kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=job.engine.timeout_s))],
        )
        state = self.accelerator.state
        self.rank, self.world_size = state.process_index, state.num_processes
        self.local_rank, self.is_main = state.local_process_index, state.is_main_process
        self.device = self.accelerator.device
        configure_fp32_math(self.device, job.engine.tf32)
        self.optimizers = {}
        self._prepared: dict[str, torch.optim.Optimizer] = {}
        self._params: dict[str, list[nn.Parameter]] = {}  # each optimizer's parameters, for clipping
        # a device mesh where Accelerate's parallelism config (ACCELERATE_USE_PARALLELISM_CONFIG) made one
        release_process_groups_at_exit(meshes=getattr(state, "device_mesh", None) is not None)

    def setup(
        self, model: nn.Module, optimizers: dict[str, torch.optim.Optimizer], dynamic_graph: bool = False
    ) -> nn.Module:
        from accelerate.utils import DistributedDataParallelKwargs

        # broadcast_buffers=False: no buffer broadcast from rank 0 before every forward. Rank 0
        # evaluates and checkpoints, so other ranks' buffers (BatchNorm running statistics, global
        # over ranks anyway with engine.sync_batchnorm) are never read; and a forward without a
        # hidden collective lets the watchdog time each rank's own forward (distributed/heartbeat.py).
        self.accelerator.ddp_handler = DistributedDataParallelKwargs(
            find_unused_parameters=dynamic_graph, broadcast_buffers=False
        )
        names = list(optimizers)
        self.model, *prepared = self.accelerator.prepare(model.to(self.device), *optimizers.values())
        self.optimizers, self._prepared = dict(optimizers), dict(zip(names, prepared, strict=True))
        self._params = {n: [p for g in o.param_groups for p in g["params"]] for n, o in self._prepared.items()}
        return self.model

    def autocast(self):
        return self.accelerator.autocast()

    def micro_batch(self, last: bool):
        return self.accelerator.no_sync(self.model) if not last else super().micro_batch(last)

    def backward(self, loss_share: torch.Tensor, micro_batches: int = 1) -> None:
        self.accelerator.backward(loss_share * (self.world_size / micro_batches))

    def step(self, name: str = "main", max_norm: float | None = None) -> float:
        optimizer, params = self._prepared[name], self._params[name]
        if max_norm is None:
            self.accelerator.unscale_gradients(optimizer)
            norm = grad_norm(params)
        else:
            norm = float(self.accelerator.clip_grad_norm_(params, max_norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    def unwrap(self) -> nn.Module:
        # Not accelerator.unwrap_model: its first call imports DeepSpeed when installed (2 s, in the
        # middle of the first checkpoint; measured), and vldist wraps in DDP only.
        return self.model.module if isinstance(self.model, nn.parallel.DistributedDataParallel) else self.model

    def save_training_state(self, directory: Path) -> None:
        self.write_training_state(directory, self.training_state_snapshot())

    def training_state_snapshot(self) -> dict | None:
        """Rank 0: the optimizers' (and the loss scaler's) state, copied, so that a background
        write can go on while the next steps change the live state in place. None elsewhere."""
        if not self.is_main:
            return None
        state = {"optimizers": {n: copied_to_cpu(o.state_dict()) for n, o in self.optimizers.items()}}
        if self.accelerator.scaler is not None:
            state["scaler"] = copied_to_cpu(self.accelerator.scaler.state_dict())
        return state

    def write_training_state(self, directory: Path, snapshot: dict | None) -> None:
        if snapshot is not None:
            torch.save(snapshot, Path(directory) / OPTIMIZER_FILE)

    def _scaler_state(self) -> dict:
        """fp16 on CUDA: the loss scaler's state, which a checkpoint keeps beside the optimizer's."""
        return {"scaler": self.accelerator.scaler.state_dict()} if self.accelerator.scaler is not None else {}

    def load_training_state(self, directory: Path, saved: dict) -> None:
        # DDP's optimizer state is whole on every rank and saved whole: it loads on any number of ranks.
        from vldist.checkpoint.format import load_torch_file

        if (Path(directory) / sharded_state.SHARDED_DIR).is_dir():  # the model's weights come with it
            extra = self.load_sharded(directory)
            if "scaler" in extra:
                self.accelerator.scaler.load_state_dict(extra["scaler"])
            return
        state = load_torch_file(Path(directory) / OPTIMIZER_FILE)
        for name, optimizer in self.optimizers.items():
            optimizer.load_state_dict(state["optimizers"][name])
        if self.accelerator.scaler is not None and "scaler" in state:
            self.accelerator.scaler.load_state_dict(state["scaler"])

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    def close(self, keep_process_group: bool = False, peers_lost: bool = False) -> None:
        # DDP reducers must go before their process group: one freed after destroy_process_group
        # (at interpreter exit, or a second model prepared by the same engine) can abort the
        # process with "terminate called without an active exception". (No group, nothing to order.)
        self.model = None
        self.accelerator.free_memory()
        grouped = dist.is_available() and dist.is_initialized()
        if grouped:
            gc.collect()
        together = grouped and not peers_lost
        if keep_process_group:  # end_training() would destroy it
            if together:
                dist.barrier()
            _forget_precision(keep_process_group=True)
            return
        self.accelerator.end_training()
        if dist.is_available() and dist.is_initialized():
            if together:
                dist.barrier()
            dist.destroy_process_group()
        release_process_groups()  # threads joined now (teardown.py)
        _forget_precision(keep_process_group=False)


def _forget_other_precision(wanted: str) -> None:
    """An earlier run in this process whose engine was not closed (it failed, or a test left it)
    left Accelerate's state with its precision, and Accelerate would refuse this run's: that
    state goes, Accelerate's process state (the group, ranks, device) stays."""
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state.get("_mixed_precision", wanted) != wanted:
        AcceleratorState._reset_state()


def _forget_precision(keep_process_group: bool) -> None:
    """Accelerate keeps one state a process and refuses another precision in it: after a run the
    next one in this process (a job's next stage, a test, a notebook's second job) sets its own.
    Accelerate's process state (the group, ranks, device) goes too where the group was destroyed."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=not keep_process_group)
