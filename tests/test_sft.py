"""The supervised warm start (algos/sft_hybrid.py): the loss mask covers exactly the assistant's tokens, tool calls
included and tool results left out, under a small Qwen-style template that renders tools; a 2-worker run learns, and
its export starts an RL run."""

import json

import pytest

from common.data import DataError
from common.tools import multiply, read_chat_template
from common.transcripts import assistant_tokens, collate_transcripts, load_transcripts
from helpers import metrics_of, run_script

# Qwen2.5's tool template in miniature, for the character-level tokenizer: the tools' names and arguments in a system
# turn, `<c>` calls in the assistant's turn, a tool's result in a turn of its own; `<eos>` ends a turn, a newline
# follows it (as ChatML's `<|im_end|>\n`), and `<a>` prompts the assistant.
QWEN_STYLE = (
    "{%- if tools %}{{ '<s>' }}{%- for tool in tools %}"
    "{{ tool.function.name + '(' + tool.function.parameters.properties | join(',') + ')' }}{%- endfor %}"
    "{{ '<eos>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ '<a>' + m.content }}"
    "{%- for call in m.tool_calls or [] %}{{ '<c>' + call.function.name + call.function.arguments | tojson + '</c>' }}"
    "{%- endfor %}{{ '<eos>\\n' }}"
    "{%- elif m.role == 'tool' %}{{ '<t>' + m.content + '<eos>\\n' }}"
    "{%- else %}{{ '<' + m.role[0] + '>' + m.content + '<eos>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<a>' }}{%- endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "mul",
            "description": "Multiply two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]


def transcript(a: int, b: int) -> list[dict]:
    call = {"type": "function", "function": {"name": "mul", "arguments": {"a": a, "b": b}}}
    return [
        {"role": "user", "content": f"{a}*{b}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]


@pytest.fixture(scope="module")
def qwen_style(tokenizer):
    """The tiny model's tokenizer with QWEN_STYLE as its chat template (a copy: the session's stays as it is)."""
    import copy

    copied = copy.deepcopy(tokenizer)
    copied.chat_template = QWEN_STYLE
    return copied


def test_the_mask_covers_exactly_the_assistants_tokens(qwen_style, tmp_path):
    # The conversation written out by hand, each piece marked with whether the assistant wrote it: its call and its
    # answer, each through its end-of-turn token; the newline after that token is the template's.
    pieces = [
        ("<s>mul(a,b)<eos>\n<u>12*34?<eos>\n<a>", 0),
        ('<c>mul{"a": 12, "b": 34}</c><eos>', 1),
        ("\n<t>408<eos>\n<a>", 0),
        ("408<eos>", 1),
        ("\n", 0),
    ]
    expected_ids, expected_mask = [], []
    for text, written in pieces:
        ids = qwen_style(text, add_special_tokens=False)["input_ids"]
        expected_ids += ids
        expected_mask += [written] * len(ids)
    eos = [qwen_style.eos_token_id]
    ids, mask = assistant_tokens(transcript(12, 34), TOOLS, qwen_style, eos, "row")
    assert ids == expected_ids
    assert mask == expected_mask

    # Through the file and the batch the policy reads: the response part's mask picks the same tokens.
    path = tmp_path / "transcripts.jsonl"
    path.write_text(json.dumps({"messages": transcript(12, 34), "tools": TOOLS}) + "\n")
    batch = collate_transcripts(load_transcripts([str(path)], qwen_style, eos, 64, 64), qwen_style.pad_token_id)
    learnt = batch["responses"][batch["response_mask"].bool()].tolist()
    assert learnt == [token for token, written in zip(expected_ids, expected_mask) if written]
    assert batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist() == expected_ids


def test_a_template_without_the_prefix_property_is_named(qwen_style, tmp_path):
    # As Qwen3's does with its thinking: the last assistant turn rendered otherwise than the same turn followed by more.
    thinking = "{{ '<a>' + ('<think></think>' if loop.last else '') + m.content }}"
    breaking = QWEN_STYLE.replace("{{ '<a>' + m.content }}", thinking)
    path = tmp_path / "transcripts.jsonl"
    path.write_text(json.dumps({"messages": transcript(12, 34), "tools": TOOLS}) + "\n")
    qwen_style.chat_template = breaking
    try:
        with pytest.raises(DataError, match=r"transcripts.jsonl, row 0: .* assistant message 1 .* prefix property"):
            load_transcripts([str(path)], qwen_style, [qwen_style.eos_token_id], 64, 64)
    finally:
        qwen_style.chat_template = QWEN_STYLE


def test_sft_learns_and_its_export_starts_grpo(ray_cluster, tiny_model, demo_files, qwen_style, tmp_path):
    from transformers import AutoModelForCausalLM

    model, template = tmp_path / "model", tmp_path / "qwen_style.jinja"
    AutoModelForCausalLM.from_pretrained(tiny_model).save_pretrained(model)
    qwen_style.chat_template = None  # the run's template comes from --chat-template, and its export keeps it
    try:
        qwen_style.save_pretrained(model)
    finally:
        qwen_style.chat_template = QWEN_STYLE
    template.write_text(QWEN_STYLE)
    for name, problems in (("train", [(a, b) for a in range(11, 15) for b in range(21, 25)]), ("val", [(17, 31), (19, 28)])):
        rows = [json.dumps({"messages": transcript(a, b), "tools": TOOLS}) for a, b in problems]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(rows) + "\n")
    sizes = ["--max-prompt-length", "48", "--max-response-length", "64", "--micro-batch-tokens", "128"]
    flags = ["--train-batch-size", "16", "--mini-batch-size", "8", "--total-steps", "6", "--test-freq", "6"]
    data = ["--train-files", str(tmp_path / "train.jsonl"), "--val-files", str(tmp_path / "val.jsonl")]
    (tmp_path / "sft").mkdir()
    model_flags = ["--model-path", str(model), "--chat-template", str(template), "--lr", "3e-3", "--num-workers", "2"]
    sft = run_script("sft_hybrid.py", *model_flags, *data, *sizes, *flags, cwd=tmp_path / "sft")
    assert sft.returncode == 0, sft.stderr[-3000:]
    run_dir, rows = metrics_of(tmp_path / "sft")
    losses = [row["actor/loss"] for row in rows if "actor/loss" in row]
    assert len(losses) == 6 and losses[-1] < 0.5 * losses[0], losses
    assert rows[-1]["val/loss"] < 0.5 * rows[0]["val/loss"], (rows[0], rows[-1])
    assert "held-out loss" in sft.stdout
    assert (run_dir / "model" / "chat_template.jinja").read_text() == QWEN_STYLE

    (tmp_path / "grpo").mkdir()
    rl = ["--train-files", demo_files[1], "--total-steps", "1", "--train-batch-size", "4", "--mini-batch-size", "4"]
    rl += ["--n", "2", "--max-prompt-length", "16", "--max-response-length", "4", "--test-freq", "100"]
    rl += ["--no-val-before-train", "--num-workers", "2"]
    grpo = run_script("grpo_hybrid.py", "--model-path", str(run_dir / "model"), *rl, cwd=tmp_path / "grpo")
    assert grpo.returncode == 0, grpo.stderr[-3000:]
    assert metrics_of(tmp_path / "grpo")[1][-1]["step"] == 1


def test_the_multiplication_tools_files(qwen_style, tmp_path):
    import pyarrow.parquet as pq
    from transformers.utils import get_json_schema

    from common import demo

    demo.build_multiply_tool(tmp_path, demo.DEMO_SEED)
    problems = {}
    for name, size in demo.MULTIPLY_TOOL_SIZES.items():
        if name.startswith("sft"):
            rows = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
            problems[name] = {tuple(row["messages"][1]["tool_calls"][0]["function"]["arguments"].values()) for row in rows}
        else:
            rows = pq.read_table(tmp_path / f"{name}.parquet").to_pylist()
            factors = [(row["extra_info"]["a"], row["extra_info"]["b"]) for row in rows]
            assert [row["reward_model"]["ground_truth"] for row in rows] == [str(a * b) for a, b in factors]
            problems[name] = set(factors)
        assert len(rows) == len(problems[name]) == size
        assert all(100 <= a <= 999 and 10 <= b <= 99 for a, b in problems[name])
    names = list(problems)
    assert all(not problems[x] & problems[y] for i, x in enumerate(names) for y in names[i + 1 :])  # held out

    # The structured transcripts: the assistant learns its call and the product, never the question or the result.
    eos = [qwen_style.eos_token_id]
    data = load_transcripts([str(tmp_path / "sft_val.jsonl")], qwen_style, eos, 128, 128)
    first = [token for token, learnt in zip(data["response_ids"][0], data["loss_mask"][0]) if learnt]
    call = json.loads((tmp_path / "sft_val.jsonl").read_text().splitlines()[0])["messages"][1]["tool_calls"][0]
    a, b = call["function"]["arguments"].values()
    expected = f'<c>multiply{{"a": {a}, "b": {b}}}</c><eos>{a * b}<eos>'
    assert first == qwen_style(expected, add_special_tokens=False)["input_ids"]
    # Through the built-in ChatML tool template, for a model whose own drops tools: the call as Qwen2.5 writes it.
    row = json.loads((tmp_path / "sft_val.jsonl").read_text().splitlines()[0])
    template = read_chat_template("chatml_tools")
    text = qwen_style.apply_chat_template(row["messages"], tools=row["tools"], chat_template=template, tokenize=False)
    assert "<tools>\n" + json.dumps(get_json_schema(multiply)) + "\n</tools>" in text
    assert f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>' in text
    assert f"<tool_response>\n{a * b}\n</tool_response>" in text
