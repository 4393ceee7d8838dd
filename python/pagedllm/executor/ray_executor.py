"""RayExecutor: tensor and pipeline parallelism whose ranks are Ray actors
(distributed_executor_backend="ray"; vLLM's Ray executor), so that the ranks can span hosts.

Cluster: the one this process is connected to (``ray.init`` already called), else the cluster
RAY_ADDRESS or ``ray start --head`` made on this host (``ray.init(address="auto")``), else a local
one that this executor starts (and stops at shutdown). A placement group holds one bundle per
rank — {"GPU": 1, "CPU": 1} on CUDA, {"CPU": 1} on the CPU — packed onto as few hosts as fit;
bundle 0 is pinned to this host and reserved for rank 0, which runs in this (the driver's)
process beside the scheduler and the sampler, as with "mp". Ranks 1..N-1 are actors of
_RayWorker (worker/worker_process.py's WorkerRank inside), one per bundle. Too few devices in the
cluster for tensor_parallel_size x pipeline_parallel_size ranks is a ValueError before any
weight loads.

Steps: the same flat step messages as "mp" (executor/step_message.py) reach every actor as one
ordered actor call per message (Ray runs an actor's calls from one caller in order); the
collectives go through torch.distributed (NCCL on GPUs, gloo on CPUs: the shared-memory
communicator cannot cross hosts) with the rendezvous at this host's IP (master_addr) — except
tensor parallelism on CPUs with every rank on this host, which takes the shared-memory
communicator as "mp" does. The hosts
need the same Python environment and the model at the same path.

Failures: an actor whose step raises aborts its groups, returns ("error", traceback) and ends its
process a moment later (its peers' collectives fail when its connections close); the executor
polls the finished calls each step, and raises RuntimeError naming the rank and its traceback
(or Ray's report of a dead actor). shutdown() kills the actors and removes the placement group.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
import traceback
import weakref
from typing import Optional

import torch

from pagedllm import ops
from pagedllm.distributed.parallel_state import GroupCoordinator, default_backend, free_port
from pagedllm.executor.abstract import ExecutorConfig
from pagedllm.executor.distributed_executor import DistributedExecutor, is_collective_failure
from pagedllm.executor.multiproc_executor import cpu_threads_per_rank
from pagedllm.executor.step_message import shutdown_message
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")

#: seconds to wait for the placement group's bundles (the cluster's devices) to be reserved
PLACEMENT_TIMEOUT_S = float(os.environ.get("PAGEDLLM_RAY_PLACEMENT_TIMEOUT", "120"))


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("distributed_executor_backend='ray' needs Ray: pip install 'ray>=2.40' "
                          "(or pip install 'pagedllm[ray]')") from None
    return ray


class _RayWorker:
    """A rank > 0 as a Ray actor: WorkerRank built by init(), messages run by execute()."""

    def __init__(self):
        self.worker = None
        self.failed = False

    def node(self) -> dict:
        import ray

        return {"node_ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id()}

    def init(self, rank: int, config: ExecutorConfig, backend: str, master_addr: str, port: int,
             ranks_on_node: int, shm_handle=None):
        from pagedllm.worker.worker_process import WorkerRank

        try:
            if config.device.type == "cpu":  # this host's cores, divided among its ranks
                ops.set_cpu_threads(cpu_threads_per_rank(ranks_on_node))
            device = torch.device("cuda", 0) if config.device.type == "cuda" else torch.device("cpu")  # Ray's GPU
            self.worker = WorkerRank(rank, config, device, backend, port, shm_handle, master_addr=master_addr)
            return "ready", self.worker.info()
        except BaseException:  # noqa: BLE001 (returned to the driver, then the process ends)
            return self._fail()

    def execute(self, message: bytes):
        if self.failed:
            return "error", "this rank failed before"
        try:
            self.worker.handle(bytearray(message))
            return None
        except BaseException:  # noqa: BLE001
            return self._fail()

    def _fail(self):
        self.failed = True
        text = traceback.format_exc()
        if self.worker is not None:
            self.worker.abort()
        # the reply goes out first; then the process ends, which releases its peers (gloo: the
        # connections close) from collectives it will never join
        threading.Timer(1.0, os._exit, args=(1,)).start()
        return "error", text

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


def _finalize(ray, actors: list, box: list, owns: list) -> None:
    """At garbage collection or interpreter exit without shutdown(): kill the actors, remove the
    placement group, stop a cluster the executor started. Nothing to do once this process is no
    longer connected (ray.shutdown() ran): ray.kill would auto-connect to a cluster that is gone."""
    if not ray.is_initialized():
        return
    for a in actors:
        try:
            ray.kill(a)
        except Exception:  # noqa: BLE001 (best effort)
            pass
    for pg in box:
        try:
            ray.util.remove_placement_group(pg)
        except Exception:  # noqa: BLE001
            pass
    if owns and owns[0] and ray.is_initialized():
        ray.shutdown()


class RayExecutor(DistributedExecutor):
    """See the module docstring. config.tensor_parallel_size x config.pipeline_parallel_size ranks."""

    def __init__(self, config: ExecutorConfig):
        self.ray = ray = _import_ray()
        self.config = config
        self.world = world = config.tensor_parallel_size * config.pipeline_parallel_size
        device = torch.device("cuda", 0) if config.device.type == "cuda" else torch.device("cpu")
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.driver_runner: Optional[ModelRunner] = None
        self.group = self.pp_group = None
        self.actors: list = []
        self.placement_group = None
        self._owns_ray = False
        self._refs: list = []  # (rank, ObjectRef) of calls not seen finished
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._watcher: Optional[threading.Thread] = None
        self._dead: Optional[str] = None
        self._threads_before = None
        self.worker_info: list[dict] = []
        self._pg_box: list = []  # the placement group, for the finalizer
        self._owns_box = [False]
        self._finalizer = weakref.finalize(self, _finalize, ray, self.actors, self._pg_box, self._owns_box)
        try:
            self._start(config, world, device)
        except BaseException as exc:
            self._raise_failure(exc, "start-up")
        r0 = self.driver_runner
        logger.info("%d ranks on Ray (tensor_parallel_size %d x pipeline_parallel_size %d, %s, backend %s); rank 0 "
                    "(pid %d, this process): weights %.3f GiB, %d KV blocks", world, config.tensor_parallel_size,
                    config.pipeline_parallel_size, device.type, self.backend, os.getpid(), r0.weight_bytes / 2**30,
                    r0.num_blocks)
        for info in self.worker_info:
            logger.info("Ray worker rank %d (pid %d on %s): weights %.3f GiB, %d KV blocks (%d KV heads)", info["rank"],
                        info["pid"], info.get("node_ip", "?"), info["weight_bytes"] / 2**30, info["num_blocks"],
                        info["num_kv_heads"])

    # ---- start-up ---------------------------------------------------------------------------
    def _connect(self) -> None:
        ray = self.ray
        if ray.is_initialized():
            return
        if os.environ.get("RAY_ADDRESS"):  # a cluster named: its errors are the user's to see
            ray.init(log_to_driver=True)
            logger.info("Ray: connected to %s", os.environ["RAY_ADDRESS"])
            return
        if _local_cluster_alive():
            ray.init(address="auto", log_to_driver=True)
            logger.info("Ray: connected to the cluster running on this host")
            return
        cpus = max(os.cpu_count() or 1, self.world)  # (logical: one bundle per rank on a small host)
        # address="local": a new cluster even where /tmp/ray still names one that has died (plain
        # ray.init() would try that address and refuse num_cpus)
        ray.init(address="local", num_cpus=cpus, log_to_driver=True, include_dashboard=False)
        self._owns_ray = self._owns_box[0] = True
        logger.info("Ray: started a local cluster (%d CPUs)", cpus)

    def _start(self, config: ExecutorConfig, world: int, device: torch.device) -> None:
        ray = self.ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._connect()
        kind = "GPU" if device.type == "cuda" else "CPU"
        have = ray.cluster_resources().get(kind, 0)
        if have < world:
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} x pipeline_parallel_size="
                             f"{config.pipeline_parallel_size} needs {world} {kind}s in the Ray cluster, which has "
                             f"{have:g}")
        ip = ray.util.get_node_ip_address()
        here = ray.get_runtime_context().get_node_id()
        bundle = {"GPU": 1, "CPU": 1} if kind == "GPU" else {"CPU": 1}
        bundles = [dict(bundle) for _ in range(world)]
        try:  # bundle 0 (rank 0's) on this node: by its id (Ray >= 2.4x's label selectors) ...
            from ray.util.placement_group import NODE_ID_LABEL_KEY

            self.placement_group = ray.util.placement_group(
                bundles, strategy="PACK", bundle_label_selector=[{NODE_ID_LABEL_KEY: here}] + [{}] * (world - 1))
        except (ImportError, TypeError):  # ... or by its IP's resource
            bundles[0][f"node:{ip}"] = 0.001
            self.placement_group = ray.util.placement_group(bundles, strategy="PACK")
        self._pg_box.append(self.placement_group)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise ValueError(f"the Ray cluster could not place {world} bundles of {bundle} (one on this host, "
                             f"{ip}) within {PLACEMENT_TIMEOUT_S:.0f} s (PAGEDLLM_RAY_PLACEMENT_TIMEOUT)")
        if kind == "GPU":  # rank 0 computes on the GPU that bundle 0 holds (Ray assigned it)
            self.device = device = self._bundle0_device()
        actor_cls = ray.remote(_RayWorker)
        actors = []
        for bundle_index in range(1, world):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.placement_group,
                                                        placement_group_bundle_index=bundle_index)
            options = dict(num_cpus=1, num_gpus=1 if kind == "GPU" else 0, scheduling_strategy=strategy,
                           name=None, max_restarts=0)
            actors.append(actor_cls.options(**options).remote())
        self.actors.extend(actors)
        found = ray.get([a.node.remote() for a in actors])
        # ranks by host, this one first: rank = stage x tp + tp_rank, so a stage's TP group stays on
        # as few hosts as the packing allows
        order = sorted(range(len(actors)), key=lambda i: (found[i]["node_id"] != here, found[i]["node_id"]))
        self.actors[:] = [actors[i] for i in order]
        nodes = [found[i] for i in order]
        port = free_port()
        per_node = collections.Counter([here] + [n["node_id"] for n in nodes])
        threads = cpu_threads_per_rank(per_node[here])
        shm_handle = None
        if device.type == "cpu" and config.pipeline_parallel_size == 1 and per_node[here] == world:
            # every rank on this host: pagedllm's shared-memory all-reduce instead of gloo's (the
            # "mp" default; gloo's costs milliseconds per call on a small CPU host)
            self.backend = default_backend(device)
            if self.backend == "shm":
                self.group = GroupCoordinator.init(0, world, device, "shm")
                shm_handle = self.group.shm.handle()
        init_refs = [a.init.remote(r, config, self.backend, ip, port, per_node[n["node_id"]], shm_handle)
                     for r, (a, n) in enumerate(zip(self.actors, nodes), start=1)]
        with self._lock:
            self._refs = list(enumerate(init_refs, start=1))
        self._watcher = threading.Thread(target=self._watch, name="pagedllm-ray-watch", daemon=True)
        self._watcher.start()
        if device.type == "cpu":
            self._threads_before = (torch.get_num_threads(), ops.get_num_threads())
            ops.set_cpu_threads(threads)
        if self.group is None:
            self.group, self.pp_group = self._join(device, port, lambda: self._init_failure(init_refs), ip)
        self.driver_runner = ModelRunner(config.model_path, config.model_config, device=device,
                                         tp_group=self.group, pp_group=self.pp_group, **config.runner_kwargs())
        for rank, (reply, node) in enumerate(zip(ray.get(init_refs), nodes), start=1):
            kind_of, payload = reply
            if kind_of == "error":
                raise RuntimeError(f"Ray worker rank {rank} failed:\n{payload}")
            self.worker_info.append(dict(payload, **node))

    def _bundle0_device(self) -> torch.device:
        """The CUDA device of this process that placement-group bundle 0's GPU is (a task there
        reads Ray's assignment; this process may see the host's GPUs through CUDA_VISIBLE_DEVICES)."""
        ray = self.ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        probe = ray.remote(lambda: [str(g) for g in ray.get_gpu_ids()])
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.placement_group,
                                                    placement_group_bundle_index=0)
        (gpu,) = ray.get(probe.options(num_cpus=0, num_gpus=1, scheduling_strategy=strategy).remote())
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        index = visible.split(",").index(gpu) if visible else int(gpu)
        logger.info("Ray: rank 0 on GPU %s of this host (cuda:%d here)", gpu, index)
        return torch.device("cuda", index)

    def _init_failure(self, init_refs: list) -> Optional[str]:
        """An actor's failure in init (or its death), if one has finished so."""
        done = set(self.ray.wait(init_refs, num_returns=len(init_refs), timeout=0)[0])
        for rank, ref in enumerate(init_refs, start=1):
            if ref in done:
                try:
                    kind, payload = self.ray.get(ref)
                except Exception as exc:  # noqa: BLE001 (the actor died)
                    kind, payload = "error", f"{type(exc).__name__}: {exc}"
                if kind == "error":
                    return f"Ray worker rank {rank} failed:\n{payload}"
        return None

    # ---- failures ---------------------------------------------------------------------------
    def _poll(self, timeout: float = 0.0) -> Optional[str]:
        """Check the finished actor calls (waiting up to `timeout` s for one); the first failure
        found is kept in self._dead, and the groups are aborted (so that rank 0 is not left in a
        shared-memory collective). Returns self._dead. Thread-safe (the watcher calls it too)."""
        ray = self.ray
        with self._lock:
            snapshot = list(self._refs)
        if snapshot:
            done, _ = ray.wait([ref for _, ref in snapshot], num_returns=1, timeout=timeout)
            if done:  # then everything finished by now
                done, _ = ray.wait([ref for _, ref in snapshot], num_returns=len(snapshot), timeout=0)
            finished = set(done)
            failure = None
            mine = [(rank, ref) for rank, ref in snapshot if ref in finished]
            try:  # one call for all (each ray.get costs tens of microseconds)
                replies = ray.get([ref for _, ref in mine])
            except Exception:  # noqa: BLE001 (an actor died: find which, with Ray's report)
                replies = []
                for _, ref in mine:
                    try:
                        replies.append(ray.get(ref))
                    except Exception as exc:  # noqa: BLE001
                        replies.append(("error", f"{type(exc).__name__}: {exc}"))
            for (rank, _), reply in zip(mine, replies):
                if isinstance(reply, tuple) and reply[0] == "error" and failure is None:
                    failure = f"Ray worker rank {rank} failed:\n{reply[1]}"
            with self._lock:
                self._refs = [(rank, ref) for rank, ref in self._refs if ref not in finished]
                if failure is not None and self._dead is None:
                    self._dead = failure
                    logger.error("%s", failure)
                    self._abort_groups()
        return self._dead

    def _abort_groups(self) -> None:
        for g in (self.group, self.pp_group):
            if g is not None:
                g.abort()

    def _watch(self) -> None:
        """The watcher thread: notices a failed or dead actor while rank 0 waits in a collective."""
        while not self._closing.wait(0.2) and self._dead is None:
            try:  # (timeout 0: a waiting ray.wait slows the driver's own Ray calls many times over)
                self._poll(0.0)
            except Exception:  # noqa: BLE001 (Ray shutting down)
                return

    def _raise_failure(self, exc: BaseException, during: str):
        """Rank 0 failed: when its error is a collective that was aborted or lost its peer, an
        actor's failure (given 2 s to be found) is the cause; otherwise rank 0's own exception is
        raised unchanged. The groups are aborted and, at start-up, everything is shut down."""
        cause = self._poll()
        if cause is None and is_collective_failure(exc):
            deadline = time.monotonic() + 2.0
            while cause is None and self._refs and time.monotonic() < deadline:
                cause = self._poll(0.1)
        if self._dead is None:
            self._dead = f"rank 0 failed during {during}: {type(exc).__name__}: {exc}"
        self._abort_groups()
        if during == "start-up":
            self.shutdown()
        if cause is not None and is_collective_failure(exc):
            raise RuntimeError(cause) from exc
        raise exc

    def check_health(self) -> None:
        if self._poll() is not None:
            raise RuntimeError(f"the tensor-parallel engine has stopped: {self._dead}")

    # ---- steps (DistributedExecutor runs them) ----------------------------------------------
    def _send(self, parts, stage0_only: bool = False) -> None:
        message = b"".join(p.tobytes() for p in parts)
        targets = list(enumerate(self.actors, start=1))
        if stage0_only:  # (COLLECT: stage 0's other TP ranks)
            targets = targets[:self.config.tensor_parallel_size - 1]
        # a large step once into the object store; a small one inline with each call
        ref = self.ray.put(message) if len(message) > (64 << 10) and len(targets) > 1 else message
        calls = [(rank, a.execute.remote(ref)) for rank, a in targets]
        with self._lock:
            self._refs += calls

    @property
    def worker_pids(self) -> list[int]:
        return [info["pid"] for info in self.worker_info]

    def shutdown(self) -> None:
        """Stop the actors (a shutdown message, then kill), free rank 0's weights and caches,
        leave the groups, remove the placement group (and stop a cluster this executor started).
        Idempotent."""
        ray = self.ray
        self._closing.set()
        self._finalizer.detach()
        if self._watcher is not None:
            self._watcher.join(2.0)
            self._watcher = None
        if self._dead is None and self.actors:
            try:
                self._send(shutdown_message())
                ray.get([a.close.remote() for a in self.actors], timeout=10)
            except Exception:  # noqa: BLE001 (an actor died meanwhile: killed below)
                pass
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001
                pass
        self.actors.clear()
        self._refs = []
        if self.driver_runner is not None:
            self.driver_runner.shutdown()
            self.driver_runner = None
        for g in (self.group, self.pp_group):
            if g is not None:
                g.destroy()
        self.group = self.pp_group = None
        if self.placement_group is not None:
            try:
                ray.util.remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001
                pass
            self.placement_group = None
            self._pg_box.clear()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = self._owns_box[0] = False
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before[0])
            ops.set_num_threads(self._threads_before[1])
            self._threads_before = None


def _local_cluster_alive(timeout_s: float = 1.0) -> bool:
    """Whether the cluster that `ray start` last recorded on this host (its address file,
    /tmp/ray/ray_current_cluster) still accepts connections on its GCS port. A dead cluster's file
    outlives it, and ray.init(address="auto") on it retries for minutes before failing."""
    try:
        from ray._private.utils import read_ray_address
        address = read_ray_address()
    except Exception:  # (a private helper: a Ray without it just starts its own cluster)
        return False
    if not address or ":" not in address:
        return False
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
