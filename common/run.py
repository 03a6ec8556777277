"""A run from start to finish: what every script does around its algorithm.

A script's `Args` extends `RunArgs` (common/args.py) with the algorithm's own
flags. Its `__main__` reads as the algorithm because the rest is a few calls:

    run = Run(args)                  # every input checked, data loaded, the run's folder, Ray
    policy = run.policy()            # the worker group: trainer, rollout engine, reference
    for step in run.steps():         # resumes or validates first; progress, stop requests
        ...                          # the algorithm's phases, inline
        run.end_step(step, batch, scores, metrics)   # validate, save, log, NaN guard
    run.finish()                     # export, teardown

The run keeps the worker groups, checkpoints and logs; it hands scoring to a
`Scorer` (common/scoring.py) and the supply of rollouts to a `RolloutSupply`
(common/rollout_supply.py).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import time
from collections import defaultdict

from common.args import RunArgs, check_args, engine_settings, flag, resolve_args, worker_micro_batch_tokens
from common.pretrained import load_tokenizer

__all__ = ["Run", "RunArgs", "flag"]  # RunArgs and flag are the scripts' to import from here too


class Run:
    """One training run with `args` (a RunArgs), from the checks of its input to its exported model. The algorithm's
    name is the script's (algorithm_name): it names the run's folder, its wandb tag and what --resume auto looks for.

    `worker_groups`: how many groups share each accelerator (PPO's policy and critic: 2).
    `prompts_per_batch`: prompts per batch drawn (RolloutSupply.next_prompts); default --train-batch-size.
    `supervised`: the files hold chat transcripts to learn from (common/transcripts.py, algos/sft_hybrid.py), not
    prompts: no rewards and no rollout engine, batches from `next_transcripts()`, and validation is the loss on them.
    """

    def __init__(self, args: RunArgs, worker_groups: int = 1, prompts_per_batch: int | None = None, supervised: bool = False):
        import torch

        from common.console import start_console
        from common.engine_registry import load_engine
        from common.engines import eos_token_ids
        from common.sequence_parallel import check_heads

        # Everything that can be wrong with the input fails here, before any worker starts.
        self.algo, self.supervised = algorithm_name(sys.argv[0]), supervised
        check_args(args)
        self.args = args = resolve_args(args)  # what the flags become on this machine, decided once; `args` is this copy
        self.engine = engine_settings(args)  # how the rollout engines generate, one object every engine receives whole
        load_engine(self.engine)
        self.run_prefix = f"{self.algo}__{args.exp_name}__{args.seed}"
        sys.excepthook = self._report_stop
        torch.manual_seed(args.seed)
        if args.sequence_parallel > 1:
            check_heads(args.model_path, args.sequence_parallel)
        self.tokenizer = load_tokenizer(args.model_path, chat_template=args.chat_template)
        self.eos_token_ids = eos_token_ids(args.model_path, self.tokenizer)
        environments = self._load_data(prompts_per_batch)
        self.tracker = self._tracker()
        start_console(self.tracker.run_dir)  # the console a person reads; all of it in the run's folder
        self._start(worker_groups, environments)
        self.groups = {}
        self.start_step, self.first_val, self.last_val, self.bad_steps = 1, None, None, 0
        self.resumed, self.stop, self.step_start, self.postfix, self.last_step = False, None, 0.0, {}, 0
        self.stopping = False  # a stop request seen when end_step decided whether to save
        self.alike_steps = 0  # steps in a row whose prompts' samples all scored alike (say_when_groups_score_alike)

    def _load_data(self, prompts_per_batch: int | None):
        """The train and validation loaders (prompts, or a supervised run's transcripts; batches of `prompts_per_batch`,
        default --train-batch-size) and the scorer that checks the prompts' data sources; --total-epochs turns into
        steps here. Returns the environments of --env/--tools, or --agent's."""
        from common.data import PromptLoader, load_prompts, pad_token_id
        from common.envs import episode_spec, load_environments
        from common.scoring import Scorer
        from common.transcripts import TranscriptLoader, load_transcripts
        from common.warm_start import GenerationValidation

        args, environments = self.args, None
        self.by_generation = None  # a supervised run's validation by generation (common/warm_start.py)
        pad = pad_token_id(self.tokenizer, self.eos_token_ids)
        loader = TranscriptLoader if self.supervised else PromptLoader
        if self.supervised:
            self.scorer, lengths = None, (args.max_prompt_length, args.max_response_length)
            train_data = load_transcripts(args.train_files, self.tokenizer, self.eos_token_ids, *lengths)
            val_data = train_data
            self.by_generation = GenerationValidation.of(args, self.tokenizer, self.eos_token_ids)  # --val-files of prompts
            if args.val_files and self.by_generation is None:
                val_data = load_transcripts(args.val_files, self.tokenizer, self.eos_token_ids, *lengths)
            self.val_name = "held-out loss" if args.val_files else "loss on the training transcripts (no --val-files)"
            self.val_name = self.by_generation.name if self.by_generation else self.val_name
        else:
            self.scorer = Scorer(args, self.tokenizer)
            spec = episode_spec(args.env, args.tools, args.agent)
            environments = load_environments(spec) if spec else None
            # each one's tools, by name; an agent's requests bring their own
            envs = environments.check(self.tokenizer, self.eos_token_ids) if environments and not args.agent else None
            overlong = "drop" if args.filter_overlong_prompts else "truncate" if args.truncate_prompts else "error"
            train_data = load_prompts(args.train_files, self.tokenizer, args.max_prompt_length, overlong, envs)
            val_data = train_data
            if args.val_files:
                val_data = load_prompts(args.val_files, self.tokenizer, args.max_prompt_length, overlong, envs)
            self.scorer.check_prompts(train_data, val_data, environments)
            self.val_name = "held-out accuracy" if args.val_files else "accuracy on the training prompts (no --val-files)"
        batch_size = prompts_per_batch or args.train_batch_size
        if batch_size > len(train_data):
            flag = "--train-batch-size" if prompts_per_batch is None else "the prompts drawn per round (--gen-batch-size)"
            raise ValueError(
                f"{flag} is {batch_size} prompts, more than the {len(train_data)} in --train-files "
                f"{' '.join(args.train_files)}: lower it, or add prompts"
            )
        self.train_loader = loader(train_data, batch_size, pad, shuffle=True, seed=args.seed)
        epoch_steps = None if args.total_epochs is None else args.total_epochs * len(self.train_loader)
        if epoch_steps is not None and epoch_steps < args.total_steps:  # whichever comes first
            print(f"--total-epochs {args.total_epochs} of {len(self.train_loader)} batches each: {epoch_steps} steps")
            self.args = dataclasses.replace(args, total_steps=epoch_steps)
        self.val_loader = loader(val_data, args.val_batch_size, pad, shuffle=False, drop_last=False)
        return environments

    def _tracker(self):
        """The checkpoint to resume (--resume), checked against these settings, and the run's folder and logs."""
        from common.checkpoint import check_config, find_checkpoint
        from common.tracking import Tracker

        args = self.args
        self.resume_from = find_checkpoint(args.resume, args.runs_dir, self.run_prefix)
        if self.resume_from is not None:
            check_config(self.resume_from, args, args.force_resume)
        elif args.resume == "auto":
            print(f"--resume auto: no checkpoint of {args.runs_dir}/{self.run_prefix}__* yet, so this run starts from step 1")
        wandb = dict(wandb_project=args.wandb_project_name, wandb_entity=args.wandb_entity) if args.track else {}
        script = sys.argv[0] if sys.argv[0].endswith(".py") else None
        # the code that made the curve, and in wandb the experiment's group with the algorithm as a tag
        provenance = dict(script=script, group=args.exp_name, tags=(self.algo,))
        return Tracker(
            self.run_prefix, dataclasses.asdict(args), self.resume_from, **wandb, runs_dir=args.runs_dir, **provenance
        )

    def _start(self, worker_groups: int, environments) -> None:
        """Ray and the accelerators' pool, the scorer's processes and the supply of rollouts (or of transcripts)."""
        from common.rollout_supply import RolloutSupply

        args, reward_workers = self.args, self.args.reward_workers
        if reward_workers is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # not on macOS
            reward_workers = 0 if args.in_process and not args.agent else min(cores, 16)  # agents run in processes
        colocated = not self.supervised and self.scorer.by_model and not args.reward_model_workers  # a scorer beside it
        self.pool = None if args.in_process else self._start_pool(max_colocated=worker_groups + colocated)
        self.rollouts = None
        if self.supervised:
            self.train_batches = self.train_loader.forever()
            if self.by_generation:
                self.by_generation.start(self.pool, reward_workers, self.engine)
        else:
            self.scorer.start(self.pool, reward_workers, self.engine)
            self.rollouts = RolloutSupply(
                args, self.engine, self.tokenizer, self.eos_token_ids, self.train_loader, environments, reward_workers
            )

    def _start_pool(self, max_colocated: int):
        """Ray, and one bundle per policy worker on its accelerators, shared by `max_colocated` worker groups."""
        from common.worker_group import ResourcePool, init_ray

        args = self.args
        init_ray()
        import ray

        use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        if args.offload and not use_gpu:
            raise ValueError("--offload frees GPU memory for the vllm engine; drop it on CPUs")
        kind, apart = ("GPU" if use_gpu else "CPU"), args.rollout_workers + args.reward_model_workers
        have = int(ray.cluster_resources().get(kind, 0))
        if apart and args.num_workers + apart > have:
            raise ValueError(
                f"--num-workers {args.num_workers}, --rollout-workers {args.rollout_workers} and --reward-model-workers "
                f"{args.reward_model_workers} need {args.num_workers + apart} {kind}s, one each; the Ray cluster has {have}: "
                "lower them or add nodes"
            )
        return ResourcePool(args.num_workers, use_gpu, max_colocated, args.call_timeout)

    def workers(self, worker_cls, name: str, **settings):
        """A group of `worker_cls` on the run's accelerators (or in this process), set up with the run's model
        and optimiser settings, each overridden by `settings`."""
        from common.pretrained import resolve as resolve_model
        from common.worker_group import WorkerGroup

        args = self.args
        defaults = dict(
            model_path=args.model_path,
            epochs=args.ppo_epochs,
            mini_batch_size=args.mini_batch_size * args.n,
            micro_batch_size=args.micro_batch_size,
            micro_batch_tokens=worker_micro_batch_tokens(args, fits_budget=True),
            seed=args.seed,
            lr=args.lr,
            weight_decay=args.weight_decay,
            lr_warmup_steps=args.lr_warmup_steps,
            lr_decay_steps=max(1, args.total_steps - args.lr_warmup_steps) if args.lr_schedule == "cosine" else 0,
            max_grad_norm=args.max_grad_norm,
            gradient_checkpointing=args.gradient_checkpointing,
            compute_dtype=args.compute_dtype,
            lora_rank=args.lora_rank,
            lora_alpha=args.lora_alpha,
            lora_target_modules=args.lora_target_modules,
            sequence_parallel=args.sequence_parallel,
        )
        settings = defaults | settings
        settings["model_path"] = resolve_model(settings["model_path"])  # a model of the group's own (PPO's critic) too
        group = self.groups[name] = WorkerGroup(worker_cls, self.pool, name, args.call_timeout, **settings)
        if args.micro_batch_tokens == "auto":  # measured once all of the worker is in memory (its engine too)
            share = 0.8 if args.max_memory_share is None else args.max_memory_share
            group.broadcast("keep_memory_within", share, 1 if self.pool is None else self.pool.max_colocated)
            group.broadcast("fit_micro_batch_tokens", args.max_prompt_length, args.max_response_length)
        return group

    def policy(self, **settings):
        """The hybrid engine's group: the policy that trains, generates (unless --rollout-workers do), and (with LoRA)
        scores the reference."""
        from common.workers import PolicyWorker

        if self.supervised:  # no engine; the log-probs of the data at temperature 1
            rollout = dict(engine=None, use_reference=False)
            rollout |= self.by_generation.policy_settings() if self.by_generation else {}  # an engine to validate with
        else:
            rollout = self.rollouts.policy_settings()
        # the run's chat template (--chat-template), which the exported model's tokenizer keeps
        rollout |= dict(log_prob_chunk_tokens=self.args.log_prob_chunk_tokens, chat_template=self.tokenizer.chat_template)
        policy = self.workers(PolicyWorker, "policy", **(rollout | settings))
        if not self.supervised:
            self.rollouts.start(policy, self.pool, self.val_loader.dataset)
        elif self.by_generation:
            self.by_generation.attach(policy, self.pool)
        return policy

    def next_transcripts(self):
        """A supervised run's next batch of transcripts (common/transcripts.py), reshuffled at every pass over them."""
        return next(self.train_batches)

    def next_rollouts(self, n: int, metrics: dict):
        """The next batch of prompts, `n` samples of each, with each sample's `staleness` (RolloutSupply.next_rollouts)."""
        return self.rollouts.next_rollouts(n, metrics)

    def generate(self, batch, do_sample: bool = True):
        """The policy's responses to `batch`'s prompts (RolloutSupply.generate)."""
        return self.rollouts.generate(batch, do_sample)

    def score(self, batch, metrics: dict):
        """One score per response of `batch` (Scorer.score)."""
        return self.scorer.score(batch, metrics)

    def _validate(self, step: int = 0) -> tuple[dict, list[dict]]:
        from common.rewards import validate
        from common.transcripts import token_mean_loss

        if self.by_generation:
            self.last_val, samples = self.by_generation(step)
            return self.last_val, samples
        if self.supervised:
            self.last_val = {"val/loss": token_mean_loss(self.groups["policy"], self.val_loader)}
            return self.last_val, []
        self.last_val, samples = validate(
            self.generate, self.val_loader, self.tokenizer, self.scorer.score_texts, self.args.val_n
        )
        return self.last_val, samples

    def resume(self, **driver_state) -> dict:
        """Restore every worker group and the data's position from the checkpoint to resume, or validate first.

        `driver_state`: what the script keeps between steps besides the data's position (PPO's KL coefficient);
        returned as the checkpoint saved it, or as given on a fresh start.
        """
        from common.checkpoint import load_checkpoint

        self.resumed = True
        if self.resume_from is not None:
            groups = self.groups if self.supervised else self.groups | self.rollouts.groups()
            saved = load_checkpoint(self.resume_from, groups)
            if self.supervised:
                self.train_loader.load_state_dict(saved["loader"])
            else:
                self.rollouts.restore(saved["step"], saved)
            self.start_step = saved["step"] + 1
            print(f"resumed from {self.resume_from}")
            return {key: saved[key] for key in driver_state}
        if self.args.val_before_train:
            self.first_val, samples = self._validate()
            self.tracker.log(self.first_val, step=0)
            self.tracker.log_samples(samples, step=0)
        return driver_state

    def steps(self):
        """Step numbers from 1 (or the step after the resumed checkpoint) to --total-steps, with a progress bar;
        SIGINT or SIGTERM ends them after the current step, once it is saved."""
        from tqdm import trange

        from common.checkpoint import StopRequest

        if not self.resumed:
            self.resume()
        self.stop = StopRequest()
        progress = trange(self.start_step, self.args.total_steps + 1, desc=self.algo)
        for step in progress:
            self.step_start = time.perf_counter()
            yield step
            progress.set_postfix(self.postfix)
            if self.stopping:  # a request that came after end_step's decision waits for the next step's checkpoint
                break

    def end_step(self, step: int, batch, scores, metrics: dict, **driver_state) -> None:
        """The step's standard metrics, then validation, a checkpoint (with `driver_state`) and the log when due.
        `scores`: one per response; None for a supervised step, whose progress bar shows its `actor/loss`.

        Stops the run after --max-bad-steps steps in a row whose updates a NaN or inf gradient skipped.
        """
        from common.rewards import extra_means
        from common.tracking import timer

        args, step_time = self.args, time.perf_counter() - self.step_start
        metrics |= self._step_metrics(batch, scores, step_time)
        self.alike_steps = say_when_groups_score_alike(batch, scores, metrics, self.alike_steps)
        # the reward's own keys beside its counts, which keep a name both use
        extras = extra_means(batch["reward_extra"] if "reward_extra" in batch else [], "reward/")
        metrics |= {key: value for key, value in extras.items() if key not in metrics}
        if self.rollouts is not None:
            self.rollouts.version = step  # the step's update: validation and the next generate see it
        self.stopping = self.stop.requested
        if step % args.test_freq == 0 or step == args.total_steps:
            with timer("validate", metrics):
                val_metrics, samples = self._validate(step)
            metrics |= val_metrics
            self.tracker.log_samples(samples, step=step)
        self._record_peak_memory(metrics)
        with self.stop.deferred():  # a checkpoint and its step's row together: a resumed run finds both
            if step % args.save_freq == 0 or step == args.total_steps or self.stopping:
                self._save(step, metrics, driver_state)
            self.tracker.log(metrics, step=step)
        shown = ("loss", metrics["actor/loss"]) if scores is None else ("reward", metrics["train/reward_mean"])
        self.postfix = {shown[0]: f"{shown[1]:.3f}", "step_s": f"{step_time:.2f}"}
        self.last_step = step
        skipped = any(value for key, value in metrics.items() if key.endswith("skipped_updates"))
        self.bad_steps = self.bad_steps + 1 if skipped else 0
        if self.bad_steps >= args.max_bad_steps:
            raise RuntimeError(
                f"{self.bad_steps} steps in a row had NaN or inf gradients; their updates were skipped, so no weights "
                "are corrupted. Check the rewards and the learning rate, then continue with --resume auto"
            )

    def _step_metrics(self, batch, scores, step_time: float) -> dict:
        """What every step logs of its batch: entropy (unless the update measured it), reward, response lengths, speed,
        the samples' staleness, the epoch and the episodes' figures."""
        from common.episodes import episode_metrics

        metrics, response_mask = {}, batch["response_mask"]
        response_lengths = response_mask.sum(-1)
        if "entropy" in batch:  # else the update measured it
            metrics["actor/entropy"] = ((batch["entropy"] * response_mask).sum() / response_mask.sum()).item()
        if scores is not None:  # None: a supervised step
            metrics["train/reward_mean"] = scores.mean().item()
        metrics |= {
            "response/length_mean": response_lengths.mean().item(),
            "response/clip_ratio": (response_lengths == self.args.max_response_length).float().mean().item(),
            "timing/step": step_time,
            "perf/tokens_per_s": batch["attention_mask"].sum().item() / step_time,
        }
        if "staleness" in batch:  # updates between the weights that generated the samples and the policy's
            staleness = batch["staleness"].float()
            metrics |= {"rollout/staleness_mean": staleness.mean().item(), "rollout/staleness_max": staleness.max().item()}
        position, batches = self.train_loader.state_dict(), len(self.train_loader)
        metrics["train/epoch"] = position["epoch"] + position["batch_index"] / batches  # passes over the data so far
        if "ending" in batch:
            metrics |= episode_metrics(batch, "env/")
        return metrics

    def _save(self, step: int, metrics: dict, driver_state: dict) -> None:
        """A checkpoint of every group and the driver's state (with engines apart, their work in flight finished)."""
        from common.checkpoint import save_checkpoint
        from common.tracking import timer

        with timer("save", metrics):
            if self.supervised:
                groups, driver = self.groups, {"loader": self.train_loader.state_dict()} | driver_state
            else:
                groups = self.groups | self.rollouts.groups()
                with timer("save_in_flight", metrics):  # the engines finish the work in flight that the checkpoint keeps
                    driver = self.rollouts.checkpoint_state() | driver_state
            save_checkpoint(self.tracker.run_dir, step, groups, driver, self.args.keep_last)

    def _record_peak_memory(self, metrics: dict) -> None:
        """The step's peak memory per worker method, the largest over ranks and calls (`perf/peak_memory_gb/policy/
        update`...: resident memory on CPUs, allocated memory on GPUs; see memory.measured), and the largest of all.
        The rollout workers report theirs with each batch (SplitEngines.take): asking them now would wait for the
        batches they are generating."""
        from common.memory import record_peak_memory

        scorers = {} if self.scorer is None else self.scorer.groups()
        for name, group in (self.groups | scorers).items():
            record_peak_memory(metrics, name, group.broadcast("phase_peak_memory"))
        peaks = [value for key, value in metrics.items() if key.startswith("perf/peak_memory_gb/")]
        metrics["perf/peak_memory_gb"] = max(peaks, default=0.0)

    def _report_stop(self, kind, error, traceback) -> None:
        """A fault mid-run as one message: what happened, where the run stands and the command that continues it.
        (sys.excepthook: Ray's screens of traceback for a dead worker say no more, and hide the way back.)"""
        from common.checkpoint import CheckpointNotWritten, saved_checkpoints
        from common.worker_group import WorkerDied, WorkerStopped

        if isinstance(error, WorkerDied):
            what = f"the {error}: {likely_cause(error)}"
        elif isinstance(error, WorkerStopped):
            longer = "a call that needs longer: raise --call-timeout"
            what = f"the {error}\nthe run stops rather than wait for it without end ({longer})"
        elif isinstance(error, CheckpointNotWritten):
            what = f"{error}; free some space (or lower --keep-last)"
        elif isinstance(error, KeyboardInterrupt) and self.stop is None:
            what = "stopped by Ctrl-C while the run started"
        elif isinstance(error, KeyboardInterrupt):
            what = "stopped at once by a second Ctrl-C or SIGTERM: the step under way is lost"
        else:
            sys.__excepthook__(kind, error, traceback)
            return
        checkpoint = next(iter(saved_checkpoints(self.args.runs_dir, self.run_prefix)), None)  # unchecked: --resume checks it
        if checkpoint is None:
            where = "no complete checkpoint yet: the command below starts the run again from step 1"
        else:
            where = f"the last complete checkpoint is {checkpoint} (step {checkpoint.name.removeprefix('step_')})"
        print(f"\n{what}\n{where}\ncontinue with:\n  {resume_command()}", file=sys.stderr, flush=True)

    def finish(self) -> None:
        """Report, export the policy (unless stopped early), and release the workers."""

        def shown(val: dict) -> str:
            return f"{val['val/loss']:.4f}" if "val/loss" in val else f"{val['val/accuracy']:.1%}"

        if self.first_val is not None:
            print(f"{self.val_name}: {shown(self.first_val)} before training")
        if self.last_val is not None:
            print(f"{self.val_name}: {shown(self.last_val)} at the last validation")
        run_dir = self.tracker.run_dir
        print(f"metrics and checkpoints in {run_dir}")
        if self.stop is not None and self.stop.requested:
            print(f"stopped after step {self.last_step}; continue with:\n  {resume_command()}")
        else:
            self.groups["policy"].broadcast("export", str(run_dir / "model"), adapter_only=self.args.export_adapter_only)
            print(f"the trained policy, as a Hugging Face model folder: {run_dir / 'model'}")
        self.tracker.close()
        if not self.supervised:
            self.scorer.close()
            self.rollouts.close()
        if self.by_generation:
            self.by_generation.close()
        for group in self.groups.values():
            group.shutdown()
        if self.pool is not None:
            self.pool.shutdown()


def algorithm_name(script: str) -> str:
    """The algorithm's name from its script's file name: `algos/my_algo_hybrid.py` -> `my_algo`."""
    name = os.path.splitext(os.path.basename(script))[0].removesuffix("_hybrid")
    if not name or "__" in name:
        raise ValueError(
            f"the script {script} names the algorithm {name!r}; a run's folder joins the algorithm, --exp-name and "
            "--seed with '__', so name the script <algorithm>_hybrid.py without '__'"
        )
    return name


def likely_cause(error) -> str:
    """Why a worker died (a WorkerDied), and what to do when it was memory."""
    if not error.out_of_memory:
        return "killed (SIGKILL, by hand or by the system's out-of-memory killer) or crashed; its log is in Ray's logs"
    lower = {
        "update": "--micro-batch-size (or --micro-batch-tokens), or pass --gradient-checkpointing",
        "generate": "--max-response-length or --train-batch-size, or pass --offload with vllm on GPUs",
    }.get(error.method, "--micro-batch-size or --log-prob-chunk-tokens")
    return f"to need less memory, lower {lower}"


ALIKE_STEPS = 3
"""steps in a row whose every prompt's samples scored alike before a run says that it learns nothing"""


def say_when_groups_score_alike(batch, scores, metrics: dict, streak: int | None) -> int | None:
    """The share of the step's prompts whose samples all got the same score (`train/alike_group_share`), which a
    group-relative advantage (GRPO's, RLOO's, DAPO's...) turns into 0 for each of them; and the steps in a row so far in
    which every prompt's did, `streak` before this one. At ALIKE_STEPS such steps the run has learnt nothing from them:
    it says so on stderr with what to change, once (None is returned then, and stays so)."""
    if scores is None:
        return streak
    groups = defaultdict(list)
    for uid, score in zip(batch["uid"], scores.tolist()):
        groups[uid].append(score)
    groups = [group for group in groups.values() if len(group) > 1]  # a prompt sampled once has no group to compare
    if not groups:
        return streak
    alike = sum(len(set(group)) == 1 for group in groups)
    metrics["train/alike_group_share"] = alike / len(groups)
    if streak is None:  # said already
        return None
    streak = streak + 1 if alike == len(groups) else 0
    if streak < ALIKE_STEPS:
        return streak
    values = sorted({group[0] for group in groups})
    print(
        f"\nin each of the last {streak} steps every prompt's {len(groups[0])} samples scored alike (this step's scores: "
        f"{', '.join(f'{value:g}' for value in values[:5])}), so every advantage was 0 and no update learnt anything. "
        "The model may not yet write what the reward reads (a tool call, an answer's shape), or the prompts are too hard "
        "or too easy for it: warm-start it longer, until its held-out accuracy and tool calls show the format took "
        "(docs/warm-start.md); sample more per prompt (--n); or let DAPO's dynamic sampling (algos/dapo_hybrid.py) "
        "sample again in place of the prompts whose samples agree",
        file=sys.stderr,
        flush=True,
    )
    return None


def resume_command() -> str:
    """The command line that started this process, with --resume auto instead of any --resume it had."""
    argv = list(sys.orig_argv)
    if "--resume" in argv:
        at = argv.index("--resume")
        del argv[at : at + 2]
    return shlex.join([*(arg for arg in argv if not arg.startswith("--resume=")), "--resume", "auto"])
