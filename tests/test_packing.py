"""Packed micro-batches against padded ones on the tiny model, the partitioning that balances them, and the log-probs
and entropies computed from them."""

from functools import partial

import numpy as np
import pytest
import torch
from helpers import uneven_batch

from common.layouts import (
    balanced_parts,
    pack_rows,
    packing_gap,
    part_loads,
    response_outputs,
    rows_of,
    same_prompts,
    shared_prompt_mask,
    shared_prompt_places,
)
from common.log_probs import Entropy, chunked_log_probs, head_outputs_pass_through, response_log_probs


@pytest.mark.parametrize("packing", ["rows", "one row", "shared prompts"])
def test_packed_log_probs_entropies_gradients_and_step_equal_the_padded_ones(tiny_model, packing):
    from transformers import AutoModelForCausalLM

    results = []
    for layout in ("padded", packing):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa")
        batch = uneven_batch(model.config.vocab_size)
        mask = batch["attention_mask"][:, 7:].bool()
        logits = response_outputs(model, batch, layout, language_model=True)
        log_probs, entropy = response_log_probs(logits, batch["responses"][mask], 1.0, with_entropy=True)
        advantages = torch.linspace(-1, 1, int(mask.sum()))
        (-(log_probs * advantages).mean() - 0.01 * entropy.mean()).backward()
        gradients = {name: p.grad.clone() for name, p in model.named_parameters()}
        torch.optim.SGD(model.parameters(), lr=1.0).step()
        results.append((rows_of(log_probs, mask), rows_of(entropy, mask), gradients, model.state_dict()))
    (padded_log_probs, padded_entropy, padded_grads, padded_weights), (log_probs, entropy, grads, weights) = results
    assert padded_log_probs.shape == (7, 6) and torch.all(padded_log_probs[~mask] == 0)
    torch.testing.assert_close(log_probs, padded_log_probs, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, padded_entropy, rtol=0, atol=1e-5)
    for name, gradient in padded_grads.items():
        torch.testing.assert_close(grads[name], gradient, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(weights[name], padded_weights[name], rtol=0, atol=1e-5)


@pytest.mark.parametrize("packing", ["rows", "one row", "shared prompts"])
def test_packed_values_equal_the_padded_ones(tiny_model, packing):
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(tiny_model, dtype=torch.float32, num_labels=1)
    batch = uneven_batch(model.config.vocab_size)
    padded, packed = (response_outputs(model, batch, layout, language_model=False) for layout in ("padded", packing))
    assert packed.shape == (int(batch["attention_mask"][:, 7:].sum()), 1)
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)


def test_shared_prompts_without_a_shared_prompt_pack_as_rows(tiny_model):
    """Rows 0-3 have prompts of their own: no dense mask is built, the model runs exactly as packed in rows."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa")
    batch = uneven_batch(model.config.vocab_size)[[0, 1, 2, 3]]
    shared, rows = (response_outputs(model, batch, layout, language_model=True) for layout in ("shared prompts", "rows"))
    assert torch.equal(shared, rows)


def test_shared_prompts_run_once_for_their_samples_and_no_wider_than_the_padded_attention():
    batch = uneven_batch(100)
    mask = batch["attention_mask"].bool()
    place, width, rows, segments = shared_prompt_places(same_prompts(batch["input_ids"], mask, 6), mask, 6)
    # Rows 0, 4 and 6 read row 0's prompt from the same places, rows 1 and 5 row 1's; every other token has its own.
    assert torch.equal(place[4, :7][mask[4, :7]], place[0, :7][mask[0, :7]]) and torch.equal(place[6, :7], place[0, :7])
    assert torch.equal(place[5, :7][mask[5, :7]], place[1, :7][mask[1, :7]])
    assert len(place[mask].unique()) == int(mask.sum()) - 7 - 7 - 3 == 40
    # Segments: row 0's prompt with its 3 responses (19 tokens), row 1's with 2 (10), rows 2 and 3 alone (8 and 3),
    # in rows as wide as the widest: 19, then 10 + 8, then 3.
    attention = shared_prompt_mask(*segments)
    assert width == 19 and rows == 3 and attention.shape == (3, 1, 19, 19)
    attention = attention[0, 0]
    response_of_row_4 = place[4, 7:11] % width
    assert attention[response_of_row_4[-1]].sum() == 7 + 4  # the prompt and its own response, not row 0's
    # 12 samples of one prompt (7 tokens), each answer 300 tokens: one segment would hold 3,607 tokens and 13 million
    # attention scores, against the rectangle's 1.1 million. Segments of at most 1,024 tokens (SEGMENT_TOKENS): 4.
    ids, mask = torch.ones(12, 7 + 300, dtype=torch.long), torch.ones(12, 7 + 300, dtype=torch.bool)
    place, width, rows, _ = shared_prompt_places(same_prompts(ids, mask, 300), mask, 300)
    assert width == 7 + 3 * 300 and rows == 4 and len(place[:, 6].unique()) == 4


def test_log_probs_in_chunks_equal_them_whole_and_never_hold_more_than_a_chunk_of_logits(tiny_model):
    """Chunks of 4 of the batch's 24 response tokens: log-probs, entropies and gradients as from the whole logits, and
    no tensor as wide as the vocabulary ever holds more than 4 rows, in the forward or the backward (checked on every
    tensor an operation returns); whole, the same probe sees all 24."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForCausalLM

    class WidestLogits(TorchDispatchMode):
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for tensor in result if isinstance(result, (tuple, list)) else [result]:
                # [tokens, vocabulary]; not the output layer's weight, [hidden, vocabulary] when transposed
                if (
                    isinstance(tensor, torch.Tensor)
                    and tensor.dim() == 2
                    and tensor.shape[-1] == vocab_size
                    and tensor.shape[0] != hidden_size
                ):
                    self.rows = max(self.rows, tensor.shape[0])
            return result

    results = []
    for chunk_tokens in (4, 0):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa")
        vocab_size, hidden_size = model.config.vocab_size, model.config.hidden_size
        batch = uneven_batch(vocab_size)
        mask = batch["attention_mask"][:, 7:].bool()
        chunked = partial(chunked_log_probs, responses=batch["responses"][mask], temperature=0.7, with_entropy=True)
        with WidestLogits() as probe:
            outputs = response_outputs(model, batch, "shared prompts", True, partial(chunked, chunk_tokens=chunk_tokens))
            log_probs, entropy = outputs[:, 0], outputs[:, 1]
            advantages = torch.linspace(-1, 1, int(mask.sum()))
            (-(log_probs * advantages).mean() - 0.01 * entropy.mean()).backward()
        results.append((log_probs, entropy, {name: p.grad for name, p in model.named_parameters()}, probe.rows))
    (log_probs, entropy, gradients, rows), (whole_log_probs, whole_entropy, whole_gradients, whole_rows) = results
    logits = response_outputs(model, batch, "shared prompts", True)
    expected_log_probs, expected_entropy = response_log_probs(logits, batch["responses"][mask], 0.7, with_entropy=True)
    torch.testing.assert_close(whole_log_probs, expected_log_probs, rtol=0, atol=1e-6)
    torch.testing.assert_close(whole_entropy, expected_entropy, rtol=0, atol=1e-6)
    torch.testing.assert_close(log_probs, whole_log_probs, rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, whole_entropy, rtol=0, atol=1e-6)
    for name, gradient in whole_gradients.items():
        torch.testing.assert_close(gradients[name], gradient, rtol=1e-5, atol=1e-7)
    assert rows == 4 and whole_rows == int(mask.sum()) == 24


def test_log_probs_in_chunks_only_where_the_model_keeps_its_output_layer_output(tiny_model):
    """Gemma 2 soft-caps its logits after the output layer: chunked log-probs would be capped in their place."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    llama = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    config = Gemma2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        final_logit_softcapping=30.0,
    )
    gemma = AutoModelForCausalLM.from_config(config)
    assert head_outputs_pass_through(llama, torch.device("cpu"))
    assert not head_outputs_pass_through(gemma, torch.device("cpu"))


def test_attention_that_crosses_sequences_would_be_caught(tiny_model):
    """Two sequences in one row whose positions do not restart are one sequence to the model: the second then sees
    the first, and its outputs move far beyond the tolerance of the check each worker makes at setup
    (FSDPWorker._packs_exactly), against the second alone at the same positions."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa")
    batch = uneven_batch(model.config.vocab_size)
    mask = batch["attention_mask"].bool()
    first, second = batch["input_ids"][0][mask[0]], batch["input_ids"][1][mask[1]]
    positions = torch.arange(len(first) + len(second))[None]
    crossing = model(input_ids=torch.cat([first, second])[None], position_ids=positions).logits[0, len(first) :]
    alone = model(input_ids=second[None], position_ids=positions[:, len(first) :]).logits[0]
    assert (torch.log_softmax(crossing, -1) - torch.log_softmax(alone, -1)).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packing_check_catches_attention_that_crosses_sequences_in_either_dtype(tiny_model, dtype):
    """The check each worker makes at setup (FSDPWorker._packs_exactly), on the tiny model: it passes as transformers
    keeps packed sequences apart; once positions run on across a packed row without a mask, it names the leak, in
    fp32 and bf16 alike (the sequences beside redrawn responses move, in the same layout, beyond any rounding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=dtype, attn_implementation="sdpa").eval()
    for packing in ("rows", "shared prompts"):
        assert packing_gap(model, packing, True, dtype) is None

    def one_sequence_per_row(module, args, kwargs):
        ids = kwargs["input_ids"]
        kwargs["position_ids"] = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
        kwargs.pop("attention_mask", None)
        return args, kwargs

    model.register_forward_pre_hook(one_sequence_per_row, with_kwargs=True)
    for packing in ("rows", "shared prompts"):
        assert "this model's attention lets packed sequences see each other" in packing_gap(model, packing, True, dtype)


BF16_CHECK = """
import torch
from transformers import AutoModelForCausalLM
from common.layouts import packing_gap
model = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
gaps = [packing_gap(model, packing, True, torch.bfloat16) for packing in ("rows", "shared prompts")]
print(torch.backends.cpu.get_cpu_capability(), gaps)
"""


@pytest.mark.parametrize("capability", ["own", "avx2", "default"])
def test_the_packing_check_passes_in_bf16_whatever_the_cpus_kernels(smollm2, capability):
    """SmolLM2-135M in bf16 under this CPU's own kernels (AVX-512 with native bf16 on an EPYC of family 25, AMX on an
    Intel Xeon), under ATEN_CPU_CAPABILITY avx2 (the EPYC AVX2 machine's own) and default (no vector kernels), standing
    in for CPUs whose bf16 rounds differently: packed rows and shared prompts pass the check. Its earlier form (the
    vocabulary's log-probs within 0.05 of the padded rows') failed on an Intel Xeon with AMX and on the EPYC AVX2
    machine, where bf16 alone moved them by 0.41."""
    import os
    import subprocess
    import sys

    env = {name: value for name, value in os.environ.items() if name != "ATEN_CPU_CAPABILITY"}
    if capability != "own":
        env["ATEN_CPU_CAPABILITY"] = capability
    result = subprocess.run(
        [sys.executable, "-c", BF16_CHECK.format(path=smollm2)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["[None,", "None]"], result.stdout
    if capability != "own":
        assert result.stdout.split()[-3] == capability.upper(), result.stdout


def test_balanced_parts_deal_the_heaviest_first_to_the_lightest_part():
    weights = [10, 1, 1, 1, 9, 2]
    parts = balanced_parts(weights, 2, equal_size=True)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5]] and part_loads(weights, parts) == [12, 12]
    parts = balanced_parts([5, 4, 3, 3, 3], 2)
    assert [p.tolist() for p in parts] == [[0, 3], [1, 2, 4]]  # 8 and 10: greedy, not the optimum 9 and 9
    parts = balanced_parts([1, 1, 1, 1], 4)
    assert [p.tolist() for p in parts] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="5 items do not split into 2 parts of equal size"):
        balanced_parts([1] * 5, 2, equal_size=True)
    # Groups stay whole where they fit: each part takes one group of 4; groups of 3 split only where room is left.
    parts = balanced_parts([1] * 8, 2, equal_size=True, groups=[0, 1, 0, 1, 0, 1, 0, 1])
    assert [p.tolist() for p in parts] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    parts = balanced_parts([1] * 6, 2, equal_size=True, groups=[0, 0, 1, 1, 2, 2])
    assert sorted(map(len, parts)) == [3, 3] and sum(set(p.tolist()) in ({0, 1}, {2, 3}, {4, 5}) for p in parts) == 0
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5, 1, 512), 16, 1024).tolist()
    loads = part_loads(lengths, balanced_parts(lengths, 8, equal_size=True))
    assert max(loads) - min(loads) <= max(lengths)


def test_pack_rows_fills_the_first_row_with_room_longest_first():
    assert pack_rows([5, 9, 3, 4, 12], 12) == ([2, 1, 1, 2, 0], [0, 0, 9, 5, 0])
    assert pack_rows([2, 3], 5) == ([0, 0], [3, 0])


def test_the_entropy_and_its_gradient_are_autograds_and_weighed_by_zero_it_adds_nothing_to_the_gradient():
    logits = torch.randn(6, 50, dtype=torch.float64, requires_grad=True)  # float64: gradcheck's finite differences
    assert torch.autograd.gradcheck(lambda z: Entropy.apply(torch.log_softmax(z, -1)), (logits,))
    log_probs = torch.log_softmax(logits, -1)
    torch.testing.assert_close(Entropy.apply(log_probs), -(log_probs.exp() * log_probs).sum(-1), rtol=1e-12, atol=0)
    tokens = torch.arange(6)[:, None]
    without = torch.autograd.grad(log_probs.gather(-1, tokens).sum(), logits, retain_graph=True)[0]
    weighed_by_zero = log_probs.gather(-1, tokens).sum() + 0.0 * Entropy.apply(log_probs).sum()
    assert torch.equal(torch.autograd.grad(weighed_by_zero, logits)[0], without)  # the same operations: bit for bit
