"""Chat transcripts for supervised training (algos/sft_hybrid.py), checked and tokenised before any worker starts.

Each row: `messages`, a conversation in the chat format of OpenAI and transformers (roles system, user, assistant
and tool; an assistant's `tool_calls`, a `tool` message with a call's result), and optionally `tools`, the JSON
schemas of the tools the conversation may call (as transformers.utils.get_json_schema gives them). The tokenizer's
chat template renders a row; the loss covers the assistant's tokens only: its content, its tool calls and its
end-of-turn token, never what the user, the system or a tool wrote.

Which tokens are the assistant's is found the same way for any template: the conversation up to an assistant
message, rendered with the generation prompt, must be a prefix (in tokens) of the conversation up to and including
that message, itself a prefix of the whole; the tokens in between are the assistant's, up to its last end-of-turn
token (the trailing newline of ChatML's turns is the template's, not the model's). A template that breaks the prefix
property (one that renders earlier turns differently once later ones follow) is named with the row that shows it.
"""

from __future__ import annotations

import torch

from common.data import DataError, PromptLoader, data_files, read_rows
from common.dataproto import DataProto

ROLES = ("system", "user", "assistant", "tool")


def check_transcript(row, path: str, index: int) -> None:
    where = f"{path}, row {index}"
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError(f"{where}: field 'messages' must be a non-empty list of chat messages (a transcript to train on)")
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise DataError(f"{where}: every message needs a 'role' among {', '.join(ROLES)}, got {message!r}")
    if not any(message["role"] == "assistant" for message in messages):
        raise DataError(f"{where}: no assistant message, so nothing to learn from it; add one or drop the row")
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: field 'tools' must be a list of JSON schemas (dicts, as get_json_schema gives them)")


def assistant_tokens(messages: list[dict], tools: list[dict] | None, tokenizer, eos_token_ids: list[int], where: str):
    """The token ids of the conversation as the chat template renders it, and a 0/1 mask of the assistant's tokens."""

    def tokens(upto: int, generation_prompt: bool = False) -> list[int]:
        text = tokenizer.apply_chat_template(
            messages[:upto], tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    ids = tokens(len(messages))
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = tokens(i, generation_prompt=True), tokens(i + 1)
        if through[: len(before)] != before or ids[: len(through)] != through:
            raise DataError(
                f"{where}: the chat template renders the conversation up to assistant message {i} otherwise once later "
                "messages follow, so its tokens cannot be told apart from the rest (the prefix property); use a "
                "template that renders earlier turns the same whatever follows them (a model folder whose tokenizer has one)"
            )
        turn = through[len(before) :]
        ends = [j for j, token in enumerate(turn) if token in eos_token_ids]
        end = len(before) + (ends[-1] + 1 if ends else len(turn))  # through its end-of-turn token
        mask[len(before) : end] = [1] * (end - len(before))
    return ids, mask


def load_transcripts(
    files: list[str], tokenizer, eos_token_ids: list[int], max_prompt_length: int, max_response_length: int
) -> DataProto:
    """Read, check and tokenise every row of `files`, each split where the assistant first writes: the tokens before
    it (`prompt_ids`, at most `max_prompt_length`) and the rest (`response_ids`, at most `max_response_length`, with
    its `loss_mask`). Raises on the first bad row."""
    if not tokenizer.chat_template:
        raise DataError("the tokenizer has no chat template to render transcripts with: use a model folder that has one")
    prompt_ids, response_ids, loss_masks = [], [], []
    for path in data_files(files):
        for index, row in enumerate(read_rows(path)):
            check_transcript(row, path, index)
            where = f"{path}, row {index}"
            ids, mask = assistant_tokens(list(row["messages"]), row.get("tools") or None, tokenizer, eos_token_ids, where)
            start = mask.index(1)
            if start == 0:
                raise DataError(f"{where}: the template renders nothing before the assistant's first token; add a user turn")
            if start > max_prompt_length or len(ids) - start > max_response_length:
                raise DataError(
                    f"{where}: {start} tokens before the assistant's first and {len(ids) - start} from it on, more than "
                    f"--max-prompt-length {max_prompt_length} or --max-response-length {max_response_length}: raise them"
                )
            prompt_ids.append(ids[:start])
            response_ids.append(ids[start:])
            loss_masks.append(mask[start:])
    return DataProto.from_dict(non_tensors={"prompt_ids": prompt_ids, "response_ids": response_ids, "loss_mask": loss_masks})


def collate_transcripts(rows: DataProto, pad_token_id: int) -> DataProto:
    """The batch a policy's passes read, as rollouts make it (rollout.response_batch): left-padded prompts, then
    right-padded responses whose `response_mask` is the assistant's tokens."""
    prompt_width = max(len(ids) for ids in rows["prompt_ids"])
    response_width = max(len(ids) for ids in rows["response_ids"])
    input_ids = torch.full((len(rows), prompt_width + response_width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros((len(rows), response_width))
    for i, (prompt, response, mask) in enumerate(zip(rows["prompt_ids"], rows["response_ids"], rows["loss_mask"])):
        span = slice(prompt_width - len(prompt), prompt_width + len(response))
        input_ids[i, span] = torch.tensor(prompt + response)
        attention_mask[i, span] = 1
        response_mask[i, : len(mask)] = torch.tensor(mask, dtype=torch.float)
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, prompt_width:],
            "response_mask": response_mask,
        }
    )


class TranscriptLoader(PromptLoader):
    """Batches of transcripts (load_transcripts' rows), reshuffled every epoch, with a position to save and restore."""

    def collate(self, rows: DataProto) -> DataProto:
        return collate_transcripts(rows, self.pad_token_id)


def token_mean_loss(policy, loader: TranscriptLoader) -> float:
    """The mean negative log-likelihood of the assistant's tokens of every transcript of `loader`, under `policy`."""
    total, tokens = 0.0, 0.0
    for batch in loader:
        inputs = batch.select("input_ids", "attention_mask", "position_ids", "responses")
        log_probs = policy.scatter("compute_log_prob", inputs)
        total -= float((log_probs["old_log_probs"] * batch["response_mask"]).sum())
        tokens += float(batch["response_mask"].sum())
    return total / max(tokens, 1.0)

