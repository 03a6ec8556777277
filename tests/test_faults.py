"""Faults in the middle of a run, caused for real: each ends with one message that names the last complete checkpoint
and the command that continues the run, and that command ends where a run never interrupted ends."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from ray import cloudpickle
from safetensors.torch import load_file

from common.checkpoint import complete_checkpoints
from common.worker_group import Worker, WorkerDied, WorkerGroup, WorkerStopped
from helpers import TINY, comparable, metric_rows, run_command, run_script, start_script, wait_for_steps

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Peers' workers have no tests folder to import from

STEPS = ["--total-steps", "4", "--save-freq", "1", "--keep-last", "1"]
# The engine apart from the policy generates the next batch while the policy trains on this one
ASYNC = ["--num-workers", "1", "--rollout-workers", "1", "--rollout-engine", "hf", "--max-staleness", "1"]


def run_to_the_end(folder, algo: str, *flags, steps=STEPS):
    """The metrics and the exported weights of the run that the interrupted ones must end up as."""
    result = run_script(f"{algo}_hybrid.py", *TINY, *steps, *flags, cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = (folder / "runs").iterdir()
    return metric_rows(run_dir), load_file(run_dir / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_grpo):
    """The end of the run of STEPS never interrupted (it keeps every checkpoint, which changes nothing it trains)."""
    return metric_rows(uninterrupted_grpo), load_file(uninterrupted_grpo / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted_ppo(ray_cluster, demo_files, tmp_path_factory):
    return run_to_the_end(tmp_path_factory.mktemp("uninterrupted_ppo"), "ppo")


@pytest.fixture(scope="module")
def uninterrupted_with_reward_model(ray_cluster, demo_files, reward_model, tmp_path_factory):  # noqa: F811
    return run_to_the_end(tmp_path_factory.mktemp("uninterrupted_rm"), "grpo", "--reward-model", reward_model)


def ray_workers(since: float) -> list[psutil.Process]:
    """The Ray actors started since `since` under this test process: by the Ray instance the tests share, or one a
    script started for itself; not those of another Ray on the machine."""
    titled = [(p, title_of(p)) for p in psutil.Process().children(recursive=True)]
    return [p for p, title in titled if title.startswith("ray::") and "Worker" in title and created_at(p) >= since - 1]


def created_at(process: psutil.Process) -> float:
    try:
        return process.create_time()
    except psutil.NoSuchProcess:
        return 0.0


def alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def still_running(workers: list[psutil.Process], seconds: float = 30) -> list[str]:
    """The titles of `workers` still running after up to `seconds`."""
    deadline = time.time() + seconds
    while (left := [title_of(p) for p in workers if alive(p)]) and time.time() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture(autouse=True)
def no_worker_left():
    """No Ray worker started by a test's runs outlives them (checked after each test)."""
    started = time.time()
    yield
    assert not still_running(ray_workers(started))


def title_of(process: psutil.Process) -> str:
    """A process's title ('' once it has ended)."""
    try:
        return (process.cmdline() or [""])[0]
    except psutil.NoSuchProcess:
        return ""


def kill_when(started: float, process, actor: str, method: str | None) -> None:
    """SIGKILL a Ray actor of the class `actor` started since `started` as soon as it runs a method that `method`
    matches, or (None) while it waits for a call: Ray titles an actor's process ray::<class>.<method> while the method
    runs, ray::<class> while it waits. Only the actor's own processes are read then, so a call of milliseconds is met."""
    title = f"ray::{actor}" + ("" if method is None else rf"\.({method})")
    deadline = time.time() + 120
    workers = []
    while not workers:
        workers = [p for p in ray_workers(started) if re.match(rf"ray::{actor}\b", title_of(p))]
        assert process.poll() is None and time.time() < deadline, process.communicate()[1][-3000:]
    while time.time() < deadline:
        for worker in workers:
            if re.fullmatch(title, title_of(worker)):
                worker.kill()
                return
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.001)
    raise TimeoutError(f"no actor titled {title}")


def kill_in_the_update_after(process, run_dir: Path, step: int) -> None:
    """SIGKILL the run's driver (`process`) in the update of step `step` + 1: the policy worker is paused (SIGSTOP) at
    each update it starts until the metrics hold `step` rows, so the run cannot get past that step, however late this
    test looks, and no checkpoint after step `step` can be written. Any policy worker counts, whenever its process
    started (Ray may give an actor a process it started before the run): no other run's is left (no_worker_left)."""
    deadline = time.time() + 120
    while time.time() < deadline:
        for worker in [p for p in ray_workers(0) if title_of(p) == "ray::PolicyWorker.update"]:
            worker.suspend()
            logged = (run_dir / "metrics.jsonl").read_text().count("\n")
            if logged == step:
                process.kill()
                process.communicate(timeout=60)
                worker.kill()
                return
            assert logged < step, f"the update of step {logged + 1} went unseen"
            worker.resume()
            while title_of(worker) == "ray::PolicyWorker.update":
                time.sleep(0.001)
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.001)
    raise TimeoutError(f"no update after step {step}")


def continue_as_told(stderr: str, cwd, uninterrupted) -> None:
    """Check the message, run the command it gives, and compare the run's end with the uninterrupted one's."""
    [checkpoint] = re.findall(r"the last complete checkpoint is (\S+/checkpoints/step_\d+) \(step \d+\)", stderr)
    [command] = re.findall(r"continue with:\n  (.+)\n", stderr)
    assert command.endswith(" --resume auto") and "Traceback" not in stderr
    continues(command, checkpoint, cwd, uninterrupted)


def continues(command: str, checkpoint: str, cwd, uninterrupted) -> None:
    resumed = run_command(command, cwd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoint}" in resumed.stdout
    run_dir = next((cwd / "runs").iterdir())
    rows, weights = uninterrupted
    assert [comparable(r) for r in metric_rows(run_dir)] == [comparable(r) for r in rows]
    exported = load_file(run_dir / "model" / "model.safetensors")
    assert all(torch.equal(exported[name], weights[name]) for name in weights)


def killed_and_resumed(tmp_path, uninterrupted, group: str, actor: str, method: str | None, *flags, algo="grpo"):
    """After the run's first step, kill a worker of `group` (its class `actor`) as it runs `method` (see kill_when); the
    message must name the group and the method (any, with None), and the command it gives continue to `uninterrupted`."""
    started = time.time()
    process = start_script(f"{algo}_hybrid.py", *TINY, *STEPS, *flags, cwd=tmp_path)
    wait_for_steps(tmp_path, 1, process)
    kill_when(started, process, actor, method)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode != 0
    during = method or r"\w+"
    stop = rf"the {group} worker rank \d died during '({during})' \(its process ended\): killed \(SIGKILL"
    assert re.search(stop, stderr), stderr[-3000:]
    continue_as_told(stderr, tmp_path, uninterrupted)


@pytest.mark.parametrize("method", ["generate", "compute_ref_log_prob", "update", "save"])
def test_a_killed_policy_worker_names_the_checkpoint_and_the_command(uninterrupted, tmp_path, method):
    """Killed in each phase of a step it runs: generation, the reference's log-probs (the reference lives in the
    policy's worker), the update, and the checkpoint's write, whose half-written folder the resumed run must not take
    (it resumes from the one the message names, the step before)."""
    killed_and_resumed(tmp_path, uninterrupted, "policy", "PolicyWorker", method)


def test_a_critic_worker_killed_in_its_phase_names_the_critic(uninterrupted_ppo, tmp_path):
    killed_and_resumed(tmp_path, uninterrupted_ppo, "critic", "CriticWorker", "compute_values|update", algo="ppo")


def test_a_reward_model_worker_killed_names_it(uninterrupted_with_reward_model, reward_model, tmp_path):  # noqa: F811
    """Killed while it scores or waits to: its next call, the step's scoring or its report of peak memory, meets it."""
    rm = ["--reward-model", reward_model]
    killed_and_resumed(tmp_path, uninterrupted_with_reward_model, "reward_model", "RewardModelWorker", None, *rm)


@pytest.mark.parametrize("method", ["generate", None], ids=["generating", "waiting"])
def test_a_killed_rollout_worker_names_it_and_leaves_the_checkpoint_whole(ray_cluster, demo_files, tmp_path, method):
    """An engine apart from the policy killed while it generates, or while it waits for prompts or weights (then the
    policy's next weight send is the first to miss it, and would report only a connection reset by its peer). The
    batches generated before go on feeding steps until the next weights are due; the resumed run takes the batches the
    checkpoint kept and goes on to the last step (that it then equals the run never stopped: the SIGTERM and kill -9
    test below)."""
    started = time.time()
    process = start_script(
        "grpo_hybrid.py", *TINY, *ASYNC, "--total-steps", "12", "--save-freq", "1", "--keep-last", "1", cwd=tmp_path
    )
    run_dir = wait_for_steps(tmp_path, 1, process)
    kill_when(started, process, "RolloutWorker", method)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode != 0
    stop = r"the rollout worker rank 0 died during '\w+' \(its process ended\): killed \(SIGKILL"
    assert re.search(stop, stderr) and "Traceback" not in stderr, stderr[-3000:]
    [checkpoint] = re.findall(r"the last complete checkpoint is (\S+/checkpoints/step_\d+) \(step \d+\)", stderr)
    assert Path(checkpoint) == complete_checkpoints(run_dir)[-1].resolve()
    [command] = re.findall(r"continue with:\n  (.+)\n", stderr)
    resumed = run_command(command, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoint}" in resumed.stdout
    # every step logged once: none after the last checkpoint had been logged when the engine died
    assert [row["step"] for row in metric_rows(run_dir)] == list(range(1, 13))


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_an_asynchronous_run_stopped_by_sigterm_then_killed_resumes_as_if_never_stopped(
    ray_cluster, demo_files, tmp_path, algo
):
    """An asynchronous run (the engine a step ahead) stopped by SIGTERM after its first step saves the batch the engine
    had generated and no step trained on, with the engine's randomness; its resume, killed with SIGKILL once it logged
    step 5 (in step 6's update), resumes again from its last checkpoint, step 4 (saved every second step): step 5 runs
    again. Each piece trains on exactly what the run never interrupted trains on: its metrics and weights, to the bit."""
    flags = [*TINY, *ASYNC, "--total-steps", "6", "--save-freq", "2", "--keep-last", "1"]
    (tmp_path / "straight").mkdir()
    straight = run_to_the_end(tmp_path / "straight", algo, *flags[len(TINY) :], steps=[])
    (tmp_path / "stopped").mkdir()
    cwd = tmp_path / "stopped"
    process = start_script(f"{algo}_hybrid.py", *flags, cwd=cwd)
    run_dir = wait_for_steps(cwd, 1, process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-3000:]
    [checkpoint] = complete_checkpoints(run_dir)
    stopped_at = int(checkpoint.name.removeprefix("step_"))
    # the tiny model's steps take some 50 ms, so the stop may land a few steps after the first: by step 4 it leaves the
    # resume steps 5 and 6, and the kill after step 5 its checkpoint of step 4
    assert stopped_at <= 4 and torch.load(checkpoint / "driver.pt", weights_only=False)["in_flight"]
    process = start_script(f"{algo}_hybrid.py", *flags, "--resume", "auto", cwd=cwd)
    kill_in_the_update_after(process, run_dir, 5)
    [checkpoint] = complete_checkpoints(run_dir)
    assert checkpoint.name == "step_4"  # step 5 is logged, and runs again
    continues(shlex.join(process.args), str(checkpoint.resolve()), cwd, straight)


def test_a_killed_driver_leaves_no_worker_and_resumes(uninterrupted, tmp_path):
    started = time.time()
    process = start_script("grpo_hybrid.py", *TINY, *STEPS, cwd=tmp_path)
    wait_for_steps(tmp_path, 2, process)
    workers = ray_workers(started)
    assert workers
    process.kill()
    process.communicate(timeout=60)
    assert not still_running(workers)
    # a driver killed has no chance to say where the run stands: the same command with --resume auto takes the last
    last = complete_checkpoints(next((tmp_path / "runs").iterdir()))[-1]
    continues(shlex.join([*process.args, "--resume", "auto"]), str(last.resolve()), tmp_path, uninterrupted)


def test_ctrl_c_twice_stops_at_once_and_resumes(uninterrupted, tmp_path):
    process = start_script("grpo_hybrid.py", *TINY, *STEPS, cwd=tmp_path)
    wait_for_steps(tmp_path, 1, process)
    os.killpg(process.pid, signal.SIGINT)
    # The second Ctrl-C once the run says it heard the first, as a user presses it: two that reach the driver while a
    # Ray call holds it (Ray looks for signals once a second) make one, and the run then stops after the step.
    heard = next((line for line in process.stdout if line.startswith("SIGINT: saving a checkpoint")), None)
    assert heard, process.communicate()[1][-3000:]
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode != 0, stderr[-3000:]
    assert "stopped at once by a second Ctrl-C or SIGTERM: the step under way is lost" in stderr
    continue_as_told(stderr, tmp_path, uninterrupted)


@pytest.fixture
def small_disk(tmp_path):
    """A folder on a filesystem of its own that the test can enlarge: 2 MB, where a checkpoint of the tiny model takes
    1.4 MB. Skipped where mounting is not allowed."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=True)


def test_a_full_disk_keeps_the_previous_checkpoint(uninterrupted, small_disk):
    # --keep-last 1: the disk holds one checkpoint and the metrics, not a second checkpoint beside them
    result = run_script("grpo_hybrid.py", *TINY, *STEPS, cwd=small_disk)
    assert result.returncode != 0
    # the writer's own error need not say the disk is full (torch.save's zip writer: "unexpected pos"): the space does
    written = re.search(r"the checkpoint of step \d+ could not be written \(([\d.]+) MB free on the disk of ", result.stderr)
    assert written and float(written[1]) < 1.4, result.stderr[-3000:]
    [run_dir] = (small_disk / "runs").iterdir()
    assert len(complete_checkpoints(run_dir)) == 1
    assert not list((run_dir / "checkpoints").glob(".*"))  # the half-written one is gone
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)  # the user frees space
    continue_as_told(result.stderr, small_disk, uninterrupted)


def test_a_host_short_of_memory_stops_the_run_through_rays_memory_monitor_and_it_resumes(uninterrupted, tmp_path, monkeypatch):
    """The run on a Ray of its own whose memory monitor acts 3 GB above what the machine uses now (its default is 95%
    of the memory); once it trains, this test takes memory until the monitor kills a worker, with the driver stopped
    meanwhile (SIGSTOP) so that the run cannot end first: it meets the dead worker at its next call."""
    total = psutil.virtual_memory().total
    threshold = (total - psutil.virtual_memory().available + 3 * 2**30) / total
    if threshold > 0.9:
        pytest.skip("the machine has less than 4 GB of memory free")
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setenv("RAY_memory_usage_threshold", f"{threshold:.4f}")
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "100")
    started = time.time()
    process = start_script("grpo_hybrid.py", *TINY, *STEPS, cwd=tmp_path)
    monkeypatch.undo()
    wait_for_steps(tmp_path, 1, process)
    workers = [p for p in ray_workers(started) if "PolicyWorker" in title_of(p)]
    os.kill(process.pid, signal.SIGSTOP)
    taken = []
    while all(map(alive, workers)) and len(taken) < 4 * 8:  # up to 8 GB, a quarter of a GB at a time, each page written
        taken.append(bytearray(2**28))
        time.sleep(0.05)
    taken.clear()
    os.kill(process.pid, signal.SIGCONT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode != 0
    stop = r"the policy worker rank \d died during '\w+' \(Ray's memory monitor stopped it, its machine short of memory\)"
    assert re.search(stop + ": to need less memory, lower --", stderr), stderr[-3000:]
    continue_as_told(stderr, tmp_path, uninterrupted)


class Peers(Worker):
    """Two ranks of a group, as in a collective."""

    def setup(self, master):
        pass

    def fail_as_rank_1_dies(self):
        """Rank 0 fails at once, as a collective does when its peer's process ends (gloo: connection closed by peer);
        rank 1's process ends half a second later, as late as Ray may report the death of a peer killed at once."""
        if self.rank == 1:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")


def test_a_rank_failing_for_a_dead_peer_names_the_dead_one(cpu_pool):
    group = WorkerGroup(Peers, cpu_pool, "peers")
    try:
        with pytest.raises(WorkerDied, match=r"peers worker rank 1 died during 'fail_as_rank_1_dies' \(its process ended"):
            group.broadcast("fail_as_rank_1_dies")
    finally:
        group.shutdown()


def test_a_worker_stopped_by_rays_memory_monitor_names_the_flags_that_lower_memory():
    from common.run import likely_cause

    update = WorkerDied("policy", 0, "update", out_of_memory=True)
    assert "Ray's memory monitor stopped it" in str(update)
    assert "--micro-batch-size" in likely_cause(update) and "--gradient-checkpointing" in likely_cause(update)
    assert "--log-prob-chunk-tokens" in likely_cause(WorkerDied("policy", 0, "compute_log_prob", out_of_memory=True))
    assert "killed (SIGKILL" in likely_cause(WorkerDied("critic", 1, "compute_values", out_of_memory=False))


class Sleeper(Worker):
    """Ranks of a group that answer, or not."""

    def setup(self, master):
        pass

    def sleep(self, seconds: float, rank: int):
        """Rank `rank` sleeps `seconds`; the others answer at once."""
        if self.rank == rank:
            time.sleep(seconds)
        return self.rank


def test_a_rank_that_stops_answering_is_named_with_its_stack_or_as_stopped(cpu_pool):
    """No answer within the bound: --call-timeout (here 1 s) for a call measured shorter. A rank stuck in Python is
    named with the line it stands on; a rank stopped by SIGSTOP, which can say nothing, as stopped."""
    group = WorkerGroup(Sleeper, cpu_pool, "sleepers", call_timeout=1.0)
    try:
        assert group.broadcast("sleep", 0.0, 1) == [0, 1]
        start = time.monotonic()
        with pytest.raises(WorkerStopped) as stuck:
            group.broadcast("sleep", 600.0, 1)
        assert time.monotonic() - start < 10
        message = str(stuck.value)
        assert message.startswith("sleepers worker rank 1 stopped answering during 'sleep': no answer in 1 s (the bound: 5 x")
        where = r"rank 1's process \(\d+\) stands at \(every thread's stack in \S+\):\n +File \S+test_faults.py\", "
        assert re.search(where + r"line \d+ in sleep", message), message
        _, pid, _ = group.processes[1]
        os.kill(pid, signal.SIGSTOP)
        stopped = r"rank 1 stopped answering during 'sleep'.*rank 1's process \(\d+\) is stopped \(SIGSTOP, or a debugger"
        with pytest.raises(WorkerStopped, match=stopped + r" holds it\), so it cannot say where"):
            group.broadcast("sleep", 0.0, 1)
    finally:
        group.shutdown()


def test_a_pool_the_cluster_cannot_give_says_so_then_gives_up(ray_cluster, capsys):
    """Every free CPU held by another job: the pool says what it waits for after --call-timeout (here 0.1 s) and gives
    up after 30 times that, its placement group removed."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    from common.worker_group import ResourcePool

    other_job = placement_group([{"CPU": 1}] * int(ray.available_resources()["CPU"]))
    ray.get(other_job.ready())
    try:
        start = time.monotonic()
        refused = r"no 1 x \{'CPU': 1\} for the workers from the Ray cluster, .* after 3 s \(30 x --call-timeout\): "
        with pytest.raises(RuntimeError, match=refused + "free them, or lower --num-workers"):
            ResourcePool(1, use_gpu=False, call_timeout=0.1)
        assert time.monotonic() - start < 10
        assert "waiting for 1 x {'CPU': 1} for the workers from the Ray cluster" in capsys.readouterr().out
        assert not [group for group in placement_group_table().values() if group["state"] == "PENDING"]  # none left waiting
    finally:
        remove_placement_group(other_job)


def stopped_and_reported(tmp_path, group: str, actor: str, *flags, algo="grpo"):
    """After the run's first step, stop a worker of `group` (its class `actor`) with SIGSTOP: the run must stop within
    the bound (--call-timeout 10 s, the calls of the tiny model measured shorter) plus the time to say so, naming the
    group, the rank and its state, the last checkpoint and the command that continues the run."""
    started = time.time()
    process = start_script(f"{algo}_hybrid.py", *TINY, *STEPS, "--call-timeout", "10", *flags, cwd=tmp_path)
    wait_for_steps(tmp_path, 1, process)
    [worker, *_] = [p for p in ray_workers(started) if re.match(rf"ray::{actor}\b", title_of(p))]
    worker.suspend()
    stopped = time.monotonic()
    _, stderr = process.communicate(timeout=120)
    assert process.returncode != 0 and "Traceback" not in stderr, stderr[-3000:]
    stop = rf"the {group} worker rank \d stopped answering during '\w+': no answer in \d+ s \(.*--call-timeout 10 s\)"
    state = rf"; it did not die: rank \d's process \({worker.pid}\) is stopped \(SIGSTOP"
    assert re.search(stop + state, stderr), stderr[-3000:]
    told = r"the last complete checkpoint is \S+/checkpoints/step_\d+ \(step \d+\)\ncontinue with:\n  .+ --resume auto\n"
    assert re.search(told, stderr), stderr
    assert time.monotonic() - stopped < 90


def test_a_stopped_policy_worker_is_reported_within_the_bound(ray_cluster, demo_files, tmp_path):
    stopped_and_reported(tmp_path, "policy", "PolicyWorker")


def test_a_stopped_rollout_worker_is_reported_within_the_bound(ray_cluster, demo_files, tmp_path):
    stopped_and_reported(tmp_path, "rollout", "RolloutWorker", *ASYNC)


def test_a_stopped_reward_model_worker_is_reported(ray_cluster, demo_files, reward_model, tmp_path):  # noqa: F811
    stopped_and_reported(tmp_path, "reward_model", "RewardModelWorker", "--reward-model", reward_model)
