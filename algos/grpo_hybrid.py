# GRPO: Shao et al. 2024, "DeepSeekMath" (https://arxiv.org/abs/2402.03300), section 4.1
# Group-relative advantages from outcome rewards, a clipped policy loss, KL to the reference as a loss; no critic.
import os
from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np
import torch
import tyro


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    track: bool = False
    """log metrics and config to wandb"""
    wandb_project_name: str = "hybridrl"
    """the wandb project"""
    wandb_entity: str | None = None
    """the wandb entity (team)"""

    model_path: str | None = None
    """HF model folder or hub id; leave unset for the built-in demo (a tiny model on an addition task)"""
    train_files: list[str] | None = None
    """training prompts, verl-style parquet or jsonl files"""
    val_files: list[str] | None = None
    """validation prompts, same format"""
    reward_fn: str | None = None
    """your reward, `path/to/file.py:function_name`; by default a built-in reward per data_source"""
    max_prompt_length: int = 512
    """longest prompt in tokens; a longer one is an error unless --truncate-prompts"""
    truncate_prompts: bool = False
    """keep the last --max-prompt-length tokens of a longer prompt instead of stopping"""
    max_response_length: int = 1024
    """most tokens generated per response"""

    num_workers: int = 2
    """policy processes, one per GPU (per CPU slot without GPUs)"""
    rollout_engine: Literal["hf", "vllm"] = "hf"
    """what generates rollouts: `hf`, transformers' generate on the policy itself; `vllm`, a vLLM engine in its process"""
    rollout_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """with vllm: what the engine computes in (the trainer keeps fp32 weights; TIS corrects the gap)"""
    rollout_gpu_memory_utilization: float = 0.5
    """with vllm on GPUs: the share of each GPU's memory the engine takes for its weights and KV cache"""
    lora_merge: bool = False
    """with vllm and LoRA: send the engine the adapter merged into the weights, instead of the adapter alone"""
    offload: bool = False
    """with vllm: move the policy's weights and optimiser state to CPU memory while the engine generates"""
    max_rollout_logprob_diff: float = 0.1
    """stop when the engine's log-probs of its samples differ from the trainer's by more than this per token (0: never)"""
    micro_batch_size: int = 8
    """sequences per forward/backward on one worker (gradient accumulation beyond that)"""
    val_batch_size: int = 256
    """prompts per validation generate call"""
    val_n: int = 1
    """responses per validation prompt: 1 decodes greedily; more samples them for mean@n and pass@n"""
    reward_timeout: float = 10.0
    """seconds a reward function may take for one response before it scores 0 (0: no limit)"""
    max_reward_error_share: float = 0.5
    """stop when the reward function fails for more than this share of a batch's responses (1: never)"""

    total_steps: int = 500
    """training steps (one batch of prompts each)"""
    train_batch_size: int = 32
    """prompts per step"""
    n: int = 8
    """responses sampled per prompt (the group)"""
    temperature: float = 1.0
    """sampling temperature, also applied to the logits when computing log-probs"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
    top_k: int = 0
    """top-k sampling, 0 disables"""
    mini_batch_size: int = 32
    """prompts per optimiser step; train-batch-size / mini-batch-size steps per batch"""
    ppo_epochs: int = 1
    """passes over each batch"""
    lr: float = 1e-6
    """policy learning rate"""
    lr_warmup_steps: int = 0
    """linear learning-rate warm-up, in training steps"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    gradient_checkpointing: bool = False
    """recompute activations in backward to save memory"""
    lora_rank: int = 0
    """LoRA rank; 0 trains every weight. With LoRA the reference is the model with its adapter disabled"""
    lora_alpha: int = 16
    """LoRA scaling numerator"""
    lora_target_modules: str = "all-linear"
    """modules that get an adapter"""

    norm_adv_by_std: bool = True
    """divide advantages by the group's std (False: Dr.GRPO)"""
    clip_ratio_low: float = 0.2
    """PPO clip range below 1"""
    clip_ratio_high: float = 0.2
    """PPO clip range above 1"""
    clip_ratio_c: float = 3.0
    """dual-clip bound for negative advantages"""
    tis: bool = False
    """truncated importance sampling: weight each token's policy loss by pi_old / pi_rollout, for the rollout engine's numerics"""
    tis_cap: float = 2.0
    """upper bound of the TIS weight"""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """how per-token losses become one number"""
    kl_loss_coef: float = 0.001
    """weight of KL(policy || reference) in the loss; 0 skips the reference"""
    kl_loss_type: Literal["kl", "abs", "mse", "low_var_kl"] = "low_var_kl"
    """KL estimator: k1, |k1|, k2, k3"""
    entropy_coef: float = 0.0
    """entropy bonus"""

    test_freq: int = 25
    """validate every this many steps"""
    val_before_train: bool = True
    """validate once before the first step"""
    save_freq: int = 100
    """save a checkpoint every this many steps, and always at the end"""
    keep_last: int = 2
    """checkpoints to keep; older ones are deleted (0 keeps all)"""
    resume: str | None = None
    """`auto`: continue the newest complete checkpoint of this algorithm, exp-name and seed; or a checkpoints/step_<N> folder"""
    force_resume: bool = False
    """resume even from a checkpoint made with other settings"""
    export_adapter_only: bool = False
    """with LoRA, export only the adapter instead of the merged model"""
    max_bad_steps: int = 3
    """stop after this many consecutive steps whose update was skipped for a NaN or inf gradient"""


def compute_grpo_advantages(scores: torch.Tensor, group_ids: np.ndarray, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """(score - group mean) / (group std + eps), groups being the samples of one prompt.

    The std uses Bessel's correction; a group of one has mean 0 and std 1.
    """
    advantages = torch.empty_like(scores)
    for group in np.unique(group_ids):
        members = torch.as_tensor(np.flatnonzero(group_ids == group))
        group_scores = scores[members]
        if len(members) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = group_scores.mean(), group_scores.std()
        advantages[members] = (group_scores - mean) / (std + eps) if norm_by_std else group_scores - mean
    return advantages


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) (Schulman, "Approximating KL divergence")."""
    log_ratio = log_prob - ref_log_prob
    if kind == "kl":  # k1
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind == "mse":  # k2
        return 0.5 * log_ratio.square()
    if kind == "low_var_kl":  # k3: unbiased and always positive
        ref_over_policy = (-log_ratio).clamp(-20, 20)
        return (ref_over_policy.exp() - ref_over_policy - 1).clamp(-10, 10)
    raise ValueError(f"unknown KL estimator '{kind}'")


def agg_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, num_tokens: float | None = None, num_seqs: float | None = None) -> torch.Tensor:
    """Reduce a [batch, tokens] loss over the valid tokens.

    `num_tokens` and `num_seqs` are the counts of the whole mini-batch (over
    every micro-batch and rank); with them, the results of all micro-batches
    add up to the mini-batch's value. They default to this batch's own counts.
    """
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs
    token_sums = (loss * mask).sum(-1)
    if mode == "token-mean":
        return token_sums.sum() / num_tokens
    if mode == "seq-mean-token-sum":
        return token_sums.sum() / num_seqs
    if mode == "seq-mean-token-mean":
        return (token_sums / mask.sum(-1).clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":  # Dr.GRPO: a constant length normaliser
        return token_sums.sum() / (num_seqs * mask.shape[-1])
    raise ValueError(f"unknown loss aggregation '{mode}'")


def compute_tis_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, cap: float) -> torch.Tensor:
    """min(pi_old / pi_rollout, cap) per token: the rollout engine samples from slightly other probabilities
    than the trainer computes (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training")."""
    return (old_log_prob - rollout_log_prob).clamp(max=20).exp().clamp(max=cap)


def compute_policy_loss(old_log_prob, log_prob, advantages, mask, clip_low, clip_high, clip_c, agg_mode, num_tokens=None, num_seqs=None, tis_weights=None):
    """PPO's clipped surrogate with dual-clip (Ye et al. 2020) for negative advantages, optionally TIS-weighted."""
    log_ratio = (log_prob - old_log_prob).clamp(-20, 20)
    ratio = log_ratio.exp()
    surrogate = -advantages * ratio
    surrogate_clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    clipped_loss = torch.maximum(surrogate, surrogate_clipped)
    dual_clipped_loss = torch.minimum(clipped_loss, -advantages * clip_c)
    per_token = torch.where(advantages < 0, dual_clipped_loss, clipped_loss)
    if tis_weights is not None:
        per_token = per_token * tis_weights
    token_mean = partial(agg_loss, mask=mask, mode="token-mean", num_tokens=num_tokens)
    metrics = {
        "clipfrac": token_mean((surrogate_clipped > surrogate).float()).detach(),
        "clipfrac_dual": token_mean(((clipped_loss > -advantages * clip_c) & (advantages < 0)).float()).detach(),
        "approx_kl": token_mean(-log_ratio).detach(),
    }
    if tis_weights is not None:
        metrics["tis_weight"] = token_mean(tis_weights).detach()
    return agg_loss(per_token, mask, agg_mode, num_tokens, num_seqs), metrics


def actor_loss(batch, outputs, minibatch_tokens, minibatch_seqs, args: Args):
    """The policy's loss on one micro-batch, as its share of the mini-batch (see agg_loss)."""
    log_prob, entropy = outputs
    mask = batch["response_mask"]
    aggregate = partial(agg_loss, mask=mask, mode=args.loss_agg_mode, num_tokens=minibatch_tokens, num_seqs=minibatch_seqs)
    tis_weights = compute_tis_weights(batch["old_log_probs"], batch["rollout_log_probs"], args.tis_cap) if args.tis else None
    pg_loss, metrics = compute_policy_loss(
        batch["old_log_probs"], log_prob, batch["advantages"], mask,
        args.clip_ratio_low, args.clip_ratio_high, args.clip_ratio_c, args.loss_agg_mode, minibatch_tokens, minibatch_seqs, tis_weights,
    )  # fmt: skip
    loss = pg_loss - args.entropy_coef * aggregate(entropy)
    metrics["pg_loss"] = pg_loss.detach()
    if args.kl_loss_coef > 0:
        kl = aggregate(kl_penalty(log_prob, batch["ref_log_probs"], args.kl_loss_type))
        loss = loss + args.kl_loss_coef * kl
        metrics["kl"] = kl.detach()
    return loss, metrics


if __name__ == "__main__":
    import time

    import ray
    from tqdm import trange
    from transformers import AutoTokenizer

    from common import demo
    from common.checkpoint import StopRequest, check_config, find_checkpoint, load_checkpoint, save_checkpoint
    from common.data import PromptLoader, check_batch_sizes, check_positive, load_prompts
    from common.rewards import check_data_sources, load_reward_fn, score, validate
    from common.tracking import Tracker, timer
    from common.vllm_rollout import check_rollout
    from common.workers import PolicyWorker, ResourcePool, WorkerGroup, init_ray, rollout_logprob_gap

    args = tyro.cli(Args)
    check_rollout(args.rollout_engine, args.temperature, args.top_p, args.top_k)
    if args.model_path is None:
        args = demo.apply(Args, lr=3e-4, max_prompt_length=8, max_response_length=4, micro_batch_size=256, train_batch_size=64, mini_batch_size=16, total_steps=400)
    torch.manual_seed(args.seed)

    # Everything that can be wrong with the input fails here, before any worker starts.
    check_positive(args, "num_workers", "total_steps", "train_batch_size", "mini_batch_size", "micro_batch_size", "n")
    check_positive(args, "ppo_epochs", "max_prompt_length", "max_response_length", "val_batch_size", "val_n")
    check_positive(args, "test_freq", "save_freq")
    check_batch_sizes(args.train_batch_size, args.mini_batch_size, args.n, args.num_workers)
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    reward_fn = load_reward_fn(args.reward_fn)
    train_data = load_prompts(args.train_files, tokenizer, args.max_prompt_length, args.truncate_prompts)
    val_data = load_prompts(args.val_files or args.train_files, tokenizer, args.max_prompt_length, args.truncate_prompts)
    check_data_sources(train_data, reward_fn)
    check_data_sources(val_data, reward_fn)
    train_loader = PromptLoader(train_data, args.train_batch_size, pad_token_id, shuffle=True, seed=args.seed)
    val_loader = PromptLoader(val_data, args.val_batch_size, pad_token_id, shuffle=False, drop_last=False)
    resume_from = find_checkpoint(args.resume, "runs", f"grpo__{args.exp_name}__{args.seed}")
    if resume_from is not None:
        check_config(resume_from, args, args.force_resume)
    tracker = Tracker("grpo", args, resume_from=resume_from)

    init_ray()
    pool = ResourcePool(args.num_workers, use_gpu=ray.cluster_resources().get("GPU", 0) > 0)
    policy = WorkerGroup(
        PolicyWorker, pool, "policy",
        model_path=args.model_path, seed=args.seed, lr=args.lr, weight_decay=args.weight_decay,
        lr_warmup_steps=args.lr_warmup_steps, max_grad_norm=args.max_grad_norm,
        gradient_checkpointing=args.gradient_checkpointing, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
        lora_target_modules=args.lora_target_modules, use_reference=args.kl_loss_coef > 0, rollout_engine=args.rollout_engine,
        rollout_dtype=args.rollout_dtype, rollout_gpu_memory_utilization=args.rollout_gpu_memory_utilization,
        max_model_len=args.max_prompt_length + args.max_response_length, lora_merge=args.lora_merge, offload=args.offload,
    )  # fmt: skip
    reward_limits = dict(timeout=args.reward_timeout, max_error_share=args.max_reward_error_share)
    sampling = dict(max_response_length=args.max_response_length, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    log_prob_inputs = ("input_ids", "attention_mask", "position_ids", "responses")
    log_prob_kwargs = dict(temperature=args.temperature, micro_batch_size=args.micro_batch_size)

    start_step, first_val, last_val, bad_steps = 1, None, None, 0
    if resume_from is not None:
        driver_state = load_checkpoint(resume_from, {"policy": policy})
        train_loader.load_state_dict(driver_state["loader"])
        start_step = driver_state["step"] + 1
        print(f"resumed from {resume_from}")
    elif args.val_before_train:
        first_val, samples = validate(policy, val_loader, tokenizer, reward_fn, sampling, args.val_n, **reward_limits)
        last_val = first_val
        tracker.log(first_val, step=0)
        tracker.log_samples(samples, step=0)
    train_batches = train_loader.forever()
    stop, step = StopRequest(), start_step - 1
    progress = trange(start_step, args.total_steps + 1, desc="grpo")
    for step in progress:
        metrics, step_start = {}, time.perf_counter()

        # 1. Rollout: n samples of every prompt; a prompt's samples share its uid (the group).
        with timer("generate", metrics):
            batch = next(train_batches).repeat(args.n, interleave=True)
            batch |= policy.scatter("generate", batch.select("prompts", "prompt_mask"), **sampling)
        response_mask = batch.batch["response_mask"]

        # 2. Outcome reward: one score per response.
        with timer("reward", metrics):
            scores, reward_metrics = score(batch, tokenizer, reward_fn, **reward_limits)

        # 3. Log-probs of the sampled tokens under the policy that sampled them, and under the reference.
        with timer("old_log_prob", metrics):
            batch |= policy.scatter("compute_log_prob", batch.select(*log_prob_inputs), **log_prob_kwargs)
        # How far the engine's probabilities of its own samples are from the trainer's (what TIS corrects); a gap
        # that numerics cannot explain stops the run: the engine would be sampling from other weights.
        metrics |= rollout_logprob_gap(batch, args.max_rollout_logprob_diff)
        if args.kl_loss_coef > 0:
            with timer("ref_log_prob", metrics):
                batch |= policy.scatter("compute_ref_log_prob", batch.select(*log_prob_inputs), **log_prob_kwargs)

        # 4. GRPO's advantage: the response's score relative to its group, the same for each of its tokens.
        with timer("advantages", metrics):
            advantages = compute_grpo_advantages(scores, batch.non_tensor["uid"], args.norm_adv_by_std)
            batch.batch["advantages"] = advantages[:, None] * response_mask

        # 5. Policy update: clipped surrogate + KL loss, over epochs x mini-batches x micro-batches.
        with timer("update", metrics):
            update_inputs = batch.select(
                *log_prob_inputs, "response_mask", "old_log_probs", "advantages",
                *(["ref_log_probs"] if args.kl_loss_coef > 0 else []), *(["rollout_log_probs"] if args.tis else []),
            )  # fmt: skip
            actor_metrics = policy.scatter(
                "update", update_inputs, loss_fn=partial(actor_loss, args=args), temperature=args.temperature,
                epochs=args.ppo_epochs, mini_batch_size=args.mini_batch_size * args.n, micro_batch_size=args.micro_batch_size,
            )[0]  # fmt: skip

        step_time = time.perf_counter() - step_start
        response_lengths = response_mask.sum(-1)
        metrics.update(reward_metrics)
        metrics.update({f"actor/{k}": v for k, v in actor_metrics.items()})
        metrics.update({
            "train/reward_mean": scores.mean().item(),
            "actor/entropy": ((batch.batch["entropy"] * response_mask).sum() / response_mask.sum()).item(),
            "response/length_mean": response_lengths.mean().item(),
            "response/clip_ratio": (response_lengths == args.max_response_length).float().mean().item(),
            "timing/step": step_time,
            "perf/tokens_per_s": batch.batch["attention_mask"].sum().item() / step_time,
        })  # fmt: skip
        if step % args.test_freq == 0 or step == args.total_steps:
            with timer("validate", metrics):
                last_val, samples = validate(policy, val_loader, tokenizer, reward_fn, sampling, args.val_n, **reward_limits)
            metrics.update(last_val)
            tracker.log_samples(samples, step=step)
        if step % args.save_freq == 0 or step == args.total_steps or stop.requested:
            with timer("save", metrics):
                save_checkpoint(tracker.run_dir, step, {"policy": policy}, {"loader": train_loader.state_dict()}, args.keep_last)
        tracker.log(metrics, step=step)
        progress.set_postfix(reward=f"{metrics['train/reward_mean']:.3f}", step_s=f"{step_time:.2f}")
        bad_steps = bad_steps + 1 if actor_metrics.get("skipped_updates") else 0
        if bad_steps >= args.max_bad_steps:
            raise RuntimeError(
                f"{bad_steps} steps in a row had NaN or inf gradients; their updates were skipped, so no weights are "
                "corrupted. Check the rewards and the learning rate, then continue with --resume auto"
            )
        if stop.requested:
            break

    if first_val is not None:
        print(f"held-out accuracy: {first_val['val/accuracy']:.1%} before training")
    if last_val is not None:
        print(f"held-out accuracy: {last_val['val/accuracy']:.1%} at the last validation")
    print(f"metrics and checkpoints in {tracker.run_dir}")
    if stop.requested:
        print(f"stopped after step {step}; continue with the same command and --resume auto")
    else:
        policy.rank0("export", str(tracker.run_dir / "model"), adapter_only=args.export_adapter_only)
        print(f"the trained policy, as a Hugging Face model folder: {tracker.run_dir / 'model'}")
    tracker.close()
    policy.shutdown()
    pool.shutdown()
