"""Agents as programs (--agent): an OpenAI-compatible endpoint in front of the rollout engines, served while a batch of
sessions plays, and the play of those sessions.

Each row's session (a session is an episode) runs `solve(row, client)` in the environment processes
(common/envs_agent.py) with an `openai` client whose base URL names the session: http://127.0.0.1:PORT/s/SESSION/v1.
A `/v1/chat/completions` request is rendered with the run's chat template (its `tools` too), sent to the session's
rank's engine as one turn, beside the other sessions' turns (as EpisodePlay batches an episode's turns), and answered
with the completion, the model's tool calls as OpenAI `tool_calls` (read as --tools reads them).

Token in, token out: a request whose rendering starts with the session's previous prompt and completion (as text) is
that context's tokens, the engine's own, and the new text encoded after them. A session whose every request does so is
one sample: the model's tokens in the loss, the rest masked, as an episode's layout. A request that rewrote the history
(a summary, a dropped message) starts a segment, a sample of its own whose prompt is that request's: the session's
segments are consecutive rows of the batch that share its row's fields (its group's uid) and its reward, counted in
`agent/segments_per_session` and `agent/rewritten_sessions`.

What a request may carry: REFUSED names the fields answered with HTTP 400 unless they hold the one value served,
IGNORED those read and ignored (the run's flags sample: the log-probs that train are the ones sampled at --temperature);
any other field is ignored too.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from common.data import pad_token_id
from common.episode_play import GATHER_SECONDS, Episode, EpisodeLimits, seed_of
from common.episodes import episodes_batch, episodes_of
from common.isolation import report_once
from common.rollout import stop_end
from common.tools import TEMPLATE_HINT, TOOL_CALL_FRAMING, parse_tool_calls, render

MODEL_NAME = "policy"  # what /v1/models lists: any `model` a request names is served by the policy
ROLES = ("system", "user", "assistant", "tool")
REFUSED = {  # field: (the value served, what a request is told)
    "n": (1, "one completion per request: make n requests"),
    "stream": (False, "streaming is not served: the whole completion comes at once"),
    "tool_choice": ("auto", "the model chooses its calls (tool_choice 'auto')"),
}
IGNORED = ("model", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logprobs", "user")
ENDED = "the session ended: its agent returned, failed or ran out of time"


class Refused(Exception):
    """A request the endpoint answers with an HTTP error: `status`, and what the client is told."""

    def __init__(self, status: int, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class Session:
    """One agent's session: its episode, its segments (the samples that train: the episode, then one for each request
    that did not extend the context before it), and the context its next request may extend."""

    episode: Episode
    place: int  # its row's place in the batch: its turns' seeds
    segments: list[Episode] = field(default_factory=list)
    requests: int = 0  # requests the engine answered
    completions: dict[str, tuple[int, int]] = field(default_factory=dict)  # by id: its segment's place, its turn there
    turn_rewards: dict[tuple[int, int], float] = field(default_factory=dict)  # what the agent reported, by the same
    context: list[int] | None = None  # the last request's prompt and completion (None before the first request)
    context_text: str = ""
    refused: int = 0  # requests answered with an HTTP error
    busy: bool = False  # a request of it is under way
    ended: bool = False  # its agent returned, failed or ran out of time: it makes no more requests


@dataclass
class Turn:
    """A request on its way to the engine and back: its prompt's tokens, what it may generate, where its answer goes."""

    session: Session
    tokens: list[int]
    max_tokens: int
    stop: list[str]
    tools: list[dict] | None  # the request's, whose calls the completion is read for
    extends: bool  # whether its prompt extends its session's context (else it starts a segment)
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    completion: list[int] = field(default_factory=list)
    finish_reason: str = "stop"


def conversation(body: dict) -> tuple[list[dict], list[dict] | None]:
    """The messages and the tools of a chat-completions request, as chat templates take them (a call's arguments as
    an object, not a JSON string); Refused (400) for a request that is not one."""
    messages, tools = body.get("messages"), body.get("tools")
    if not isinstance(messages, list) or not messages:
        raise Refused(400, "messages must be a non-empty list of messages")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) and "function" in t for t in tools)):
        raise Refused(400, 'tools must be a list of {"type": "function", "function": {...}}')
    read = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise Refused(400, f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}")
        content = message.get("content") or ""
        if isinstance(content, list):  # parts: the text ones, joined
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict) and "text" in part)
        if not isinstance(content, str):
            raise Refused(400, f"messages[{i}].content must be text")
        read.append({"role": message["role"], "content": content} | ({"name": message["name"]} if "name" in message else {}))
        if message.get("tool_calls"):
            read[-1]["tool_calls"] = [tool_call(call, i) for call in message["tool_calls"]]
    return read, tools or None


def tool_call(call, i: int) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not isinstance(arguments, dict):
        raise Refused(400, f"messages[{i}].tool_calls: each is a function call with a name and JSON object arguments")
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def generation_limits(body: dict) -> tuple[int | None, list[str]]:
    """A request's max_tokens (or max_completion_tokens) and stop strings; Refused (400) for fields not served."""
    for name, (served, told) in REFUSED.items():
        if body.get(name) not in (None, served):
            raise Refused(400, f"{name}={body[name]!r} is not served: {told}")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise Refused(400, f"max_tokens must be a positive integer, not {max_tokens!r}")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise Refused(400, "stop must be a string or a list of non-empty strings")
    return max_tokens, stop


class AgentPlay:
    """The sessions of a batch of rows, each its agent's, played against an Endpoint: each session's requests become
    turns of its rank's engine (`policy.submit_rank(rank, "turns", ...)`), which takes those that came while it
    generated into its next step, and when idle gathers them GATHER_SECONDS (or until every session of the rank waits).
    The agents run in `env_calls`' processes (EnvProcesses of --agent, each call under --agent-timeout)."""

    def __init__(self, policy, env_calls, tokenizer, eos_token_ids, limits: EpisodeLimits, sampling: dict, **settings):
        self.policy, self.env_calls, self.tokenizer, self.eos_token_ids = policy, env_calls, tokenizer, eos_token_ids
        self.limits, self.sampling = limits, sampling
        self.seed, self.agent_timeout = settings.get("seed"), settings["agent_timeout"]
        self.lockstep = settings.get("lockstep", False)
        self.pad = pad_token_id(tokenizer, eos_token_ids)
        self.name = uuid.uuid4().hex[:12]
        self.inbox, self.lock = queue.SimpleQueue(), threading.Lock()  # the endpoint's turns; the sessions' state
        self.failures, self.stepping, self.start = {}, {}, time.perf_counter()

    def play(self, episodes: list[Episode]) -> None:
        ranks = self.policy.world_size
        self.sessions = {}
        for i, episode in enumerate(episodes):
            episode.key, episode.rank = f"{self.name}/{i}", i * ranks // len(episodes)  # a group's sessions on one rank
            self.sessions[f"{self.name}-{i}"] = Session(episode, i, [episode])
        self.waiting, self.under_way = {r: [] for r in range(ranks)}, {}  # by rank; by key, the turns at the engine
        self.ready_since = dict.fromkeys(range(ranks), self.start)  # by rank, when its first waiting turn came
        calls, work_before = {}, self.policy.broadcast("open_turns")
        try:
            with Endpoint(self) as endpoint:
                for name, session in self.sessions.items():
                    columns = dict(row=session.episode.columns, base_url=endpoint.base_url(name), timeout=self.agent_timeout)
                    self._call(session, ("open", "agent", columns))
                while self.stepping or calls or self.under_way:
                    self._gather()
                    for rank in range(ranks):
                        if rank not in calls and self._due(rank):
                            calls[rank] = self._submit(rank)
                    for rank in [rank for rank, call in calls.items() if call.done()]:
                        for key, tokens, log_probs, version, _ in calls.pop(rank).result():
                            self._take_turn(self.under_way.pop(key), tokens, log_probs, version)
                    # while an engine generates, its answer is looked for every 2 ms; else the endpoint's every 10 ms
                    for ticket, outcome in self.env_calls.collect(timeout=0.002 if calls else 0.01).items():
                        self._answer(*self.stepping.pop(ticket), outcome)
                self._gather()  # what came after the sessions ended: a call from a thread an agent left behind
                for turn in [turn for turns in self.waiting.values() for turn in turns]:
                    resolve(turn, Refused(410, ENDED, "session_ended"))
        finally:
            self.policy.broadcast("close_turns", self.name)
        work_after = self.policy.broadcast("engine_work")
        engine_seconds = sum(after["seconds"] - before["seconds"] for before, after in zip(work_before, work_after))
        self.engine_idle_share = max(0.0, 1 - engine_seconds / (ranks * (time.perf_counter() - self.start)))

    def _gather(self) -> None:
        """Take the turns the endpoint sent since, to their ranks' waiting lists (the first of a list starts its clock)."""
        while True:
            try:
                turn = self.inbox.get_nowait()
            except queue.Empty:
                return
            rank = turn.session.episode.rank
            if not self.waiting[rank]:
                self.ready_since[rank] = time.perf_counter()
            self.waiting[rank].append(turn)

    def _due(self, rank: int) -> bool:
        """Whether `rank`'s engine takes its waiting turns now: at once while it generates others (they join them),
        else once every live session of the rank waits, or GATHER_SECONDS after the first turn came. In lockstep
        (--deterministic), rounds: once none generates, and every live session of the rank waits, whatever the time."""
        if any(turn.session.episode.rank == rank for turn in self.under_way.values()):
            return not self.lockstep
        if not self.waiting[rank]:
            return False
        live = sum(not s.ended for s in self.sessions.values() if s.episode.rank == rank)
        if self.lockstep:
            return len(self.waiting[rank]) >= live
        return len(self.waiting[rank]) >= live or time.perf_counter() - self.ready_since[rank] >= GATHER_SECONDS

    def _submit(self, rank: int):
        turns, self.waiting[rank] = sorted(self.waiting[rank], key=lambda turn: turn.session.place), []  # the batch's order
        requests = []
        for turn in turns:
            session = turn.session
            self.under_way[session.episode.key] = turn
            seed = None if self.seed is None else seed_of(self.seed, session.place, session.requests)
            requests.append((session.episode.key, turn.tokens, turn.max_tokens, seed))
        return self.policy.submit_rank(rank, "turns", self.name, requests, **self.sampling)

    def _take_turn(self, turn: Turn, tokens: list[int], log_probs: list[float], version) -> None:
        """Keep the engine's completion of `turn` in its session (cut after a stop string) and answer the request."""
        session, episode = turn.session, turn.session.episode
        tokens = tokens[: turn.max_tokens]  # the session's room, whatever an engine returned
        end = stop_end(tokens, turn.stop, self.tokenizer)
        ended_by_eos = end is None and tokens and tokens[-1] in self.eos_token_ids
        kept = end or len(tokens)
        turn.completion = tokens[:kept]
        turn.finish_reason = "stop" if end is not None or ended_by_eos else "length"
        with self.lock:
            if session.ended:
                return resolve(turn, Refused(410, ENDED, "session_ended"))
            sample = session.segments[-1]  # its segment: its prompt, then what each request added
            if turn.extends:  # what the agent added since (tool results, its messages): masked
                added = len(turn.tokens) - len(session.context)
                sample.tokens += turn.tokens[len(session.context) :]
                sample.own += [False] * added
                sample.log_probs += [0.0] * added
            sample.tokens += turn.completion
            sample.own += [True] * kept
            sample.log_probs += log_probs[:kept]
            sample.turn_ends.append(len(sample.tokens) - 1)
            sample.versions.append(version)
            sample.turns += 1
            session.requests += 1
            session.completions[turn.id] = (len(session.segments) - 1, sample.turns - 1)
            episode.last_turn = self.tokenizer.decode(turn.completion, skip_special_tokens=True)
            session.context = turn.tokens + turn.completion
            session.context_text = self.tokenizer.decode(session.context)
            session.busy = False
        resolve(turn, turn)

    def _call(self, session: Session, request: tuple) -> None:
        self.stepping[self.env_calls.submit(session.episode.key, request)] = (session, request)

    def _answer(self, session: Session, request: tuple, outcome: tuple) -> None:
        """The agent's process answered: its session ended (then its reward is asked), or its reward came."""
        episode = session.episode
        if outcome[0] == "ok" and request[0] == "open":
            self._end(session, episode.ending or "answered")
            return self._call(session, ("finish", True))
        if outcome[0] == "ok":
            episode.score = outcome[1]
            return
        self._end(session, outcome[0])
        episode.score = 0.0
        if outcome[0] == "error":
            self.failures.setdefault(outcome[1], (episode, outcome[2]))

    def _end(self, session: Session, ending: str) -> None:
        """End `session`: its requests waiting for the engine are refused, and so is every later one."""
        with self.lock:
            session.ended, session.episode.ending = True, ending
            session.episode.seconds = time.perf_counter() - self.start
        rank = session.episode.rank
        for turn in [turn for turn in self.waiting[rank] if turn.session is session]:
            self.waiting[rank].remove(turn)
            resolve(turn, Refused(410, ENDED, "session_ended"))

    def prepare(self, session: Session, body: dict, loop) -> Turn:
        """The turn of a request of `session` (in the endpoint's thread): its prompt's tokens and what it may generate;
        Refused for one that is malformed, too long or not served."""
        messages, tools = conversation(body)
        max_tokens, stop = generation_limits(body)
        try:
            text = render(self.tokenizer, messages, tools)
            if tools and text == render(self.tokenizer, messages):  # the model would never see them
                raise Refused(400, f"the run's chat template ignores tools; {TEMPLATE_HINT}", "template_ignores_tools")
        except ValueError as error:
            raise Refused(400, f"the chat template cannot render these messages: {error}") from None
        with self.lock:
            if session.ended:
                raise Refused(410, ENDED, "session_ended")
            if session.busy:
                raise Refused(400, "a session takes one request at a time: wait for its answer", "session_busy")
            if session.requests >= self.limits.max_turns:
                raise Refused(400, f"the session made --max-turns {self.limits.max_turns} requests", "max_turns")
            # the engine's tokens of the context it extends, and what follows encoded: token in, token out
            extends = session.context is not None and text.startswith(session.context_text)
            if extends:
                tokens = session.context + self.encode(text[len(session.context_text) :])
            else:
                tokens = self.encode(text)
                self._start_segment(session, tokens)
            # the segment's response tokens so far, and this request's additions to its context
            room = self.limits.max_response_length - (len(tokens) - len(session.segments[-1].prompt))
            if room <= 0:
                session.episode.ending = "token_limit"
                too_long = "the session's conversation is --max-response-length tokens long"
                raise Refused(400, too_long, "context_length_exceeded")
            session.busy = True
        return Turn(session, tokens, min(room, max_tokens or room), stop, tools, extends, loop, loop.create_future())

    def _start_segment(self, session: Session, tokens: list[int]) -> None:
        """A request that does not extend its session's context starts a segment whose prompt is its own (the first
        request's: the episode's); a segment that the engine did not answer yet gives its place to this one."""
        if len(tokens) > self.limits.max_prompt_length:
            too_long = f"the prompt is {len(tokens)} tokens, more than --max-prompt-length {self.limits.max_prompt_length}"
            raise Refused(400, too_long, "context_length_exceeded")
        episode, last = session.episode, session.segments[-1]
        if session.context is None or not last.turns:
            last.prompt = tokens
            return
        segment = Episode(tokens, episode.row, episode.env_name, episode.columns, episode.prompt_source)
        segment.key, segment.rank = episode.key, episode.rank
        session.segments.append(segment)

    def reward_turn(self, session: Session, body: dict) -> dict:
        """Keep the reward `body` reports for a completion of `session` ({"id": the completion's id, "reward": a
        number}), as an environment's turn_reward; Refused for an id the session did not get, or a reward not a number."""
        reward, completion = body.get("reward"), body.get("id")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise Refused(400, f"reward must be a finite number, not {reward!r}")
        with self.lock:
            if session.ended:
                raise Refused(410, ENDED, "session_ended")
            if completion not in session.completions:
                raise Refused(400, f"no completion {completion!r} in this session: send the id of one it answered")
            session.turn_rewards[session.completions[completion]] = float(reward)
        return {"id": completion, "reward": float(reward)}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def response(self, turn: Turn) -> dict:
        """The chat-completions answer of a turn the engine completed, its tool calls read as --tools reads them."""
        tokenizer, text = self.tokenizer, self.tokenizer.decode(turn.completion)
        prefix = tokenizer.decode(turn.tokens)
        calls = parse_tool_calls(tokenizer, text, prefix, turn.tools) if turn.tools else []
        message = {"role": "assistant", "content": tokenizer.decode(turn.completion, skip_special_tokens=True)}
        for stop in turn.stop:  # as OpenAI's: the completion without its stop string
            message["content"] = message["content"].split(stop)[0] if stop in message["content"] else message["content"]
        finish_reason = turn.finish_reason
        if calls and all("error" not in call for call in calls):
            framing = getattr(tokenizer, "response_template", None) or TOOL_CALL_FRAMING
            message["content"] = tokenizer.parse_response(text, framing, prefix=prefix).get("content") or None
            functions = [{"name": call["name"], "arguments": json.dumps(call["arguments"])} for call in calls]
            message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": f} for i, f in enumerate(functions)]
            finish_reason = "tool_calls"
        usage = dict(prompt_tokens=len(turn.tokens), completion_tokens=len(turn.completion))
        return {
            "id": turn.id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": MODEL_NAME,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage | {"total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]},
        }


def resolve(turn: Turn, outcome) -> None:
    """Answer `turn`'s request, waiting in the endpoint's thread, with `outcome` (the turn, or a Refused)."""

    def settle() -> None:
        if not turn.future.done():
            (turn.future.set_exception if isinstance(outcome, Exception) else turn.future.set_result)(outcome)

    turn.loop.call_soon_threadsafe(settle)


class Endpoint:
    """The HTTP server of a play (FastAPI under uvicorn, on a thread of its own), listening on 127.0.0.1 on a free
    port from its `with` to its end: `/s/SESSION/v1/chat/completions` and `/s/SESSION/v1/models`."""

    def __init__(self, play: AgentPlay):
        import uvicorn

        self.play = play
        app = FastAPI()
        app.post("/s/{session}/v1/chat/completions")(self.chat)
        app.get("/s/{session}/v1/models")(self.models)
        app.post("/s/{session}/v1/rewards")(self.rewards)
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        # a request still open when the play ends (its agent's process gone) does not hold the run
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[self.socket]), daemon=True)

    def base_url(self, session: str) -> str:
        return f"http://127.0.0.1:{self.port}/s/{session}/v1"

    def __enter__(self) -> Endpoint:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agents' endpoint did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *failure) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.socket.close()

    async def models(self, session: str):
        return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "hybridrl"}]}

    async def chat(self, session: str, request: Request):
        return await self.answer(session, request, self._complete)

    async def rewards(self, session: str, request: Request):
        return await self.answer(session, request, lambda found, body: self.play.reward_turn(found, body))

    async def _complete(self, found: Session, body: dict) -> dict:
        turn = self.play.prepare(found, body, asyncio.get_running_loop())
        self.play.inbox.put(turn)
        return self.play.response(await turn.future)

    async def answer(self, session: str, request: Request, serve):
        """`serve(session, body)`'s answer to a request of `session` whose body is a JSON object; OpenAI's error
        object, with its HTTP status, for one that is Refused."""
        found = self.play.sessions.get(session)
        try:
            if found is None:
                raise Refused(404, f"no session {session} in this play", "no_session")
            try:
                body = await request.json()
            except ValueError:
                raise Refused(400, "the request's body is not JSON") from None
            if not isinstance(body, dict):
                raise Refused(400, "the request's body must be a JSON object")
            answer = serve(found, body)
            return await answer if inspect.isawaitable(answer) else answer
        except Refused as refused:
            if found is not None:
                found.refused += 1
            error = {"message": str(refused), "type": "invalid_request_error", "param": None, "code": refused.code}
            return JSONResponse({"error": error}, status_code=refused.status)


def run_sessions(
    policy, batch, env_calls, environments, tokenizer, eos_token_ids, limits: EpisodeLimits, sampling: dict, **settings
):
    """Play one agent session per row of `batch` (AgentPlay) and lay out their segments as run_episodes lays out
    episodes, a row each, with per row its `segment` (0 for a session's first) and its session's `segments` and
    `refused_requests`. A session of several segments takes that many rows: `batch`'s row is repeated in place
    (DataProto.keep_rows) so that `batch | samples` holds. `settings`: the play's `seed`, `agent_timeout` and
    `lockstep` (AgentPlay._due)."""
    episodes = episodes_of(batch, environments)
    prompts = [episode.prompt for episode in episodes]  # the first request's prompt takes the row's place
    play = AgentPlay(policy, env_calls, tokenizer, eos_token_ids, limits, sampling, **settings)
    play.play(episodes)
    report_failures(play.failures)
    rows, samples, per_row = [], [], dict(segment=[], segments=[], refused_requests=[])
    for row, session in enumerate(play.sessions.values()):
        episode = session.episode
        for place, segment in enumerate(session.segments):  # each shares its session's ending, reward and last turn
            segment.ending, segment.score, segment.last_turn, segment.seconds = (
                episode.ending, episode.score, episode.last_turn, episode.seconds
            )
            if session.turn_rewards:  # per turn, what the agent reported for it (0 without)
                segment.turn_rewards = [session.turn_rewards.get((place, turn), 0.0) for turn in range(segment.turns)]
            rows.append(row)
            samples.append(segment)
            per_row["segment"].append(place)
            per_row["segments"].append(len(session.segments))
            per_row["refused_requests"].append(session.refused if place == 0 else 0)
    if len(rows) > len(batch):
        batch.keep_rows(rows)
    prompts = [prompts[row] for row in rows]
    width = limits.max_response_length
    return episodes_batch(batch, samples, prompts, width, play.pad, play.engine_idle_share, **per_row)


def report_failures(failures: dict) -> None:
    """Print the first traceback of each kind of an agent's failure, once per run: its session ended with score 0."""
    for kind, (episode, trace) in failures.items():
        report_once(
            f"agent {kind}",
            f"an agent failed ({kind}) in a session for {episode.row}:\n{trace}The session ends with score 0 and counts "
            "in env/ended_error; fix the agent.",
        )
