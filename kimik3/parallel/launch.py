"""Starting a tensor/expert-parallel group (spec parallelism §7): environment, process groups,
process roles, failure handling.

One node: rank 0 (the process that serves) spawns ranks 1..N-1 (``torch.multiprocessing``,
spawn) and rendezvous over a free loopback port. Several nodes: every process is started by
``torchrun`` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); rank 0 runs the engine and the
server, the others only ``worker_loop``. Groups: the world group for the model's collectives
(NCCL on GPU, gloo on CPU; finite timeout) and a gloo control group for the step broadcasts.

Failures are fatal for the group (spec §7.3): a worker that exits, or a rank-0 step that raises,
logs why and takes the whole group down (exit code 1) instead of leaving ranks in a collective.
Rank 0 watches its spawned workers from the moment they are spawned: one that dies before or
during the rendezvous makes ``start_group`` raise within a second, naming its rank and exit code
(rank 0 joins in a helper thread while it watches); a spawned worker watches its parent; under
torchrun the agent stops the other ranks. One group per process: ``ParallelGroup.close`` destroys it,
so the next ``start_group`` can make another.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kimik3.config import load_config
from kimik3.distributed import ParallelContext, PipelineContext, make_dcp_group, plan_stages
from kimik3.loader.load import load_model
from kimik3.model.kimi_k3 import check_parallel_degrees, layer_weight_bytes
from kimik3.ops.options import KernelOptions, install_kernel_options
from kimik3.parallel.worker import stop_workers, worker_loop

logger = logging.getLogger(__name__)

# NVLink multicast can take a shared host's GPUs out of service (device KINDS.md): off unless set.
NVLS_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# A collective that waits longer than this is a dead or diverged peer.
DATA_TIMEOUT = timedelta(minutes=10)
# Workers wait on the control group while the server idles; dead peers are caught by the
# monitors (and gloo's closed connections), not by this timeout.
CONTROL_TIMEOUT = timedelta(days=7)
MONITOR_INTERVAL_S = 0.5
SHUTDOWN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ParallelConfig:
    """The layout flags (vLLM's names): TP degree t = world size; with expert parallelism the
    experts are split t ways (EP = TP group)."""

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    moe_mode: str = "tep"          # with EP: "tep", "a2a" (all-to-all) or "agrs"
    moe_tail: str = "auto"         # "auto", "concat" (a) or "sliced" (b)
    decode_context_parallel_size: int = 1   # c | t: the MLA latent cache striped over c TP ranks
    enable_eplb: bool = False               # expert slots placed by load (needs expert parallelism)
    num_redundant_experts: int = 0          # EPLB's extra slots per MoE layer
    pipeline_parallel_size: int = 1         # p stages of t ranks each: world = p * t
    pp_layer_partition: tuple[int, ...] | None = None   # decoder layers per stage (None: planned by bytes)

    def __post_init__(self) -> None:
        t, p = self.tensor_parallel_size, self.pipeline_parallel_size
        for name, v in (("tensor_parallel_size", t), ("pipeline_parallel_size", p)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.pp_layer_partition is not None and len(self.pp_layer_partition) != p:
            raise ValueError(f"pp_layer_partition {list(self.pp_layer_partition)} needs one layer count per "
                             f"pipeline stage ({p})")
        self.context(0)              # the MoE mode and tail are checked where they are used

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def stage_ranges(self, text) -> tuple[tuple[int, int], ...]:
        """Each stage's decoder layers [start, end): ``pp_layer_partition``, else planned by weight bytes and
        the attention-residual blocks (``distributed.plan_stages``)."""
        L, p = text.num_hidden_layers, self.pipeline_parallel_size
        if self.pp_layer_partition is None:
            return plan_stages(layer_weight_bytes(text), p, text.attn_res_block_size)
        counts = list(self.pp_layer_partition)
        if sum(counts) != L or min(counts) < 1:
            raise ValueError(f"pp_layer_partition {counts} must give every stage at least one layer and sum to the "
                             f"model's {L} decoder layers")
        bounds = [0, *itertools.accumulate(counts)]
        return tuple((bounds[i], bounds[i + 1]) for i in range(p))

    def check_model(self, config, block_size: int) -> None:
        """What the layout needs of the model and the cache, checked before any worker starts (each refusal names
        the fix): the TP / EP cut (``check_parallel_degrees``), the pipeline stages, EPLB's expert slots over the EP
        ranks, DCP's stripes of a cache block."""
        text = config.text
        check_parallel_degrees(config, self.context(0))
        if self.pipeline_parallel_size > 1:
            self.stage_ranges(text)
        E, R = text.num_experts, self.num_redundant_experts
        e = self.tensor_parallel_size if self.enable_expert_parallel else 1
        if self.enable_eplb and (E + R) % e:
            fit = R + (-(E + R)) % e
            raise ValueError(f"num_redundant_experts {R}: the {E} routed experts and {R} redundant slots ({E + R}) must "
                             f"divide over the {e} expert-parallel ranks; use num_redundant_experts {fit}")
        c = self.decode_context_parallel_size
        if block_size % c:
            raise ValueError(f"block_size {block_size} must be a multiple of decode_context_parallel_size {c} (each rank "
                             f"holds block_size / {c} positions of every block)")

    def context(self, rank: int, group=None, dcp_group=None) -> ParallelContext:
        t = self.tensor_parallel_size
        return ParallelContext(rank, t, group, t if self.enable_expert_parallel else 1, self.moe_mode, self.moe_tail,
                               dcp_size=self.decode_context_parallel_size, dcp_group=dcp_group,
                               eplb=self.enable_eplb, num_redundant_experts=self.num_redundant_experts)

    def join(self, rank: int, model_path: str) -> dict:
        """This world rank's ``parallel`` and ``pipeline`` contexts (``load_model``'s arguments) once the process
        group is up: makes the sub-groups every rank makes (``new_group`` is collective): with pipeline stages
        one TP group per stage (ranks s*t .. s*t + t - 1), the DCP groups when c < t."""
        t, p = self.tensor_parallel_size, self.pipeline_parallel_size
        stage, group, dcp_group = rank // t, None, None
        for s in range(p):
            ranks = list(range(s * t, (s + 1) * t))
            g = dist.new_group(ranks) if p > 1 else None
            d = make_dcp_group(ranks, self.decode_context_parallel_size, rank)
            if s == stage:
                group, dcp_group = g, d
        pipeline = PipelineContext()
        if p > 1:
            pipeline = PipelineContext(stage, self.stage_ranges(load_config(model_path).text), rank % t, t)
        return {"parallel": self.context(rank % t, group, dcp_group), "pipeline": pipeline}


def set_safe_nvls_env() -> list[str]:
    """Set the NVLink-multicast switches to off where unset; returns the names it set."""
    unset = [k for k in NVLS_SAFE_ENV if k not in os.environ]
    for k in unset:
        os.environ[k] = NVLS_SAFE_ENV[k]
    if unset:
        logger.info("NVLink multicast off: set %s", ", ".join(f"{k}={NVLS_SAFE_ENV[k]}" for k in unset))
    return unset


def init_rank(rank: int, world: int, init_method: str, device_type: str) -> tuple[torch.device, object]:
    """Join the group: the world process group and the gloo control group. Returns (device, control)."""
    set_safe_nvls_env()
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"rank {rank} wants cuda:{local} but this node has {torch.cuda.device_count()} GPU(s); "
                               f"lower --tensor-parallel-size or start more nodes with torchrun")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world, timeout=DATA_TIMEOUT,
                                device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=DATA_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return device, control


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to load its shard and join the group."""

    model_path: str
    dtype: torch.dtype
    device_type: str
    parallel: ParallelConfig
    init_method: str
    load_kwargs: dict = field(default_factory=dict)
    kernel_options: KernelOptions = field(default_factory=KernelOptions)     # rank 0's, installed on every rank


def run_worker(rank: int, spec: WorkerSpec) -> None:
    """A rank > 0: join, load the shard, run steps until rank 0 stops; exit 1 on any error."""
    try:
        install_kernel_options(spec.kernel_options)
        device, control = init_rank(rank, spec.parallel.world_size, spec.init_method, spec.device_type)
        model = load_model(spec.model_path, device=device, dtype=spec.dtype,
                           **spec.parallel.join(rank, spec.model_path), **spec.load_kwargs)
        steps = worker_loop(model, control)
        logger.info("worker rank %d: stopped after %d steps", rank, steps)
        dist.destroy_process_group()
    except BaseException:
        logger.exception("tensor-parallel worker rank %d failed", rank)
        logging.shutdown()
        os._exit(1)


def _spawned_worker(index: int, spec: WorkerSpec, parent_pid: int, log_level: int) -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [rank {index + 1}] %(name)s: %(message)s")
    torch.set_num_threads(max(1, torch.get_num_threads() // spec.parallel.world_size))

    def watch_parent():
        while True:
            if os.getppid() != parent_pid:
                logger.error("rank 0 (pid %d) is gone; worker rank %d exits", parent_pid, index + 1)
                os._exit(1)
            time.sleep(MONITOR_INTERVAL_S)

    threading.Thread(target=watch_parent, daemon=True).start()
    run_worker(index + 1, spec)


class ParallelGroup:
    """Rank 0's handle on the group: the control group (rank 0's runner broadcasts each step on
    it: ``kimik3.engine.run.parallel_runner``), the workers it spawned (watched by a thread), and a
    clean shutdown."""

    def __init__(self, control, processes: list, device: torch.device):
        self.control, self.processes, self.device = control, processes, device
        self._stopping = False
        if processes:
            threading.Thread(target=self._monitor, daemon=True, name="kimik3-tp-monitor").start()
        atexit.register(self.close)

    def _monitor(self) -> None:
        while not self._stopping:
            for rank, p in enumerate(self.processes, start=1):
                if p.exitcode is not None and not self._stopping:
                    self.fail(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}")
            time.sleep(MONITOR_INTERVAL_S)

    def fail(self, why: str) -> None:
        """Take the group down: log, stop the workers, exit 1 (no rank may continue alone)."""
        self._stopping = True
        for p in self.processes:
            p.join(0.2)                     # a peer's closed connection may arrive before its exit code
        dead = [f"tensor-parallel worker rank {r} (pid {p.pid}) exited with code {p.exitcode}"
                for r, p in enumerate(self.processes, start=1) if p.exitcode is not None]
        if dead and not why.startswith("tensor-parallel worker"):
            why = f"{why} ({'; '.join(dead)})"
        logger.error("%s; stopping all ranks", why)
        print(f"kimik3: {why}; stopping all ranks", file=sys.stderr, flush=True)
        for p in self.processes:
            if p.exitcode is None:
                p.kill()
        logging.shutdown()
        os._exit(1)

    def close(self) -> None:
        """Stop the workers' loops and leave the group (idempotent; also at exit)."""
        if self._stopping:
            return
        self._stopping = True
        try:
            stop_workers(self.control)
            for p in self.processes:
                p.join(SHUTDOWN_TIMEOUT_S)
                if p.exitcode is None:
                    logger.warning("worker pid %d did not stop in %.0f s; killing it", p.pid, SHUTDOWN_TIMEOUT_S)
                    p.kill()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            atexit.unregister(self.close)


def _join_watching(processes: list, device_type: str, init_method: str, world: int):
    """``init_rank(0, ...)`` while watching the spawned workers: RuntimeError naming the first one that
    exits before the group is formed (the rendezvous would otherwise wait for it until its timeout)."""
    box: dict = {}

    def join():
        try:
            box["result"] = init_rank(0, world, init_method, device_type)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e
    t = threading.Thread(target=join, daemon=True, name="kimik3-tp-rendezvous")
    t.start()
    while t.is_alive():
        t.join(MONITOR_INTERVAL_S / 5)
        dead = [(r, p) for r, p in enumerate(processes, start=1) if p.exitcode is not None]
        if dead and t.is_alive():
            rank, p = dead[0]
            raise RuntimeError(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode} "
                               f"before the group was formed; its log above says why (a script run from standard "
                               f"input or without an `if __name__ == '__main__':` guard cannot be re-imported by "
                               f"spawned workers)")
    if "error" in box:
        raise box["error"]
    device, control = box["result"]
    if device.type == "cuda":
        torch.cuda.set_device(device)      # the current device is per thread
    return device, control


def start_group(model_path: str, parallel: ParallelConfig, dtype: torch.dtype, device_type: str,
                kernel_options: KernelOptions | None = None, **load_kwargs):
    """Become rank 0 of a new group (spawning the workers, or as torchrun's rank 0) and load
    rank 0's shard: returns (model, ParallelGroup). Under torchrun a rank > 0 runs its worker
    loop here and exits the process when rank 0 stops."""
    world = parallel.world_size
    if dist.is_initialized():
        raise RuntimeError("this process already runs a tensor-parallel group (an earlier LLM or engine that was "
                           "not shut down); call its shutdown() first, or use `with LLM(...) as llm:`")
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    processes = []
    if torchrun:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if size != world:
            raise ValueError(f"torchrun started {size} processes but --tensor-parallel-size x "
                             f"--pipeline-parallel-size is {world}; they must be equal (data parallel is not "
                             f"supported yet)")
        spec = WorkerSpec(str(model_path), dtype, device_type, parallel, "env://", load_kwargs,
                          kernel_options or KernelOptions())
        if rank != 0:
            run_worker(rank, spec)
            sys.exit(0)
        logger.info("rank 0 of %d on %s (torchrun)", world, socket.gethostname())
    else:
        if device_type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"--tensor-parallel-size x --pipeline-parallel-size = {world} needs {world} GPUs on this node, found "
                             f"{torch.cuda.device_count()}; use torchrun for several nodes")
        set_safe_nvls_env()       # the children inherit it
        spec = WorkerSpec(str(model_path), dtype, device_type, parallel, f"tcp://127.0.0.1:{free_port()}", load_kwargs,
                          kernel_options or KernelOptions())
        ctx = mp.get_context("spawn")
        for i in range(world - 1):
            p = ctx.Process(target=_spawned_worker, args=(i, spec, os.getpid(), logging.getLogger().level),
                            daemon=True, name=f"kimik3-tp-rank{i + 1}")
            p.start()
            processes.append(p)
        logger.info("spawned %d tensor-parallel worker(s): pids %s", len(processes), [p.pid for p in processes])
    try:
        if processes:
            device, control = _join_watching(processes, device_type, spec.init_method, world)
        else:
            device, control = init_rank(0, world, spec.init_method, device_type)
        group = ParallelGroup(control, processes, device)
        model = load_model(model_path, device=device, dtype=dtype, **parallel.join(0, str(model_path)), **load_kwargs)
    except BaseException:
        for p in processes:
            p.kill()
        raise
    return model, group
