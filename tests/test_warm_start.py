"""A warm start that says when the format took (common/warm_start.py): with RL prompts as --val-files, sft_hybrid.py
validates as the RL scripts do, by playing the episodes greedily with the tool and scoring them, and reports the
held-out accuracy and the share of episodes that call the tool; and an RL run whose groups all score alike says so
once (common/run.py's say_when_groups_score_alike)."""

import json
import re
from statistics import fmean

from common.demo import multiply_tool_transcript
from helpers import metrics_of, run_script, stop_in_process
from test_tools import COMPACT_TEMPLATE  # tools in a few characters, for the tiny model's 128 positions

CALL = r'<tool_call>\{"name": ?"multiply", ?"arguments": ?\{"a": ?(\d+), ?"b": ?(\d+)\}\}</tool_call>'


def write_multiply_task(folder, train_problems, val_problems) -> None:
    """The demo's multiplication tool in short questions: transcripts to learn from (train.jsonl), and RL prompts to
    validate with (val.jsonl: data source multiply_tool, scored by the last number of the episode's last turn)."""
    from transformers.utils import get_json_schema

    from common.tools import multiply

    tools = [get_json_schema(multiply)]
    rows = [{"messages": multiply_tool_transcript(a, b, f"{a}*{b}?"), "tools": tools} for a, b in train_problems]
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    prompts = [
        {
            "prompt": [{"role": "user", "content": f"{a}*{b}?"}],
            "data_source": "multiply_tool",
            "reward_model": {"ground_truth": str(a * b)},
        }
        for a, b in val_problems
    ]
    (folder / "val.jsonl").write_text("".join(json.dumps(row) + "\n" for row in prompts))


def test_the_warm_start_validates_by_generation_with_a_tool(tiny_model, tmp_path):
    problems = [(a, b) for a in range(11, 99, 7) for b in range(12, 99, 9)]  # 13 x 10, two digits each
    write_multiply_task(tmp_path, problems[16:], problems[:16])
    (tmp_path / "compact.jinja").write_text(COMPACT_TEMPLATE)
    flags = ["--model-path", tiny_model, "--chat-template", str(tmp_path / "compact.jinja"), "--tools", "multiply"]
    flags += ["--train-files", str(tmp_path / "train.jsonl"), "--val-files", str(tmp_path / "val.jsonl")]
    flags += ["--max-prompt-length", "24", "--max-response-length", "100", "--max-turns", "3", "--lr", "3e-3"]
    flags += ["--train-batch-size", "16", "--mini-batch-size", "16", "--total-steps", "200", "--test-freq", "100"]
    flags += ["--in-process", "--reward-workers", "1"]
    result = run_script("sft_hybrid.py", *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir, rows = metrics_of(tmp_path)
    validations = {row["step"]: row for row in rows if "val/accuracy" in row}
    assert sorted(validations) == [0, 100, 200] and not any("val/loss" in row for row in rows)

    shares = []
    for step, row in validations.items():
        # What the validation's rows show, counted here: each episode's score, and whether its model wrote a call.
        episodes = [json.loads(line) for line in (run_dir / "validation" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(episodes) == 16
        calling = [episode["tool_calls"] > 0 for episode in episodes]
        assert calling == ["<tool_call>" in episode["response"] for episode in episodes]
        assert row["val/accuracy"] == fmean(episode["score"] for episode in episodes)
        for episode in episodes:  # the score of the episode's last turn (after the last `A:`): its last number, right
            numbers = re.findall(r"\d+", episode["response"].rsplit("A:", 1)[-1])
            assert episode["score"] == float(numbers[-1:] == [episode["ground_truth"]])
        assert row["val/env/tool_call_share"] == fmean(calling)
        for episode in episodes:  # a call the tool answered: its result follows in the episode
            calls = re.findall(CALL, episode["response"])
            assert all(f"</tool_call>R:{int(a) * int(b)}A:" in episode["response"] for a, b in calls)
        errors, answered = fmean(e["tool_errors"] for e in episodes), fmean(e["ending"] == "answered" for e in episodes)
        shown = f"step {step}: held-out accuracy {row['val/accuracy']:.1%}, episodes that call a tool {fmean(calling):.1%}"
        assert f"{shown}, tool errors per episode {errors:.2f}, episodes that answer {answered:.1%}" in result.stdout
        shares.append(row["val/env/tool_call_share"])
    assert shares[0] == 0 and shares[-1] > 0.5, shares  # the format took
    assert f"held-out accuracy: {validations[200]['val/accuracy']:.1%} at the last validation" in result.stdout  # Run.finish


def test_what_the_warm_start_cannot_validate_stops_it_before_any_worker(tiny_model, tmp_path, monkeypatch):
    write_multiply_task(tmp_path, [(12, 34)], [(21, 43)])
    (tmp_path / "compact.jinja").write_text(COMPACT_TEMPLATE)
    flags = ["--model-path", tiny_model, "--chat-template", str(tmp_path / "compact.jinja"), "--tools", "multiply"]
    flags += ["--train-files", str(tmp_path / "train.jsonl"), "--max-prompt-length", "24", "--max-response-length", "100"]
    place = dict(cwd=tmp_path, monkeypatch=monkeypatch)
    stop = stop_in_process("sft_hybrid.py", *flags, "--val-files", str(tmp_path / "train.jsonl"), **place)
    assert "--tools and --env play RL's episodes in the warm start's validation: pass --val-files of RL prompts" in stop
    both = ["--val-files", str(tmp_path / "train.jsonl"), str(tmp_path / "val.jsonl")]
    stop = stop_in_process("sft_hybrid.py", *flags, *both, cwd=tmp_path, monkeypatch=monkeypatch)
    assert f"--val-files mixes RL prompts ({tmp_path / 'val.jsonl'}) with transcripts" in stop


def test_a_run_whose_groups_all_score_alike_says_so_once(demo_files, tmp_path):
    model, train, _ = demo_files
    (tmp_path / "zero.py").write_text("def zero(data_source, solution_str, ground_truth, extra_info):\n    return 0.0\n")
    flags = ["--model-path", model, "--train-files", train, "--reward-fn", f"{tmp_path}/zero.py:zero"]
    flags += ["--max-prompt-length", "16", "--max-response-length", "4", "--total-steps", "4", "--train-batch-size", "4"]
    flags += ["--mini-batch-size", "4", "--n", "2", "--test-freq", "100", "--no-val-before-train", "--in-process"]
    result = run_script("grpo_hybrid.py", *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [row["train/alike_group_share"] for row in metrics_of(tmp_path)[1]] == [1.0] * 4
    said = "in each of the last 3 steps every prompt's 2 samples scored alike (this step's scores: 0)"
    assert result.stderr.count(said) == 1 and said not in result.stdout
    assert "--n" in result.stderr and "algos/dapo_hybrid.py" in result.stderr and "docs/warm-start.md" in result.stderr


def test_the_steps_in_a_row_are_counted_and_said_once(capsys):
    import torch

    from common.dataproto import DataProto
    from common.run import ALIKE_STEPS, say_when_groups_score_alike

    batch = DataProto.from_dict(non_tensors={"uid": ["a", "a", "b", "b"]})
    alike, apart = torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([1.0, 0.0, 0.0, 0.0])
    streak, shares = 0, []
    for scores in [alike, alike, apart, *[alike] * ALIKE_STEPS, alike, apart, *[alike] * ALIKE_STEPS]:
        metrics = {}
        streak = say_when_groups_score_alike(batch, scores, metrics, streak)
        shares.append(metrics.get("train/alike_group_share"))
        said = capsys.readouterr().err
        assert bool(said) == (len(shares) == 6), (len(shares), said)  # the third in a row after the reset, and never again
    assert shares == [1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0] and streak is None
    assert say_when_groups_score_alike(batch, None, {}, 0) == 0  # a supervised step: no scores
    once = DataProto.from_dict(non_tensors={"uid": ["a", "b"]})
    assert say_when_groups_score_alike(once, torch.tensor([0.0, 0.0]), {}, 2) == 2  # one sample a prompt: no groups
