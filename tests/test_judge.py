"""The LLM judge (--judge-model): its question, its verdicts, its worker group, and runs that it scores."""

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from helpers import SMALL_RUN, metrics_of, run_script, stop_in_process

from common.data import collate
from common.dataproto import DataProto
from common.engines import EngineSettings
from common.judge import Judge, load_template, parse_verdict, probability_verdicts, question, question_ids, verdict_token_ids
from common.rollout import response_batch
from common.worker_group import WorkerGroup
from common.workers import JudgeWorker

TEMPLATE_FILE = str(Path(__file__).resolve().parents[1] / "examples" / "judge" / "correct_answer.txt")  # docs/rewards.md's
TEMPLATE = load_template(TEMPLATE_FILE)


def test_the_question_holds_the_prompt_the_response_and_the_truth():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4="}]
    text = question("{prompt}|{response}|{ground_truth}|{response}|{other}", messages, "7", 7)
    assert text == "Be brief.\n\n3+4=|7|7|7|{other}"  # a brace the template means literally stays


def test_a_template_without_the_response_or_a_missing_one_is_refused(tmp_path):
    (tmp_path / "blind.txt").write_text("Is {prompt} hard? Answer Yes or No.")
    with pytest.raises(ValueError, match="has no {response}"):
        load_template(str(tmp_path / "blind.txt"))
    with pytest.raises(ValueError, match="--judge-template .*missing.txt: no such file"):
        load_template(str(tmp_path / "missing.txt"))


def test_the_first_yes_or_no_is_the_verdict():
    answers = ["Yes.", "no, it is 8", "The answer is correct: YES", "Nope", "yesterday no", "It is 7.", ""]
    assert [parse_verdict(answer) for answer in answers] == [1.0, 0.0, 1.0, None, 0.0, None, None]


def test_a_probability_verdict_is_p_yes_over_p_yes_and_no_when_a_verdict_is_most_likely():
    log_probs = torch.log(torch.tensor([[0.6, 0.2], [0.1, 0.3], [0.05, 0.05]]))
    verdicts = probability_verdicts(log_probs, torch.tensor([5, 9, 7]), [5, 7])
    assert verdicts[0] == pytest.approx(0.75) and verdicts[1] is None and verdicts[2] == pytest.approx(0.5)


def test_verdict_tokens_are_the_one_token_spellings(smollm2, tokenizer):
    from transformers import AutoTokenizer

    yes, no = verdict_token_ids(AutoTokenizer.from_pretrained(smollm2), "smollm2")
    judge = AutoTokenizer.from_pretrained(smollm2)
    assert sorted(judge.decode([token]) for token in yes) == [" Yes", " yes", "Yes", "yes"]
    assert sorted(judge.decode([token]) for token in no) == [" No", " no", "No", "no"]
    with pytest.raises(ValueError, match="use --judge-mode parsed"):
        verdict_token_ids(tokenizer, "demo")  # one token per character


def test_the_worker_reads_the_judges_next_token_as_transformers_does(cpu_pool, smollm2):
    """Questions of different lengths, left-padded, dealt to 2 ranks: each row's log p(Yes), log p(No) and its most
    likely next token equal transformers' own on the question alone, unpadded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    judge = AutoTokenizer.from_pretrained(smollm2)
    rows = [("2+2=", "4", 4), ("7+8=", "15", 15), ("What is 12 times 12? Think first.", "It is 124", 144), ("1+1=", "3", 2)]
    ids = [question_ids(question(TEMPLATE, [{"role": "user", "content": p}], r, t), judge) for p, r, t in rows]
    assert len(set(map(len, ids))) > 1
    yes, no = verdict_token_ids(judge, "smollm2")
    prompts = collate(DataProto.from_dict(non_tensors={"prompt_ids": ids}), judge.pad_token_id)
    batch = response_batch(
        prompts["prompts"], prompts["prompt_mask"], torch.full((4, 1), yes[0]), torch.zeros(4, 1), 1, [], judge.pad_token_id
    )
    group = WorkerGroup(JudgeWorker, cpu_pool, "judge", model_path=smollm2, micro_batch_size=2, compute_dtype="float32")
    try:
        judged = group.scatter("verdict_log_probs", batch, yes_ids=yes, no_ids=no)
    finally:
        group.shutdown()
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    with torch.no_grad():
        expected = [torch.log_softmax(model(torch.tensor([row])).logits[0, -1].float(), -1) for row in ids]
    for got, top, log_probs in zip(judged["verdict_log_probs"], judged["top_tokens"], expected):
        want = [log_probs[yes].logsumexp(-1), log_probs[no].logsumexp(-1)]
        assert got.tolist() == pytest.approx([value.item() for value in want], abs=1e-4)
        assert log_probs[top] == pytest.approx(log_probs.max().item(), abs=1e-4)


CLEARLY = [
    ("3+4=", "7", "7"),
    ("3+4=", "12", "7"),
    ("9+9=", "18", "18"),
    ("9+9=", "2", "18"),
    ("0+5=", "5", "5"),
    ("0+5=", "14", "5"),
]


@pytest.fixture(scope="module")
def arithmetic_judge(tiny_model, tmp_path_factory):
    """A judge that knows these texts: the demo's model with Yes and No added as tokens, fine-tuned here to answer
    "r=t?" (the response, the ground truth) of each row of CLEARLY with Yes when they are equal and No otherwise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.demo import warm_start

    folder = str(tmp_path_factory.mktemp("arithmetic_judge"))
    torch.manual_seed(0)  # the new tokens' embeddings
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.add_tokens(["Yes", "No"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    examples = [(f"{response}={truth}?", [("Yes" if response == truth else "No", True)]) for _, response, truth in CLEARLY]
    warm_start(folder, examples, steps=200)
    return folder


@pytest.fixture(scope="module")
def judge_ranks(cpu_pool, arithmetic_judge):
    """Its 2 ranks, which judge in either mode."""
    group = WorkerGroup(JudgeWorker, cpu_pool, "judge", model_path=arithmetic_judge, compute_dtype="float32")
    yield group
    group.shutdown()


@pytest.mark.parametrize("mode", ["probability", "parsed"])
def test_a_judge_that_knows_says_yes_to_the_right_answers_and_no_to_the_wrong(judge_ranks, arithmetic_judge, mode):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(arithmetic_judge)
    judge = Judge(judge_ranks, tokenizer, "{response}={ground_truth}?", mode, 4, 64, arithmetic_judge)
    messages = [[{"role": "user", "content": prompt}] for prompt, _, _ in CLEARLY]
    scores, failures = judge.score(messages, [r for _, r, _ in CLEARLY], [t for _, _, t in CLEARLY], 0.0)
    assert failures == 0
    right = [response == truth for _, response, truth in CLEARLY]
    assert [score > 0.9 if ok else score < 0.1 for score, ok in zip(scores, right)] == [True] * len(CLEARLY), scores


def test_a_vllm_judge_answers_greedily_with_the_weights_it_loaded(cpu_pool, smollm2):
    """--judge-mode parsed on the vllm engine (fp32): every token of each answer is the judge's most likely one under
    transformers (up to 1e-3 nat: ties), so the engine answers with the judge's own weights though it is never sent
    any."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    judge = AutoTokenizer.from_pretrained(smollm2)
    rows = [("2+2=", "4", 4), ("7+8=", "16", 15)]
    ids = [question_ids(question(TEMPLATE, [{"role": "user", "content": p}], r, t), judge) for p, r, t in rows]
    engine = EngineSettings(name="vllm", dtype="float32", max_model_len=256)
    group = WorkerGroup(JudgeWorker, cpu_pool, "judge", model_path=smollm2, compute_dtype="float32", engine=engine)
    try:
        prompts = collate(DataProto.from_dict(non_tensors={"prompt_ids": ids}), judge.pad_token_id)
        answered = group.scatter("generate", prompts.select("prompts", "prompt_mask"), max_response_length=8, do_sample=False)
    finally:
        group.shutdown()
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    for question_tokens, answer, mask in zip(ids, answered["responses"], answered["response_mask"]):
        answer = answer[mask.bool()].tolist()
        with torch.no_grad():
            log_probs = torch.log_softmax(
                model(torch.tensor([question_tokens + answer])).logits[0, len(question_tokens) - 1 : -1], -1
            )
        taken = log_probs.gather(-1, torch.tensor(answer)[:, None])[:, 0]
        assert len(answer) > 0 and (taken >= log_probs.max(-1).values - 1e-3).all(), judge.decode(answer)


def test_grpo_with_the_judge_beside_the_rule(ray_cluster, demo_files, smollm2, tmp_path):
    """The real model judges the demo's answers: each row's reward is its rule's + 0.5 x the judge's p(Yes)-share."""
    flags = ["--judge-model", "smollm2", "--judge-template", TEMPLATE_FILE, "--reward-model-coef", "0.5"]
    result = run_script("grpo_hybrid.py", *SMALL_RUN, *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _, rows = metrics_of(tmp_path)
    for row in rows[1:]:
        assert row["train/reward_mean"] == pytest.approx(row["reward/rule"] + 0.5 * row["reward/judge"], abs=1e-6)
        assert 0 < row["reward/judge"] < 1 and "reward/judge_failures" in row and "val/reward/judge" in row


def test_a_judge_that_gives_no_verdict_is_counted_then_stops_the_run(ray_cluster, demo_files, tmp_path):
    """The demo's own model as the judge writes digits, never yes or no: every verdict is missing. Rows without a
    rule (data source "chat") are the judge's alone, so every score is 0, counted; past --max-reward-error-share the
    run stops, saying why, before an update uses the scores."""
    rows = pq.read_table(demo_files[1]).to_pylist()
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(row | {"data_source": "chat"}) + "\n" for row in rows))
    judge = ["--judge-model", demo_files[0], "--judge-template", TEMPLATE_FILE, "--judge-mode", "parsed"]
    flags = [*SMALL_RUN, "--train-files", str(chat), "--val-files", str(chat), *judge, "--judge-max-tokens", "4"]
    result = run_script("grpo_hybrid.py", *flags, "--max-reward-error-share", "1", "--total-steps", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the judge gave no verdict" in result.stderr and "make --judge-template ask for Yes or No" in result.stderr
    _, metrics = metrics_of(tmp_path)
    assert metrics[-1]["reward/judge_failures"] == 32 and metrics[-1]["train/reward_mean"] == 0
    stopped = run_script("grpo_hybrid.py", *flags, "--exp-name", "stops", cwd=tmp_path)
    assert stopped.returncode != 0
    assert re.search(
        r"the judge gave no verdict for (\d+) of \1 responses, more than --max-reward-error-share 0.5", stopped.stderr
    )


def test_judge_flags_that_do_not_fit_stop_before_any_worker(demo_files, tmp_path, monkeypatch):
    (tmp_path / "blind.txt").write_text("Is {prompt} hard? Answer Yes or No.")
    cases = [
        (["--judge-model", demo_files[0], "--judge-template", str(tmp_path / "blind.txt")], "has no {response}"),
        (["--judge-model", demo_files[0]], "--judge-model needs --judge-template"),
        (["--judge-template", TEMPLATE_FILE], "pass --judge-model too"),
        (["--judge-model", demo_files[0], "--judge-template", TEMPLATE_FILE], "use --judge-mode parsed"),
        (
            [
                "--judge-model",
                demo_files[0],
                "--judge-template",
                TEMPLATE_FILE,
                "--judge-mode",
                "parsed",
                "--judge-max-prompt-length",
                "64",
            ],
            "more than --judge-max-prompt-length 64",
        ),
    ]
    for flags, message in cases:
        stop = stop_in_process("grpo_hybrid.py", *flags, cwd=tmp_path, monkeypatch=monkeypatch)
        assert message in stop and "PolicyWorker" not in stop, (flags, stop[-2000:])
