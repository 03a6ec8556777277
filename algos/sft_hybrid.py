# Supervised fine-tuning on chat transcripts: the warm start a small model needs before RL can reinforce a format it
# never writes on its own (a tool call, an answer's shape). Ouyang et al. 2022, "Training language models to follow
# instructions with human feedback" (https://arxiv.org/abs/2203.02155), step 1: maximise the likelihood of the
# demonstrations' assistant turns. The loss is the negative log-likelihood of the assistant's tokens alone (its
# content, its tool calls, its end-of-turn token; common/transcripts.py finds them), averaged over them.
from dataclasses import dataclass

import tyro

from common.run import RunArgs, flag


@dataclass
class Args(RunArgs):
    """The warm start's flags; those every script shares (model, workers, batches, LoRA, checkpoints) are in
    common/args.py (--tools, --env and the reward among them, for validation). Here a batch is --train-batch-size
    transcripts, and validation is the loss on --val-files, or RL's validation on them where they hold RL prompts."""

    train_files: list[str] | None = None
    """chat transcripts to learn from: parquet or jsonl rows with `messages` (OpenAI's chat format, tool calls and tool
    results included) and optionally `tools` (JSON schemas); see docs/warm-start.md"""
    val_files: list[str] | None = None
    """held-out transcripts in the same format, whose loss validation measures (without them, the training ones'); or
    RL prompts, played greedily with --tools/--env and scored as the RL scripts do: the held-out accuracy RL will start
    from, and the share of episodes that call a tool (docs/warm-start.md)"""
    lr: float = 1e-5
    """learning rate"""
    total_steps: int = flag(200, resumable=True, positive=True)
    """training steps (one batch of transcripts each)"""
    train_batch_size: int = flag(32, positive=True)
    """transcripts per step"""
    mini_batch_size: int = flag(32, positive=True)
    """transcripts per optimiser step; train-batch-size / mini-batch-size steps per batch"""
    n: int = flag(1, positive=True)
    """(kept at 1: a transcript is trained on once per batch)"""
    test_freq: int = flag(20, resumable=True, positive=True)
    """validate every this many steps"""


def sft_loss(batch, outputs, minibatch_tokens, minibatch_seqs):
    """The mean negative log-likelihood of the assistant's tokens of the mini-batch, this micro-batch's share of it:
    divided by the mini-batch's token count over every micro-batch and rank, never the micro-batch's own, so that the
    shares add up to the mini-batch's mean however it is split (the loss contract of grpo_hybrid.py's agg_loss)."""
    log_prob, entropy = outputs  # [batch, response_len] each, 0 on padding
    mask = batch["response_mask"]  # [batch, response_len]: 1 on the assistant's tokens, 0 on the user's, tools', padding
    tokens = max(minibatch_tokens, 1)
    loss = -(log_prob * mask).sum() / tokens
    return loss, {"entropy": ((entropy * mask).sum() / tokens).detach()}


if __name__ == "__main__":
    from common import demo
    from common.run import Run
    from common.tracking import timer

    args = tyro.cli(Args)
    args = demo.apply_warm_start(Args, args)
    if args.n != 1:
        raise ValueError(f"--n {args.n}: a transcript is its own response, learnt once per batch; leave --n at 1")
    run = Run(args, supervised=True)
    policy = run.policy()
    update_inputs = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")

    for step in run.steps():
        metrics = {}

        # 1. The next transcripts: prompt tokens (before the assistant's first), then the rest with the assistant's mask.
        batch = run.next_transcripts()

        # 2. One pass of gradient steps on them: the update's loss is this script's sft_loss.
        with timer("update", metrics):
            update = policy.update(batch.select(*update_inputs), sft_loss)
        metrics |= {f"actor/{key}": value for key, value in update.items()}
        run.end_step(step, batch, None, metrics)

    run.finish()
