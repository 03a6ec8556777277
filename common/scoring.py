"""What scores a response, behind one `Scorer`: the rule (common/rewards.py, the user's --reward-fn or a built-in, in
isolated processes), and with --reward-model or --judge-model a model's score beside it (common/reward_model.py,
common/judge.py), which runs on a worker group of its own."""

from __future__ import annotations

from common.args import worker_micro_batch_tokens
from common.pretrained import load_tokenizer
from common.reward_model import check_reward_model


class Scorer:
    """The run's scorers, loaded and checked when made (the reward function, the model's tokenizer, the judge's
    template), before any worker starts; `start` starts their processes and the model's group. `tokenizer`: the
    policy's, which decodes the responses."""

    def __init__(self, args, tokenizer):
        from common.rewards import load_reward_fn, reward_weights

        self.args, self.tokenizer = args, tokenizer
        self.by_model = args.reward_model is not None or args.judge_model is not None
        if args.reward_model is not None:
            self.reward_model_tokenizer = load_tokenizer(args.reward_model, "--reward-model")
            check_reward_model(args.reward_model)
        if args.judge_model is not None:
            from common.judge import load_template, verdict_token_ids  # here: the module imports torch

            self.judge_tokenizer = load_tokenizer(args.judge_model, "--judge-model")
            self.judge_template = load_template(args.judge_template)
            if args.judge_mode == "probability":
                verdict_token_ids(self.judge_tokenizer, args.judge_model)
        self.reward_fn = load_reward_fn(args.reward_fn)
        self.weights = reward_weights(args.reward_fn, args.reward_weights)
        # what start() starts: the rule's calls, the model's group, and its own accelerators (--reward-model-workers)
        self.rewards, self.reward_model, self.judge, self.pool = None, None, None, None

    def check_prompts(self, train_data, val_data, environments=None) -> None:
        """Fail before any worker starts on a data source that no rule scores (unless a model scores every row, or the
        row's environment, of `environments`, scores its episodes with get_reward), or on a judge's question longer
        than --judge-max-prompt-length."""
        from common.dataproto import DataProto
        from common.rewards import check_data_sources

        args = self.args
        if not self.by_model:  # else rows without a rule are the model's alone
            for data in (train_data,) if val_data is train_data else (train_data, val_data):
                if environments is not None and "env" in data:
                    sources = [s for s, name in zip(data["data_source"], data["env"]) if not environments.scores(name)]
                    data = DataProto.from_dict(non_tensors={"data_source": sources})
                check_data_sources(data, self.reward_fn)
        if args.judge_model is not None:
            from common.judge import check_question_length

            truths = [*train_data["ground_truth"], *val_data["ground_truth"]]
            longest = args.max_prompt_length + args.max_response_length
            check_question_length(self.judge_template, self.judge_tokenizer, truths, longest, args.judge_max_prompt_length)

    def start(self, pool, reward_workers: int, engine=None) -> None:
        """The rule's processes (`reward_workers`; 0: calls in this process), and the reward model's group or the
        judge's: on the run's accelerators (`pool`), on --reward-model-workers of its own, or in this process (`pool`
        None). It scores and never trains, so no checkpoint holds it. `engine`: the run's engine settings, which the
        judge's engine takes with lengths of its own."""
        from common.isolation import CallProcesses, InProcessCalls
        from common.rewards import REWARD_CALLS

        args = self.args
        if reward_workers:
            self.rewards = CallProcesses(args.reward_fn, reward_workers, REWARD_CALLS, args.reward_timeout)
        else:
            self.rewards = InProcessCalls(self.reward_fn, args.reward_fn, REWARD_CALLS, args.reward_timeout)
        if self.by_model:
            self._start_model(pool, engine)

    def _start_model(self, pool, engine) -> None:
        import dataclasses

        from common.judge import Judge
        from common.worker_group import ResourcePool, WorkerGroup
        from common.workers import JudgeWorker
        from common.workers import RewardModelWorker

        args = self.args
        if args.reward_model_workers:
            self.pool = pool = ResourcePool(args.reward_model_workers, pool.use_gpu, call_timeout=args.call_timeout)
        model = dict(
            micro_batch_size=args.micro_batch_size,
            micro_batch_tokens=worker_micro_batch_tokens(args, fits_budget=False),
            seed=args.seed,
            compute_dtype=args.compute_dtype,
        )
        if args.reward_model is not None:
            self.reward_model = WorkerGroup(
                RewardModelWorker, pool, "reward_model", args.call_timeout, model_path=args.reward_model, **model
            )
            return
        # the run's engine with the judge's lengths, its verdicts' log-probs at temperature 1, never offloaded or sent weights
        longest = args.judge_max_prompt_length + args.judge_max_tokens
        engine = dataclasses.replace(engine, max_model_len=longest, temperature=1.0, lora_sync="auto", offload=False)
        judge = dict(model_path=args.judge_model, engine=engine)
        group = WorkerGroup(JudgeWorker, pool, "judge", args.call_timeout, **judge, **model)
        self.judge = Judge(
            group,
            self.judge_tokenizer,
            self.judge_template,
            args.judge_mode,
            args.judge_max_tokens,
            args.judge_max_prompt_length,
            args.judge_model,
        )

    def groups(self) -> dict:
        """The model's worker group by name, if a model scores."""
        if self.judge is not None:
            return {"judge": self.judge.group}
        return {"reward_model": self.reward_model} if self.reward_model is not None else {}

    def score(self, batch, metrics: dict):
        """One score per response of `batch` (see score_texts); the reward's error and timeout counts are added to
        `metrics`, the other keys go to `batch["reward_extra"]` (logged as `reward/<key>` by Run.end_step). An episode
        whose environment rewarded its turns scores the sum of their rewards and its outcome's score, which
        `batch["outcome_score"]` keeps (see envs.split_turn_rewards)."""
        import torch

        from common.rewards import response_texts

        scores, counts, batch["reward_extra"] = self.score_texts(response_texts(batch, self.tokenizer), batch)
        for key, value in counts.items():
            metrics[key] = metrics.get(key, 0) + value
        scores = torch.tensor(scores, dtype=torch.float32)
        if "turn_reward_tokens" in batch:  # episodes whose environment rewarded turns: the sum (common/envs.py)
            batch["outcome_score"] = scores
            scores = scores + batch["turn_reward_tokens"].sum(-1)
        return scores

    def score_texts(self, texts: list[str], batch) -> tuple[list[float], dict, list[dict]]:
        """Each response's score, the reward's error and timeout counts, and per response the keys beside its score:
        the rule's (common/rewards.py), or with --reward-model (--judge-model) the rule's and the model's as
        common/reward_model.py combines them, the model's under `model` (`judge`) and the rule's under `rule`."""
        import numpy as np

        from common.data import pad_token_id
        from common.reward_model import combine, render_conversations, reward_model_batch
        from common.rewards import has_rule, score_texts

        args = self.args
        if self.reward_model is None and self.judge is None:
            return score_texts(texts, batch, self.rewards, args.max_reward_error_share, self.weights)
        ruled = np.array([i for i, source in enumerate(batch["data_source"]) if has_rule(source, self.reward_fn)])
        rule_scores, counts, rule_extras = [], {"reward/errors": 0, "reward/timeouts": 0, "reward/unscored": 0}, []
        if len(ruled):
            ruled_texts = [texts[i] for i in ruled]
            rule_scores, counts, rule_extras = score_texts(
                ruled_texts, batch[ruled], self.rewards, args.max_reward_error_share, self.weights
            )
        if self.judge is not None:
            key = "judge"
            model_scores, counts["reward/judge_failures"] = self.judge.score(
                batch["prompt_messages"], texts, batch["ground_truth"], args.max_reward_error_share
            )
        else:
            key, tokenizer = "model", self.reward_model_tokenizer
            conversations = render_conversations(batch["prompt_messages"], texts, tokenizer)
            rm_batch = reward_model_batch(conversations, pad_token_id(tokenizer))
            model_scores = self.reward_model.scatter("compute_rm_score", rm_batch)["rm_scores"].tolist()
        extras = [{key: score} for score in model_scores]
        for i, rule, extra in zip(ruled, rule_scores, rule_extras):
            extras[i] = extra | {key: model_scores[i], "rule": rule}
        return combine(dict(zip(ruled.tolist(), rule_scores)), model_scores, args.reward_model_coef), counts, extras

    def close(self) -> None:
        """Stop the rule's processes and the model's group, and give its accelerators back."""
        self.rewards.close()
        for group in self.groups().values():
            group.shutdown()
        if self.pool is not None:
            self.pool.shutdown()
