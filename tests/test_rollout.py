"""common/hf_engine.py: a prompt its samples share is computed once and generates as a full pass does; each
token is drawn at its probability."""

import torch
from transformers import GenerationConfig, LogitsProcessorList

from common.data import collate
from common.dataproto import DataProto
from common.hf_engine import HFEngine, InverseCDFSample, SampledLogProbs, shared_prompt_cache
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
    rollout = HFEngine(model, tokenizer, [tokenizer.eos_token_id], pad)
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
    assert shared_prompt_cache(model, prompts[::4], mask[::4])[0] is None  # no two rows alike: nothing to share


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


def test_an_episodes_next_turn_starts_from_its_kept_keys_and_values_and_generates_what_a_full_pass_would(
    tiny_model, tokenizer
):
    model, pad, eos = local_model(tiny_model).eval(), tokenizer.pad_token_id, [tokenizer.eos_token_id]
    greedy = dict(do_sample=False, temperature=1.0, top_p=1.0, top_k=0, stop_strings=None)
    prompts = [tokenizer(text).input_ids for text in ["12+34=", "7*8=", "100+1="]]  # of three lengths

    def turns(engine, contexts: dict) -> dict:
        for key, context in contexts.items():
            engine.add_request(key, context, 6, **greedy)
        return {key: rest for key, *rest in engine.finished_requests()}

    engine = HFEngine(model, tokenizer, eos, pad)
    engine.wake()
    first = turns(engine, {f"play/{i}": prompt for i, prompt in enumerate(prompts)})
    answers = [tokenizer(text, add_special_tokens=False).input_ids for text in ["=46;", "56;", "=101;"]]
    kept = [len(first[f"play/{i}"][0]) for i in range(2)] + [2]  # the third episode's turn cut after 2 tokens
    second_contexts = {
        f"play/{i}": prompt + first[f"play/{i}"][0][: kept[i]] + answer
        for i, (prompt, answer) in enumerate(zip(prompts, answers))
    }
    second = turns(engine, second_contexts)
    # each context computed from where the kept keys and values end: the answer, after the first turn's last token
    # (which no forward had read) where the whole turn was kept
    assert [second[f"play/{i}"][2] for i in range(2)] == [len(answers[i]) + 1 for i in range(2)]
    assert second["play/2"][2] <= len(answers[2]) + kept[2]

    fresh = HFEngine(model, tokenizer, eos, pad)  # nothing kept: every context computed whole
    fresh.wake()
    whole = turns(fresh, second_contexts)
    assert [whole[key][2] for key in second_contexts] == [len(context) for context in second_contexts.values()]
    for key in second_contexts:
        assert second[key][0] == whole[key][0]
        # fp32 both ways; keys and values computed in other batches and shapes: rounding alone differs
        torch.testing.assert_close(torch.tensor(second[key][1]), torch.tensor(whole[key][1]), atol=1e-5, rtol=0)
    engine.forget("play/")
    engine.sleep()
    assert engine.held == {}

    tight = HFEngine(model, tokenizer, eos, pad)  # no memory to keep anything in: each turn computes its whole context
    tight.wake()
    tight.held_budget = 0
    turns(tight, {f"play/{i}": prompt for i, prompt in enumerate(prompts)})
    assert tight.held == {}
    assert [turn[2] for turn in turns(tight, second_contexts).values()] == [len(c) for c in second_contexts.values()]


def test_a_model_saved_without_its_cache_generates_with_it_whatever_its_folder_says(tiny_model, tokenizer, tmp_path):
    """A folder saved for training elsewhere (TRL writes `use_cache: false` into config.json) generates one new token
    a forward after the prompt, as an export of this project does, and the same tokens."""
    import json
    import shutil

    folder = tmp_path / "trained_elsewhere"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"use_cache": False}))
    (folder / "generation_config.json").unlink(missing_ok=True)
    prompts = collate(DataProto.from_dict(non_tensors={"prompt_ids": [tokenizer("12+34=").input_ids]}), 0)
    greedy = dict(do_sample=False, temperature=1.0, top_p=1.0, top_k=0)
    responses = []
    for path in (tiny_model, folder):
        model = local_model(path).eval()
        widths = []
        width = lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1])  # noqa: E731
        model.register_forward_pre_hook(width, with_kwargs=True)
        engine = HFEngine(model, tokenizer, [tokenizer.eos_token_id], tokenizer.pad_token_id)
        responses.append(engine.generate(prompts["prompts"], prompts["prompt_mask"], 8, **greedy)[0])
        assert len(widths) > 1 and widths[1:] == [1] * (len(widths) - 1), (path, widths)  # then the new token alone
    assert torch.equal(responses[0], responses[1])


def test_each_request_of_a_batch_generates_at_most_its_own_max_tokens(tiny_model, tokenizer):
    model, pad = local_model(tiny_model).eval(), tokenizer.pad_token_id
    greedy = dict(do_sample=False, temperature=1.0, top_p=1.0, top_k=0, stop_strings=None)
    engine = HFEngine(model, tokenizer, [pad], pad)  # an end it never writes: each request runs to its bound
    engine.wake()
    prompt = tokenizer("12+34=").input_ids
    for key, most in (("short", 2), ("long", 12)):  # one generate, which runs to the longer request's bound
        engine.add_request(key, prompt, most, **greedy)
    tokens = {key: tokens for key, tokens, *_ in engine.finished_requests()}
    assert len(tokens["short"]) == 2 and len(tokens["long"]) == 12 and tokens["short"] == tokens["long"][:2]
    engine.sleep()
