"""What a warm start (algos/sft_hybrid.py) validates with, when its --val-files hold RL prompts instead of transcripts:
what RL will start from, measured as the RL scripts' validation measures it (common/rewards.validate), with --tools,
--env and the reward as they take them. The greedy held-out accuracy, and of the episodes the share that call a tool
(`val/env/tool_call_share`) beside the rest of RL's episode figures (`val/env/...`), tell when the format has taken.
"""

from __future__ import annotations

import dataclasses

from common.data import DataError, data_files, read_rows


def holds_prompts(files: list[str] | None) -> bool:
    """Whether data files hold RL prompts (rows with `prompt`, as the RL scripts take them) rather than transcripts
    (rows with `messages`); files of both kinds at once are an error that names them."""
    kinds = {path: "prompt" in (row := read_rows(path)[0]) and "messages" not in row for path in data_files(files or [])}
    if len(set(kinds.values())) > 1:
        prompts = ", ".join(path for path, prompt in kinds.items() if prompt)
        raise DataError(
            f"--val-files mixes RL prompts ({prompts}) with transcripts: pass the prompts, whose episodes validation plays "
            "and scores, or the transcripts, whose loss it measures"
        )
    return any(kinds.values())


class GenerationValidation:
    """RL's validation in a supervised run: the prompts of --val-files, their episodes played by the policy's own
    engine (a RolloutSupply, as the RL scripts generate) and scored by the run's Scorer; everything checked when
    made, before any worker starts."""

    name = "held-out accuracy"

    @classmethod
    def of(cls, args, tokenizer, eos_token_ids: list[int]) -> GenerationValidation | None:
        """The validation by generation a supervised run's flags ask for: with --val-files of RL prompts; None with
        transcripts, where --tools and --env have nothing to play."""
        if not holds_prompts(args.val_files):
            if args.env or args.tools:
                raise ValueError(
                    "--tools and --env play RL's episodes in the warm start's validation: pass --val-files of RL prompts "
                    "(the files the RL scripts take) to validate by generation, or leave them out to validate by the loss"
                )
            return None
        if args.reward_model or args.judge_model:
            raise ValueError(
                "the warm start's validation scores its episodes by rule (a built-in per data_source, or --reward-fn): "
                "leave --reward-model and --judge-model to the RL run"
            )
        return cls(args, tokenizer, eos_token_ids)

    def __init__(self, args, tokenizer, eos_token_ids: list[int]):
        from common.data import PromptLoader, load_prompts, pad_token_id
        from common.envs import episode_spec, load_environments
        from common.scoring import Scorer

        self.args, self.tokenizer, self.eos_token_ids = args, tokenizer, eos_token_ids
        self.scorer = Scorer(args, tokenizer)
        self.environments = load_environments(episode_spec(args.env, args.tools)) if args.env or args.tools else None
        envs = self.environments and self.environments.check(tokenizer, eos_token_ids)  # each one's tools, by name
        overlong = "drop" if args.filter_overlong_prompts else "truncate" if args.truncate_prompts else "error"
        prompts = load_prompts(args.val_files, tokenizer, args.max_prompt_length, overlong, envs)
        self.scorer.check_prompts(prompts, prompts, self.environments)
        pad = pad_token_id(tokenizer, eos_token_ids)
        self.loader = PromptLoader(prompts, args.val_batch_size, pad, shuffle=False, drop_last=False)
        self.rollouts = None

    def start(self, pool, reward_workers: int, engine) -> None:
        """The scorer's processes, and the environments' with --env or --tools (`reward_workers`, as in RL); `engine`:
        the run's engine settings (EngineSettings)."""
        from common.rollout_supply import RolloutSupply

        self.scorer.start(pool, reward_workers, engine)
        self.rollouts = RolloutSupply(
            self.args, engine, self.tokenizer, self.eos_token_ids, self.loader, self.environments, reward_workers
        )

    def policy_settings(self) -> dict:
        """The policy's rollout engine; its log-probs stay those of the data at temperature 1, and no reference."""
        settings = self.rollouts.policy_settings()
        return settings | dict(engine=dataclasses.replace(settings["engine"], temperature=1.0), use_reference=False)

    def attach(self, policy, pool) -> None:
        """Generate from `policy`, the group that trains."""
        self.rollouts.start(policy, pool, self.loader.dataset)

    def __call__(self, step: int) -> tuple[dict, list[dict]]:
        """RL's validation of the policy after `step` steps (0: before the first), greedy or --val-n samples a prompt:
        its metrics and every episode, and a line on the console with the accuracy, the share of episodes that called a
        tool, their tool errors and the share that answered."""
        from common.rewards import validate

        n = self.args.val_n
        self.rollouts.version = step
        metrics, samples = validate(self.rollouts.generate, self.loader, self.tokenizer, self.scorer.score_texts, n)
        line = f"step {step}: held-out accuracy {metrics['val/accuracy']:.1%}"
        if "val/env/tool_call_share" in metrics:  # a call that does not parse counts: its errors and the answers say so
            line += f", episodes that call a tool {metrics['val/env/tool_call_share']:.1%}"
            line += f", tool errors per episode {metrics['val/env/tool_errors']:.2f}"
            line += f", episodes that answer {metrics['val/env/ended_answered']:.1%}"
        print(f"{line} ({len(self.loader.dataset)} prompts, {'greedy' if n == 1 else f'{n} samples each'})", flush=True)
        return metrics, samples

    def close(self) -> None:
        self.scorer.close()
        if self.rollouts is not None:
            self.rollouts.close()
