"""Prompt files: real parquet and jsonl files, checked before any training."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.data import DataError, PromptLoader, check_batch_sizes, collate, load_prompts


def row(content="1+2=", truth="3", source="addition"):
    return {
        "prompt": [{"role": "user", "content": content}],
        "data_source": source,
        "reward_model": {"ground_truth": truth},
        "extra_info": {"k": 1},
    }


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_parquet_and_jsonl_load_the_same(tmp_path, tokenizer):
    rows = [row(), row("4+4=", "8")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    from_parquet = load_prompts([str(tmp_path / "d.parquet")], tokenizer, 16)
    from_jsonl = load_prompts([write_jsonl(tmp_path / "d.jsonl", rows)], tokenizer, 16)
    assert list(from_parquet["prompt_ids"]) == list(from_jsonl["prompt_ids"])
    assert list(from_parquet["ground_truth"]) == ["3", "8"]
    assert from_parquet["extra_info"][0] == {"k": 1}
    assert tokenizer.decode(from_parquet["prompt_ids"][1]) == "4+4="


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"data_source": "addition", "reward_model": {"ground_truth": "3"}}, "row 1: field 'prompt'"),
        ({**row(), "prompt": "1+2="}, "row 1: field 'prompt'"),
        ({**row(), "prompt": [{"role": "user"}]}, "row 1: field 'prompt' must hold messages"),
        ({**row(), "data_source": 3}, "row 1: field 'data_source'"),
        ({**row(), "reward_model": {"answer": "3"}}, "row 1: field 'reward_model'"),
        ({**row(), "extra_info": "x"}, "row 1: field 'extra_info'"),
    ],
)
def test_malformed_rows_name_file_row_and_field(tmp_path, tokenizer, bad, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [row(), bad])
    with pytest.raises(DataError, match=message) as error:
        load_prompts([path], tokenizer, 16)
    assert "bad.jsonl" in str(error.value)


def test_missing_empty_and_unknown_files(tmp_path, tokenizer):
    with pytest.raises(DataError, match="does not exist"):
        load_prompts([str(tmp_path / "nope.parquet")], tokenizer, 16)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="has no rows"):
        load_prompts([str(tmp_path / "empty.jsonl")], tokenizer, 16)
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="use .parquet or .jsonl"):
        load_prompts([str(tmp_path / "d.csv")], tokenizer, 16)
    (tmp_path / "broken.jsonl").write_text('{"prompt": \n')
    with pytest.raises(DataError, match="line 1: not valid JSON"):
        load_prompts([str(tmp_path / "broken.jsonl")], tokenizer, 16)


def test_a_csv_named_parquet_is_named_and_said_not_parquet(tmp_path, tokenizer):
    (tmp_path / "train.parquet").write_text("prompt,data_source\n1+2=,addition\n")
    with pytest.raises(DataError, match=r"train.parquet is not a parquet file .*parquet \(.parquet\) and JSON lines"):
        load_prompts([str(tmp_path / "train.parquet")], tokenizer, 16)


def test_a_folder_reads_the_data_files_inside_and_says_which(tmp_path, tokenizer, capsys):
    row = {"prompt": [{"role": "user", "content": "1+1="}], "data_source": "addition", "reward_model": {"ground_truth": "2"}}
    rows = [row | {"reward_model": {"ground_truth": str(i + 1)}} for i in range(3)]
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "b.jsonl").write_text("\n".join(json.dumps(row) for row in rows[1:]) + "\n")
    pq.write_table(pa.Table.from_pylist(rows[:1]), folder / "a.parquet")
    (folder / "notes.txt").write_text("not data")
    (folder / "nested.jsonl").mkdir()  # a folder with a data file's name is not a file
    data = load_prompts([str(folder)], tokenizer, 16)
    assert list(data["ground_truth"]) == ["1", "2", "3"]  # a.parquet, then b.jsonl
    assert f"data folder {folder}: reading a.parquet, b.jsonl" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"data folder .*empty holds no .parquet, .jsonl or .json file"):
        load_prompts([str(tmp_path / "empty")], tokenizer, 16)


def test_long_prompt_is_an_error_truncated_or_dropped(tmp_path, tokenizer, capsys):
    path = write_jsonl(tmp_path / "long.jsonl", [row(), row("12345+67890=")])
    with pytest.raises(DataError, match=r"long.jsonl, row 1: the prompt has 12 tokens, more than --max-prompt-length 8"):
        load_prompts([path], tokenizer, 8)
    data = load_prompts([path], tokenizer, 8, overlong="truncate")
    assert tokenizer.decode(data["prompt_ids"][1]) == "5+67890="
    data = load_prompts([path], tokenizer, 8, overlong="drop")  # verl's filter_overlong_prompts
    assert list(data["prompt_text"]) == ["1+2="]
    assert "left out 1 prompts" in capsys.readouterr().out
    with pytest.raises(DataError, match="every prompt of .* is longer than --max-prompt-length 3"):
        load_prompts([path], tokenizer, 3, overlong="drop")


def test_trl_rows_a_string_or_messages_with_their_columns(tmp_path, tokenizer):
    rows = [
        {"prompt": "1+2=", "answer": "3", "level": 1},
        {"prompt": [{"role": "user", "content": "2+2="}], "data_source": "addition", "ground_truth": "4"},
    ]
    data = load_prompts([write_jsonl(tmp_path / "trl.jsonl", rows)], tokenizer, 16)
    assert list(data["prompt_text"]) == ["1+2=", "2+2="] and list(data["data_source"]) == ["custom", "addition"]
    assert list(data["ground_truth"]) == ["", "4"]
    assert data["columns"][0] == {"answer": "3", "level": 1} == data["extra_info"][0]
    assert data["prompt"][0] == "1+2=" and data["prompt"][1] == rows[1]["prompt"]
    with pytest.raises(DataError, match="row 0: field 'prompt' must be a string or a non-empty list of chat messages"):
        load_prompts([write_jsonl(tmp_path / "bad.jsonl", [{"prompt": 3}])], tokenizer, 16)


def test_chat_template_applied_when_present(tmp_path, tokenizer):
    templated = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    templated.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    )
    data = load_prompts([write_jsonl(tmp_path / "d.jsonl", [row()])], templated, 32)
    assert data["prompt_text"][0] == "<user>1+2=<a>"
    plain = load_prompts([write_jsonl(tmp_path / "d.jsonl", [row()])], tokenizer, 32)
    assert plain["prompt_text"][0] == "1+2="


def test_collate_left_pads(tokenizer, tmp_path):
    data = load_prompts([write_jsonl(tmp_path / "d.jsonl", [row("1+2="), row("10+20=")])], tokenizer, 16)
    batch = collate(data, tokenizer.pad_token_id)
    assert batch["prompt_mask"].tolist() == [[0, 0, 1, 1, 1, 1], [1] * 6]
    assert batch["prompts"][0, :2].tolist() == [tokenizer.pad_token_id] * 2


def test_loader_epochs_shuffle_and_resume(tokenizer, tmp_path):
    data = load_prompts([write_jsonl(tmp_path / "d.jsonl", [row(f"{i}+0=", str(i)) for i in range(10)])], tokenizer, 16)
    loader = PromptLoader(data, 3, tokenizer.pad_token_id, seed=7)
    stream = loader.forever()
    first_epoch = [list(next(stream)["ground_truth"]) for _ in range(3)]
    assert len({t for batch in first_epoch for t in batch}) == 9  # 3 full batches, the last row dropped
    state = loader.state_dict()
    following = [list(next(stream)["ground_truth"]) for _ in range(4)]
    resumed = PromptLoader(data, 3, tokenizer.pad_token_id, seed=7)
    resumed.load_state_dict(state)
    resumed_stream = resumed.forever()
    assert [list(next(resumed_stream)["ground_truth"]) for _ in range(4)] == following
    with pytest.raises(DataError, match="batch of 11 prompts is larger than the dataset"):
        PromptLoader(data, 11, tokenizer.pad_token_id)


def test_batch_sizes_must_divide():
    check_batch_sizes(32, 16, 8, 2, 1)
    with pytest.raises(ValueError, match="not a multiple of --mini-batch-size"):
        check_batch_sizes(32, 12, 8, 2, 1)
    with pytest.raises(ValueError, match="does not split evenly over --num-workers 3"):
        check_batch_sizes(4, 4, 1, 3, 1)
    check_batch_sizes(1, 1, 2, 4, 2)  # 2 sequences over 2 data-parallel ranks of 2 workers each
    with pytest.raises(ValueError, match=r"over 3 data-parallel ranks \(--num-workers 6 / --sequence-parallel 2\)"):
        check_batch_sizes(4, 4, 1, 6, 2)
