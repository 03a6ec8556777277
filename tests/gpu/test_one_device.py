"""The policy worker as --in-process makes it (no Ray), on each device present, against the same computation in fp32
or padded: bf16 compute over fp32 master weights, packed micro-batches and shared prompts (through dense and block
masks, and on a GPU in one row through PyTorch's varlen kernel), block masks set up once the budget is fitted, LoRA's
reference by the disabled adapter, the reference offloaded to host memory, the peak-memory metric, and the retry of
an update out of the GPU's memory."""

from contextlib import contextmanager
from functools import partial

import grpo_hybrid
import pytest
import torch
import torch.distributed as dist
from helpers import flex_against_padded, uneven_batch, varlen_against_padded
from torch.distributed.tensor import DTensor

from common.attention import ATTENTION, CPU_WIDTH, GPU_WIDTH, VARLEN
from common.dataproto import DataProto
from common.memory import measured
from common.workers import PolicyWorker

LOG_PROB_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")
GRPO_LOSS = partial(grpo_hybrid.actor_loss, args=grpo_hybrid.Args(kl_loss_coef=0.0))


class Probe(PolicyWorker):
    @measured
    def hold(self, gigabytes: float) -> None:
        """Fill `gigabytes` of the device's memory for the length of the call."""
        torch.ones(int(gigabytes * 2**30) // 4, device=self.device)

    def master_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter of the policy, whole, on the CPU."""
        self.model.reshard()  # FSDP2 keeps the root unsharded after a forward, in the compute dtype
        return {name: p.full_tensor().detach().cpu().clone() for name, p in self.model.named_parameters()}


@contextmanager
def policy_on(device: str, model_path: str, **settings):
    """A policy worker on `device` as WorkerGroup makes one without a pool: rank 0 of 1, in this process."""
    worker = Probe(0, 1, use_gpu=device == "cuda")
    try:
        worker.setup(worker.master_address(), model_path=model_path, **settings)
        yield worker
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()  # the next worker, maybe on the other device, starts its own


def fp32_logits(model_path: str, batch: DataProto, device: str) -> torch.Tensor:
    """The logits that give the responses' tokens ([batch, response_len, vocab]) by the model in fp32, unsharded, its
    micro-batch padded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    inputs = {key: batch[key].to(device) for key in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        return model(**inputs).logits[:, -batch["responses"].shape[1] - 1 : -1].float()


def fp32_log_probs(model_path: str, batch: DataProto, device: str) -> torch.Tensor:
    """Log-probs of the responses by the model in fp32, unsharded, its micro-batch padded."""
    logits, responses = fp32_logits(model_path, batch, device), batch["responses"].to(device)
    log_probs = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    return (log_probs * batch["attention_mask"][:, -responses.shape[1] :].to(device)).cpu()


def rollout(worker, prompts, n: int) -> DataProto:
    batch = prompts.repeat(n)
    return batch | worker.generate(batch.select("prompts", "prompt_mask"), max_response_length=4)


def grpo_update(worker, batch: DataProto) -> dict:
    batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None] * batch["response_mask"]
    batch["rollout_log_probs"] = torch.zeros(batch["responses"].shape)
    return worker.update(batch.select(*LOG_PROB_INPUTS, "response_mask", "advantages", "rollout_log_probs"), GRPO_LOSS)


def test_bf16_compute_over_fp32_master_weights(device, tiny_model, prompts):
    with policy_on(device, tiny_model, compute_dtype="bfloat16", lr=1e-2) as worker:
        batch = rollout(worker, prompts, n=4)
        mask = batch["response_mask"].bool()
        bf16 = worker.compute_log_prob(batch.select(*LOG_PROB_INPUTS))["old_log_probs"][mask]
        logits = fp32_logits(tiny_model, batch, device)
        fp32 = torch.log_softmax(logits, -1).gather(-1, batch["responses"].to(device).unsqueeze(-1)).squeeze(-1).cpu()[mask]
        # bf16 keeps 8 significant bits: each rounding on the way to a logit, about 8 in this 2-layer model (each layer's
        # attention and MLP outputs and residual sums, the final norm, the head), adds up to 2^-9 of the largest logit L,
        # and a log-prob is a logit less the log-sum-exp: each at most 8 * 2^-8 * L off, their mean within a hundredth
        gap, largest_logit = (bf16 - fp32).abs(), logits.abs().amax(-1).cpu()[mask]
        assert 0 < gap.mean() < 0.01
        assert torch.all(gap <= 8 * 2**-8 * largest_logit)
        before = worker.master_weights()
        grpo_update(worker, batch)
        after = worker.master_weights()
        assert {weight.dtype for weight in after.values()} == {torch.float32}
        assert any(not torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_packed_micro_batches_and_shared_prompts_give_the_padded_log_probs(device, tiny_model, compute_dtype):
    with policy_on(device, tiny_model, compute_dtype=compute_dtype) as worker:
        batch = uneven_batch(worker.model.config.vocab_size)  # three rows share the prompts of two others
        # flash-attn's or torch's variable-length kernel takes every sequence in one row; SDPA, a prompt and its samples
        one_row = worker.attention in ("flash_attention_2", VARLEN)
        assert worker.layout == ("one row" if one_row else "shared prompts")
        assert one_row == (device == "cuda" and compute_dtype == "bfloat16")  # torch 2.10 and later has the varlen kernel
        packed = worker.compute_log_prob(batch)["old_log_probs"]
        worker.layout = "padded"
        padded = worker.compute_log_prob(batch)["old_log_probs"]
    mask = batch["attention_mask"][:, 7:].bool()
    assert torch.all(padded[mask] < 0)
    if compute_dtype == "float32":
        torch.testing.assert_close(packed, padded, rtol=0, atol=1e-4)
    else:  # the two layouts round differently; attention across sequences would move log-probs by whole units
        assert (packed - padded)[mask].abs().mean() < 0.02


def test_block_masks_give_the_padded_log_probs_entropies_and_gradients(device, tiny_model):
    """Shared prompts through FlexAttention against the padded micro-batch (on the CPU the gradients take the dense
    mask, torch having no FlexAttention backward there); a policy worker takes block masks after its start-up check,
    where its micro-batches may hold rows of CPU_WIDTH tokens on the CPU, GPU_WIDTH on a GPU."""
    padded, flex = flex_against_padded(tiny_model, device, "shared prompts")
    for padded_values, flex_values in zip(padded[:2], flex[:2]):
        torch.testing.assert_close(flex_values, padded_values, rtol=1e-5, atol=1e-5)
    for name, gradient in padded[2].items():
        torch.testing.assert_close(flex[2][name], gradient, rtol=1e-4, atol=1e-5)
    with policy_on(device, tiny_model, compute_dtype="float32", micro_batch_tokens=GPU_WIDTH) as worker:
        assert worker.attention == ATTENTION and worker.flex_from == (GPU_WIDTH if device == "cuda" else CPU_WIDTH)
        batch = uneven_batch(worker.model.config.vocab_size)
        worker.flex_from = 0
        flex = worker.compute_log_prob(batch)["old_log_probs"]
        worker.layout = "padded"
        torch.testing.assert_close(flex, worker.compute_log_prob(batch)["old_log_probs"], rtol=1e-5, atol=1e-5)


def test_one_row_through_torchs_varlen_kernel_gives_the_padded_log_probs_entropies_and_gradients(device, tiny_model):
    """PyTorch's FlashAttention varlen kernel in bf16 (the tiny model's two query heads share one key head) against
    SDPA over the padded micro-batch in bf16."""
    if device != "cuda":
        pytest.skip("the varlen kernel runs on CUDA only: tests/test_varlen_attention.py checks the CPU's fallback")
    padded, varlen = varlen_against_padded(tiny_model, device, torch.bfloat16)
    mask = padded[0] < 0
    # Two bf16 computations (8 bits of mantissa) that differ in their attention kernel: a log-prob or an entropy moves
    # by a few hundredths at most; attention across sequences would move them by whole units.
    for padded_values, varlen_values in zip(padded[:2], varlen[:2]):
        gap = (varlen_values - padded_values)[mask].abs()
        assert gap.mean() < 0.02 and gap.max() < 0.15
    for name, gradient in padded[2].items():  # the same rounding, summed over every token: within a few percent
        assert (varlen[2][name] - gradient).norm() <= 0.05 * gradient.norm() + 1e-6, name


def test_block_masks_are_set_up_once_the_budget_is_fitted(device, tiny_model):
    """A worker set up without a token budget (as a run of --micro-batch-tokens auto may set it up) decides on block
    masks again once fit_micro_batch_tokens knows its longest sequence: a row of packed sequences is no wider than
    that one (one row per micro-batch only where a flash kernel takes it, without a mask), so a budget past the
    block-mask width with shorter sequences sets none up, and sequences of that width do."""
    width = GPU_WIDTH if device == "cuda" else CPU_WIDTH
    with policy_on(device, tiny_model, compute_dtype="float32") as worker:
        assert worker.attention == ATTENTION and worker.flex_from is None
        worker.keep_memory_within(0.5, 1)
        assert worker.fit_micro_batch_tokens(64, width // 2 - 64)["tokens"] >= width and worker.flex_from is None
        assert worker.fit_micro_batch_tokens(64, width - 64)["tokens"] >= width and worker.flex_from == width
        assert "block masks from" in worker.attention_kernel


def test_lora_reference_is_the_base_model_with_its_adapter_disabled(device, tiny_model, prompts):
    settings = dict(compute_dtype="float32", lr=1e-2, lora_rank=4, lora_alpha=8)
    with policy_on(device, tiny_model, **settings) as worker:
        assert worker.reference is None
        batch = rollout(worker, prompts, n=2)
        mask, inputs = batch["response_mask"].bool(), batch.select(*LOG_PROB_INPUTS)
        base = fp32_log_probs(tiny_model, batch, device)
        for _ in range(3):
            torch.testing.assert_close(worker.compute_ref_log_prob(inputs)["ref_log_probs"], base, rtol=1e-5, atol=1e-4)
            grpo_update(worker, batch)
        assert (worker.compute_log_prob(inputs)["old_log_probs"] - base)[mask].abs().max() > 1e-3


def test_reference_lives_in_host_memory_and_computes_on_the_device(device, tiny_model, prompts):
    """The frozen reference is offloaded to host memory (FSDP's CPU offload on a GPU; on the CPU it is there already)
    and gathered onto the device for each of its passes, which match the model's in fp32; updates leave it alone."""
    with policy_on(device, tiny_model, compute_dtype="float32", lr=1e-2) as worker:
        batch = rollout(worker, prompts, n=2)
        mask, inputs = batch["response_mask"].bool(), batch.select(*LOG_PROB_INPUTS)
        base = fp32_log_probs(tiny_model, batch, device)
        for _ in range(2):
            # only its shards between passes: FSDP keeps a root gathered after its forward unless told otherwise
            assert all(isinstance(p, DTensor) for p in worker.reference.parameters())
            assert {p.device.type for p in worker.reference.parameters()} == {"cpu"}
            torch.testing.assert_close(worker.compute_ref_log_prob(inputs)["ref_log_probs"], base, rtol=1e-5, atol=1e-4)
            grpo_update(worker, batch)
        assert {p.device.type for p in worker.model.parameters()} == {device}
        assert (worker.compute_log_prob(inputs)["old_log_probs"] - base)[mask].abs().max() > 1e-3


def test_peak_memory_is_measured_per_method(device, tiny_model, prompts):
    """Each method's peak counts from its own start: half a gigabyte one call held is not in the next call's peak (on
    a GPU its allocator's peak, on Linux the resident set's high-water mark). Each peak is read once."""
    with policy_on(device, tiny_model, compute_dtype="float32") as worker:
        worker.phase_peak_memory()
        worker.hold(0.5)
        worker.compute_log_prob(rollout(worker, prompts, n=1).select(*LOG_PROB_INPUTS))
        peaks = worker.phase_peak_memory()
        assert set(peaks) == {"hold", "generate", "compute_log_prob"}
        assert peaks["hold"] > peaks["compute_log_prob"] + 0.4 and peaks["hold"] > peaks["generate"] + 0.4
        assert peaks["compute_log_prob"] > 0
        assert worker.phase_peak_memory() == {}


def test_an_update_out_of_the_gpus_memory_retries_at_half_the_budget(device, tiny_model):
    """The allocator's own out-of-memory error, with the GPU capped between what updates at 2 and at 4 sequences a
    micro-batch reserve: the update at 4 is done again at 2 and says so (the CPU's retry, which holds the worker to
    its share itself, is tests/test_micro_batch_budget.py's)."""
    if device != "cuda":
        pytest.skip("on the CPU nothing fails at a limit: tests/test_micro_batch_budget.py checks the retry there")
    length = 8192
    with policy_on(device, tiny_model, compute_dtype="float32", max_grad_norm=1e9) as worker:
        worker.keep_memory_within(0.8, 1)
        ids = torch.randint(3, worker.model.config.vocab_size, (4, length), generator=torch.Generator().manual_seed(0))
        batch = DataProto.from_dict(
            {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "position_ids": torch.arange(length).expand(4, -1),
                "responses": ids[:, 64:],
                "response_mask": torch.ones_like(ids[:, 64:]),
            }
        )
        reserved = []
        for sequences in (2, 4):
            worker.budget.tokens = sequences * length
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            grpo_update(worker, batch)
            reserved.append(torch.cuda.max_memory_reserved())
        assert reserved[1] > reserved[0]
        torch.cuda.empty_cache()  # what the cache keeps would serve the update at 4 without asking for more
        try:
            torch.cuda.set_per_process_memory_fraction(sum(reserved) / 2 / torch.cuda.get_device_properties(0).total_memory)
            worker.budget.tokens = 4 * length
            metrics = grpo_update(worker, batch)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        assert metrics["memory_retries"] == 1 and metrics["micro_batch_tokens"] == 2 * length
