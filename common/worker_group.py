"""Worker groups: N ranks of a `Worker` that form one torch.distributed group, as Ray actors or in this process.

A `WorkerGroup` is N Ray actors, one per accelerator (one per CPU slot on a
machine without one), that form one torch.distributed group. The driver calls
every rank at once: a collective inside a method deadlocks if ranks are called
one after another. Without a pool, the group is one worker inside the
driver's own process (no Ray): `breakpoint()` anywhere then stops in the
user's terminal, and Ray need not be installed (this module imports it only
where a group has Ray actors).
"""

from __future__ import annotations

import socket
import sys

import numpy as np
import torch

from common.dataproto import DataProto
from common.layouts import balanced_parts, same_prompts


class WorkerDied(RuntimeError):
    """Rank `rank` of the group `group` died during `method`; `out_of_memory`: Ray's memory monitor stopped it (its
    machine was short of memory), else its process ended otherwise (killed, or crashed)."""

    def __init__(self, group: str, rank: int, method: str, out_of_memory: bool):
        self.group, self.rank, self.method, self.out_of_memory = group, rank, method, out_of_memory
        cause = "Ray's memory monitor stopped it, its machine short of memory" if out_of_memory else "its process ended"
        super().__init__(f"{group} worker rank {rank} died during '{method}' ({cause})")


def _died() -> tuple[type[BaseException], ...]:
    """What Ray raises for a rank gone, or stopped by Ray's memory monitor."""
    import ray

    return (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError)


def _gather(calls: list[tuple]) -> list:
    """The results of Ray calls, each given as (ref, group's name, rank, method), in their order. Waited for in
    completion order, so that a rank that dies is reported at once (WorkerDied), not after its peers time out inside a
    collective with it; a rank whose collective lost a peer can even fail before Ray reports that peer dead, and the
    dead one is then the fault named."""
    import ray

    named = {call[0]: call[1:] for call in calls}
    results, pending = {}, list(named)
    while pending:
        [ready], pending = ray.wait(pending, num_returns=1)
        try:
            results[ready] = ray.get(ready)
        except _died() as error:
            raise _worker_died(*named[ready], error) from error
        except Exception as error:
            dead = _first_dead(pending)
            if dead is None:
                raise
            raise _worker_died(*named[dead[0]], dead[1]) from error
    return [results[call[0]] for call in calls]


def _first_dead(pending: list, seconds: float = 5.0) -> tuple | None:
    """(ref, Ray's error) of the first of the `pending` calls whose worker is found dead within `seconds`, if any."""
    import ray

    if not pending:
        return None
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=seconds)
    for ref in ready:
        try:
            ray.get(ref)
        except _died() as error:
            return ref, error
        except Exception:
            continue
    return None


def _worker_died(group: str, rank: int, method: str, error: BaseException) -> WorkerDied:
    import ray

    return WorkerDied(group, rank, method, out_of_memory=isinstance(error, ray.exceptions.OutOfMemoryError))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Worker:
    """One rank of a WorkerGroup: its place in the group, its device, and the peak memory of its methods (see
    common/memory.py). A subclass's `setup(master, ...)` joins the group's rendezvous at `master`."""

    # What a sequence-parallel group's ranks run together (see WorkerGroup.scatter): none by default.
    sequence_parallel_methods = ()

    def __init__(self, rank: int, world_size: int, use_gpu: bool):
        # The pool decides, not torch.cuda.is_available(): recent Ray no longer hides the GPUs from CPU-only actors.
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
        self.phase_peaks: dict[str, float] = {}

    def master_address(self) -> tuple[str, int]:
        ray = sys.modules.get("ray")  # a Ray actor has imported it; a process without Ray runs on this machine alone
        return (ray.util.get_node_ip_address() if ray is not None and ray.is_initialized() else "127.0.0.1"), _free_port()

    def phase_peak_memory(self) -> dict[str, float]:
        """The peak memory (GB) of each method measured since the last call, by name (see `measured`)."""
        peaks, self.phase_peaks = self.phase_peaks, {}
        return peaks


class ResourcePool:
    """One placement-group bundle per worker: a GPU each, or a CPU each without GPUs.

    Worker groups that share a pool are colocated: rank i of each group lands
    in bundle i, on the same accelerator.
    """

    def __init__(self, num_workers: int, use_gpu: bool, max_colocated: int = 1):
        import ray
        from ray.util.placement_group import placement_group

        need = {"GPU" if use_gpu else "CPU": num_workers}
        have = ray.cluster_resources()
        for kind, count in need.items():
            if have.get(kind, 0) < count:
                raise ValueError(
                    f"--num-workers {num_workers} needs {count} {kind}s but the Ray cluster has "
                    f"{int(have.get(kind, 0))}; lower --num-workers or add nodes"
                )
        self.num_workers, self.use_gpu, self.max_colocated = num_workers, use_gpu, max_colocated
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        self.placement_group = placement_group([bundle] * num_workers, strategy="PACK")
        ray.get(self.placement_group.ready())

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.placement_group)


class WorkerGroup:
    """N actors of `worker_cls` in one torch.distributed group, placed on `pool`; or, with no pool, one
    `worker_cls` in this process."""

    def __init__(self, worker_cls, pool: ResourcePool | None, name: str, **setup_kwargs):
        self.name, self.in_process = name, pool is None
        self.sequence_parallel = setup_kwargs.get("sequence_parallel", 1)
        self.sequence_parallel_methods = worker_cls.sequence_parallel_methods
        if self.in_process:
            self.world_size = 1
            self.workers = [worker_cls(0, 1, torch.cuda.is_available())]
        else:
            import ray
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            self.world_size, share = pool.num_workers, 1.0 / pool.max_colocated
            self.workers = [
                ray.remote(worker_cls)
                .options(
                    num_cpus=share,
                    num_gpus=share if pool.use_gpu else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pool.placement_group, placement_group_bundle_index=rank
                    ),
                )
                .remote(rank, self.world_size, pool.use_gpu)
                for rank in range(self.world_size)
            ]
        try:
            [master] = self._get([self._call(self.workers[0], "master_address")], "setup")
            self.broadcast("setup", master, **setup_kwargs)
        except BaseException:
            self.shutdown()  # give their share of the placement group back
            raise

    def _call(self, worker, method: str, *args, **kwargs):
        """A Ray object ref to the result; in process, the result itself."""
        if self.in_process:
            return getattr(worker, method)(*args, **kwargs)
        return getattr(worker, method).remote(*args, **kwargs)

    def _get(self, refs, method: str) -> list:
        if self.in_process:
            return refs
        return _gather([(ref, self.name, rank, method) for rank, ref in enumerate(refs)])

    def broadcast(self, method: str, *args, **kwargs) -> list:
        """Call `method` with the same arguments on every rank; one result per rank."""
        return self.submit(method, *args, **kwargs).result()

    def submit(self, method: str, *args, **kwargs) -> Pending:
        """broadcast without waiting for it: the ranks start now (in process, the call has already run)."""
        return Pending(self, [self._call(w, method, *args, **kwargs) for w in self.workers], method)

    def scatter(self, method: str, data: DataProto, **kwargs):
        """Split `data` across ranks (padding to a multiple of the world size), call all, reassemble.

        Sequences (rows with an `attention_mask`) are dealt so that every rank gets as many rows and near-equal tokens
        (balanced_parts): the rank with the long answers would otherwise set the pace. The samples of one prompt go to
        one rank where they fit, to share the prompt's tokens there (see shared_prompt_places). With sequence
        parallelism, the ranks of a sequence-parallel group all get the same part, for the methods that split its
        tokens among them (the worker's `sequence_parallel_methods`). DataProto results come back in `data`'s order,
        unpadded; others as a list per part.
        """
        return self.submit_scatter(method, data, **kwargs).result()

    def submit_scatter(self, method: str, data: DataProto, **kwargs) -> Pending:
        """scatter without waiting for it: the ranks start now, and the result is reassembled when asked for."""
        copies = self.sequence_parallel if method in self.sequence_parallel_methods else 1
        count = self.world_size // copies
        padded, pad = data.pad_to_multiple(count)
        if "attention_mask" in padded:
            groups = None
            if "responses" in padded:
                groups = same_prompts(padded["input_ids"], padded["attention_mask"], padded["responses"].shape[1])
            parts = balanced_parts(padded["attention_mask"].sum(-1).tolist(), count, equal_size=True, groups=groups)
        else:
            parts = np.array_split(np.arange(len(padded)), count)
        refs = [self._call(w, method, padded[parts[rank // copies]], **kwargs) for rank, w in enumerate(self.workers)]

        def reassemble(results: list):
            results = results[::copies]  # a sequence-parallel group's ranks return the same
            if isinstance(results[0], DataProto):
                return DataProto.concat(results)[np.argsort(np.concatenate(parts))].unpad(pad)
            return results

        return Pending(self, refs, method, reassemble)

    def shutdown(self) -> None:
        """Kill every rank and wait until each is gone, so that the next group finds its memory free
        (a vLLM engine checks that free memory did not change while it measures its own)."""
        if self.in_process:
            self.workers.clear()
            return
        import ray

        for worker in self.workers:
            ray.kill(worker)
        for worker in self.workers:
            try:
                ray.get(worker.__ray_ready__.remote())
            except _died():  # already
                pass


class Pending:
    """A method under way on every rank of a group (WorkerGroup.submit, submit_scatter)."""

    def __init__(self, group: WorkerGroup, refs: list, method: str, reassemble=lambda results: results):
        self.group, self.refs, self.method, self.reassemble = group, refs, method, reassemble

    def result(self):
        """Wait for every rank; the group's result (a rank that died: WorkerDied)."""
        return self.reassemble(self.group._get(self.refs, self.method))


def wait_all(*calls: Pending) -> list:
    """The results of methods under way on several groups whose ranks meet in one collective (the policy sending
    weights, the rollout workers receiving them): a rank that dies in either group is reported at once, not after
    the others time out waiting for it."""
    _gather([(ref, c.group.name, rank, c.method) for c in calls if not c.group.in_process for rank, ref in enumerate(c.refs)])
    return [call.result() for call in calls]
