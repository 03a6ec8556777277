"""A rollout engine in a file of its own, as a user writes one: `--rollout-engine path/to/engine_in_a_file.py:TallyingEngine`
(tests/test_engines.py runs the scripts with it). It is the hf engine, and tallies what it is asked in a file beside
this one (`TALLY`): a line a call, its kind (a batch, or an episode's turn) and the process it ran in."""

import os
from pathlib import Path

from common import hf_engine
from common.engines import EngineContext
from common.hf_engine import HFEngine

TALLY = Path(__file__).with_suffix(".tally")


class TallyingEngine(HFEngine):
    def __init__(self, context: EngineContext):
        model = hf_engine.build(context).policy  # the policy itself, or apart a model loaded from the checkpoint
        super().__init__(model, context.tokenizer, context.eos_token_ids, context.pad_token_id)

    def generate(self, prompts, prompt_mask, max_response_length, **sampling):
        self.tally("batch")
        return super().generate(prompts, prompt_mask, max_response_length, **sampling)

    def add_request(self, key: str, tokens: list[int], max_tokens: int, seed: int | None = None, **sampling) -> None:
        self.tally("turn")
        super().add_request(key, tokens, max_tokens, seed, **sampling)

    def tally(self, kind: str) -> None:
        with open(TALLY, "a") as file:
            file.write(f"{kind} {os.getpid()}\n")
