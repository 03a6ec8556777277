"""A vLLM engine inside the policy worker's process, sharing its GPU (imported on GPUs only).

Each policy rank runs its own engine (tensor parallel size 1) on its own
share of the prompts. vLLM's external-launcher mode makes the engine join
the torch.distributed group the worker already formed instead of starting
one: every rank then is an independent replica.

The engine sleeps while the policy trains. Before each generation it wakes
its weights, receives the policy's (all of them, or just the LoRA adapter),
then wakes its KV cache; after generation it sleeps again.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch

# The maximum LoRA ranks vLLM accepts; an adapter of a smaller rank is served in the next one up.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def write_adapter(path: str, tensors: dict[str, torch.Tensor], peft_config) -> None:
    """A PEFT adapter folder, as vLLM loads adapters: adapter_config.json and adapter_model.safetensors."""
    from safetensors.torch import save_file

    os.makedirs(path)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, os.path.join(path, "adapter_model.safetensors"))
    peft_config.save_pretrained(path)


class VLLMRollout:
    def __init__(
        self,
        model_path: str,
        rank: int,
        world_size: int,
        master: tuple[str, int],
        seed: int,
        gpu_memory_utilization: float,
        max_model_len: int,
        lora_rank: int = 0,
    ):
        """`lora_rank` > 0 serves a LoRA adapter on top of the base weights read from `model_path`."""
        from vllm import LLM

        # What external-launcher mode reads to place this process; the group itself already exists.
        addr, port = master
        os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world_size), MASTER_ADDR=addr, MASTER_PORT=str(port))
        lora = {}
        if lora_rank:
            max_lora_rank = min((r for r in VLLM_LORA_RANKS if r >= lora_rank), default=lora_rank)
            lora = dict(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        self.llm = LLM(
            model=model_path,
            tensor_parallel_size=1,
            distributed_executor_backend="external_launcher",
            dtype="bfloat16",
            seed=seed + rank,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_sleep_mode=True,
            enable_prefix_caching=True,
            # log-probs of the distribution tokens are sampled from (after temperature), as the trainer computes them
            logprobs_mode="processed_logprobs",
            **lora,
        )
        # Level 1 keeps the base weights (in CPU memory) for the adapter to sit on; level 2 drops
        # them, since the policy sends all of them at every wake.
        self.sleep_level = 1 if lora_rank else 2
        self.adapter_dir = tempfile.mkdtemp(prefix="hybridrl_adapter_")
        self.lora_request = None
        self.sleep()

    def sleep(self) -> None:
        self.llm.sleep(level=self.sleep_level)

    def wake_weights(self) -> None:
        self.llm.wake_up(tags=["weights"])

    def wake_kv_cache(self) -> None:
        self.llm.wake_up(tags=["kv_cache"])
        # cached prefixes were computed with the old weights
        self.llm.reset_prefix_cache()

    def load_weights(self, weights) -> None:
        """Copy (name, tensor) pairs, named as in the model's checkpoint, into the engine's model."""
        self.llm.apply_model(lambda model: model.load_weights(weights))

    def load_adapter(self, tensors: dict[str, torch.Tensor], peft_config) -> None:
        """Serve this adapter from now on: written as a PEFT folder, loaded under a new id, the old one dropped."""
        from vllm.lora.request import LoRARequest

        version = 1 if self.lora_request is None else self.lora_request.lora_int_id + 1
        path = os.path.join(self.adapter_dir, str(version))
        write_adapter(path, tensors, peft_config)
        request = LoRARequest(lora_name=f"policy_v{version}", lora_int_id=version, lora_path=path)
        self.llm.llm_engine.add_lora(request)
        if self.lora_request is not None:
            self.llm.llm_engine.remove_lora(self.lora_request.lora_int_id)
            shutil.rmtree(self.lora_request.lora_path, ignore_errors=True)
        self.lora_request = request

    def generate(
        self, prompts: list[list[int]], max_tokens: int, eos_token_ids: list[int], do_sample: bool, temperature: float, top_p: float, top_k: int
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One response per prompt: (token ids, log-prob of each under the sampling distribution)."""
        from vllm import SamplingParams

        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k) if do_sample else dict(temperature=0.0)
        params = SamplingParams(n=1, max_tokens=max_tokens, stop_token_ids=eos_token_ids, logprobs=0, detokenize=False, **sampling)
        outputs = self.llm.generate(
            [{"prompt_token_ids": prompt} for prompt in prompts], params, lora_request=self.lora_request, use_tqdm=False
        )
        tokens = [list(output.outputs[0].token_ids) for output in outputs]
        log_probs = [
            [position[token].logprob for token, position in zip(ids, output.outputs[0].logprobs)] for ids, output in zip(tokens, outputs)
        ]
        return tokens, log_probs
