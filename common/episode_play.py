"""The play of a batch of episodes: each episode's environment opened, its turns generated one by one as requests to
an engine, and its environment's answers framed as the chat template renders them, until it ends.

What the model generated is kept as the engine's token ids and never encoded again: only the environment's answers
are encoded, framed by the chat template as "tool" messages (AnswerFraming; ToolResultFraming for tool calls).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass, field

from common.data import pad_token_id, render_prompt
from common.rollout import stop_end
from common.tools import ToolResultFraming, parse_tool_calls

# How an episode ended, logged as the share of each under env/ended_<how>; `answered`: a turn without a tool call.
ENDINGS = ("by_env", "answered", "max_turns", "token_limit", "error", "timeout")
GATHER_SECONDS = 0.05  # how long an idle engine waits for the answers of its other episodes' calls (EpisodePlay._due)


class AnswerFraming:
    """The tokens that append an environment's answer to a conversation, as the chat template renders it.

    Without a chat template the answer's text alone. With one, what the template puts after an assistant message
    when a tool message follows it: the end of the assistant's message (less the EOS the model generated itself, if
    its turn ended with one), the tool message, and the start of the next assistant message.
    """

    MARK = "\x00hybridrl turn\x00"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_texts = [t for t in {tokenizer.eos_token} if t]

    def __call__(self, answer: str, ended_with_eos: bool) -> list[int]:
        text = answer
        if self.tokenizer.chat_template:
            messages = [
                {"role": "user", "content": "?"},
                {"role": "assistant", "content": self.MARK},
                {"role": "tool", "content": answer},
            ]
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            text = rendered[rendered.index(self.MARK) + len(self.MARK) :]
            if ended_with_eos:
                eos = next((e for e in self.eos_texts if text.startswith(e)), "")
                text = text[len(eos) :]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int  # model turns
    max_prompt_length: int  # the prompt's tokens, with what reset added
    max_response_length: int  # the episode's tokens after the prompt: the model's and the environment's


@dataclass
class Episode:
    prompt: list[int]
    row: tuple  # data_source, ground_truth, extra_info: how messages name the episode
    env_name: str
    columns: dict = field(default_factory=dict)  # what its environment's reset gets: the row's columns (TRL's)
    prompt_source: object = None  # the row's prompt, messages or text: where the text reset returns is added
    tokens: list[int] = field(default_factory=list)
    own: list[bool] = field(default_factory=list)  # which tokens the model generated
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    last_turn: str = ""
    ending: str | None = None
    score: float | None = None
    turn_rewards: list[float] = field(default_factory=list)  # per model turn, what the environment's turn_reward gave
    turn_ends: list[int] = field(default_factory=list)  # per model turn, where its last token is in `tokens`
    tool_calls: int = 0
    tool_errors: int = 0  # calls answered with an error message: malformed, unknown tool, wrong arguments, raised
    seconds: float = 0.0  # from the start of the play until the episode ended
    versions: list = field(default_factory=list)  # per model turn, the weight version the engine generated it from
    key: str = ""  # its play's name and its place in the batch: what its turns' and its environment's requests are known by
    rank: int = 0  # the rank whose engine generates its turns
    fresh: int = 0  # the tokens of the environment's last answer, which no engine has seen
    computed_again: int = 0  # tokens of its context the engine computed again at later turns (no cache kept them)


class EpisodePlay:
    """The turns of a batch of episodes, each episode on its own. Its environment is opened first (made and reset from
    its row: the text reset returns joins the prompt's last user message), and a rank's first turns start once all of
    its episodes' environments are open. Then an episode's turn is a request to one engine (its rank's, for every turn,
    where the keys and values of its earlier turns are kept), started as soon as its environment answered, beside the
    turns of the other episodes under way (vLLM: continuous batching; hf: the turns that came since its last generate,
    gathered into the next), while the environments' calls run in their processes. A slow or hung call holds its own
    episode alone (to --reward-timeout). An episode that ends is finished: get_reward scores it, if its environment has
    one, and its close() runs. `engine_idle_share`, after `play`: the share of its time the engines were not generating
    (EngineWorker.engine_work); `failures`: the first traceback of each kind of failure, and `tool_failures` of each
    kind of exception a tool raised, by kind (see report_failures).

    Each turn samples from a generator of its own, seeded by the play's `seed`, the episode's place in the batch and the
    turn's number (seed_of): what an episode samples does not hang on the turns beside it. With `lockstep`
    (--deterministic) a rank's engine takes turns in rounds: once none of its episodes is generating or calling its
    environment, every waiting turn at once, in the batch's order; so the engines compute the same batches whatever
    the environments' timing, and a play repeats bit for bit."""

    def __init__(
        self,
        policy,
        env_calls,
        environments,
        tokenizer,
        eos_token_ids,
        limits: EpisodeLimits,
        sampling: dict,
        seed: int | None = None,
        lockstep: bool = False,
    ):
        self.policy, self.env_calls, self.environments, self.tokenizer = policy, env_calls, environments, tokenizer
        self.eos_token_ids, self.max_turns = eos_token_ids, limits.max_turns
        self.max_prompt_length, self.max_response_length = limits.max_prompt_length, limits.max_response_length
        self.sampling = sampling | dict(stop_strings=environments.stop_strings)
        self.pad = pad_token_id(tokenizer, eos_token_ids)
        self.frame = AnswerFraming(tokenizer)
        self.frame_results = ToolResultFraming(tokenizer, tokenizer.convert_ids_to_tokens(eos_token_ids))
        self.failures, self.tool_failures = {}, {}
        self.stepping, self.start = {}, time.perf_counter()  # stepping: the environments' calls under way by ticket
        self.name = uuid.uuid4().hex[:12]  # the play's, before its episodes' keys: plays may share engines
        self.seed, self.lockstep = seed, lockstep

    def play(self, episodes: list[Episode]) -> None:
        ranks = self.policy.world_size
        for i, episode in enumerate(episodes):
            episode.key, episode.rank = f"{self.name}/{i}", i * ranks // len(episodes)  # a group's samples on one rank
            self._call(episode, ("open", episode.env_name, episode.columns))
        self.episodes = {episode.key: episode for episode in episodes}
        self.place = {episode.key: i for i, episode in enumerate(episodes)}
        self.waiting = {rank: [] for rank in range(ranks)}  # ready for a turn
        self.under_way, self.ready_since = dict.fromkeys(range(ranks), 0), dict.fromkeys(range(ranks), self.start)
        calls = {}  # by rank, its turns call under way
        work_before = self.policy.broadcast("open_turns")
        try:
            while any(self.waiting.values()) or any(self.under_way.values()) or self.stepping:
                for rank in range(ranks):
                    taken = None if rank in calls else self._taken(rank)
                    if taken is not None:
                        requests = [(e.key, e.prompt + e.tokens, self._room(e), self._turn_seed(e)) for e in taken]
                        calls[rank] = self.policy.submit_rank(rank, "turns", self.name, requests, **self.sampling)
                        self.under_way[rank] += len(requests)
                        self.waiting[rank] = [e for e in self.waiting[rank] if all(e is not t for t in taken)]
                # with no environment call to wait for, wait for an engine; else take the engines that answered
                answered = [next(iter(calls))] if calls and not self.stepping else [r for r, c in calls.items() if c.done()]
                for rank in answered:
                    for key, tokens, log_probs, version, computed in calls.pop(rank).result():
                        self.under_way[rank] -= 1
                        self._take_turn(self.episodes[key], tokens, log_probs, version, computed)
                # the calls just made are sent at once; while engines generate or turns wait, answers are gathered every
                # 10 ms; else the first to come is taken as it comes
                timeout = 0.001 if answered else 0.01 if calls or any(self.waiting.values()) else None
                for ticket, outcome in self.env_calls.collect(timeout=timeout).items():
                    episode, request = self.stepping.pop(ticket)
                    if self._answer(episode, request, outcome):
                        if not self.waiting[episode.rank]:
                            self.ready_since[episode.rank] = time.perf_counter()
                        self.waiting[episode.rank].append(episode)
        finally:
            self.policy.broadcast("close_turns", self.name)
        work_after = self.policy.broadcast("engine_work")
        engine_seconds = sum(after["seconds"] - before["seconds"] for before, after in zip(work_before, work_after))
        self.engine_idle_share = max(0.0, 1 - engine_seconds / (ranks * (time.perf_counter() - self.start)))

    def _taken(self, rank: int) -> list[Episode] | None:
        """The waiting episodes whose turns `rank`'s engine takes now (none: it goes on generating those under way), or
        None: no call now. In lockstep, a round: every waiting turn, once no turn or call of its episodes is under way."""
        if not self.lockstep:
            return self.waiting[rank] if self._due(rank) else None
        if self.under_way[rank]:
            return []
        calling = any(episode.rank == rank and request[0] != "finish" for episode, request in self.stepping.values())
        return sorted(self.waiting[rank], key=lambda e: self.place[e.key]) if self.waiting[rank] and not calling else None

    def _turn_seed(self, episode: Episode) -> int | None:
        return None if self.seed is None else seed_of(self.seed, self.place[episode.key], episode.turns)

    def _due(self, rank: int) -> bool:
        """Whether `rank`'s engine takes its waiting turns now: at once when it is generating others (they join them);
        when it stands idle, once every environment of its episodes is open and no call of theirs is under way, or
        GATHER_SECONDS after the first turn came, so that answers that come together start together (an hf generate
        takes only the turns it began with)."""
        if self.under_way[rank]:  # a call keeps it generating, and the waiting turns join
            return True
        if not self.waiting[rank]:
            return False
        calls = [request[0] for episode, request in self.stepping.values() if episode.rank == rank]
        if "open" in calls:
            return False
        calling = any(kind != "finish" for kind in calls)
        return not calling or time.perf_counter() - self.ready_since[rank] >= GATHER_SECONDS

    def _room(self, episode: Episode) -> int:
        """The most tokens the episode's next turn may take."""
        return self.max_response_length - len(episode.tokens)

    def _take_turn(self, episode: Episode, tokens: list[int], log_probs: list[float], version, computed: int) -> None:
        """Add the model's turn to `episode` (generated from weights `version`, its engine computing `computed` tokens of
        its context), then end it or call its environment."""
        environments, tokenizer = self.environments, self.tokenizer
        episode.versions.append(version)
        if episode.turns:  # the context's tokens computed again: all but the answer and the last token sampled before it
            episode.computed_again += max(0, computed - episode.fresh - 1)
        room = self._room(episode)
        end = stop_end(tokens, environments.stop_strings, tokenizer)
        if end is None and tokens and tokens[-1] in self.eos_token_ids:
            end = len(tokens)
        kept = min(len(tokens), room) if end is None or end > room else end
        context = episode.prompt + episode.tokens
        episode.tokens += tokens[:kept]
        episode.turn_ends.append(len(episode.tokens) - 1)
        episode.own += [True] * kept
        episode.log_probs += log_probs[:kept]
        episode.turns += 1
        episode.last_turn = tokenizer.decode(tokens[:kept], skip_special_tokens=True)
        if end is None or end > room:  # the model was still writing when the episode's tokens ran out
            return self._end(episode, "token_limit")
        if environments.reads_text(episode.env_name):
            return self._call(episode, ("text", episode.last_turn))
        schemas = list(environments.schemas(episode.env_name).values())
        turn_text, context_text = tokenizer.decode(tokens[:kept]), tokenizer.decode(context)
        calls = parse_tool_calls(tokenizer, turn_text, context_text, schemas)
        if not calls:
            return self._end(episode, "answered")
        self._call(episode, ("tools", calls))

    def _call(self, episode: Episode, request: tuple) -> None:
        self.stepping[self.env_calls.submit(episode.key, request)] = (episode, request)

    def _answer(self, episode: Episode, request: tuple, outcome: tuple) -> bool:
        """Take the environment's answer to `request` into `episode`; whether the model takes a turn now."""
        if outcome[0] != "ok":
            self._fail(episode, outcome)
            return False
        if request[0] == "open":
            return outcome[1] is None or self._extend_prompt(episode, outcome[1])
        if request[0] == "finish":
            episode.score = episode.score if outcome[1] is None else outcome[1]
            episode.seconds = time.perf_counter() - self.start
            return False
        reply, turn_reward, raised = outcome[1]
        episode.turn_rewards.append(turn_reward or 0.0)
        if request[0] == "tools":
            episode.tool_calls += len(reply)
            episode.tool_errors += sum(error for _, error in reply)
            if raised:
                self.tool_failures.setdefault(raised.strip().splitlines()[-1].split(":")[0], (episode, raised))
        elif not isinstance(reply, str):
            episode.score = reply
            return self._end(episode, "by_env")
        if episode.turns == self.max_turns:
            return self._end(episode, "max_turns")
        ended_with_eos = episode.tokens[-1] in self.eos_token_ids
        if request[0] == "tools":
            answer = self.frame_results(request[1], [result for result, _ in reply], ended_with_eos)
        else:
            answer = self.frame(reply, ended_with_eos)
        if len(episode.tokens) + len(answer) >= self.max_response_length:  # no room left to act on it
            return self._end(episode, "token_limit")
        episode.tokens += answer
        episode.fresh = len(answer)
        episode.own += [False] * len(answer)
        episode.log_probs += [0.0] * len(answer)
        return True

    def _extend_prompt(self, episode: Episode, text: str) -> bool:
        """Add the text reset returned to the episode's prompt, at the end of its last user message (as TRL does); a
        prompt that grows past --max-prompt-length fails the episode."""
        prompt = episode.prompt_source
        if isinstance(prompt, str):
            prompt = prompt + text
        else:
            last = max(i for i, message in enumerate(prompt) if message["role"] == "user")
            prompt = [*prompt[:last], {**prompt[last], "content": prompt[last]["content"] + text}, *prompt[last + 1 :]]
        schemas = self.environments.schemas(episode.env_name)
        rendered = render_prompt(prompt, self.tokenizer, list(schemas.values()) if schemas else None)
        ids = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        if len(ids) > self.max_prompt_length:
            problem = (
                f"the text reset returned made the prompt {len(ids)} tokens long, more than --max-prompt-length "
                f"{self.max_prompt_length}: raise it, or return less\n"
            )
            self._fail(episode, ("error", "PromptTooLong", problem))
            self._call(episode, ("finish", False))
            return False
        episode.prompt = ids
        return True

    def _end(self, episode: Episode, ending: str) -> bool:
        """End `episode`: an environment with get_reward scores it, however it ended, and its close() runs."""
        episode.ending = ending
        episode.seconds = time.perf_counter() - self.start
        final_turn = episode.last_turn if ending == "answered" else None  # a tool environment did not play it
        self._call(episode, ("finish", self.environments.scores(episode.env_name), final_turn))
        return False

    def _fail(self, episode: Episode, outcome: tuple) -> None:
        """End `episode` with score 0 for an environment's call that failed or ran out of time; keep the first traceback
        of each kind of failure."""
        episode.ending, episode.score = outcome[0], 0.0
        episode.seconds = time.perf_counter() - self.start
        if outcome[0] == "error":
            self.failures.setdefault(outcome[1], (episode, outcome[2]))


def seed_of(*parts) -> int:
    """A seed for what `parts` name (the run's seed and a play's number; a play's seed, an episode's place and a turn's
    number): 63 bits of their hash, the same in every process and run (Python's own hash of a str is not)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
