"""What every script does around its algorithm: the flags they share, and a run from start to finish.

A script's `Args` extends `RunArgs` with the algorithm's own flags. Its
`__main__` reads as the algorithm because the rest is a few calls:

    run = Run("grpo", args)          # every input checked, data loaded, the run's folder, Ray
    policy = run.policy()            # the worker group: trainer, rollout engine, reference
    for step in run.steps():         # resumes or validates first; progress, stop requests
        ...                          # the algorithm's phases, inline
        run.end_step(step, batch, scores, metrics)   # validate, save, log, NaN guard
    run.finish()                     # export, teardown

`flag(default, resumable=..., positive=...)` marks what a field may do:
change when a run resumes, or must be above 0. A script marks its own
fields the same way; nothing here names them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


def flag(default, *, resumable: bool = False, positive: bool = False):
    """A field of Args with its default; `resumable`: may differ when the run resumes; `positive`: must be above 0
    (when set, for an optional one)."""
    return dataclasses.field(default=default, metadata={"resumable": resumable, "positive": positive})


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def count_workers(requested: int | None, gpus: int) -> int:
    """--num-workers as asked, or by default one per GPU of `gpus` (2 CPU slots where there are none); asking for
    more workers than `gpus` is an error where there are GPUs."""
    if requested is None:
        return gpus or 2
    if gpus and requested > gpus:
        raise ValueError(
            f"--num-workers {requested} asks for {requested} GPUs, one per worker; this machine has {gpus}: lower it, or "
            "leave it out to take every GPU"
        )
    return requested


@dataclass
class RunArgs:
    exp_name: str = os.path.basename(sys.argv[0]).removesuffix(".py")
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    track: bool = flag(False, resumable=True)
    """log metrics and config to wandb"""
    wandb_project_name: str = flag("hybridrl", resumable=True)
    """the wandb project"""
    wandb_entity: str | None = flag(None, resumable=True)
    """the wandb entity (team)"""

    model_path: str | None = None
    """HF model folder or hub id; leave unset for the built-in demo (a tiny model on an addition task)"""
    train_files: list[str] | None = None
    """training prompts, verl-style parquet or jsonl files"""
    val_files: list[str] | None = None
    """validation prompts, same format; without them validation uses the training prompts"""
    reward_fn: str | None = None
    """your reward, `path/to/file.py:function_name`; by default a built-in reward per data_source"""
    max_prompt_length: int = flag(512, positive=True)
    """longest prompt in tokens; a longer one is an error unless --truncate-prompts"""
    truncate_prompts: bool = False
    """keep the last --max-prompt-length tokens of a longer prompt instead of stopping"""
    max_response_length: int = flag(1024, positive=True)
    """most tokens generated per response; with --env, most tokens of an episode (the model's and the environment's)"""
    env: str | None = None
    """multi-turn episodes: the environment that answers the model's turns, `path/to/file.py:ClassName` or a built-in
    (calculator); its steps run isolated like rewards, under --reward-workers and --reward-timeout (see README)"""
    max_turns: int = flag(4, positive=True)
    """with --env: most model turns per episode"""

    num_workers: int | None = flag(None, positive=True)
    """policy processes, one per GPU (per CPU slot without GPUs); default: every GPU this machine has, 2 without GPUs
    or with RAY_ADDRESS (a cluster: pass it)"""
    in_process: bool = False
    """debug mode: one worker inside this process, without Ray, so that breakpoint() in a loss, a reward or a worker
    stops in this terminal (--num-workers is then 1)"""
    rollout_engine: Literal["hf", "vllm"] = "hf"
    """what generates rollouts: `hf`, transformers' generate on the policy itself; `vllm`, a vLLM engine in its process"""
    rollout_workers: int = flag(0, resumable=True)
    """0: the policy's own processes generate (the hybrid engine); N: N processes apart from the policy's, one
    --rollout-engine each, to which the policy sends its weights after each update (split placement, see README)"""
    max_staleness: int = flag(0, resumable=True)
    """0: each step generates its batch from the policy as it is, then trains; K: the rollout workers generate the next
    batches while the policy trains, from weights at most K updates older than the policy's (needs --rollout-workers;
    the scripts' losses then correct for the older weights, see README)"""
    rollout_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """with vllm: what the engine computes in (the trainer keeps fp32 weights; TIS corrects the gap)"""
    rollout_gpu_memory_utilization: float = 0.5
    """with vllm on GPUs: the share of each GPU's memory the engine takes for its weights and KV cache"""
    lora_sync: Literal["auto", "adapter", "merged"] = "auto"
    """with vllm and LoRA, what the engine receives after each update: the adapter alone, or the adapter merged into
    every weight; `auto`: merged on CPUs, where vLLM's LoRA kernels cost more than the model itself, the adapter on GPUs"""
    offload: bool = False
    """with vllm: move the policy's weights and optimiser state to CPU memory while the engine generates"""
    max_rollout_logprob_diff: float = flag(0.1, resumable=True)
    """stop when the engine's log-probs of its samples differ from the trainer's by more than this per token (0: never)"""
    temperature: float = 1.0
    """sampling temperature, also applied to the logits when computing log-probs"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
    top_k: int = 0
    """top-k sampling, 0 disables"""

    total_steps: int = flag(500, resumable=True, positive=True)
    """training steps (one batch of prompts each)"""
    train_batch_size: int = flag(32, positive=True)
    """prompts per step"""
    n: int = flag(8, positive=True)
    """responses sampled per prompt"""
    mini_batch_size: int = flag(32, positive=True)
    """prompts per optimiser step; train-batch-size / mini-batch-size steps per batch"""
    micro_batch_size: int = flag(8, positive=True, resumable=True)
    """sequences per forward/backward on one worker (gradient accumulation beyond that)"""
    micro_batch_tokens: int = flag(0, resumable=True)
    """tokens (prompt and response, no padding) per forward/backward on one worker, as many sequences as fit, in place
    of --micro-batch-size; at least --max-prompt-length + --max-response-length (0: count sequences instead)"""
    ppo_epochs: int = flag(1, positive=True)
    """passes over each batch"""
    lr: float = 1e-6
    """policy learning rate"""
    lr_warmup_steps: int = 0
    """linear learning-rate warm-up, in training steps"""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """after the warm-up: keep --lr, or decay it along a cosine to 0 at --total-steps (a resumed run that raises
    --total-steps follows the longer curve from there)"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    compute_dtype: Literal["auto", "bfloat16", "float32"] = flag("auto", resumable=True)
    """what the policy and the critic compute in (log-probs, the reference, updates, the hf engine), over fp32 master
    weights: `auto` takes bfloat16 on GPUs and on CPUs that compute it natively (AVX512-BF16 or AMX), float32
    elsewhere"""
    gradient_checkpointing: bool = False
    """recompute activations in backward to save memory"""
    sequence_parallel: int = flag(1, positive=True, resumable=True)
    """workers that split each sequence's tokens among them in the log-prob, reference, value and update passes, for
    responses too long for one worker's memory (Ulysses: they swap tokens for heads around attention);
    --num-workers must be a multiple of it, and the batch sizes split over --num-workers / it"""
    log_prob_chunk_tokens: int = flag(1024, resumable=True)
    """response tokens whose logits over the vocabulary exist at once in the log-prob, reference and update passes
    (the update computes each chunk's again in backward); 0: all of a micro-batch's at once"""
    lora_rank: int = 0
    """LoRA rank; 0 trains every weight. With LoRA the reference is the model with its adapter disabled"""
    lora_alpha: int = 16
    """LoRA scaling numerator"""
    lora_target_modules: str = "all-linear"
    """modules that get an adapter"""

    reward_workers: int | None = flag(None, resumable=True)
    """processes that call the reward function, each on one response at a time, isolated from the run (default: one
    per CPU core, at most 16); 0 calls it in this process, one response after another (the default with --in-process)"""
    reward_timeout: float = flag(10.0, resumable=True)
    """seconds a reward function may take for one response (an environment for one step) before it is stopped and
    scores 0 (0: no limit)"""
    max_reward_error_share: float = flag(0.5, resumable=True)
    """stop when the reward function fails for more than this share of a batch's responses (1: never)"""
    reward_model: str | None = None
    """a reward model (a ...ForSequenceClassification folder with one label) that scores every response; a row whose
    data source has a rule scores rule + --reward-model-coef x the model's score, a row without one the model's alone"""
    reward_model_coef: float = 1.0
    """weight of the reward model's (or the judge's) score beside a rule's"""
    reward_model_workers: int = flag(0, resumable=True)
    """0: the reward model (or the judge) shares the policy's accelerators (colocated); N: N workers of its own, apart"""
    judge_model: str | None = None
    """an LLM judge (a causal language model folder, or a short name) that scores every response as --judge-template
    asks it; its score meets a rule's as --reward-model's does (see README)"""
    judge_template: str | None = None
    """with --judge-model: a text file holding the judge's question, with {prompt}, {response} and {ground_truth} in
    it, that asks for a verdict, Yes or No"""
    judge_mode: Literal["probability", "parsed"] = "probability"
    """how a verdict becomes a score: `probability`, p(Yes) / (p(Yes) + p(No)) of the judge's next token; `parsed`,
    1 or 0 for the first yes or no in the answer it writes on --rollout-engine (up to --judge-max-tokens)"""
    judge_max_tokens: int = flag(32, positive=True)
    """with --judge-mode parsed: the most tokens of the judge's answer"""
    judge_max_prompt_length: int = flag(2048, positive=True)
    """longest judge's question in the judge's tokens (the template filled in, in its chat template)"""
    test_freq: int = flag(25, resumable=True, positive=True)
    """validate every this many steps"""
    val_before_train: bool = flag(True, resumable=True)
    """validate once before the first step"""
    val_batch_size: int = flag(256, resumable=True, positive=True)
    """prompts per validation generate call"""
    val_n: int = flag(1, resumable=True, positive=True)
    """responses per validation prompt: 1 decodes greedily; more samples them for mean@n and pass@n"""
    save_freq: int = flag(100, resumable=True, positive=True)
    """save a checkpoint every this many steps, and always at the end"""
    keep_last: int = flag(2, resumable=True)
    """checkpoints to keep; older ones are deleted (0 keeps all)"""
    resume: str | None = flag(None, resumable=True)
    """`auto`: continue the newest complete checkpoint of this algorithm, exp-name and seed; or a step_<N> folder"""
    force_resume: bool = flag(False, resumable=True)
    """resume even from a checkpoint made with other settings"""
    export_adapter_only: bool = flag(False, resumable=True)
    """with LoRA, export only the adapter instead of the merged model"""
    max_bad_steps: int = flag(3, resumable=True)
    """stop after this many consecutive steps whose update was skipped for a NaN or inf gradient"""


class Run:
    """One training run of `algo` with `args` (a RunArgs), from the checks of its input to its exported model.

    `worker_groups`: how many groups share each accelerator (PPO's policy and critic: 2).
    `prompts_per_batch`: prompts per `next_prompts()`; default --train-batch-size.
    """

    def __init__(self, algo: str, args: RunArgs, worker_groups: int = 1, prompts_per_batch: int | None = None):
        import torch

        from common.checkpoint import check_config, find_checkpoint
        from common.data import PromptLoader, check_batch_sizes, load_prompts
        from common.envs import ENV_CALLS, load_env
        from common.isolation import CallProcesses, InProcessCalls
        from common.pretrained import resolve as resolve_model
        from common.rewards import REWARD_CALLS, check_data_sources, load_reward_fn
        from common.rollout import check_rollout, eos_token_ids
        from common.sequence_parallel import check_heads
        from common.tracking import Tracker

        # Everything that can be wrong with the input fails here, before any worker starts.
        self.algo, self.args = algo, args
        for field in dataclasses.fields(args):
            value = getattr(args, field.name)
            if field.metadata.get("positive") and value is not None and not value > 0:
                raise ValueError(f"{flag_name(field.name)} is {value}; it must be above 0")
        if not args.in_process:  # a cluster's GPUs are counted where its pool is made (ResourcePool)
            gpus = 0 if os.environ.get("RAY_ADDRESS") else torch.cuda.device_count()
            args.num_workers = count_workers(args.num_workers, gpus)
        num_workers = 1 if args.in_process else args.num_workers
        if num_workers % args.sequence_parallel:
            raise ValueError(
                f"--sequence-parallel {args.sequence_parallel} does not divide --num-workers {num_workers} into groups of "
                "workers; change one of them"
            )
        check_batch_sizes(args.train_batch_size, args.mini_batch_size, args.n, num_workers, args.sequence_parallel)
        check_rollout(args.rollout_engine, args.temperature, args.top_p, args.top_k, args.lora_sync, args.offload)
        longest = args.max_prompt_length + args.max_response_length
        if args.log_prob_chunk_tokens < 0:
            raise ValueError(f"--log-prob-chunk-tokens is {args.log_prob_chunk_tokens}; use 0 for all at once, or more")
        if args.micro_batch_tokens < 0:
            raise ValueError(f"--micro-batch-tokens is {args.micro_batch_tokens}; use 0 to count sequences, or more")
        if args.micro_batch_tokens > 0 and longest > args.micro_batch_tokens:
            raise ValueError(
                f"--micro-batch-tokens {args.micro_batch_tokens} cannot hold one sequence of --max-prompt-length + "
                f"--max-response-length = {longest} tokens; raise it, or use 0 to count sequences with --micro-batch-size"
            )
        if args.rollout_workers < 0 or (args.rollout_workers and args.in_process):
            raise ValueError(
                f"--rollout-workers is {args.rollout_workers}; use 0 for the policy's own processes to generate (the only "
                "choice with --in-process), or more for engines apart from them"
            )
        if args.max_staleness < 0 or (args.max_staleness and not args.rollout_workers):
            raise ValueError(
                f"--max-staleness is {args.max_staleness}: above 0, the engines generate while the policy trains, which "
                "needs engines apart from the policy's processes (--rollout-workers 1 or more); 0 is the synchronous loop"
            )
        if args.max_staleness and args.env:
            raise ValueError(
                "--env runs episodes turn by turn with the environment, a batch at a time: drop --max-staleness (the "
                "engines apart, --rollout-workers, still generate them)"
            )
        if args.rollout_workers and args.offload:
            raise ValueError("--offload makes room for an engine in the policy's processes: drop it with --rollout-workers")
        if args.reward_workers is not None and args.reward_workers < 0:
            raise ValueError(f"--reward-workers is {args.reward_workers}; use 0 to score in this process, or more")
        if args.judge_model is not None and (args.reward_model is not None or args.judge_template is None):
            raise ValueError(
                "--judge-model needs --judge-template (the question it answers), and takes the place of --reward-model: "
                "pass one of the two"
            )
        if args.judge_template is not None and args.judge_model is None:
            raise ValueError("--judge-template is the question of an LLM judge: pass --judge-model too")
        if args.reward_model_workers < 0 or (args.reward_model_workers and args.in_process):
            raise ValueError(
                f"--reward-model-workers is {args.reward_model_workers}; use 0 to share the policy's accelerators (the "
                "only choice with --in-process), or more to place the reward model apart"
            )
        torch.manual_seed(args.seed)
        if not args.train_files:
            raise ValueError("--train-files is missing: name the prompt files to train on (verl-style parquet or jsonl)")
        args.model_path = resolve_model(args.model_path)
        if args.sequence_parallel > 1:
            check_heads(args.model_path, args.sequence_parallel)
        self.tokenizer = load_tokenizer(args.model_path)
        if args.reward_model is not None:
            args.reward_model = resolve_model(args.reward_model)
            self.reward_model_tokenizer = load_tokenizer(args.reward_model, "--reward-model")
            check_reward_model(args.reward_model)
        if args.judge_model is not None:
            from common.judge import load_template, verdict_token_ids  # here: the module imports torch

            args.judge_model = resolve_model(args.judge_model)
            self.judge_tokenizer = load_tokenizer(args.judge_model, "--judge-model")
            self.judge_template = load_template(args.judge_template)
            if args.judge_mode == "probability":
                verdict_token_ids(self.judge_tokenizer, args.judge_model)
        self.eos_token_ids = eos_token_ids(args.model_path, self.tokenizer)
        pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.reward_fn = load_reward_fn(args.reward_fn)
        self.env_cls = load_env(args.env) if args.env else None
        train_data = load_prompts(args.train_files, self.tokenizer, args.max_prompt_length, args.truncate_prompts)
        scored_by_model = args.reward_model is not None or args.judge_model is not None
        if not scored_by_model:  # else rows without a rule are the model's alone
            check_data_sources(train_data, self.reward_fn)
        val_data = train_data
        if args.val_files:
            val_data = load_prompts(args.val_files, self.tokenizer, args.max_prompt_length, args.truncate_prompts)
            if not scored_by_model:
                check_data_sources(val_data, self.reward_fn)
        if args.judge_model is not None:
            from common.judge import check_question_length

            truths = [*train_data["ground_truth"], *val_data["ground_truth"]]
            longest = args.max_prompt_length + args.max_response_length
            check_question_length(self.judge_template, self.judge_tokenizer, truths, longest, args.judge_max_prompt_length)
        self.val_name = "held-out accuracy" if args.val_files else "accuracy on the training prompts (no --val-files)"
        batch_size = prompts_per_batch or args.train_batch_size
        if batch_size > len(train_data):
            flag = "--train-batch-size" if prompts_per_batch is None else "the prompts drawn per round (--gen-batch-size)"
            raise ValueError(
                f"{flag} is {batch_size} prompts, more than the {len(train_data)} in --train-files "
                f"{' '.join(args.train_files)}: lower it, or add prompts"
            )
        self.train_loader = PromptLoader(train_data, batch_size, pad_token_id, shuffle=True, seed=args.seed)
        self.val_loader = PromptLoader(val_data, args.val_batch_size, pad_token_id, shuffle=False, drop_last=False)
        run_prefix = f"{algo}__{args.exp_name}__{args.seed}"
        self.resume_from = find_checkpoint(args.resume, "runs", run_prefix)
        if self.resume_from is not None:
            check_config(self.resume_from, args, args.force_resume)
        elif args.resume == "auto":
            print(f"--resume auto: no checkpoint of runs/{run_prefix}__* yet, so this run starts from step 1")
        wandb = dict(wandb_project=args.wandb_project_name, wandb_entity=args.wandb_entity) if args.track else {}
        script = sys.argv[0] if sys.argv[0].endswith(".py") else None
        # the code that made the curve, and in wandb the experiment's group with the algorithm as a tag
        provenance = dict(script=script, group=args.exp_name, tags=(algo,))
        self.tracker = Tracker(run_prefix, dataclasses.asdict(args), self.resume_from, **wandb, **provenance)

        reward_workers = args.reward_workers
        if reward_workers is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # not on macOS
            reward_workers = 0 if args.in_process else min(cores, 16)
        if reward_workers:
            self.rewards = CallProcesses(args.reward_fn, reward_workers, REWARD_CALLS, args.reward_timeout)
        else:
            self.rewards = InProcessCalls(self.reward_fn, args.reward_fn, REWARD_CALLS, args.reward_timeout)
        self.env_calls = None
        if args.env and reward_workers:
            self.env_calls = CallProcesses(args.env, reward_workers, ENV_CALLS, args.reward_timeout)
        elif args.env:
            self.env_calls = InProcessCalls(self.env_cls, args.env, ENV_CALLS, args.reward_timeout)
        self.pool = None
        if not args.in_process:
            init_ray()
            import ray

            from common.workers import ResourcePool

            use_gpu = ray.cluster_resources().get("GPU", 0) > 0
            if args.offload and not use_gpu:
                raise ValueError("--offload frees GPU memory for the vllm engine; drop it on CPUs")
            kind, apart = ("GPU" if use_gpu else "CPU"), args.rollout_workers + args.reward_model_workers
            have = int(ray.cluster_resources().get(kind, 0))
            if apart and num_workers + apart > have:
                raise ValueError(
                    f"--num-workers {num_workers}, --rollout-workers {args.rollout_workers} and --reward-model-workers "
                    f"{args.reward_model_workers} need {num_workers + apart} {kind}s, one each; the Ray cluster has {have}: "
                    "lower them or add nodes"
                )
            colocated = scored_by_model and not args.reward_model_workers
            self.pool = ResourcePool(num_workers, use_gpu, max_colocated=worker_groups + colocated)
        self.reward_model, self.judge, self.reward_model_pool = None, None, None
        if scored_by_model:
            self._start_reward_model()
        self.groups, self.train_batches = {}, self.train_loader.forever()
        # the engines apart (--rollout-workers), and the policy's version: its updates so far
        self.engines, self.version = None, 0
        self.start_step, self.first_val, self.last_val, self.bad_steps = 1, None, None, 0
        self.resumed, self.stop, self.step_start, self.postfix, self.last_step = False, None, 0.0, {}, 0
        self.stopping = False  # a stop request seen when end_step decided whether to save

    def _start_reward_model(self) -> None:
        """The reward model's group, or the judge's: on the run's accelerators, on --reward-model-workers of its own,
        or in this process. It scores and never trains, so no checkpoint holds it."""
        from common.judge import Judge
        from common.workers import JudgeWorker, ResourcePool, RewardModelWorker, WorkerGroup

        args, pool = self.args, self.pool
        if args.reward_model_workers:
            self.reward_model_pool = pool = ResourcePool(args.reward_model_workers, self.pool.use_gpu)
        model = dict(
            micro_batch_size=args.micro_batch_size,
            micro_batch_tokens=args.micro_batch_tokens,
            seed=args.seed,
            compute_dtype=args.compute_dtype,
        )
        if args.reward_model is not None:
            self.reward_model = WorkerGroup(RewardModelWorker, pool, "reward_model", model_path=args.reward_model, **model)
            return
        engine = dict(
            rollout_engine=args.rollout_engine,
            rollout_dtype=args.rollout_dtype,
            rollout_gpu_memory_utilization=args.rollout_gpu_memory_utilization,
            max_model_len=args.judge_max_prompt_length + args.judge_max_tokens,
            temperature=1.0,
        )
        group = WorkerGroup(JudgeWorker, pool, "judge", model_path=args.judge_model, **model, **engine)
        self.judge = Judge(
            group,
            self.judge_tokenizer,
            self.judge_template,
            args.judge_mode,
            args.judge_max_tokens,
            args.judge_max_prompt_length,
            args.judge_model,
        )

    def workers(self, worker_cls, name: str, **settings):
        """A group of `worker_cls` on the run's accelerators (or in this process), set up with the run's model
        and optimiser settings, each overridden by `settings`."""
        from common.workers import WorkerGroup

        args = self.args
        defaults = dict(
            model_path=args.model_path,
            epochs=args.ppo_epochs,
            mini_batch_size=args.mini_batch_size * args.n,
            micro_batch_size=args.micro_batch_size,
            micro_batch_tokens=args.micro_batch_tokens,
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
        self.groups[name] = WorkerGroup(worker_cls, self.pool, name, **(defaults | settings))
        return self.groups[name]

    def policy(self, **settings):
        """The hybrid engine's group: the policy that trains, generates, and (with LoRA) scores the reference."""
        from common.workers import PolicyWorker

        args = self.args
        rollout = self._engine_settings() | dict(
            rollout_engine=None if args.rollout_workers else args.rollout_engine,
            lora_sync=args.lora_sync,
            offload=args.offload,
            log_prob_chunk_tokens=args.log_prob_chunk_tokens,
        )
        policy = self.workers(PolicyWorker, "policy", **(rollout | settings))
        if args.rollout_workers:
            self._start_rollout_workers(policy)
        return policy

    def _start_rollout_workers(self, policy) -> None:
        """--rollout-workers engines apart from the policy (common/rollout_workers.py). They get their first weights at
        the first generate."""
        from common.rollout import serves_adapter
        from common.rollout_workers import RolloutWorkers, probe

        args = self.args
        lora, on_gpu = args.lora_rank > 0, self.pool.use_gpu
        self.engines = RolloutWorkers(
            policy,
            args.rollout_workers,
            on_gpu,
            probe(self.val_loader.dataset, self.eos_token_ids, self.tokenizer.pad_token_id, args.max_response_length),
            args.max_rollout_logprob_diff,
            args.rollout_engine == "vllm" and serves_adapter(lora, args.lora_sync, on_gpu),
            **self._engine_settings(),
            model_path=args.model_path,
            compute_dtype=args.compute_dtype,
            seed=args.seed,
        )

    def _engine_settings(self) -> dict:
        """How a rollout engine generates, in the policy's processes or apart."""
        args = self.args
        return dict(
            temperature=args.temperature,
            rollout_engine=args.rollout_engine,
            rollout_dtype=args.rollout_dtype,
            rollout_gpu_memory_utilization=args.rollout_gpu_memory_utilization,
            max_model_len=args.max_prompt_length + args.max_response_length,
        )

    def _engines(self):
        """The group that generates: the policy's, or the engines apart, the policy's newest weights queued for them."""
        if self.engines is None:
            return self.groups["policy"]
        self.engines.send_weights(self.version)
        return self.engines.group

    def next_rollouts(self, n: int, metrics: dict):
        """The next batch of prompts, `n` samples of each (a prompt's samples share its uid), with the `staleness`
        of each sample: the updates the policy had since the weights that generated it.

        With --max-staleness 0 the batch is generated now, from the policy as it is. Above 0 it comes from the
        batches the rollout workers generate while the policy trains (--max-staleness + 1 asked at a time), each from
        the newest weights they held when they began it; one that would train more than --max-staleness updates after
        them is dropped, counted in `rollout/dropped_batches`, and another generated. `metrics` gets the seconds
        this waited for the engines (`timing/wait_for_rollouts`), the seconds the engines waited for prompts or weights
        before they began the batch (`timing/rollout_idle`, their mean), and the weight probe's gap."""
        import torch

        args = self.args
        if self.engines is None or args.env:
            batch = self.next_prompts().repeat(n, interleave=True)
            batch |= self.generate(batch)
            if self.engines is not None:
                self.engines.settle(metrics)
            batch["staleness"] = torch.zeros(len(batch), dtype=torch.long)
            return batch
        start = time.perf_counter()
        self.engines.send_weights(self.version)
        generate = dict(max_response_length=args.max_response_length, top_p=args.top_p, top_k=args.top_k)
        while True:
            while self.engines.batches_asked() < args.max_staleness + 1:
                position = self.train_loader.state_dict()
                self.engines.ask(self.next_prompts().repeat(n, interleave=True), position, **generate)
            batch = self.engines.take(metrics)
            batch["staleness"] = self.version - batch["weight_version"]
            if batch["staleness"].max() <= args.max_staleness:
                break
            metrics["rollout/dropped_batches"] = metrics.get("rollout/dropped_batches", 0) + 1
        metrics["timing/wait_for_rollouts"] = metrics.get("timing/wait_for_rollouts", 0.0) + time.perf_counter() - start
        return batch

    def generate(self, batch, do_sample: bool = True):
        """The policy's responses to `batch`'s prompts: one turn each, or with --env one episode each (see
        common/envs.py), whose environment's tokens `response_mask` leaves out. They carry the `weight_version` they
        were generated from: the policy's updates so far (single turns on rollout workers: as the engine held it)."""
        import torch

        from common.envs import run_episodes

        args, engines, prompts = self.args, self._engines(), batch.select("prompts", "prompt_mask")
        sampling = dict(do_sample=do_sample, top_p=args.top_p, top_k=args.top_k)
        if args.env:
            stop_strings = list(getattr(self.env_cls, "stop_strings", []))
            generated = run_episodes(
                engines,
                batch,
                self.env_calls,
                stop_strings,
                self.tokenizer,
                self.eos_token_ids,
                args.max_turns,
                args.max_response_length,
                sampling,
            )
        else:
            generated = engines.scatter("generate", prompts, max_response_length=args.max_response_length, **sampling)
        if "weight_version" not in generated:  # generated from the policy as it is now
            generated["weight_version"] = torch.full((len(generated),), self.version)
        return generated

    def next_prompts(self):
        """The next batch of prompts, reshuffled at every pass over the data."""
        return next(self.train_batches)

    def score(self, batch, metrics: dict):
        """One score per response of `batch` (see _score_texts); the reward's error and timeout counts are added to
        `metrics`, the other keys go to `batch["reward_extra"]` (logged as `reward/<key>` by end_step)."""
        import torch

        from common.rewards import response_texts

        scores, counts, batch["reward_extra"] = self._score_texts(response_texts(batch, self.tokenizer), batch)
        for key, value in counts.items():
            metrics[key] = metrics.get(key, 0) + value
        return torch.tensor(scores, dtype=torch.float32)

    def _score_texts(self, texts: list[str], batch) -> tuple[list[float], dict, list[dict]]:
        """Each response's score, the reward's error and timeout counts, and per response the keys beside its score:
        the rule's (common/rewards.py), or with --reward-model (--judge-model) the rule's and the model's as
        common/reward_model.py combines them, the model's under `model` (`judge`) and the rule's under `rule`."""
        import numpy as np

        from common.reward_model import combine, render_conversations, reward_model_batch
        from common.rewards import has_rule, score_texts

        args = self.args
        if self.reward_model is None and self.judge is None:
            return score_texts(texts, batch, self.rewards, args.max_reward_error_share)
        ruled = np.array([i for i, source in enumerate(batch["data_source"]) if has_rule(source, self.reward_fn)])
        rule_scores, counts, rule_extras = [], {"reward/errors": 0, "reward/timeouts": 0}, []
        if len(ruled):
            ruled_texts = [texts[i] for i in ruled]
            rule_scores, counts, rule_extras = score_texts(
                ruled_texts, batch[ruled], self.rewards, args.max_reward_error_share
            )
        if self.judge is not None:
            key = "judge"
            model_scores, counts["reward/judge_failures"] = self.judge.score(
                batch["prompt_messages"], texts, batch["ground_truth"], args.max_reward_error_share
            )
        else:
            key, tokenizer = "model", self.reward_model_tokenizer
            conversations = render_conversations(batch["prompt_messages"], texts, tokenizer)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
            rm_batch = reward_model_batch(conversations, pad)
            model_scores = self.reward_model.scatter("compute_rm_score", rm_batch)["rm_scores"].tolist()
        extras = [{key: score} for score in model_scores]
        for i, rule, extra in zip(ruled, rule_scores, rule_extras):
            extras[i] = extra | {key: model_scores[i], "rule": rule}
        return combine(dict(zip(ruled.tolist(), rule_scores)), model_scores, args.reward_model_coef), counts, extras

    def _validate(self) -> tuple[dict, list[dict]]:
        from common.rewards import validate

        self.last_val, samples = validate(self.generate, self.val_loader, self.tokenizer, self._score_texts, self.args.val_n)
        return self.last_val, samples

    def resume(self, **driver_state) -> dict:
        """Restore every worker group and the data's position from the checkpoint to resume, or validate first.

        `driver_state`: what the script keeps between steps besides the data's position (PPO's KL coefficient);
        returned as the checkpoint saved it, or as given on a fresh start.
        """
        from common.checkpoint import load_checkpoint

        self.resumed = True
        if self.resume_from is not None:
            saved = load_checkpoint(self.resume_from, self.groups)
            self.train_loader.load_state_dict(saved["loader"])
            self.start_step, self.version = saved["step"] + 1, saved["step"]
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
            self.step_start, self.version = time.perf_counter(), step - 1
            yield step
            progress.set_postfix(self.postfix)
            if self.stopping:  # a request that came after end_step's decision waits for the next step's checkpoint
                break

    def end_step(self, step: int, batch, scores, metrics: dict, **driver_state) -> None:
        """The step's standard metrics, then validation, a checkpoint (with `driver_state`) and the log when due.

        Stops the run after --max-bad-steps steps in a row whose updates a NaN or inf gradient skipped.
        """
        from common.checkpoint import save_checkpoint
        from common.envs import episode_metrics
        from common.rewards import extra_means
        from common.tracking import timer

        args, step_time = self.args, time.perf_counter() - self.step_start
        response_mask = batch["response_mask"]
        response_lengths = response_mask.sum(-1)
        if "entropy" in batch:  # else the update measured it
            metrics["actor/entropy"] = ((batch["entropy"] * response_mask).sum() / response_mask.sum()).item()
        metrics |= {
            "train/reward_mean": scores.mean().item(),
            "response/length_mean": response_lengths.mean().item(),
            "response/clip_ratio": (response_lengths == args.max_response_length).float().mean().item(),
            "timing/step": step_time,
            "perf/tokens_per_s": batch["attention_mask"].sum().item() / step_time,
        }
        if "staleness" in batch:  # updates between the weights that generated the samples and the policy's
            staleness = batch["staleness"].float()
            metrics |= {"rollout/staleness_mean": staleness.mean().item(), "rollout/staleness_max": staleness.max().item()}
        self.version = step  # the step's update: validation and the next generate see it
        if "ending" in batch:
            metrics |= episode_metrics(batch, "env/")
        # the reward's own keys beside its counts, which keep a name both use
        extras = extra_means(batch["reward_extra"] if "reward_extra" in batch else [], "reward/")
        metrics |= {key: value for key, value in extras.items() if key not in metrics}
        self.stopping = self.stop.requested
        last = step == args.total_steps or self.stopping
        if step % args.test_freq == 0 or step == args.total_steps:
            with timer("validate", metrics):
                val_metrics, samples = self._validate()
            metrics |= val_metrics
            self.tracker.log_samples(samples, step=step)
        self._record_peak_memory(metrics)
        if step % args.save_freq == 0 or last:
            with timer("save", metrics):
                driver = {"loader": self._data_position(), **driver_state}
                save_checkpoint(self.tracker.run_dir, step, self.groups, driver, args.keep_last)
        self.tracker.log(metrics, step=step)
        self.postfix = dict(reward=f"{metrics['train/reward_mean']:.3f}", step_s=f"{step_time:.2f}")
        self.last_step = step
        skipped = any(value for key, value in metrics.items() if key.endswith("skipped_updates"))
        self.bad_steps = self.bad_steps + 1 if skipped else 0
        if self.bad_steps >= args.max_bad_steps:
            raise RuntimeError(
                f"{self.bad_steps} steps in a row had NaN or inf gradients; their updates were skipped, so no weights "
                "are corrupted. Check the rewards and the learning rate, then continue with --resume auto"
            )

    def _data_position(self) -> dict:
        """Where the data stands for a resumed run: before the prompts of the batches the engines were asked for and
        no step has trained on (a resumed run generates them again)."""
        asked = self.engines.data_position() if self.engines is not None else None
        return asked or self.train_loader.state_dict()

    def _worker_groups(self) -> dict:
        groups = self.groups | ({"rollout": self.engines.group} if self.engines is not None else {})
        if self.judge is not None:
            return groups | {"judge": self.judge.group}
        return groups | ({"reward_model": self.reward_model} if self.reward_model is not None else {})

    def _record_peak_memory(self, metrics: dict) -> None:
        """The step's peak memory per worker method, the largest over ranks and calls (`perf/peak_memory_gb/policy/
        update`...: resident memory on CPUs, allocated memory on GPUs; see workers.measured), and the largest of all.
        The rollout workers report theirs with each batch (RolloutWorkers.take): asking them now would wait for the
        batches they are generating."""
        from common.workers import record_peak_memory

        for name, group in self._worker_groups().items():
            if name != "rollout":
                record_peak_memory(metrics, name, group.broadcast("phase_peak_memory"))
        peaks = [value for key, value in metrics.items() if key.startswith("perf/peak_memory_gb/")]
        metrics["perf/peak_memory_gb"] = max(peaks, default=0.0)

    def finish(self) -> None:
        """Report, export the policy (unless stopped early), and release the workers."""
        if self.first_val is not None:
            print(f"{self.val_name}: {self.first_val['val/accuracy']:.1%} before training")
        if self.last_val is not None:
            print(f"{self.val_name}: {self.last_val['val/accuracy']:.1%} at the last validation")
        run_dir = self.tracker.run_dir
        print(f"metrics and checkpoints in {run_dir}")
        if self.stop is not None and self.stop.requested:
            print(f"stopped after step {self.last_step}; continue with the same command and --resume auto")
        else:
            self.groups["policy"].broadcast("export", str(run_dir / "model"), adapter_only=self.args.export_adapter_only)
            print(f"the trained policy, as a Hugging Face model folder: {run_dir / 'model'}")
        self.tracker.close()
        self.rewards.close()
        if self.env_calls is not None:
            self.env_calls.close()
        for group in self._worker_groups().values():
            group.shutdown()
        for pool in (self.pool, self.reward_model_pool, self.engines.pool if self.engines is not None else None):
            if pool is not None:
                pool.shutdown()


def load_tokenizer(model_path: str, flag: str = "--model-path"):
    """The tokenizer of a model folder or hub id, with a message that names `flag` and says what is missing."""
    from transformers import AutoTokenizer

    path = Path(model_path)
    if path.exists() or model_path.startswith((".", "/", "~")) or model_path.count("/") > 1:
        if not path.is_dir():
            raise ValueError(f"{flag} {model_path}: no such folder; pass a Hugging Face model folder or hub id")
        if not (path / "config.json").is_file():
            raise ValueError(f"{flag} {model_path}: no config.json in it; pass a folder saved by save_pretrained")
    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as error:
        raise ValueError(f"{flag} {model_path}: no tokenizer could be loaded from it ({error})") from error


def check_reward_model(path: str) -> None:
    """Fail before any worker starts when --reward-model is no sequence-classification model with one label."""
    import json

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return  # a hub id: the worker's own check says what is wrong
    config = json.loads(config_file.read_text())
    architectures, labels = config.get("architectures") or [], len(config.get("id2label") or {0: ""})
    if not any(name.endswith("ForSequenceClassification") for name in architectures) or labels != 1:
        raise ValueError(
            f"--reward-model {path}: its config.json names {architectures or 'no architecture'} with {labels} labels; a "
            "reward model is a ...ForSequenceClassification with one label (num_labels=1), one score per sequence"
        )


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
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
    if not address:
        ray.init(include_dashboard=False, runtime_env=env)
        return
    try:
        ray.init(address=address, runtime_env=env)
    except ConnectionError as error:
        mode = os.environ.get("RAY_AUTH_MODE", "disabled")
        raise ConnectionError(
            f"could not join the Ray cluster at RAY_ADDRESS={address} with RAY_AUTH_MODE={mode}. Is the head node "
            "up at that address? A cluster started with token authentication needs RAY_AUTH_MODE=token and its token "
            "(~/.ray/auth_token, or RAY_AUTH_TOKEN); one started without needs RAY_AUTH_MODE=disabled"
        ) from error
