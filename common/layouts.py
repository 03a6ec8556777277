"""How a batch's rows are laid out for the model: dealt into balanced parts, packed into rows, a prompt shared by its
samples, split among sequence-parallel ranks; and the model's outputs read back at the response tokens alone.

Pure torch, no process of its own: the worker group deals rows to ranks (balanced_parts), a worker deals its rows
into micro-batches and runs the model over each in its layout (response_outputs).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from contextlib import contextmanager
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from common.attention import packed_segments, runs_flex, segment_block_mask
from common.dataproto import DataProto
from common.sequence_parallel import SequenceParallel, full_attention, gather_tokens


def balanced_parts(
    weights: list[float], parts: int, equal_size: bool = False, groups: list[int] | None = None
) -> list[np.ndarray]:
    """Indices of `weights` in `parts` parts of near-equal total weight (greedy number partitioning: the heaviest
    item goes to the lightest part), each part in ascending order. With `equal_size`, each part takes
    len(weights) / parts items. With `groups` (one per item), the items of a group go together, the heaviest group
    first, to the lightest part with room; those that do not fit there go on to the next."""
    if equal_size and len(weights) % parts:
        raise ValueError(f"{len(weights)} items do not split into {parts} parts of equal size")
    room = len(weights) // parts if equal_size else len(weights)
    items_of = defaultdict(list)
    for i, group in enumerate(range(len(weights)) if groups is None else groups):
        items_of[group].append(i)
    members, loads = [[] for _ in range(parts)], [0.0] * parts
    for items in sorted(items_of.values(), key=lambda items: -sum(weights[i] for i in items)):
        while items:
            part = min((p for p in range(parts) if len(members[p]) < room), key=lambda p: loads[p])
            taken, items = items[: room - len(members[part])], items[room - len(members[part]) :]
            members[part] += taken
            loads[part] += sum(weights[i] for i in taken)
    return [np.array(sorted(m), dtype=np.int64) for m in members]


def part_loads(weights: list[float], parts: list[np.ndarray]) -> list[float]:
    return [sum(weights[i] for i in part) for part in parts]


def pack_rows(lengths: list[int], width: int) -> tuple[list[int], list[int]]:
    """The row and the offset of each sequence in rows of `width` tokens (first-fit decreasing bin packing)."""
    row_of, offset_of, rows, open_rows, shortest = [0] * len(lengths), [0] * len(lengths), 0, [], min(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((row for row in open_rows if row[1] + lengths[i] <= width), None)
        if row is None:
            row, rows = [rows, 0], rows + 1
            open_rows.append(row)
        row_of[i], offset_of[i] = row
        row[1] += lengths[i]
        if width - row[1] < shortest:  # no sequence fits in what is left: stop looking at this row
            open_rows.remove(row)
    return row_of, offset_of


Layout = Literal["padded", "one row", "rows", "shared prompts"]


def response_outputs(
    model,
    micro: DataProto,
    layout: Layout,
    language_model: bool,
    head_outputs=None,
    sequence_group=None,
    flex_from: int | None = None,
) -> torch.Tensor:
    """The model's output (a language model's logits, a critic's values) at the position before each real response
    token: one row per token where `attention_mask`'s response part is 1, the micro-batch's rows one after another.

    "padded": the model runs over the micro-batch's rectangle, padding included. Packed, the sequences' tokens are
    laid end to end with positions restarting per sequence, from which transformers builds attention that never
    crosses a sequence: "one row" holds them all, for flash-attention's variable-length kernel; "rows" fills rows as
    wide as the micro-batch, for kernels that take a dense mask (SDPA), whose cost grows with the square of a row's
    width, or a block mask (FlexAttention). "shared prompts" also takes either mask, and runs a prompt's tokens once
    for all its samples in the micro-batch (see shared_prompt_places); where no two of them share one, it packs as
    "rows" (which leaves a row that holds one sequence to the causal kernel, with no mask at all). A language model
    projects to the vocabulary only the positions read (see output_layer_at), or gives `head_outputs`' instead of
    logits. A micro-batch whose padded rows are at least `flex_from` wide (None: none) attends through a block mask
    instead of a dense one, its tokens in one row, where the model runs with common/attention.py's attention (see
    runs_flex there). With a `sequence_group`, its ranks split the rows' tokens among them (see
    sequence_parallel_outputs), over either mask.
    """
    attention_mask = micro["attention_mask"].bool()
    response_length = micro["responses"].shape[1]
    response_mask = attention_mask[:, -response_length:]
    if layout == "padded":
        inputs = {key: micro[key] for key in ("input_ids", "attention_mask", "position_ids")}
        place = torch.arange(attention_mask.numel(), device=attention_mask.device).view(attention_mask.shape)
        causal, flex, segments = False, False, None
    else:
        inputs, place, causal, flex, segments = packed_inputs(micro, layout, flex_from, sequence_group is None)
    read = place[:, -response_length - 1 : -1][response_mask]
    if sequence_group is not None:
        mask = segments if flex else None if causal else full_attention(inputs)
        return sequence_parallel_outputs(model, inputs, read, mask, language_model, head_outputs, sequence_group)
    if language_model:
        with output_layer_at(model, read, head_outputs):
            return model(**inputs, use_cache=False).logits[0]
    return model(**inputs, use_cache=False).logits.flatten(0, 1)[read]


def packed_inputs(micro: DataProto, layout: Layout, flex_from: int | None, block_mask: bool):
    """A micro-batch's sequences packed as response_outputs describes `layout` (not "padded"): the model's inputs,
    each token's place in the packed rows, read flat ([rows, width] as the micro-batch's), whether each row holds one
    sequence from its first place (the causal kernel needs no mask), whether it attends through a block mask, and the
    segments that mask is built from. `block_mask` False: a sequence-parallel group builds the mask itself."""
    attention_mask = micro["attention_mask"].bool()
    response_length = micro["responses"].shape[1]
    prompts = same_prompts(micro["input_ids"], attention_mask, response_length) if layout == "shared prompts" else []
    # A block mask costs nothing for the pairs of sequences that never meet: one row holds the whole micro-batch
    # (and torch.compile, which on the CPU fails to build FlexAttention again for another number of rows, sees one).
    flex, segments = runs_flex(attention_mask.shape[1], attention_mask.device, flex_from), None
    if len(set(prompts)) < len(prompts):
        place, width, rows, segments = shared_prompt_places(prompts, attention_mask, response_length, one_row=flex)
        causal = False
    else:
        lengths = attention_mask.sum(-1)
        width = int(lengths.sum()) if layout == "one row" or flex else attention_mask.shape[1]
        row_of, offset_of = pack_rows(lengths.tolist(), width)
        start = torch.tensor(row_of, device=lengths.device) * width + torch.tensor(offset_of, device=lengths.device)
        place, rows = start[:, None] + attention_mask.cumsum(-1) - 1, max(row_of) + 1
        causal = max(offset_of) == 0  # each row holds one sequence from its first place, then padding
    tokens = place[attention_mask]  # each token's place in the packed rows, read flat
    inputs = {
        key: micro[key].new_zeros(rows * width).index_put_((tokens,), micro[key][attention_mask]).view(-1, width)
        for key in ("input_ids", "position_ids")  # padding at a row's end sits at position 0: a sequence of its own
    }
    if flex:
        segments = segments or (packed_segments(inputs["position_ids"]),)
        if block_mask:
            inputs["attention_mask"] = segment_block_mask(*segments)
    elif segments is not None:
        inputs["attention_mask"] = shared_prompt_mask(*segments)
    return inputs, place, causal, flex, segments


def sequence_parallel_outputs(model, inputs: dict, read: torch.Tensor, mask, language_model: bool, head_outputs, group):
    """response_outputs' outputs, the rows' tokens split among the ranks of `group` (Ulysses; see
    common/sequence_parallel.py): rank r runs the r-th of as many equal shares of each row's columns (the rows padded
    to a multiple of the ranks), reads the outputs at its own read positions, and every rank gets them all back in
    `read`'s order. `mask`: whom each token of the whole rows sees, dense, or for a block mask a tuple of their
    segments (and parts) as segment_block_mask takes them (None: causal). With `head_outputs`, it is called with
    `tokens=`, the indices of the response tokens (in `read`'s order) whose hidden states it gets."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    rows, width = inputs["input_ids"].shape
    share = -(-width // ranks)
    pad = share * ranks - width
    if isinstance(mask, tuple):
        mask = segment_block_mask(*mask, width=share * ranks)
    elif mask is not None and pad:  # a padding token sees itself only
        eye = torch.eye(share * ranks, dtype=torch.bool, device=mask.device)
        mask = torch.nn.functional.pad(mask, (0, pad, 0, pad)) | eye
    columns = slice(rank * share, (rank + 1) * share)
    local = {key: torch.nn.functional.pad(inputs[key], (0, pad))[:, columns] for key in ("input_ids", "position_ids")}
    row, column = read // width, read % width
    owner = column // share
    counts = torch.bincount(owner, minlength=ranks).tolist()
    mine = (owner == rank).nonzero()[:, 0]
    local_read = row[mine] * share + column[mine] - rank * share
    forward = dict(use_cache=False, sequence_parallel=SequenceParallel(group, mask))
    if mask is not None:  # as the model's own too: else it builds one for the rank's share, dense where rows are packed
        forward["attention_mask"] = mask
    if language_model:
        local_head = None if head_outputs is None else functools.partial(head_outputs, tokens=mine)
        with output_layer_at(model, local_read, local_head):
            outputs = model(**local, **forward).logits[0]
    else:
        outputs = model(**local, **forward).logits.flatten(0, 1)[local_read]
    order = torch.argsort(owner, stable=True)  # the gathered outputs come rank after rank, each in `read`'s order
    return gather_tokens(outputs, counts, group)[torch.argsort(order)]


# Segments of shared prompts may grow this wide (see shared_prompt_places): a token's attention scores, one per
# head and token it sees, then take less memory than its other activations (some fifteen times the hidden size).
SEGMENT_TOKENS = 1024


def same_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> list[int]:
    """A group per row: rows with the same prompt (the tokens before the last `response_length`) share one."""
    prompt_mask = attention_mask[:, :-response_length]
    prompts = torch.cat([input_ids[:, :-response_length] * prompt_mask, prompt_mask], -1)
    return torch.unique(prompts, dim=0, return_inverse=True)[1].tolist()


def shared_prompt_places(same_prompt: list[int], attention_mask: torch.Tensor, response_length: int, one_row: bool = False):
    """Where each token of a micro-batch goes when the samples of one prompt share its tokens (Liu et al. 2025,
    "Prefix Grouper"): a segment holds a prompt once, then its samples' responses one after another, each response
    attending to the prompt and to itself only, at the positions it has after the prompt. The prompt's last output
    predicts every response's first token. Segments are packed into rows; none grows wider than SEGMENT_TOKENS or, if
    more, than keeps the rows' attention scores (rows x width squared) about those of the padded rectangle; with
    `one_row`, into one row (for a block mask, which holds no scores of segments that never meet).

    `same_prompt`: each row's prompt, as same_prompts gives it. Returns each token's flat place ([rows, width] read
    flat), the width, the number of rows, and each place's segment and part ([rows, width] each; a part is 0 for a
    prompt, else its response's own), from which shared_prompt_mask or a block mask (common/attention.py) says who
    sees whom.
    """
    prompt_length = attention_mask.shape[1] - response_length
    prompt_mask, response_mask = attention_mask[:, :prompt_length], attention_mask[:, prompt_length:]
    prompt_lengths, response_lengths = prompt_mask.sum(-1).tolist(), response_mask.sum(-1).tolist()
    # Segments of at most max_width tokens, in rows as wide, hold about as many attention scores as the padded
    # rectangle does when their tokens (each prompt once) fill max_width x rows: shared_tokens x max_width. Up to
    # SEGMENT_TOKENS wide, a token's scores (one per head and token it sees) take less than its other activations.
    shared_tokens = sum(response_lengths) + sum(dict(zip(same_prompt, prompt_lengths)).values())
    padded_width = attention_mask.shape[1]
    max_width = max(padded_width, SEGMENT_TOKENS, attention_mask.numel() * padded_width // shared_tokens)
    segments, open_segment = [], {}  # segments: [rows sharing a prompt]; open_segment: a prompt's last one, its length
    for row, prompt in enumerate(same_prompt):
        members, length = open_segment.get(prompt, (None, 0))
        if members is None or length + response_lengths[row] > max_width:
            members, length = [], prompt_lengths[row]
            segments.append(members)
        members.append(row)
        open_segment[prompt] = (members, length + response_lengths[row])
    lengths = [prompt_lengths[members[0]] + sum(response_lengths[row] for row in members) for members in segments]
    width = sum(lengths) if one_row else max(lengths)
    row_of, offset_of = pack_rows(lengths, width)
    prompt_start, response_start = [0] * len(same_prompt), [0] * len(same_prompt)
    segment_of, part_of = [-1] * len(same_prompt), [0] * len(same_prompt)
    for segment, members in enumerate(segments):
        start = row_of[segment] * width + offset_of[segment]
        end = start + prompt_lengths[members[0]]
        for row in members:
            prompt_start[row], response_start[row], segment_of[row], part_of[row] = start, end, segment, row + 1
            end += response_lengths[row]
    prompt_start, response_start, segment_of, part_of = (
        torch.tensor(v, device=attention_mask.device)[:, None] for v in (prompt_start, response_start, segment_of, part_of)
    )
    place = torch.cat([prompt_start + prompt_mask.cumsum(-1) - 1, response_start + response_mask.cumsum(-1) - 1], -1)
    tokens, size = place[attention_mask], (max(row_of) + 1) * width
    # Each place's segment and part (0: the prompt, else 1 + the response's row); a padding place is a segment alone.
    segment_at = -1 - torch.arange(size, device=attention_mask.device)
    segment_at[tokens] = segment_of.expand_as(attention_mask)[attention_mask]
    part_at = torch.zeros_like(segment_at)
    part_at[place[:, prompt_length:][response_mask]] = part_of.expand_as(response_mask)[response_mask]
    return place, width, max(row_of) + 1, (segment_at.view(-1, width), part_at.view(-1, width))


def shared_prompt_mask(segment: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """shared_prompt_places' attention as a dense mask, [rows, 1, width, width] (True: may attend): a token sees the
    tokens before it in its segment that are the prompt's or its own response's."""
    same_segment = segment[:, :, None] == segment[:, None, :]
    prompt_or_same_part = (part[:, None, :] == 0) | (part[:, :, None] == part[:, None, :])
    causal = torch.ones(segment.shape[1], segment.shape[1], dtype=torch.bool, device=segment.device).tril()
    return (same_segment & prompt_or_same_part & causal)[:, None]


@contextmanager
def output_layer_at(model, read: torch.Tensor, head_outputs=None):
    """Apply a language model's output layer only at the flat positions `read` of its [rows, width] hidden states.

    Logits over the whole vocabulary at every position are a pass's largest tensor (a 49k vocabulary makes 196 kB per
    token in fp32, against 2 kB of hidden state for a 576-wide model), yet only the tokens before a response's are read:
    the rest, prompts and padding, would cost compute and memory for nothing. The logits come back as one row; with
    `head_outputs(hidden, output_layer)`, what it returns for those positions' hidden states comes back in their place
    (see log_probs.chunked_log_probs).
    """
    head = model.get_output_embeddings()
    output_layer = head.forward

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.flatten(0, 1)[read]
        return (output_layer(hidden) if head_outputs is None else head_outputs(hidden, output_layer))[None]

    head.forward = forward
    try:
        yield
    finally:
        del head.forward  # the class's own again


def rows_of(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values`, one per true entry of `mask`, back in `mask`'s shape with 0 elsewhere."""
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


# How far the same output may move when only the layout changes, as a share of its size (at least 1): fp32 reorders
# sums (SmolLM2-135M's own-token log-probs by 1.3e-6 of themselves); bf16 rounds every output to 8 bits, which
# moved them by up to 1.2% on the EPYC AVX2 machine, by different amounts on other CPUs. A sequence that sees
# another moves them by 13% or more there.
LAYOUT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.05}


@torch.no_grad()
def packing_gap(
    model, packing: Layout, language_model: bool, dtype: torch.dtype, sequence_group=None, flex_from: int | None = None
) -> str | None:
    """Why `packing` does not stand in for padded micro-batches with `model` (computing in `dtype`), or None where it
    does. Three made-up sequences share packed rows, two of them a prompt. Compared, at LAYOUT_TOLERANCE[dtype]: the
    outputs a run uses (a language model's log-prob of each sequence's own next token, a critic's value), packed and
    padded; and, in the packed rows alone, each sequence's when the responses beside it are redrawn, which stay
    exactly the same unless the model's attention lets packed sequences see each other, whatever the CPU or GPU.
    response_outputs' other arguments as there."""
    vocab_size = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab_size, (3, 12), generator=generator)
    ids[2, :6] = ids[0, :6]
    attention_mask = torch.tensor([[0] * 4 + [1] * 5 + [0] * 3, [0] * 3 + [1] * 6 + [0] * 3, [0] * 4 + [1] * 7 + [0]])
    redrawn = torch.randint(vocab_size, (3, 6), generator=generator)
    device = next(model.parameters()).device
    response_mask = attention_mask[:, 6:].bool()
    row_of_token = torch.arange(3)[:, None].expand(3, 6)[response_mask]

    def outputs(layout: Layout, redraw: list[int]) -> torch.Tensor:
        tokens = ids.clone()
        tokens[redraw, 6:] = redrawn[redraw]
        micro = DataProto.from_dict(
            {
                "input_ids": tokens * attention_mask,
                "attention_mask": attention_mask,
                "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
                "responses": tokens[:, 6:],
            }
        ).to(device)
        out = response_outputs(model, micro, layout, language_model, None, sequence_group, flex_from).float().cpu()
        if not language_model:
            return out[:, 0]
        return torch.log_softmax(out, -1).gather(-1, tokens[:, 6:][response_mask][:, None])[:, 0]

    def moved(changed: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
        """The largest move as a share of the reference's size (at least 1), and that move."""
        gaps = (changed - reference).abs()
        worst = int((gaps / reference.abs().clamp(min=1)).argmax())
        return float(gaps[worst] / reference[worst].abs().clamp(min=1)), float(gaps[worst])

    tolerance, what = LAYOUT_TOLERANCE[dtype], "own-token log-probs" if language_model else "values"
    packed = outputs(packing, [])
    for redraw, kept in (([0, 1], [2]), ([2], [0, 1])):  # either way round: whichever sits first in a packed row
        keep = torch.isin(row_of_token, torch.tensor(kept))
        share, gap = moved(outputs(packing, redraw)[keep], packed[keep])
        if share > tolerance:
            return (
                f"packed as {packing}, sequences' {what} moved by up to {gap:.3g} ({share:.1%}) when the responses "
                "packed beside them were redrawn: this model's attention lets packed sequences see each other"
            )
    share, gap = moved(packed, outputs("padded", []))
    if share > tolerance:
        return (
            f"packed as {packing}, the {what} differ from padded rows' by up to {gap:.3g} ({share:.1%}), more than "
            f"{str(dtype).removeprefix('torch.')} allows ({tolerance:g} of their size)"
        )
    return None
