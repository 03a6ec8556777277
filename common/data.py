"""Prompt files in verl's format or TRL's, checked and tokenised before any worker starts.

A verl row: `prompt` (a list of chat messages, dicts with `role` and `content`), `data_source` (names the reward
function), `reward_model` (a dict with `ground_truth`) and optionally `extra_info` (a dict, passed to the reward) and
`env` (with several --env environments: the one whose episode the row plays).
A TRL row (one without `reward_model`): `prompt`, a string (used as it is, without the chat template, as TRL does) or
a list of messages, and any other columns, which reach a reward function as TRL passes them (its `extra_info` in
verl's signature); `data_source` (default "custom") and `ground_truth` columns are read when present.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from common.dataproto import DataProto


class DataError(ValueError):
    pass


DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


def pad_token_id(tokenizer, eos_token_ids: list[int] | None = None) -> int:
    """The token that fills a row's padding, for every model a run holds: the tokenizer's pad token, else the first token
    that ends a response (`eos_token_ids`, a model's own, else the tokenizer's EOS), else 0. Padding is masked: it must
    only be a token of the vocabulary."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return (eos_token_ids or [tokenizer.eos_token_id])[0] or 0


def data_files(paths: list[str]) -> list[str]:
    """`paths` with each folder replaced by the data files in it (.parquet, .jsonl, .json; not in subfolders), sorted
    by name, as the datasets library reads a folder; each folder's files are printed."""
    files = []
    for path in paths:
        if not os.path.isdir(path):
            files.append(path)
            continue
        inside = sorted(os.path.join(path, name) for name in os.listdir(path) if name.endswith(DATA_SUFFIXES))
        inside = [file for file in inside if os.path.isfile(file)]
        if not inside:
            raise DataError(f"data folder {path} holds no .parquet, .jsonl or .json file; name the files, or put them in it")
        print(f"data folder {path}: reading {', '.join(os.path.basename(file) for file in inside)}")
        files += inside
    return files


def read_rows(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise DataError(f"data file {path} does not exist")
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except pa.ArrowInvalid as error:
            raise DataError(
                f"data file {path} is not a parquet file ({error}); the files read are parquet (.parquet) and JSON lines "
                "(.jsonl, .json), chosen by their ending: convert it, or rename it to what it holds"
            ) from None
    elif path.endswith((".jsonl", ".json")):
        with open(path) as f:
            rows = []
            for line_number, line in enumerate(f):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as error:
                        raise DataError(f"{path}, line {line_number + 1}: not valid JSON ({error})") from None
    else:
        raise DataError(f"data file {path}: use .parquet or .jsonl (or a folder of them)")
    if not rows:
        raise DataError(f"data file {path} has no rows")
    return rows


def check_messages(prompt, where: str) -> None:
    for message in prompt:
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("content"), str)
            or not isinstance(message.get("role"), str)
        ):
            raise DataError(
                f"{where}: field 'prompt' must hold messages like {{'role': 'user', 'content': '...'}}, got {message!r}"
            )
    if not any(message["content"].strip() for message in prompt):
        raise DataError(f"{where}: field 'prompt' has no text (every message's 'content' is empty); fill it or drop the row")


def check_row(row, path: str, index: int) -> None:
    where = f"{path}, row {index}"
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with fields prompt, data_source, reward_model")
    prompt = row.get("prompt")
    if "reward_model" not in row:  # TRL's format
        if isinstance(prompt, str) and not prompt.strip():
            raise DataError(f"{where}: field 'prompt' is an empty string; fill it or drop the row")
        if not isinstance(prompt, (str, list, tuple)) or not prompt:
            raise DataError(
                f"{where}: field 'prompt' must be a string or a non-empty list of chat messages, got "
                f"{type(prompt).__name__} (a verl row also has 'data_source' and 'reward_model')"
            )
        if not isinstance(prompt, str):
            check_messages(prompt, where)
        if not isinstance(row.get("data_source", ""), str):
            raise DataError(f"{where}: field 'data_source' must be a string naming the reward function when present")
        return
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise DataError(f"{where}: field 'prompt' must be a non-empty list of chat messages, got {type(prompt).__name__}")
    check_messages(prompt, where)
    if not isinstance(row.get("data_source"), str):
        raise DataError(f"{where}: field 'data_source' must be a string naming the reward function")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise DataError(f"{where}: field 'reward_model' must be a dict with a 'ground_truth'")
    if reward_model["ground_truth"] is None:
        raise DataError(
            f"{where}: field 'reward_model' has a null 'ground_truth'; give the answer the reward compares with "
            "(an empty string if your reward needs none)"
        )
    if row.get("extra_info") is not None and not isinstance(row["extra_info"], dict):
        raise DataError(f"{where}: field 'extra_info' must be a dict when present")
    for name in ("env", "environment"):  # ours, TRL's
        if row.get(name) is not None and not isinstance(row[name], str):
            raise DataError(f"{where}: field '{name}' must be a string naming one of --env's environments when present")


def render_prompt(prompt, tokenizer, tools: list[dict] | None = None) -> str:
    """A string prompt as it is; messages in the chat template when the tokenizer has one (with `tools`' JSON schemas),
    their text otherwise."""
    if isinstance(prompt, str):
        return prompt
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(list(prompt), tools=tools, add_generation_prompt=True, tokenize=False)
    return "\n".join(m["content"] for m in prompt)


def row_fields(row: dict) -> tuple[str, object, dict, dict]:
    """(data_source, ground_truth, extra_info, the other columns) of a checked row of either format."""
    columns = {key: value for key, value in row.items() if key != "prompt"}
    if "reward_model" in row:
        return row["data_source"], row["reward_model"]["ground_truth"], row.get("extra_info") or {}, columns
    return row.get("data_source") or "custom", row.get("ground_truth", ""), columns, columns


def load_prompts(
    files: list[str], tokenizer, max_prompt_length: int, overlong: str = "error", envs: dict | None = None
) -> DataProto:
    """Read, check and tokenise every row of `files`; raise on the first bad one. A prompt over `max_prompt_length`
    tokens is an error, its last tokens kept (`overlong` "truncate") or the row left out ("drop", counted and printed).
    `envs`: with --env or --tools, each environment's tools by name (their schemas, rendered in the prompt; None for a
    step(text) environment): a row's `env` field (or TRL's `environment`) names its environment, kept as `env`, else the
    first."""
    prompt_ids, data_sources, ground_truths, extra_infos, texts, messages, prompts, columns = ([] for _ in range(8))
    env_names, dropped = [], 0
    for path in data_files(files):
        for index, row in enumerate(read_rows(path)):
            check_row(row, path, index)
            env_name = row.get("env") or row.get("environment") or (next(iter(envs)) if envs else None)
            if env_name is not None and env_name not in (envs or {}):
                raise DataError(
                    f"{path}, row {index}: field 'env' (or 'environment') names {env_name!r}, not one of --env's environments "
                    f"({', '.join(envs or {}) or 'no --env given'}); pass it to --env, or fix the row"
                )
            schemas = envs[env_name] if envs else None
            text = render_prompt(row["prompt"], tokenizer, list(schemas.values()) if schemas else None)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) > max_prompt_length:
                if overlong == "drop":
                    dropped += 1
                    continue
                if overlong == "error":
                    raise DataError(
                        f"{path}, row {index}: the prompt has {len(ids)} tokens, more than --max-prompt-length "
                        f"{max_prompt_length}; raise the limit, pass --truncate-prompts to keep its last tokens or "
                        "--filter-overlong-prompts to leave such rows out"
                    )
                ids = ids[-max_prompt_length:]
            source, truth, extra_info, other = row_fields(row)
            prompt_ids.append(ids)
            texts.append(text)
            prompt = row["prompt"]
            messages.append([{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt))
            prompts.append(prompt if isinstance(prompt, str) else list(prompt))
            data_sources.append(source)
            ground_truths.append(truth)
            extra_infos.append(extra_info)
            columns.append(other)
            env_names.append(env_name)
    if dropped:
        print(f"--filter-overlong-prompts: left out {dropped} prompts of {files} longer than {max_prompt_length} tokens")
    if not prompt_ids:
        raise DataError(f"every prompt of {files} is longer than --max-prompt-length {max_prompt_length}; raise it")
    rows = {
        "prompt_ids": prompt_ids,
        "prompt_text": texts,
        "prompt_messages": messages,
        "prompt": prompts,
        "data_source": data_sources,
        "ground_truth": ground_truths,
        "extra_info": extra_infos,
        "columns": columns,
    }
    return DataProto.from_dict(non_tensors=rows | ({"env": env_names} if envs else {}))


def collate(rows: DataProto, pad_token_id: int) -> DataProto:
    """Left-pad the prompts of `rows` into `prompts` and `prompt_mask`."""
    longest = max(len(ids) for ids in rows["prompt_ids"])
    prompts = torch.full((len(rows), longest), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, ids in enumerate(rows["prompt_ids"]):
        prompts[i, longest - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        prompt_mask[i, longest - len(ids) :] = 1
    return DataProto({"prompts": prompts, "prompt_mask": prompt_mask}, dict(rows.non_tensors))


class PromptLoader:
    """Batches of prompts, reshuffled every epoch, with a position that can be saved and restored."""

    def __init__(
        self,
        dataset: DataProto,
        batch_size: int,
        pad_token_id: int,
        shuffle: bool = True,
        seed: int = 1,
        drop_last: bool = True,
    ):
        if drop_last and batch_size > len(dataset):
            raise DataError(
                f"a batch of {batch_size} prompts is larger than the dataset ({len(dataset)} prompts); lower the batch size"
            )
        self.dataset, self.batch_size, self.pad_token_id = dataset, batch_size, pad_token_id
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch, self.batch_index = 0, 0

    def __len__(self) -> int:
        whole, rest = divmod(len(self.dataset), self.batch_size)
        return whole + (rest > 0 and not self.drop_last)

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng(self.seed + self.epoch).permutation(len(self.dataset))

    def __iter__(self):
        """One pass over the data from the current position."""
        order = self._order()
        while self.batch_index < len(self):
            index = order[self.batch_index * self.batch_size : (self.batch_index + 1) * self.batch_size]
            self.batch_index += 1
            batch = self.collate(self.dataset[index])
            batch["uid"] = [f"{self.epoch}-{i}" for i in index]
            yield batch
        self.epoch, self.batch_index = self.epoch + 1, 0

    def collate(self, rows: DataProto) -> DataProto:
        """A batch of `rows` as the run reads it: their prompts left-padded (collate)."""
        return collate(rows, self.pad_token_id)

    def forever(self):
        while True:
            yield from self

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_index": self.batch_index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch_index = state["epoch"], state["batch_index"]


def check_batch_sizes(train_batch_size: int, mini_batch_size: int, n: int, num_workers: int, sequence_parallel: int) -> None:
    """Every data-parallel rank (--num-workers / --sequence-parallel of them) must get the same whole number of
    sequences per mini-batch."""
    if train_batch_size % mini_batch_size:
        raise ValueError(
            f"--train-batch-size {train_batch_size} is not a multiple of --mini-batch-size {mini_batch_size}; make it one"
        )
    data_parallel = num_workers // sequence_parallel
    if mini_batch_size * n % data_parallel:
        ranks = f"--num-workers {num_workers}"
        if sequence_parallel > 1:
            ranks = f"{data_parallel} data-parallel ranks ({ranks} / --sequence-parallel {sequence_parallel})"
        raise ValueError(
            f"a mini-batch of {mini_batch_size} prompts x {n} samples = {mini_batch_size * n} sequences "
            f"does not split evenly over {ranks}; change one of them"
        )
