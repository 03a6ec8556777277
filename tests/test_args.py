"""common/args.py in this process: every rule check_args keeps, with the message it gives; how workers are counted; the
checks of a model folder and a reward model."""

import json

import pytest

from common.args import RunArgs, check_args, count_workers, flag_name
from common.pretrained import load_tokenizer
from common.reward_model import check_reward_model


def args_with(**changes) -> RunArgs:
    """Settings that keep every rule (2 CPU workers, sequences of 12 tokens), with `changes` on top."""
    settings = dict(
        train_files=["train.parquet"],
        num_workers=2,
        max_prompt_length=8,
        max_response_length=4,
        train_batch_size=8,
        mini_batch_size=4,
        n=4,
    )
    return RunArgs(**(settings | changes))


def test_settings_that_keep_every_rule_pass():
    check_args(args_with())
    check_args(args_with(micro_batch_tokens="auto", max_memory_share=0.5, rollout_workers=1, max_staleness=2))
    check_args(args_with(in_process=True, num_workers=None, mini_batch_size=2))
    check_args(args_with(judge_model="judge", judge_template="Is {response} right?"))
    check_args(args_with(reward_fn="a.py:f,b.py:g", reward_weights="1,0.5", total_epochs=2, filter_overlong_prompts=True))


BROKEN_RULES = [
    (dict(max_prompt_length=0), "--max-prompt-length is 0; it must be above 0"),
    (dict(max_response_length=-3), "--max-response-length is -3; it must be above 0"),
    (dict(num_workers=0), "--num-workers is 0; it must be above 0"),
    (dict(max_memory_share=0.0, micro_batch_tokens="auto"), "--max-memory-share is 0.0; it must be above 0"),
    (dict(sequence_parallel=3), "--sequence-parallel 3 does not divide --num-workers 2 into groups of workers"),
    (dict(mini_batch_size=3), "--train-batch-size 8 is not a multiple of --mini-batch-size 3"),
    (dict(num_workers=3), "does not split evenly over --num-workers 3"),
    (dict(temperature=0.0), "--temperature is 0.0: rollouts are sampled, so it must be above 0"),
    (dict(offload=True), "--offload and --lora-sync act on the vllm engine only"),
    (dict(rollout_engine="sglang"), "rollout engine 'sglang' is not available; use 'hf' or 'vllm' (--rollout-engine)"),
    (dict(log_prob_chunk_tokens=-1), "--log-prob-chunk-tokens is -1; use 0 for all at once, or more"),
    (dict(max_memory_share=1.5, micro_batch_tokens="auto"), "--max-memory-share is 1.5; it is a share of the memory"),
    (dict(max_memory_share=0.5), "--max-memory-share 0.5 sizes the micro-batches of --micro-batch-tokens auto"),
    (dict(micro_batch_tokens=-1), "--micro-batch-tokens is -1; use 0 to count sequences, auto, or more"),
    (dict(micro_batch_tokens=11), "--micro-batch-tokens 11 cannot hold one sequence of --max-prompt-length + "),
    (dict(rollout_workers=-1), "--rollout-workers is -1; use 0 for the policy's own processes to generate"),
    (dict(rollout_workers=1, in_process=True), "--rollout-workers is 1; use 0 for the policy's own processes"),
    (dict(max_staleness=-1, rollout_workers=1), "--max-staleness is -1: above 0, the engines generate while"),
    (dict(max_staleness=1), "needs engines apart from the policy's processes (--rollout-workers 1 or more)"),
    (dict(max_staleness=1, rollout_workers=1, env="calculator", reward_workers=0), "--reward-workers 0 with --max-stale"),
    (dict(rollout_workers=1, offload=True, rollout_engine="vllm"), "--offload makes room for an engine in the policy"),
    (dict(reward_workers=-1), "--reward-workers is -1; use 0 to score in this process, or more"),
    (dict(judge_model="judge"), "--judge-model needs --judge-template (the question it answers)"),
    (dict(judge_model="judge", judge_template="?", reward_model="rm"), "takes the place of --reward-model"),
    (dict(judge_template="?"), "--judge-template is the question of an LLM judge: pass --judge-model too"),
    (dict(reward_model_workers=-1), "--reward-model-workers is -1; use 0 to share the policy's accelerators"),
    (dict(reward_model_workers=1, in_process=True), "--reward-model-workers is 1; use 0 to share"),
    (dict(train_files=None), "--train-files is missing: name the prompt files to train on"),
    (dict(total_epochs=0), "--total-epochs is 0; it must be above 0"),
    (dict(truncate_prompts=True, filter_overlong_prompts=True), "--filter-overlong-prompts leaves it out: pass one"),
    (dict(runs_dir=__file__), "is a file; name a folder (made if missing) for the runs' folders"),
    (dict(reward_weights="1"), "--reward-weights weighs the functions of --reward-fn: pass --reward-fn too"),
    (dict(reward_fn="a.py:f,b.py:g", reward_weights="1"), "gives 1 weights for the 2 functions of --reward-fn"),
    (dict(reward_fn="a.py:f", reward_weights="one"), "--reward-weights 'one': write numbers separated by commas"),
]


@pytest.mark.parametrize(
    "changes, message", BROKEN_RULES, ids=[" ".join(f"{k}={v}" for k, v in changes.items()) for changes, _ in BROKEN_RULES]
)
def test_each_rule_names_its_flag(changes, message):
    with pytest.raises(ValueError) as refused:
        check_args(args_with(**changes))
    assert message in str(refused.value)


def test_workers_are_one_per_gpu_or_two_cpu_slots():
    assert count_workers(None, 0) == 2
    assert count_workers(None, 8) == 8
    assert count_workers(3, 0) == 3  # CPU slots: as many as asked
    assert count_workers(4, 8) == 4
    with pytest.raises(ValueError, match="--num-workers 9 asks for 9 GPUs, one per worker; this machine has 8"):
        count_workers(9, 8)
    assert flag_name("max_prompt_length") == "--max-prompt-length"


def test_a_model_folder_is_checked_before_its_tokenizer_loads(tiny_model, tmp_path):
    assert load_tokenizer(tiny_model).eos_token_id is not None
    with pytest.raises(ValueError, match="--model-path /nowhere: no such folder"):
        load_tokenizer("/nowhere")
    with pytest.raises(ValueError, match=f"--reward-model {tmp_path}: no config.json in it"):
        load_tokenizer(str(tmp_path), flag="--reward-model")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"--model-path {tmp_path}: no tokenizer could be loaded from it"):
        load_tokenizer(str(tmp_path))


def test_a_reward_model_is_a_sequence_classifier_with_one_label(reward_model, tiny_model, tmp_path):
    check_reward_model(reward_model)
    check_reward_model("an/hub-id")  # no folder here: the worker loading it says what is wrong
    with pytest.raises(ValueError, match=r"names \['Qwen2ForCausalLM'\] with \d labels; a reward model is a"):
        check_reward_model(tiny_model)
    config = {"architectures": ["Qwen2ForSequenceClassification"], "id2label": {"0": "bad", "1": "good"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="with 2 labels"):
        check_reward_model(str(tmp_path))
