"""The addition demo's warm-started model, as built into the test cache: what makes its RL demo hold on any CPU."""

import torch

from common import demo


def answer_probabilities(model, tokenizer, problems):
    """The probability of the right answer (then EOS) and the greedy answer, per problem "a+b="."""
    probabilities, greedy = [], []
    for a, b in problems:
        prompt = tokenizer(f"{a}+{b}=", return_tensors="pt")["input_ids"]
        answer = tokenizer(str(a + b))["input_ids"] + [tokenizer.eos_token_id]
        sequence = torch.cat([prompt, torch.tensor([answer])], dim=1)
        with torch.no_grad():
            log_probs = torch.log_softmax(model(sequence).logits[0, prompt.shape[1] - 1 : -1], dim=-1)
        probabilities.append(log_probs.gather(1, torch.tensor(answer)[:, None]).sum().exp().item())
        output = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        greedy.append(tokenizer.decode(output[0, prompt.shape[1] :], skip_special_tokens=True) == str(a + b))
    return probabilities, greedy


def test_the_warm_start_knows_its_half_and_spreads_its_guesses_on_the_other(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_model).eval(), AutoTokenizer.from_pretrained(tiny_model)
    known, held_out = demo.addition_problems()
    _, known_greedy = answer_probabilities(model, tokenizer, known)
    assert all(known_greedy)
    probabilities, held_out_greedy = answer_probabilities(model, tokenizer, held_out)
    # an even spread gives each of the 19 answers about 5%: no right answer is out of the reach of 8 samples a step
    # (the old warm start left some under 0.5%), and the greedy answer is right by chance only
    assert min(probabilities) > 0.005, min(probabilities)
    assert sum(held_out_greedy) <= 10
