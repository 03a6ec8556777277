"""Agents as programs (--agent, common/agent_endpoint.py): the real `openai` client, in the real environment processes,
against the real endpoint; the model's turns from test_tools.py's scripted engine, so that a session's tokens can be
checked one by one against the chat template's rendering of its conversation. The script's step runs the real engine."""

import json
import socket
from pathlib import Path

import pytest

from common.agent_endpoint import conversation, run_sessions
from common.data import collate, load_prompts
from common.env_processes import EnvProcesses
from common.envs import episode_spec, load_environments
from common.episode_play import EpisodeLimits
from common.episodes import episode_metrics
from common.isolation import REPORTED_FAILURES
from common.tools import multiply, render, tool_schema
from helpers import VLLM_FP32, metrics_of, run_script, stop_in_process
from test_tools import COMPACT_TEMPLATE, ScriptedEngine, call, row

ROOT = Path(__file__).resolve().parents[1]

AGENTS = '''
import asyncio
import json
import os
import threading
import time

import httpx
import openai
from transformers.utils import get_json_schema

from common.tools import multiply

TOOLS = [get_json_schema(multiply)]


def mark(row, name, value):
    with open(os.path.join(row["marks"], f"{name}_{row['tag']}.json"), "w") as file:
        json.dump(value, file)


def chat(row, client):
    """Its own loop and tool dispatch; returns whether its answer is right, or None for the reward function."""
    mark(row, "url", str(client.base_url))
    assert [model.id for model in client.models.list()] == ["policy"]
    messages = list(row["prompt"])
    while True:
        message = client.chat.completions.create(model="any", messages=messages, tools=TOOLS).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for tool_call in message.tool_calls:
            result = multiply(**json.loads(tool_call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": str(result)})
    mark(row, "messages", messages)
    return None if row["tag"] == "unscored" else float(message.content == row["reward_model"]["ground_truth"])


def summarises(row, client):
    """A tool call and its answer; then a summary in place of that history, and a request that extends the summary's."""
    ask = lambda messages: client.chat.completions.create(model="any", messages=messages, tools=TOOLS)  # noqa: E731
    reward = lambda reply, value: client.post("/rewards", body=dict(id=reply.id, reward=value), cast_to=object)  # noqa: E731
    messages = list(row["prompt"])
    reply = ask(messages)
    message = reply.choices[0].message
    if not message.tool_calls:
        return 0.0
    reward(reply, 0.25)  # a turn's reward, for its call
    arguments = json.loads(message.tool_calls[0].function.arguments)
    messages += [message.model_dump(exclude_none=True), {"role": "tool", "content": str(multiply(**arguments))}]
    found = ask(messages).choices[0].message.content
    summary = [{"role": "user", "content": f"the product is {found}: say it once more"}]
    said = ask(summary).choices[0].message.content
    summary += [{"role": "assistant", "content": said}, {"role": "user", "content": "sure?"}]
    mark(row, "summary", summary)
    last = ask(summary)
    statuses = []
    for bad in (dict(id="chatcmpl-none", reward=1.0), dict(id=last.id, reward="high")):
        try:
            client.post("/rewards", body=bad, cast_to=object)
        except openai.BadRequestError as error:
            statuses.append(error.status_code)
    mark(row, "reward_statuses", statuses + [reward(last, 0.5)])
    return float(last.choices[0].message.content == row["reward_model"]["ground_truth"])


async def chat_async(row, client):
    """Two requests, the second extending the first: many sessions at once, each on its own event loop."""
    messages = list(row["prompt"])
    first = await client.chat.completions.create(model="any", messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "sure?"}]
    second = await client.chat.completions.create(model="any", messages=messages)
    return float(second.choices[0].message.content == "yes")


def faulty(row, client):
    """Each fault, by its row's tag."""
    ask = lambda messages, **more: client.chat.completions.create(model="any", messages=messages, **more)  # noqa: E731
    if row["tag"] == "raises":
        ask(row["prompt"])
        raise ValueError("an agent that breaks")
    if row["tag"] == "hangs":
        ask(row["prompt"])
        time.sleep(600)
    if row["tag"] == "exits":
        os._exit(3)
    if row["tag"] == "malformed":
        url = str(client.base_url).rstrip("/")
        statuses = [httpx.post(f"{url}/chat/completions", content=b"{not json").status_code]
        statuses.append(httpx.post(f"{url}/chat/completions", json={"messages": "hi"}).status_code)
        statuses.append(httpx.post(url.replace("/s/", "/s/x") + "/chat/completions", json={"messages": []}).status_code)
        for bad in (dict(n=2), dict(stream=True), dict(max_tokens=0), dict(tool_choice="required")):
            try:
                ask(row["prompt"], **bad)
            except openai.BadRequestError as error:
                statuses.append(error.status_code)
        mark(row, "statuses", statuses)
        ask(row["prompt"])
        return 1.0
    if row["tag"] == "late":  # a call after its session ended, from a thread the agent left behind
        def late():  # with a client of its own: solve's is closed once it returns
            time.sleep(1.0)
            again = openai.OpenAI(base_url=client.base_url, api_key="late", max_retries=0)
            try:
                again.chat.completions.create(model="any", messages=row["prompt"])
                mark(row, "late", "answered")
            except openai.APIStatusError as error:
                mark(row, "late", [error.status_code, error.message])
        threading.Thread(target=late).start()
        return 1.0
    return float(ask(row["prompt"]).choices[0].message.content == "fine")
'''


@pytest.fixture(scope="module")
def agents_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("agents") / "agents.py"
    path.write_text(AGENTS)
    return str(path)


class CountingEngine(ScriptedEngine):
    """The scripted engine, which keeps how many turns each of its calls started."""

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, script)
        self.started = []

    def submit_rank(self, rank, method, play, requests, **sampling):
        self.started.append(len(requests))
        return super().submit_rank(rank, method, play, requests, **sampling)


def play(tokenizer, tmp_path, agent: str, rows: list[dict], script: dict, processes=2, timeout=30.0, **limits):
    """The sessions of `rows`, each a session of `agent` (a function of AGENTS) in `processes` environment processes."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    batch = collate(load_prompts([str(path)], tokenizer, 4000), tokenizer.pad_token_id)
    environments = load_environments(episode_spec(None, None, agent))
    engine, eos = CountingEngine(tokenizer, script), [tokenizer.eos_token_id]
    limits = EpisodeLimits(limits.get("max_turns", 4), 4000, limits.get("max_response_length", 400))
    env_calls = EnvProcesses(environments.spec, processes, timeout=timeout)
    try:
        sessions = run_sessions(engine, batch, env_calls, environments, tokenizer, eos, limits, {}, agent_timeout=timeout)
    finally:
        env_calls.close()
    return batch, sessions, engine


def tagged(question: str, tag: str, marks, truth: str = "0") -> dict:
    return row(question, truth, tag=tag, marks=str(marks))


def read_mark(marks, name: str, tag: str):
    return json.loads((marks / f"{name}_{tag}.json").read_text())


def test_a_chat_agent_with_tools_is_trained_on_exactly_its_conversation_and_the_endpoint_goes(
    tool_tokenizer, agents_file, tmp_path
):
    tokenizer, marks = tool_tokenizer, tmp_path
    rows = [tagged("37*48=", "scored", marks, "1776"), tagged("2*3=", "unscored", marks)]
    script = {"37*48=": [call("multiply", a=37, b=48), "1776"], "2*3=": ["6"]}
    _, sessions, _ = play(tokenizer, tmp_path, f"{agents_file}:chat", rows, script)
    assert sessions["ending"].tolist() == ["answered", "answered"] and sessions["turns"].tolist() == [2, 1]
    assert sessions["episode_score"].tolist() == [1.0, None]  # None: the reward function scores the last completion
    assert sessions["final_turn"].tolist() == ["1776", "6"] and sessions["segments"].tolist() == [1, 1]
    messages, tools = conversation({"messages": read_mark(marks, "messages", "scored"), "tools": None})
    rendered = render(tokenizer, messages, [tool_schema(multiply, "")], add_generation_prompt=False)
    length = int(sessions["attention_mask"][0].sum() - sessions["prompt_mask"][0].sum())
    prompt = sessions["prompts"][0][sessions["prompt_mask"][0].bool()].tolist()
    assert tokenizer.decode(prompt + sessions["responses"][0][:length].tolist()) == rendered.removesuffix("\n")
    own = sessions["response_mask"][0].bool()
    assert tokenizer.decode(sessions["responses"][0][own]) == call("multiply", a=37, b=48) + "<|im_end|>1776<|im_end|>"
    assert (sessions["rollout_log_probs"][0][own] == -0.5).all() and (sessions["rollout_log_probs"][0][~own] == 0).all()
    assert "<tool_response>\n1776\n</tool_response>" in tokenizer.decode(sessions["responses"][0][~own])
    port = int(read_mark(marks, "url", "scored").split(":")[2].split("/")[0])
    with pytest.raises(ConnectionRefusedError):  # the endpoint lived for the play alone
        socket.create_connection(("127.0.0.1", port), timeout=5)


def test_a_session_that_rewrites_its_history_trains_as_a_sample_per_segment_with_its_reward_and_turn_rewards(
    tool_tokenizer, agents_file, tmp_path
):
    tokenizer, marks = tool_tokenizer, tmp_path
    rows = [tagged("37*48=", "summarises", marks, "1776"), tagged("2*3=", "answers", marks, "6")]
    script = {"37*48=": [call("multiply", a=37, b=48), "1776"], "2*3=": ["6"], "the product is 1776": ["1776", "1776"]}
    batch, sessions, _ = play(tokenizer, tmp_path, f"{agents_file}:summarises", rows, script)
    # the first session's two segments take its row's place, twice: its group's uid, its fields
    texts = list(batch["prompt_text"])
    assert len(batch) == len(sessions) == 3 and texts[0] == texts[1] != texts[2]
    assert batch["ground_truth"].tolist() == ["1776", "1776", "6"] and (batch | sessions) is not None
    assert sessions["segment"].tolist() == [0, 1, 0] and sessions["segments"].tolist() == [2, 2, 1]
    assert sessions["episode_score"].tolist() == [1.0, 1.0, 0.0] and sessions["turns"].tolist() == [2, 2, 1]
    assert sessions["ending"].tolist() == ["answered"] * 3 and sessions["final_turn"].tolist() == ["1776", "1776", "6"]
    prompts = [p[m.bool()].tolist() for p, m in zip(sessions["prompts"], sessions["prompt_mask"])]
    lengths = (sessions["attention_mask"].sum(1) - sessions["prompt_mask"].sum(1)).tolist()
    responses = [response[:length].tolist() for response, length in zip(sessions["responses"], lengths)]
    # the second segment: the summary's conversation, its prompt the summary's first request, as the template renders it
    summary, _ = conversation({"messages": read_mark(marks, "summary", "summarises")})
    first_request = render(tokenizer, summary[:1], [tool_schema(multiply, "")])
    assert tokenizer.decode(prompts[1]) == first_request
    rendered = render(tokenizer, summary, [tool_schema(multiply, "")])
    assert tokenizer.decode(prompts[1] + responses[1]) == rendered + "1776<|im_end|>"  # and its last completion
    own = [tokenizer.decode(r[m.bool()]) for r, m in zip(sessions["responses"], sessions["response_mask"])]
    assert own == [call("multiply", a=37, b=48) + "<|im_end|>1776<|im_end|>", "1776<|im_end|>1776<|im_end|>", "6<|im_end|>"]
    assert "sure?" in tokenizer.decode(sessions["responses"][1][~sessions["response_mask"][1].bool()])
    assert tokenizer.decode(prompts[0]).endswith("37*48=<|im_end|>\n<|im_start|>assistant\n")
    # the turn rewards it reported, each on its turn's last token: the call's (first segment), the last answer's
    assert read_mark(marks, "reward_statuses", "summarises")[:2] == [400, 400]
    assert sessions["turn_rewards"].tolist() == [[0.25, 0.0], [0.0, 0.5], []]
    ends = [int(sessions["turn_reward_tokens"][i].nonzero().flatten()[0]) for i in (0, 1)]
    assert tokenizer.decode(sessions["responses"][0][ends[0]]) == "<|im_end|>" and ends[1] == lengths[1] - 1
    assert sessions["turn_reward_tokens"].sum(1).tolist() == [0.25, 0.5, 0.0]
    metrics = episode_metrics(sessions, "env/")
    assert metrics["agent/segments_per_session"] == 1.5 and metrics["agent/rewritten_sessions"] == 0.5
    assert metrics["env/turns_mean"] == 2.5 and metrics["env/ended_answered"] == 1.0


def test_an_async_agent_plays_32_sessions_at_once(tool_tokenizer, agents_file, tmp_path):
    rows = [row(f"question {i}?") for i in range(32)]
    script = {f"question {i}?": ["maybe", "yes" if i % 2 else "no"] for i in range(32)}
    _, sessions, engine = play(tool_tokenizer, tmp_path, f"{agents_file}:chat_async", rows, script, processes=2)
    assert sessions["ending"].tolist() == ["answered"] * 32 and sessions["turns"].tolist() == [2] * 32
    assert sessions["episode_score"].tolist() == [float(i % 2) for i in range(32)]
    assert sum(engine.started) == 64 and max(engine.started) > 1  # turns of several sessions in one call
    own = sessions["response_mask"].bool()
    own_text = [tool_tokenizer.decode(response[mask]) for response, mask in zip(sessions["responses"], own)]
    assert own_text == [f"maybe<|im_end|>{'yes' if i % 2 else 'no'}<|im_end|>" for i in range(32)]
    assert episode_metrics(sessions, "env/")["agent/segments_per_session"] == 1.0


def test_each_fault_ends_its_session_alone_with_score_0_or_an_http_error(tool_tokenizer, agents_file, tmp_path, capsys):
    marks = tmp_path
    tags = ["raises", "hangs", "exits", "malformed", "late", "fine"]
    rows = [tagged(f"fault {tag}?", tag, marks) for tag in tags]
    script = {f"fault {tag}?": ["fine", "again"] for tag in tags}
    REPORTED_FAILURES.clear()
    # a process each: a hung agent's process is replaced with what it held
    _, sessions, _ = play(tool_tokenizer, tmp_path, f"{agents_file}:faulty", rows, script, processes=len(tags), timeout=4)
    assert sessions["ending"].tolist() == ["error", "timeout", "error", "answered", "answered", "answered"]
    assert sessions["episode_score"].tolist() == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert read_mark(marks, "statuses", "malformed") == [400, 400, 404, 400, 400, 400, 400]
    # the unknown session's request is no session's; the late call is its session's
    assert sessions["refused_requests"].tolist() == [0, 0, 0, 6, 1, 0]
    status, message = read_mark(marks, "late", "late")
    assert status == 410 and "the session ended" in message
    metrics = episode_metrics(sessions, "env/")
    assert metrics["agent/rewritten_sessions"] == 0 and metrics["agent/refused_requests"] == 7 / 6
    assert metrics["env/ended_error"] == 2 / 6 and metrics["env/ended_timeout"] == 1 / 6
    err = capsys.readouterr().err
    assert err.count("an agent failed (ValueError)") == 1 and "an agent that breaks" in err
    assert "an agent failed (ProcessDied)" in err


def test_the_sessions_limits_are_the_runs(tool_tokenizer, agents_file, tmp_path):
    """A request past --max-turns is refused: the agent's own loop stops there (this one raises: score 0), and the
    tokens it got are in its sample as an episode's."""
    marks = tmp_path
    rows = [tagged("37*48=", "scored", marks, "1776")]
    script = {"37*48=": [call("multiply", a=37, b=48)] * 3}
    _, sessions, _ = play(tool_tokenizer, tmp_path, f"{agents_file}:chat", rows, script, max_turns=2)
    assert sessions["ending"].tolist() == ["error"] and sessions["turns"].tolist() == [2]
    assert sessions["refused_requests"].tolist() == [1] and sessions["response_mask"][0].sum() > 0


def test_tools_a_template_would_not_show_are_refused(tool_tokenizer, agents_file, tmp_path, capsys):
    from transformers import PreTrainedTokenizerFast

    tokens = dict(eos_token="<|im_end|>", pad_token="<pad>")
    plain = PreTrainedTokenizerFast(tokenizer_object=tool_tokenizer.backend_tokenizer, **tokens)
    plain.chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    REPORTED_FAILURES.clear()
    rows = [tagged("37*48=", "scored", tmp_path, "1776")]
    _, sessions, _ = play(plain, tmp_path, f"{agents_file}:chat", rows, {"37*48=": ["1776"]})
    assert sessions["ending"].tolist() == ["error"] and sessions["refused_requests"].tolist() == [1]
    assert "the run's chat template ignores tools; pass --chat-template chatml_tools" in capsys.readouterr().err


def test_agent_flags_are_checked_before_any_worker(demo_files, agents_file, tmp_path, monkeypatch):
    model, train, _ = demo_files
    flags, place = ["--model-path", model, "--train-files", train], dict(cwd=tmp_path, monkeypatch=monkeypatch)
    stop = stop_in_process("grpo_hybrid.py", *flags, "--agent", f"{agents_file}:nothing", **place)
    assert f"--agent '{agents_file}:nothing': {agents_file} defines no function 'nothing'" in stop
    stop = stop_in_process("grpo_hybrid.py", *flags, "--agent", f"{agents_file}:chat", "--tools", "multiply", **place)
    assert "--env and --tools play the run's loop of turns" in stop and "PolicyWorker" not in stop


def agent_run(demo_files, tmp_path, agent: str) -> list[str]:
    """The flags of a short GRPO run of the demo task with the agent whose source is `agent` (its function `solve`)."""
    import pyarrow.parquet as pq

    (tmp_path / "compact.jinja").write_text(COMPACT_TEMPLATE)
    (tmp_path / "agent.py").write_text(agent)
    model, train, val = demo_files
    pq.write_table(pq.read_table(val).slice(0, 8), tmp_path / "val.parquet")
    flags = ["--model-path", model, "--train-files", train, "--val-files", str(tmp_path / "val.parquet")]
    flags += ["--max-prompt-length", "24", "--max-response-length", "24", "--agent", f"{tmp_path}/agent.py:solve"]
    flags += ["--chat-template", str(tmp_path / "compact.jinja")]
    flags += ["--train-batch-size", "4", "--n", "2", "--mini-batch-size", "4", "--no-val-before-train"]
    return flags + ["--val-batch-size", "8", "--reward-workers", "2"]


@pytest.mark.parametrize("engine", [[], VLLM_FP32], ids=["hf", "vllm"])
def test_grpo_steps_with_an_agent(demo_files, tmp_path, engine):
    agent = (  # a conversation, then one of its own: two segments, which train together
        "def solve(row, client):\n"
        "    client.chat.completions.create(model='policy', messages=row['prompt'], max_tokens=8)\n"
        "    client.chat.completions.create(model='policy', messages=[dict(role='user', content='again')], max_tokens=8)\n"
    )
    flags = [*agent_run(demo_files, tmp_path, agent), "--in-process", "--total-steps", "1", *engine]
    result = run_script("grpo_hybrid.py", *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _, [step] = metrics_of(tmp_path)
    assert step["env/ended_answered"] == 1 and step["env/turns_mean"] == 2 and step["agent/segments_per_session"] == 2
    assert step["env/ended_error"] == step["env/ended_timeout"] == 0 and "val/accuracy" in step
    assert step["agent/rewritten_sessions"] == 1 and step["val/agent/rewritten_sessions"] == 1


def test_the_example_agent_solves_the_multiply_task(tool_tokenizer, tmp_path):
    agent = f"{ROOT}/examples/agents/multiply_agent.py:solve"
    rows = [row("What is 123 times 45?", "5535"), row("What is 100 times 10?", "1000")]
    script = {"123 times": [call("multiply", a=123, b=45), "5535"], "100 times": [call("multiply", a=100, b=10), "999"]}
    _, sessions, _ = play(tool_tokenizer, tmp_path, agent, rows, script)
    assert sessions["episode_score"].tolist() == [None, None] and sessions["turns"].tolist() == [2, 2]
    assert sessions["final_turn"].tolist() == ["5535", "999"]  # what the task's reward function scores
    assert sessions["tool_calls"].tolist() == [0, 0]  # the agent's own dispatch: the run saw completions alone
    assert "<tool_response>\n5535\n</tool_response>" in tool_tokenizer.decode(sessions["responses"][0])


def test_an_agent_plays_on_a_rollout_worker_while_the_policy_trains(ray_cluster, demo_files, tmp_path):
    agent = (
        "async def solve(row, client):\n"
        "    await client.chat.completions.create(model='policy', messages=row['prompt'], max_tokens=8)\n"
        "    await client.chat.completions.create(model='policy', messages=[dict(role='user', content='again')])\n"
    )
    flags = agent_run(demo_files, tmp_path, agent)
    flags += ["--num-workers", "1", "--rollout-workers", "1", "--max-staleness", "1", "--total-steps", "2"]
    result = run_script("grpo_hybrid.py", *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _, rows = metrics_of(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for step in rows:  # played by the engine apart ("newer_turns": its weights' versions), at most an update old
        assert step["env/ended_answered"] == 1 and step["agent/segments_per_session"] == 2 and "env/newer_turns" in step
        assert step["rollout/staleness_max"] <= 1
