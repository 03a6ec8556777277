"""Multi-turn episodes: the model takes a turn, an environment (a tool, a game) answers, and so on until it ends.

An environment is a plain Python class, named like a reward (`--env path/to/file.py:ClassName`), or built in
(`--env calculator`); one object plays one episode. It takes one of two shapes:

    class Echo:                      # step(text): it reads the model's turn itself
        stop_strings = ["</call>"]   # optional: text that ends a model turn, besides EOS

        def reset(self, data_source, ground_truth, extra_info):   # a new episode, for one row of the data
            self.truth = ground_truth

        def step(self, text):        # the model's turn, decoded
            # a string: the environment's answer, and the episode goes on;
            # a number: the episode's score, and it ends;
            # None: it ends, and the reward function scores this last turn
            ...

    class Store:                     # tools: its public methods, called as the chat template frames calls
        def reset(self, data_source, ground_truth, extra_info):   # keywords: take what you need, **fields the rest
            self.stock = {"apple": 3}

        def count(self, item: str) -> int:
            \"\"\"How many of an item the store holds.

            Args:
                item: The item's name.
            \"\"\"
            return self.stock.get(item, 0)

        def get_reward(self) -> float:   # optional: the episode's score, when it ends; else the reward function's
            ...

Either shape may also reward a turn: `turn_reward(self)`, if it has one, is called after each turn the environment
played (its step, or its tool calls) and returns that turn's reward (None: none). The episode's score is then the sum
of its turns' rewards and of its final score (the reward function's, step's number, get_reward's); PPO and
REINFORCE++ place each turn's reward on that turn's last token.

The second is TRL's `environment_factory` shape; --tools functions (common/tools.py) are offered beside its methods, or
alone without --env. An episode of tools ends when the model answers without a call. Several environments, comma-
separated, serve one run: a data row's `env` field names its own (the class's name, or the built-in's).

Its turns run in isolated processes as rewards do (common/isolation.py), one call at a time, and the object travels
between them from one turn to the next (pickled): it must hold only state that pickles.

What the model generated is kept as the engine's token ids and never encoded again: only the environment's answers
are encoded, framed by the chat template as "tool" messages (AnswerFraming; ToolResultFraming for tool calls).
"""

from __future__ import annotations

import inspect
import math
import os
import pickle
import re
import shlex
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field

from common.isolation import REPORTED_FAILURES, CallKind, load_user_file
from common.rollout import stop_end
from common.tools import ToolResultFraming, call_tool, check_tool_template, load_tools, parse_tool_calls, tool_schema

# How an episode ended, logged as the share of each under env/ended_<how>; `answered`: a turn without a tool call.
ENDINGS = ("by_env", "answered", "max_turns", "token_limit", "error", "timeout")
ROW_FIELDS = ("data_source", "ground_truth", "extra_info")  # what reset gets of a data row
NOT_TOOLS = ("reset", "step", "get_reward", "turn_reward")  # public methods of an environment that are not tools
GATHER_SECONDS = 0.05  # how long an idle engine waits for the answers of its other episodes' calls (EpisodePlay._due)


class Calculator:
    """The built-in tool: the model writes an expression in square brackets, `[37*48]`, and gets its value back,
    ended by a semicolon (`1776;`: the demo's tokenizer drops whitespace). A turn without a call is the model's
    answer: the episode ends and the reward function scores it."""

    stop_strings = ["]"]

    def reset(self, data_source, ground_truth, extra_info):
        pass

    def step(self, text: str) -> str | None:
        call = re.search(r"\[([^\]]*)\]\s*$", text)
        if call is None:
            return None
        expression = call.group(1)
        if not re.fullmatch(r"[0-9+\-* ()]{1,32}", expression) or "**" in expression:  # no powers: 9**9**9 never ends
            return "error;"  # a tool answers a malformed call; it does not fail the episode
        try:
            return f"{eval(expression, {'__builtins__': {}})};"
        except SyntaxError:
            return "error;"


BUILTIN_ENVS = {"calculator": Calculator}


def load_env(spec: str):
    """A built-in environment by name, or the class `ClassName` of `path/to/file.py:ClassName`."""
    if spec in BUILTIN_ENVS:
        return BUILTIN_ENVS[spec]
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"--env '{spec}': name a built-in ({', '.join(BUILTIN_ENVS)}) or write path/to/file.py:ClassName")
    if not os.path.isfile(path):
        raise ValueError(f"--env '{spec}': no file {path}")
    env_cls = getattr(load_user_file(path), name, None)
    if not isinstance(env_cls, type):
        raise ValueError(f"--env '{spec}': {path} defines no class '{name}'")
    if not callable(getattr(env_cls, "step", None)) and not tool_methods(env_cls):
        raise ValueError(
            f"--env '{spec}': {name} has neither a step(text) method nor public methods that are tools (docs/tools.md)"
        )
    stop_strings = getattr(env_cls, "stop_strings", [])
    if not isinstance(stop_strings, (list, tuple)) or not all(isinstance(s, str) and s for s in stop_strings):
        raise ValueError(f"--env '{spec}': stop_strings must be a list of non-empty strings, got {stop_strings!r}")
    return env_cls


def tool_methods(env_cls) -> list[str]:
    """The names of `env_cls`'s methods that are tools: the public ones but reset, step, get_reward and turn_reward."""
    methods = inspect.getmembers(env_cls, inspect.isfunction)
    return [name for name, _ in methods if not name.startswith("_") and name not in NOT_TOOLS]


class Environments:
    """What --env and --tools name, loaded alike in the run and in every environment process: each environment's class
    by its name (None: --tools alone, under the name ""), and the standalone tools, which every environment that is not
    a step(text) one offers beside its methods. `spec`: the flags, as episode_spec writes them."""

    def __init__(self, classes: dict, tools: dict, spec: str = ""):
        self.classes, self.tools, self.spec = classes, tools, spec
        self.names = list(classes)
        self.stop_strings = sorted({s for c in classes.values() for s in getattr(c, "stop_strings", [])})
        self._schemas = {}
        for name in self.names:
            if self.reads_text(name) and tools:
                raise ValueError(
                    f"--tools with --env {name}: a step(text) environment reads the model's turns itself and offers no "
                    "tools; give the tools to an environment whose methods are tools, or drop --tools"
                )

    @classmethod
    def of(cls, env_cls) -> Environments:
        """One environment class alone, by its own name."""
        return cls({env_cls.__name__: env_cls}, {})

    def reads_text(self, name: str) -> bool:
        return callable(getattr(self.classes[name], "step", None))

    def scores(self, name: str) -> bool:
        return callable(getattr(self.classes[name], "get_reward", None))

    def tools_of(self, name: str, env=None) -> dict:
        """The tools of an episode of environment `name`: the standalone ones, then its methods, bound to `env` (to a
        bare instance, made without running its __init__, for their schemas)."""
        env_cls = self.classes[name]
        if env_cls is None:
            return dict(self.tools)
        env = object.__new__(env_cls) if env is None else env
        return self.tools | {method: getattr(env, method) for method in tool_methods(env_cls)}

    def schemas(self, name: str) -> dict[str, dict] | None:
        """The JSON schemas of environment `name`'s tools by tool name; None for a step(text) environment."""
        if self.classes[name] is not None and self.reads_text(name):
            return None
        if name not in self._schemas:
            tools = self.tools_of(name)
            self._schemas[name] = {tool: tool_schema(function, f"--env {name}") for tool, function in tools.items()}
        return self._schemas[name]

    def check(self, tokenizer, eos_token_ids: list[int]) -> dict[str, dict | None]:
        """Each environment's tools by name (see schemas), once the chat template is checked to render them
        (check_tool_template) if any environment has tools."""
        tools = {name: self.schemas(name) for name in self.names}
        every_schema = [schema for schemas in tools.values() for schema in (schemas or {}).values()]
        if any(schemas is not None for schemas in tools.values()):
            check_tool_template(tokenizer, every_schema, tokenizer.convert_ids_to_tokens(eos_token_ids))
        return tools


def episode_spec(env: str | None, tools: list[str] | None) -> str:
    """--env and --tools as flags in one string: what an environment process loads (load_environments)."""
    return shlex.join((["--env", env] if env else []) + (["--tools", *tools] if tools else []))


def load_environments(spec: str) -> Environments:
    """The Environments of `spec` (episode_spec's flags): each of --env's comma-separated environments, by the
    built-in's or the class's name, and --tools' tools."""
    flags, current = {"--env": [], "--tools": []}, None
    for word in shlex.split(spec):
        if word in flags:
            current = word
        else:
            flags[current].append(word)
    classes = {}
    for env_spec in ",".join(flags["--env"]).split(",") if flags["--env"] else []:
        env_cls = load_env(env_spec)
        name = env_spec if env_spec in BUILTIN_ENVS else env_cls.__name__
        if name in classes:
            raise ValueError(f"--env: two environments are named {name}; a data row's `env` field picks one by its name")
        classes[name] = env_cls
    tools = load_tools(flags["--tools"])
    both = sorted(set(tools) & {method for env_cls in classes.values() for method in tool_methods(env_cls)})
    if both:
        raise ValueError(f"--tools and --env both offer tools named {', '.join(both)}: rename one")
    return Environments(classes or {"": None}, tools, spec)


ENV_CALLS = CallKind("env", "", load="common.envs:load_environments", call="common.envs:call_env")


def call_env(environments: Environments, name: str, state: bytes | None, row: tuple, action: tuple) -> tuple:
    """One call of an episode of environment `name`: ("ok", (the environment's state after it, what it returned, the
    turn's reward)) or
    ("error", kind, traceback). The state is the environment object, pickled; None before the first call, when a new
    one is made and reset from `row` (data_source, ground_truth, extra_info), and with --tools alone. `action`:
    ("text", the model's turn) for step(text), which returns its reply, a score or None; ("tools", calls parsed by
    parse_tool_calls), which returns each call's (result, whether it is an error message); ("reward",), get_reward's
    score. After a turn's call, the environment's turn_reward() (if it has one) gives that turn's reward, or None."""
    try:
        env_cls = environments.classes[name]
        if state is not None:
            env = pickle.loads(state)
        elif env_cls is None:
            env = None
        else:
            env = env_cls()
            if callable(getattr(env, "reset", None)):
                text_env = environments.reads_text(name)
                observation = env.reset(*row) if text_env else env.reset(**dict(zip(ROW_FIELDS, row)))
                if observation is not None and not text_env:
                    raise ValueError("reset returned a value: an episode's prompt is its data row's; return None")
        kind = action[0]
        if kind == "text":
            reply = env.step(action[1])
            if not (reply is None or isinstance(reply, str)):
                reply = finite_score(reply, "step")
        elif kind == "tools":
            tools, schemas = environments.tools_of(name, env), environments.schemas(name)
            reply = []
            for call in action[1]:
                if "error" in call:
                    reply.append((call["error"], True))
                elif call["name"] not in tools:
                    reply.append((f"error: there is no tool {call['name']}; the tools: {', '.join(tools)}", True))
                else:
                    reply.append(call_tool(tools[call["name"]], schemas[call["name"]], call["arguments"]))
        else:
            reply = finite_score(env.get_reward(), "get_reward")
        turn_reward = None
        if kind != "reward" and callable(getattr(env, "turn_reward", None)):
            turn_reward = env.turn_reward()
            turn_reward = None if turn_reward is None else finite_score(turn_reward, "turn_reward")
        return "ok", (None if env is None else pickle.dumps(env), reply, turn_reward)
    except (Exception, SystemExit) as error:
        return "error", type(error).__name__, traceback.format_exc()


def finite_score(value, method: str) -> float:
    score = float(value)  # anything but a number fails here, as the environment's error
    if not math.isfinite(score):
        raise ValueError(f"{method} returned the score {score}; a score must be a finite number")
    return score


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


@dataclass
class Episode:
    prompt: list[int]
    row: tuple  # data_source, ground_truth, extra_info
    env_name: str
    tokens: list[int] = field(default_factory=list)
    own: list[bool] = field(default_factory=list)  # which tokens the model generated
    log_probs: list[float] = field(default_factory=list)
    env: bytes | None = None  # the environment object, pickled (see call_env)
    turns: int = 0
    last_turn: str = ""
    ending: str | None = None
    score: float | None = None
    turn_rewards: list[float] = field(default_factory=list)  # per model turn, what the environment's turn_reward gave
    turn_ends: list[int] = field(default_factory=list)  # per model turn, where its last token is in `tokens`
    tool_calls: int = 0
    tool_errors: int = 0  # calls answered with an error message: malformed, unknown tool, wrong arguments
    seconds: float = 0.0  # from the start of run_episodes until the episode ended
    versions: list = field(default_factory=list)  # per model turn, the weight version the engine generated it from
    key: str = ""  # its play's name and its place in the batch: what its turns' requests are known by
    rank: int = 0  # the rank whose engine generates its turns
    fresh: int = 0  # the tokens of the environment's last answer, which no engine has seen
    computed_again: int = 0  # tokens of its context the engine computed again at later turns (no cache kept them)


class EpisodePlay:
    """The turns of a batch of episodes, each episode on its own: an episode's turn is a request to one engine (its
    rank's, for every turn, where the keys and values of its earlier turns are kept), started as soon as its environment
    answered, beside the turns of the other episodes under way (vLLM: continuous batching; hf: the turns that came
    since its last generate, gathered into the next), while the environments' calls run in their processes. A slow or
    hung call holds its own episode alone (to --reward-timeout). `engine_idle_share`, after `play`: the share of its
    time the engines were not generating (EngineWorker.engine_work)."""

    def __init__(self, policy, env_calls, environments, tokenizer, eos_token_ids, max_turns, max_response_length, sampling):
        self.policy, self.env_calls, self.environments, self.tokenizer = policy, env_calls, environments, tokenizer
        self.eos_token_ids, self.max_turns, self.max_response_length = eos_token_ids, max_turns, max_response_length
        self.sampling = sampling | dict(stop_strings=environments.stop_strings)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids[0]
        self.frame = AnswerFraming(tokenizer)
        self.frame_results = ToolResultFraming(tokenizer, tokenizer.convert_ids_to_tokens(eos_token_ids))
        self.failures, self.stepping, self.start = {}, {}, time.perf_counter()  # stepping: calls under way by ticket
        self.name = uuid.uuid4().hex[:12]  # the play's, before its episodes' keys: plays may share engines

    def play(self, episodes: list[Episode]) -> None:
        ranks = self.policy.world_size
        for i, episode in enumerate(episodes):
            episode.key, episode.rank = f"{self.name}/{i}", i * ranks // len(episodes)  # a group's samples on one rank
        self.episodes = {episode.key: episode for episode in episodes}
        self.waiting = {rank: [e for e in episodes if e.rank == rank] for rank in range(ranks)}  # ready for a turn
        self.under_way, self.ready_since = dict.fromkeys(range(ranks), 0), dict.fromkeys(range(ranks), self.start)
        calls = {}  # by rank, its turns call under way
        work_before = self.policy.broadcast("open_turns")
        try:
            while any(self.waiting.values()) or any(self.under_way.values()) or self.stepping:
                for rank in range(ranks):
                    if rank not in calls and self._due(rank):
                        requests = [(e.key, e.prompt + e.tokens, self._room(e)) for e in self.waiting[rank]]
                        calls[rank] = self.policy.submit_rank(rank, "turns", self.name, requests, **self.sampling)
                        self.under_way[rank], self.waiting[rank] = self.under_way[rank] + len(requests), []
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
                    episode, action = self.stepping.pop(ticket)
                    if self._answer(episode, action, outcome):
                        if not self.waiting[episode.rank]:
                            self.ready_since[episode.rank] = time.perf_counter()
                        self.waiting[episode.rank].append(episode)
        finally:
            self.policy.broadcast("close_turns", self.name)
        work_after = self.policy.broadcast("engine_work")
        engine_seconds = sum(after["seconds"] - before["seconds"] for before, after in zip(work_before, work_after))
        self.engine_idle_share = max(0.0, 1 - engine_seconds / (ranks * (time.perf_counter() - self.start)))
        report_failures(self.failures)

    def _due(self, rank: int) -> bool:
        """Whether `rank`'s engine takes its waiting turns now: at once when it is generating others (they join them);
        when it stands idle, once no environment call of its episodes is under way or GATHER_SECONDS after the first
        turn came, so that answers that come together start together (an hf generate takes only the turns it began
        with)."""
        if self.under_way[rank]:  # a call keeps it generating, and the waiting turns join
            return True
        if not self.waiting[rank]:
            return False
        calling = any(episode.rank == rank and action[0] != "reward" for episode, action in self.stepping.values())
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

    def _call(self, episode: Episode, action: tuple) -> None:
        self.stepping[self.env_calls.submit((episode.env_name, episode.env, episode.row, action))] = (episode, action)

    def _answer(self, episode: Episode, action: tuple, outcome: tuple) -> bool:
        """Take the environment's answer to `action` into `episode`; whether the model takes another turn."""
        if outcome[0] != "ok":
            fail(episode, outcome, self.failures)
            episode.seconds = time.perf_counter() - self.start
            return False
        episode.env, reply, turn_reward = outcome[1]
        if action[0] == "reward":
            episode.score = reply
            episode.seconds = time.perf_counter() - self.start
            return False
        episode.turn_rewards.append(turn_reward or 0.0)
        if action[0] == "tools":
            episode.tool_calls += len(reply)
            episode.tool_errors += sum(error for _, error in reply)
        elif not isinstance(reply, str):
            episode.score = reply
            self._end(episode, "by_env")
            return False
        if episode.turns == self.max_turns:
            self._end(episode, "max_turns")
            return False
        ended_with_eos = episode.tokens[-1] in self.eos_token_ids
        if action[0] == "tools":
            answer = self.frame_results(action[1], [result for result, _ in reply], ended_with_eos)
        else:
            answer = self.frame(reply, ended_with_eos)
        if len(episode.tokens) + len(answer) >= self.max_response_length:  # no room left to act on it
            self._end(episode, "token_limit")
            return False
        episode.tokens += answer
        episode.fresh = len(answer)
        episode.own += [False] * len(answer)
        episode.log_probs += [0.0] * len(answer)
        return True

    def _end(self, episode: Episode, ending: str) -> None:
        """End `episode`; an environment with get_reward then scores it, however it ended (a failed one scores 0)."""
        episode.ending = ending
        episode.seconds = time.perf_counter() - self.start
        if self.environments.scores(episode.env_name):
            self._call(episode, ("reward",))


def run_episodes(policy, batch, env_calls, environments, tokenizer, eos_token_ids, max_turns, max_response_length, sampling):
    """Play one episode per row of `batch`, of the environment its `env` names (else the first of `environments`), each
    on its own (EpisodePlay): the model's turns generated by `policy` (a worker group of either engine, `sampling` as its
    generate takes it), the environment's calls made by `env_calls` (CallProcesses or InProcessCalls of ENV_CALLS).
    Returns what one turn's generate returns, with `response_mask` over the model's own tokens alone and
    `max_response_length` tokens for the whole episode; and per row `final_turn` (the text a reward scores),
    `episode_score` (the environment's score, or None), `turn_rewards` (per model turn the environment played, what
    its turn_reward gave it, 0 without), `turns`, `ending` (one of ENDINGS), `tool_calls`, `tool_errors` and
    `episode_seconds` (from the start until it ended), `computed_again` (tokens of its context its engine computed
    again at a later turn) and `engine_idle_share` (the share of the play's time its engines were not generating, the
    same on every row); `turn_reward_tokens`, each turn's reward on that turn's last
    token (see split_turn_rewards); and from engines that tag what they generate with their weights' version (rollout
    workers), the episode's `weight_version`, its first turn's (its oldest), and `newer_turns`, how many of its turns
    came from newer weights (an update arrived while it played). Each token's rollout log-prob is the one its engine
    sampled it with, so the off-policy correction holds per token whatever the version."""
    import torch

    from common.dataproto import DataProto
    from common.rollout import response_tensors

    rows = zip(batch["data_source"], batch["ground_truth"], batch["extra_info"])
    names = batch["env"] if "env" in batch else [environments.names[0]] * len(batch)
    prompts = [p[m.bool()].tolist() for p, m in zip(batch["prompts"], batch["prompt_mask"])]
    episodes = [Episode(prompt, row, name) for prompt, row, name in zip(prompts, rows, names)]
    play = EpisodePlay(policy, env_calls, environments, tokenizer, eos_token_ids, max_turns, max_response_length, sampling)
    play.play(episodes)
    responses = torch.full((len(episodes), max_response_length), play.pad, dtype=torch.long)
    own = torch.zeros(len(episodes), max_response_length)
    log_probs = torch.zeros(len(episodes), max_response_length)
    turn_rewards = torch.zeros(len(episodes), max_response_length)
    for i, episode in enumerate(episodes):
        turn_rewards[i, episode.turn_ends[: len(episode.turn_rewards)]] = torch.tensor(episode.turn_rewards)
        responses[i, : len(episode.tokens)] = torch.tensor(episode.tokens, dtype=torch.long)
        own[i, : len(episode.own)] = torch.tensor(episode.own, dtype=torch.float)
        log_probs[i, : len(episode.log_probs)] = torch.tensor(episode.log_probs)
    versioned = {}
    if episodes[0].versions[0] is not None:  # engines apart (--rollout-workers): an episode is as old as its first turn
        versioned["weight_version"] = torch.tensor([e.versions[0] for e in episodes])
        versioned["newer_turns"] = torch.tensor([sum(v != e.versions[0] for v in e.versions) for e in episodes])
    # every token of the episode attends and is read; the model's own are the ones the losses count
    real = torch.arange(max_response_length) < torch.tensor([len(e.tokens) for e in episodes])[:, None]
    return DataProto.from_dict(
        response_tensors(batch["prompts"], batch["prompt_mask"], responses, own, log_probs, attends=real)
        | {"turn_reward_tokens": turn_rewards}
        | versioned,
        {
            "final_turn": [e.last_turn for e in episodes],
            "episode_score": [e.score for e in episodes],
            "turn_rewards": [e.turn_rewards for e in episodes],
            "turns": [e.turns for e in episodes],
            "ending": [e.ending for e in episodes],
            "tool_calls": [e.tool_calls for e in episodes],
            "tool_errors": [e.tool_errors for e in episodes],
            "episode_seconds": [e.seconds for e in episodes],
            "computed_again": [e.computed_again for e in episodes],
            "engine_idle_share": [play.engine_idle_share] * len(episodes),
        },
    )


def split_turn_rewards(scores, batch):
    """The rewards of `batch` as PPO and REINFORCE++ place them: each sample's outcome score (its last token's), and
    [batch, response_len] the reward of each turn of an episode on that turn's last token (zeros without)."""
    import torch

    if "turn_reward_tokens" not in batch:
        return scores, torch.zeros_like(batch["response_mask"])
    return batch["outcome_score"], batch["turn_reward_tokens"]


def fail(episode: Episode, outcome: tuple, failures: dict) -> None:
    """End `episode` with score 0 for an environment's call that failed or ran out of time; keep the first traceback of
    each kind of failure for report_failures."""
    episode.ending, episode.score = outcome[0], 0.0
    if outcome[0] == "error":
        failures.setdefault(outcome[1], (episode, outcome[2]))


def report_failures(failures: dict) -> None:
    for kind, (episode, trace) in failures.items():
        if f"env {kind}" in REPORTED_FAILURES:  # once per kind and run, as the reward's failures
            continue
        REPORTED_FAILURES.add(f"env {kind}")
        print(
            f"the environment failed ({kind}) after the turn {episode.last_turn!r} of an episode for {episode.row}:\n"
            f"{trace}The episode ends with score 0 and counts in env/ended_error; fix the environment.",
            file=sys.stderr,
        )


def episode_metrics(batch, prefix: str) -> dict[str, float]:
    """Model turns and tool calls (and those answered with an error message) per episode on average, the environment's
    mean reward of each turn (`turn_reward_<k>`), the share of episodes that ended each way (ENDINGS), the share of
    the play's time the engines stood idle (waiting for environments) and the context tokens they computed again per
    turn after an episode's first (what no cache had kept of the earlier turns)."""
    endings, episodes = list(batch["ending"]), len(batch)
    later_turns = sum(max(0, turns - 1) for turns in batch["turns"])
    metrics = {
        f"{prefix}turns_mean": sum(batch["turns"]) / episodes,
        f"{prefix}tool_calls": sum(batch["tool_calls"]) / episodes,
        f"{prefix}tool_errors": sum(batch["tool_errors"]) / episodes,
        f"{prefix}engine_idle_share": sum(batch["engine_idle_share"]) / episodes,
        f"{prefix}computed_again_per_turn": sum(batch["computed_again"]) / max(1, later_turns),
    }
    if "newer_turns" in batch:  # turns generated from newer weights than their episode's first (off-policy)
        metrics[f"{prefix}newer_turns"] = batch["newer_turns"].float().mean().item()
    rewards = list(batch["turn_rewards"]) if "turn_rewards" in batch else []
    for turn in range(max(map(len, rewards), default=0)):  # the environment's reward of each turn, over episodes that had it
        given = [r[turn] for r in rewards if len(r) > turn]
        metrics[f"{prefix}turn_reward_{turn + 1}"] = sum(given) / len(given)
    return metrics | {f"{prefix}ended_{how}": endings.count(how) / episodes for how in ENDINGS}
