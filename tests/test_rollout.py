"""common/rollout.py's hf engine: a prompt its samples share is computed once and generates as a full pass does; each
token is drawn at its probability."""

import torch
from transformers import GenerationConfig, LogitsProcessorList

from common.data import collate
from common.dataproto import DataProto
from common.hf_engine import HFRollout, InverseCDFSample, SampledLogProbs, shared_prompt_cache
from helpers import local_model


def test_a_prompt_shared_by_its_samples_runs_once_and_generates_the_tokens_of_a_full_pass(tiny_model, tokenizer):
    model = local_model(tiny_model).eval()
    pad = tokenizer.pad_token_id
    rows = [tokenizer(text).input_ids for text in ["12+34=", "7*8=", "100+1="]]  # of three lengths: left-padded
    batch = collate(DataProto.from_dict(non_tensors={"prompt_ids": rows}), pad)
    prompts, mask = batch["prompts"].repeat_interleave(4, 0), batch["prompt_mask"].repeat_interleave(4, 0)  # [12, width]
    width = prompts.shape[1]
    shapes = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    rollout = HFRollout(model, tokenizer, [tokenizer.eos_token_id], pad)
    responses, log_probs = rollout.generate(prompts, mask, 8, do_sample=False, temperature=1.0, top_p=1.0, top_k=0)
    hook.remove()
    assert shapes[0] == (3, width - 1)  # every prompt token but the last, once per distinct prompt
    assert shapes[1] == (12, 1)  # then each row from its last prompt token on

    recorder = SampledLogProbs(1.0)
    config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=[tokenizer.eos_token_id], pad_token_id=pad)
    full = model.generate(
        input_ids=prompts, attention_mask=mask, generation_config=config, logits_processor=LogitsProcessorList([recorder])
    )
    assert torch.equal(responses, full[:, width:])
    # fp32 both ways; the prompt's keys and values summed over one query row or several: rounding alone differs
    torch.testing.assert_close(log_probs, recorder.log_probs(responses), atol=1e-5, rtol=0)
    assert shared_prompt_cache(model, prompts[::4], mask[::4]) is None  # no two rows alike: nothing to share


def test_each_token_is_drawn_at_its_probability_and_left_the_only_one_possible():
    rows = 200_000
    scores = torch.tensor([0.0, 1.0, -1.0, 2.0, -torch.inf, 0.5, -6.0]).repeat(rows, 1)  # [rows, vocab]
    torch.manual_seed(0)
    left = InverseCDFSample()(None, scores)
    assert torch.equal(torch.isfinite(left).sum(-1), torch.ones(rows, dtype=torch.long))  # generate's greedy pick takes it
    shares = torch.bincount(left.argmax(-1), minlength=7).double() / rows
    probabilities = torch.softmax(scores[0].double(), -1)
    # each share a binomial mean over `rows` draws: within 5 standard errors; the impossible token never
    error = (probabilities * (1 - probabilities) / rows).sqrt()
    assert ((shares - probabilities).abs() <= 5 * error).all(), (shares, probabilities)
    assert shares[4] == 0
