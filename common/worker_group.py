"""Worker groups: N ranks of a `Worker` that form one torch.distributed group, as Ray actors or in this process.

A `WorkerGroup` is N Ray actors, one per accelerator (one per CPU slot on a
machine without one), that form one torch.distributed group. The driver calls
every rank at once: a collective inside a method deadlocks if ranks are called
one after another. Without a pool, the group is one worker inside the
driver's own process (no Ray): `breakpoint()` anywhere then stops in the
user's terminal, and Ray need not be installed (this module imports it only
where a group has Ray actors). A script's Ray starts here too (init_ray): it
joins the cluster that RAY_ADDRESS names, or starts one on this machine.

The driver waits for no call without end: a rank that dies is named at once
(WorkerDied), and one whose process stays up but gives no answer within a
bound set by --call-timeout and the earlier waits for the same call is named
with its state, stopped or the line of Python it stands on (WorkerStopped).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

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


# How long the driver waits for a call before it says a rank stopped answering: a method's first call (which may load
# a model, compile, warm an engine up) FIRST_CALL x --call-timeout; later ones SLOWER x the longest it waited for the
# same call of the same group so far, or for any call of the group made before (a rank runs its calls in turn: a call
# may wait behind another), at least --call-timeout. The process groups' collectives get the first bound.
FIRST_CALL, SLOWER = 30, 5


class WorkerStopped(RuntimeError):
    """Ranks `ranks` of the group `group` gave no answer to `method` within `seconds` while their processes stayed up
    (stopped, or stuck: a collective that never completes, a kernel that never returns); `states`: what is known of
    each one's process (stopped, or where its stack stands)."""

    def __init__(self, group: str, ranks: list[int], method: str, seconds: float, bound: str, states: list[str]):
        self.group, self.ranks, self.method = group, ranks, method
        which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        super().__init__(
            f"{group} worker {which} stopped answering during '{method}': no answer in {seconds:.0f} s ({bound}); it did "
            "not die: " + ("\n" if any("\n" in state for state in states) else "; ").join(states)
        )


def _died() -> tuple[type[BaseException], ...]:
    """What Ray raises for a rank gone, or stopped by Ray's memory monitor."""
    import ray

    return (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError)


def _gather(calls: list[tuple], timed: list[tuple]) -> list:
    """The results of Ray calls, each given as (ref, group's name, rank, method), in their order. Waited for in
    completion order, so that a rank that dies is reported at once (WorkerDied), not after its peers time out inside a
    collective with it; a rank whose collective lost a peer can even fail before Ray reports that peer dead, and the
    dead one is then the fault named. `timed`: (group, what the call is, see Pending) of each group called; a rank that
    gives no answer within the longest of their bounds (WorkerGroup.bound) is reported as stopped (WorkerStopped)."""
    import ray

    named = {call[0]: call[1:] for call in calls}
    results, pending = {}, list(named)
    bound = max(group.bound(call) for group, call in timed)
    start = time.monotonic()
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, start + bound - time.monotonic()))
        if not ready:
            groups = {group.name: (group, call) for group, call in timed}
            raise _stopped(groups, [named[ref] for ref in pending], time.monotonic() - start)
        [ready] = ready
        try:
            results[ready] = ray.get(ready)
        except _died() as error:
            raise _worker_died(*named[ready], error) from error
        except Exception as error:
            dead = _first_dead(pending)
            if dead is None:
                raise
            raise _worker_died(*named[dead[0]], dead[1]) from error
    for group, call in timed:
        group.waited(call, time.monotonic() - start)
    return [results[call[0]] for call in calls]


def _stopped(groups: dict, calls: list[tuple], seconds: float) -> WorkerStopped:
    """The error for the ranks of `calls` ((group's name, rank, method) each) that gave no answer in `seconds`: those
    whose processes are stopped (SIGSTOP, a debugger) if any, since their peers wait for them inside a collective;
    else every one, with the line each one's stack stands on. `groups`: (group, what the call is) by name."""
    stopped = [call for call in calls if groups[call[0]][0].process_state(call[1]) == "stopped"]
    name, _, method = (stopped or calls)[0]
    ranks = [rank for group, rank, _ in stopped or calls if group == name]
    group, call = groups[name]
    states = [group.describe(rank, method) for rank in ranks]
    return WorkerStopped(name, ranks, method, seconds, group.bound_text(call), states)


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


STACKS = Path(tempfile.gettempdir()) / "hybridrl_stacks"  # where each worker's process writes its stack when asked


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def node_address() -> str:
    ray = sys.modules.get("ray")  # a Ray actor has imported it; a process without Ray runs on this machine alone
    return ray.util.get_node_ip_address() if ray is not None and ray.is_initialized() else "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# The environment every Ray worker of a run starts with
RAY_RUNTIME_ENV = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}


def start_local_ray(num_cpus: int | None = None) -> None:
    """A Ray instance on this machine, as a script starts one for itself: no dashboard and no metrics. No one reads
    metrics there, and the exporter's thread in every Ray process is one more way to crash it: a SIGSEGV in
    OpenTelemetry's periodic reader, in a Ray worker, once failed a run of the test suite. Both settings are needed:
    with OpenTelemetry on, its exporter runs whatever enable_metrics_collection says. Ray's processes read them from
    the environment they start with; RAY_enable_open_telemetry=1 RAY_enable_metrics_collection=1 turn them back on."""
    import ray

    os.environ.setdefault("RAY_enable_open_telemetry", "0")
    os.environ.setdefault("RAY_enable_metrics_collection", "0")
    ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=RAY_RUNTIME_ENV)


def init_ray() -> None:
    """Join the cluster named by RAY_ADDRESS (multi-node), else start a local one."""
    address = os.environ.get("RAY_ADDRESS")
    if address:
        # A driver must use the cluster's authentication mode. Take the one `ray start` takes on this machine: token
        # authentication when a token exists (any local Ray of 2.59 or later leaves one in ~/.ray/auth_token), unless
        # RAY_AUTH_MODE says otherwise. Ray reads the mode when it is imported, hence before the import.
        token_file = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
        if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(token_file):
            os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    if ray.is_initialized():
        return
    if not address:
        start_local_ray()
        return
    try:
        ray.init(address=address, runtime_env=RAY_RUNTIME_ENV)
    except ConnectionError as error:
        mode = os.environ.get("RAY_AUTH_MODE", "disabled")
        raise ConnectionError(
            f"could not join the Ray cluster at RAY_ADDRESS={address} with RAY_AUTH_MODE={mode}. Is the head node "
            "up at that address? A cluster started with token authentication needs RAY_AUTH_MODE=token and its token "
            "(~/.ray/auth_token, or RAY_AUTH_TOKEN); one started without needs RAY_AUTH_MODE=disabled"
        ) from error


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
        return node_address(), _free_port()

    collective_timeout = datetime.timedelta(minutes=30)  # torch's default, until the driver says (watched)

    def join_process_group(self, master: tuple[str, int]) -> None:
        """This rank's torch.distributed group with the other ranks of its worker group, met at `master` (NCCL on
        GPUs, gloo on CPUs), whose collectives give up after collective_timeout."""
        import torch.distributed as dist

        (addr, port), backend = master, "nccl" if self.device.type == "cuda" else "gloo"
        address, timeout = f"tcp://{addr}:{port}", self.collective_timeout
        dist.init_process_group(backend, init_method=address, rank=self.rank, world_size=self.world_size, timeout=timeout)

    def watched(self, collective_timeout_s: float) -> tuple[str, int, str]:
        """Ready this rank for a driver that finds it not answering: its process groups' collectives give up after
        `collective_timeout_s`, and SIGUSR1 writes every thread's stack to a file (faulthandler: from the signal
        handler, whatever the Python code is doing). Returns where it is: its node's address, its process, the file."""
        self.collective_timeout = datetime.timedelta(seconds=collective_timeout_s)
        STACKS.mkdir(exist_ok=True)
        for old in STACKS.glob("*.txt"):  # left empty by a process killed with its run: nothing to keep
            with contextlib.suppress(FileNotFoundError):  # another rank, readying at once, removed it first
                if old.stat().st_size == 0 and not _alive(int(old.stem)):
                    old.unlink(missing_ok=True)
        stacks = STACKS / f"{os.getpid()}.txt"
        self.stack_file = open(stacks, "w")  # kept open: faulthandler writes to its descriptor
        faulthandler.register(signal.SIGUSR1, file=self.stack_file, all_threads=True)
        return node_address(), os.getpid(), str(stacks)

    def phase_peak_memory(self) -> dict[str, float]:
        """The peak memory (GB) of each method measured since the last call, by name (see `measured`)."""
        peaks, self.phase_peaks = self.phase_peaks, {}
        return peaks


class ResourcePool:
    """One placement-group bundle per worker: a GPU each, or a CPU each without GPUs.

    Worker groups that share a pool are colocated: rank i of each group lands
    in bundle i, on the same accelerator.
    """

    def __init__(self, num_workers: int, use_gpu: bool, max_colocated: int = 1, call_timeout: float = 60.0):
        """Waits for the cluster to give the bundles: it says so after `call_timeout` (--call-timeout) and gives up
        after FIRST_CALL times that, where other jobs hold them (or no node has a GPU and a CPU free together)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

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
        ready = self.placement_group.ready()
        if ray.wait([ready], timeout=call_timeout)[0]:
            return
        waiting = f"{num_workers} x {bundle} for the workers from the Ray cluster, whose free resources are now"
        print(f"waiting for {waiting} {ray.available_resources()}: other jobs hold them?", flush=True)
        if not ray.wait([ready], timeout=(FIRST_CALL - 1) * call_timeout)[0]:
            remove_placement_group(self.placement_group)
            raise RuntimeError(
                f"no {waiting} {ray.available_resources()} after {FIRST_CALL * call_timeout:g} s "
                f"({FIRST_CALL} x --call-timeout): free them, or lower --num-workers (and --rollout-workers, "
                "--reward-model-workers)"
            )

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.placement_group)


class WorkerGroup:
    """N actors of `worker_cls` in one torch.distributed group, placed on `pool`; or, with no pool, one
    `worker_cls` in this process."""

    def __init__(self, worker_cls, pool: ResourcePool | None, name: str, call_timeout: float = 60.0, **setup_kwargs):
        """`call_timeout`: --call-timeout, the least the driver waits for a call before it says a rank stopped
        answering (see FIRST_CALL, SLOWER)."""
        self.name, self.in_process = name, pool is None
        self.call_timeout, self.longest_wait, self.longest_repeated_wait = call_timeout, {}, 0.0
        self.processes = []  # (node, pid, stack file) of each rank, once each has said (Worker.watched)
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
            if not self.in_process:
                watched = [self._call(w, "watched", FIRST_CALL * call_timeout) for w in self.workers]
                self.processes = self._get(watched, "watched")
            [master] = self._get([self._call(self.workers[0], "master_address")], "master_address")
            self.broadcast("setup", master, **setup_kwargs)
        except BaseException:
            self.shutdown()  # give their share of the placement group back
            raise

    def _call(self, worker, method: str, *args, **kwargs):
        """A Ray object ref to the result; in process, the result itself."""
        if self.in_process:
            return getattr(worker, method)(*args, **kwargs)
        return getattr(worker, method).remote(*args, **kwargs)

    def _get(self, refs, method: str, call: str | None = None, ranks: list[int] | None = None) -> list:
        """The results of `method` on `ranks` (default: every rank); `call`: what the call is, for its bound (see
        Pending)."""
        if self.in_process:
            return refs
        ranks = range(len(refs)) if ranks is None else ranks
        return _gather([(ref, self.name, rank, method) for rank, ref in zip(ranks, refs)], [(self, call or method)])

    def bound(self, call: str) -> float:
        """The seconds the driver waits for `call` on this group (see FIRST_CALL, SLOWER)."""
        if call not in self.longest_wait:
            return FIRST_CALL * self.call_timeout
        return max(self.call_timeout, SLOWER * self._longest(call))

    def _longest(self, call: str) -> float:
        return max(self.longest_wait[call], self.longest_repeated_wait)

    def bound_text(self, call: str) -> str:
        if call not in self.longest_wait:
            return f"the bound of a first call: {FIRST_CALL} x --call-timeout {self.call_timeout:g} s"
        longest, least = self._longest(call), f"at least --call-timeout {self.call_timeout:g} s"
        return f"the bound: {SLOWER} x the longest wait for it or for a call made before, {longest:.1f} s, {least}"

    def waited(self, call: str, seconds: float) -> None:
        if call in self.longest_wait:  # a first call's time (loading, compiling) says nothing of the others'
            self.longest_repeated_wait = max(seconds, self.longest_repeated_wait)
        self.longest_wait[call] = max(seconds, self.longest_wait.get(call, 0.0))

    def process_state(self, rank: int) -> str:
        """'stopped' if rank `rank`'s process is stopped (SIGSTOP, a debugger: it cannot answer), 'running', or
        'elsewhere' on another node (whose /proc this driver cannot read)."""
        node, pid, _ = self.processes[rank]
        if node != node_address():
            return "elsewhere"
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "running"  # no /proc (macOS): ask for its stack all the same
        return "stopped" if state in "Tt" else "running"

    def describe(self, rank: int, method: str) -> str:
        """What is known of rank `rank`'s process: stopped, or the lines of Python its threads stand on (asked for
        with SIGUSR1, see Worker.watched)."""
        node, pid, stack_file = self.processes[rank]
        state = self.process_state(rank)
        if state == "stopped":
            return f"rank {rank}'s process ({pid}) is stopped (SIGSTOP, or a debugger holds it), so it cannot say where"
        if state == "elsewhere":
            return f"rank {rank}'s process ({pid}) is on node {node}: `kill -USR1 {pid}` writes its stack in {stack_file}"
        os.kill(pid, signal.SIGUSR1)
        deadline, stack = time.monotonic() + 5, ""
        while time.monotonic() < deadline and not (stack := _read(stack_file)):
            time.sleep(0.1)
        if not stack:
            return f"rank {rank}'s process ({pid}) wrote no stack to {stack_file} in 5 s"
        return f"rank {rank}'s process ({pid}) stands at (every thread's stack in {stack_file}):\n{_thread_of(stack, method)}"

    def broadcast(self, method: str, *args, **kwargs) -> list:
        """Call `method` with the same arguments on every rank; one result per rank."""
        return self.submit(method, *args, **kwargs).result()

    def submit(self, method: str, *args, **kwargs) -> Pending:
        """broadcast without waiting for it: the ranks start now (in process, the call has already run)."""
        return Pending(self, [self._call(w, method, *args, **kwargs) for w in self.workers], method)

    def submit_rank(self, rank: int, method: str, *args, **kwargs) -> Pending:
        """`method` on one rank alone, without waiting for it; its result is that rank's."""
        call = self._call(self.workers[rank], method, *args, **kwargs)
        return Pending(self, [call], method, lambda results: results[0], call=method, ranks=[rank])

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

    def update(self, data: DataProto, loss_fn) -> dict:
        """scatter `update` (FSDPWorker._update) with the script's `loss_fn`: the update's figures, which the ranks
        all-reduced alike (but for each rank's memory budget: rank 0's)."""
        return self.scatter("update", data, loss_fn=loss_fn)[0]

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

        return Pending(self, refs, method, reassemble, call=f"{method} of {len(data)} rows")

    def shutdown(self) -> None:
        """Kill every rank and wait until each is gone, so that the next group finds its memory free
        (a vLLM engine checks that free memory did not change while it measures its own)."""
        if self.in_process:
            self.workers.clear()
            return
        import ray

        for worker in self.workers:
            ray.kill(worker)
        for rank, worker in enumerate(self.workers):
            try:
                ray.get(worker.__ray_ready__.remote(), timeout=self.call_timeout)
            except _died():  # already
                pass
            except ray.exceptions.GetTimeoutError:  # its node out of reach: Ray ends it once it hears from it again
                print(f"the {self.name} worker rank {rank}, killed, was not seen to end in --call-timeout; going on")
        for node, _, stack_file in self.processes:
            if node == node_address():
                Path(stack_file).unlink(missing_ok=True)


class Pending:
    """A method under way on every rank of a group (WorkerGroup.submit, submit_scatter)."""

    def __init__(self, group: WorkerGroup, refs: list, method: str, reassemble=lambda results: results, call=None, ranks=None):
        """`call`: what the call is, whose earlier waits set its bound (WorkerGroup.bound): the method, and for a
        scatter the rows it deals (a validation's batch need not take as long as a step's). `ranks`: the ranks called
        (default: every one)."""
        self.group, self.refs, self.method, self.reassemble = group, refs, method, reassemble
        self.call, self.ranks = call or method, ranks

    def done(self) -> bool:
        """Whether every rank has answered: `result` then waits no more."""
        if self.group.in_process:
            return True
        import ray

        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def result(self):
        """Wait for every rank; the group's result (a rank that died: WorkerDied; one that gave no answer within the
        bound: WorkerStopped)."""
        return self.reassemble(self.group._get(self.refs, self.method, self.call, self.ranks))


def wait_all(*calls: Pending) -> list:
    """The results of methods under way on several groups whose ranks meet in one collective (the policy sending
    weights, the rollout workers receiving them): a rank that dies in either group is reported at once, not after
    the others time out waiting for it."""
    ranks = [(ref, c.group.name, rank, c.method) for c in calls if not c.group.in_process for rank, ref in enumerate(c.refs)]
    if ranks:
        _gather(ranks, [(call.group, call.call) for call in calls if not call.group.in_process])
    return [call.result() for call in calls]


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _thread_of(stack: str, method: str) -> str:
    """Of faulthandler's dump of every thread, the frames of the one that runs `method` (else of the first that runs
    this project's code, else of the first), innermost first, without Ray's own (which run every call)."""
    threads = [block.strip() for block in stack.split("\n\n") if "File " in block]
    runs = [t for t in threads if f" in {method}" in t] or [t for t in threads if f"{os.sep}common{os.sep}" in t] or threads
    frames = [line.strip() for line in runs[0].splitlines()[1:] if f"{os.sep}ray{os.sep}" not in line]
    return "\n".join("    " + frame for frame in frames)
