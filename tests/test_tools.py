"""Tools as typed functions and environments whose methods are tools (common/tools.py, common/envs.py): schemas rendered
by a real chat template, calls parsed, results framed, failures isolated, and a script's step with --tools.

The episodes' model turns come from a scripted engine (ScriptedEngine): what a model that learned the format writes,
which no model these tests can afford writes by chance; the real engines' episodes are test_envs.py's and
test_vllm.py's, and the script's step below runs the real one with tools.
"""

import json
import shlex
from types import SimpleNamespace

import pytest

from common.data import DataError, collate, load_prompts
from common.dataproto import DataProto
from common.env_processes import EnvProcesses, EnvsInProcess
from common.envs import LiveEpisode, episode_spec, load_environments
from common.episodes import EpisodeLimits, run_episodes
from common.isolation import REPORTED_FAILURES
from common.tools import check_tool_template, parse_tool_calls, render
from helpers import metrics_of, run_script, stop_in_process

TOOLS = '''
import os
import time


def boom(x: int) -> int:
    """Raises.

    Args:
        x: Anything.
    """
    raise ValueError("a tool that breaks")


def sleepy(x: int) -> int:
    """Hangs.

    Args:
        x: Anything.
    """
    time.sleep(600)


def leave(x: int) -> int:
    """Ends its process.

    Args:
        x: Anything.
    """
    os._exit(3)


def listing(x: int) -> list:
    """Returns a list, not a string.

    Args:
        x: How many.
    """
    return list(range(x))


class Store:
    """Guess the row's number; scored by whether a guess was right."""

    def reset(self, ground_truth, **fields):
        self.number, self.right = int(ground_truth), False

    def guess(self, number: int) -> str:
        """Guess the number.

        Args:
            number: The guess.
        """
        self.right = self.right or number == self.number
        return "right" if number == self.number else "wrong"

    def get_reward(self) -> float:
        return float(self.right)


class Counter:
    """Counts its calls; no reward of its own."""

    def reset(self, **fields):
        self.count = 0

    def tick(self) -> int:
        """Count one more."""
        self.count += 1
        return self.count
'''


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "tools.py"
    path.write_text(TOOLS)
    return str(path)


class ScriptedEngine:
    """Generates what `script` says, as a worker group of one rank: for a context holding a key of it, its turns in
    order, each ended by EOS."""

    world_size = 1

    def __init__(self, tokenizer, script: dict[str, list[str]]):
        self.tokenizer, self.script = tokenizer, script

    def broadcast(self, method, *args):
        """open_turns, close_turns, engine_work: what a worker group's ranks give."""
        return [dict(seconds=0.0, prefilled_tokens=0)]

    def submit_rank(self, rank, method, play, requests, **sampling):
        """The turns of `requests` (key, context, most tokens, seed), ready at once."""
        turns = []
        for key, context, max_tokens, _ in requests:
            tokens = self.turn(context, max_tokens)
            turns.append((key, tokens, [-0.5] * len(tokens), None, len(context)))
        return SimpleNamespace(done=lambda: True, result=lambda: turns)

    def turn(self, context: list[int], max_tokens: int) -> list[int]:
        text = self.tokenizer.decode(context)
        turns = next(turns for key, turns in self.script.items() if key in text)
        turn = turns[text.count("<|im_start|>assistant") - 1]
        return self.tokenizer(turn, add_special_tokens=False)["input_ids"][: max_tokens - 1] + [self.tokenizer.eos_token_id]


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def batch_of(tokenizer, tmp_path, rows: list[dict], environments) -> DataProto:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    envs = {name: environments.schemas(name) for name in environments.names}
    return collate(load_prompts([str(path)], tokenizer, 4000, envs=envs), tokenizer.pad_token_id)


def row(question: str, truth: str = "0", **fields) -> dict:
    prompt = [{"role": "user", "content": question}]
    return {"prompt": prompt, "data_source": "tools", "reward_model": {"ground_truth": truth}, **fields}


def play(tokenizer, batch, environments, script, env_calls=None, max_turns=3, max_response_length=400):
    env_calls = env_calls or EnvsInProcess(environments)
    engine, eos = ScriptedEngine(tokenizer, script), [tokenizer.eos_token_id]
    limits = EpisodeLimits(max_turns, 4000, max_response_length)
    return run_episodes(engine, batch, env_calls, environments, tokenizer, eos, limits, {})


def test_the_schemas_reach_the_prompt_through_the_chat_template(tool_tokenizer, tools_file, tmp_path):
    environments = load_environments(episode_spec(None, ["multiply", f"{tools_file}:listing"]))
    schemas = environments.schemas("")
    assert schemas["multiply"]["function"]["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "The first factor."},
        "b": {"type": "integer", "description": "The second factor."},
    }
    batch = batch_of(tool_tokenizer, tmp_path, [row("3*4=")], environments)
    prompt = tool_tokenizer.decode(batch["prompts"][0][batch["prompt_mask"][0].bool()])
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert prompt.endswith("<|im_start|>user\n3*4=<|im_end|>\n<|im_start|>assistant\n")
    for schema in schemas.values():  # as JSON in the system message, as Qwen2.5's template writes them
        assert "\n" + json.dumps(schema) + "\n" in prompt


# A response template of a tokenizer's own, in another framing than ours: <function>...</function>.
OWN_FRAMING = {
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<function>",
            "close_pattern": r"</function>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


@pytest.mark.parametrize("own", [True, False], ids=["the tokenizer's response template", "the fallback framing"])
def test_calls_are_parsed_well_formed_or_not(tool_tokenizer, own, monkeypatch):
    tokenizer = tool_tokenizer
    monkeypatch.setattr(tokenizer, "response_template", OWN_FRAMING if own else None)
    opener, closer = ("<function>", "</function>") if own else ("<tool_call>", "</tool_call>")
    prefix = "<|im_start|>user\n3*4=<|im_end|>\n<|im_start|>assistant\n"
    schemas = list(load_environments(episode_spec(None, ["multiply"])).schemas("").values())
    framed = lambda text: text.replace("<tool_call>", opener).replace("</tool_call>", closer)  # noqa: E731
    parse = lambda text: parse_tool_calls(tokenizer, framed(text), prefix, schemas)  # noqa: E731
    two = call("multiply", a=3, b=4) + "\n" + call("divide", a=3, b=4) + "<|im_end|>"
    arguments = {"a": 3, "b": 4}
    assert parse(two) == [{"name": "multiply", "arguments": arguments}, {"name": "divide", "arguments": arguments}]
    assert parse('<tool_call>{"name": "multiply", "arguments": {"a": "3", "b": 4}}</tool_call>') == [
        {"name": "multiply", "arguments": {"a": 3, "b": 4}}  # cast to the schema's integer
    ]
    assert parse("12<|im_end|>") == []  # no call: the model's answer
    [malformed] = parse('<tool_call>{"name": "multiply", "arguments": {"a": 3</tool_call>')
    assert malformed["error"].startswith("error: the tool call could not be parsed")
    [nameless] = parse('<tool_call>{"arguments": {"a": 3}}</tool_call>')
    assert "error" in nameless
    other_framing = two if own else two.replace("tool_call>", "function>")  # no call for this tokenizer
    assert parse_tool_calls(tokenizer, other_framing, prefix, schemas) == []


def test_tool_calls_get_results_or_error_messages(tool_tokenizer, tools_file):
    environments = load_environments(episode_spec(None, ["multiply", f"{tools_file}:listing"]))
    calls = [
        {"name": "multiply", "arguments": {"a": 37, "b": 48}},
        {"name": "listing", "arguments": {"x": 3}},  # not a string: str() of it
        {"name": "divide", "arguments": {"a": 1}},
        {"name": "multiply", "arguments": {"a": 1}},
        {"name": "multiply", "arguments": {"a": 1, "b": 2, "c": 3}},
        {"name": "multiply", "arguments": {"a": 1.5, "b": 2}},
        {"error": "error: the tool call could not be parsed"},
    ]
    episode = LiveEpisode(environments, "")
    assert episode.handle(("open", {"ground_truth": "37"})) == ("ok", None)
    outcome = episode.handle(("tools", calls))
    assert outcome[0] == "ok" and outcome[1][1:] == (None, None)  # no turn reward, no tool raised
    assert outcome[1][0] == [
        ("1776", False),
        ("[0, 1, 2]", False),
        ("error: there is no tool divide; the tools: multiply, listing", True),
        ("error: multiply needs the argument 'b' (its arguments: a, b)", True),
        ("error: multiply takes no argument 'c' (its arguments: a, b)", True),
        ("error: multiply's argument 'a' must be integer, not 1.5", True),
        ("error: the tool call could not be parsed", True),
    ]


def test_the_episode_is_the_templates_rendering_of_its_calls_and_results(tool_tokenizer, tmp_path):
    tokenizer = tool_tokenizer
    environments = load_environments(episode_spec(None, ["multiply"]))
    batch = batch_of(tokenizer, tmp_path, [row("37*48="), row("2*3=")], environments)
    first = call("multiply", a=37, b=48) + "\n" + call("multiply", a=2, b=3)
    script = {"37*48=": [first, "1776"], "2*3=": ["<tool_call>{oops</tool_call>", "6"]}
    episodes = play(tokenizer, batch, environments, script)
    assert episodes["ending"].tolist() == ["answered", "answered"] and episodes["turns"].tolist() == [2, 2]
    assert episodes["tool_calls"].tolist() == [2, 1] and episodes["tool_errors"].tolist() == [0, 1]
    tool_call = lambda a, b: {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}  # noqa
    conversation = [
        {"role": "user", "content": "37*48="},
        {"role": "assistant", "content": "", "tool_calls": [tool_call(37, 48), tool_call(2, 3)]},
        {"role": "tool", "name": "multiply", "content": "1776"},
        {"role": "tool", "name": "multiply", "content": "6"},
        {"role": "assistant", "content": "1776"},
    ]
    schemas = list(environments.schemas("").values())
    rendered = render(tokenizer, conversation, schemas, add_generation_prompt=False)
    length = int(episodes["attention_mask"][0].sum() - batch["prompt_mask"][0].sum())  # the episode's tokens
    ids = batch["prompts"][0][batch["prompt_mask"][0].bool()].tolist() + episodes["responses"][0][:length].tolist()
    assert tokenizer.decode(ids) == rendered.removesuffix("\n")  # token in, token out: exactly the conversation
    own = episodes["response_mask"][0].bool()
    assert tokenizer.decode(episodes["responses"][0][own]) == first + "<|im_end|>" + "1776<|im_end|>"
    # the malformed call is answered with the error message, as a tool message
    answer = tokenizer.decode(episodes["responses"][1][~episodes["response_mask"][1].bool()]).replace("<pad>", "")
    error = "error: the tool call could not be parsed; write it as the system message shows"
    assert answer == f"\n<|im_start|>user\n<tool_response>\n{error}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_a_tool_that_raises_answers_with_the_error_and_one_that_hangs_or_exits_ends_its_episode(
    tool_tokenizer, tools_file, tmp_path, capsys
):
    tokenizer = tool_tokenizer
    names = ["boom", "sleepy", "leave", "listing"]
    environments = load_environments(episode_spec(None, [f"{tools_file}:{','.join(names)}"]))
    batch = batch_of(tokenizer, tmp_path, [row(f"{name}?") for name in names], environments)
    script = {f"{name}?": [call(name, x=2), "done"] for name in names}
    REPORTED_FAILURES.clear()
    env_calls = EnvProcesses(environments.spec, 4, timeout=2)  # an episode a process: a death takes no other
    try:
        episodes = play(tokenizer, batch, environments, script, env_calls)
    finally:
        env_calls.close()
    assert episodes["ending"].tolist() == ["answered", "timeout", "error", "answered"]
    assert episodes["episode_score"].tolist() == [None, 0.0, 0.0, None]
    assert episodes["tool_errors"].tolist() == [1, 0, 0, 0]  # as TRL: the model reads what the tool raised
    answer = tokenizer.decode(episodes["responses"][0][~episodes["response_mask"][0].bool()])
    assert "error: ValueError: a tool that breaks" in answer
    err = capsys.readouterr().err
    assert "a tool raised ValueError" in err and "the environment failed (ProcessDied)" in err


def test_environments_with_tool_methods_and_a_reward_picked_per_row(tool_tokenizer, tools_file, tmp_path):
    tokenizer = tool_tokenizer
    environments = load_environments(episode_spec(f"{tools_file}:Store,{tools_file}:Counter", ["multiply"]))
    assert environments.names == ["Store", "Counter"]
    assert list(environments.schemas("Store")) == ["multiply", "guess"]  # the tools of --tools, then the methods
    assert environments.schemas("Store")["guess"]["function"]["parameters"]["properties"] == {
        "number": {"type": "integer", "description": "The guess."}
    }
    rows = [row("store 7", "7", env="Store"), row("store 5", "5", env="Store"), row("count", env="Counter"), row("again")]
    batch = batch_of(tokenizer, tmp_path, rows, environments)
    assert batch["env"].tolist() == ["Store", "Store", "Counter", "Store"]  # a row without `env` plays the first
    assert '"guess"' in batch["prompt_text"][0] and '"tick"' not in batch["prompt_text"][0]
    assert '"tick"' in batch["prompt_text"][2] and '"guess"' not in batch["prompt_text"][2]
    script = {
        "store 7": [call("guess", number=7), "got it"],
        "store 5": [call("guess", number=4), call("tick"), "no"],
        "count": [call("tick"), call("tick"), "2"],
        "again": ["0"],
    }
    episodes = play(tokenizer, batch, environments, script)
    assert episodes["episode_score"].tolist() == [1.0, 0.0, None, 0.0]  # Store's get_reward; Counter has none
    assert episodes["ending"].tolist() == ["answered", "answered", "answered", "answered"]
    assert episodes["tool_calls"].tolist() == [1, 2, 2, 0]
    assert episodes["tool_errors"].tolist() == [0, 1, 0, 0]  # tick is not Store's
    assert "<tool_response>\n2\n</tool_response>" in tokenizer.decode(episodes["responses"][2])  # its state kept
    with pytest.raises(DataError, match=r"field 'env' \(or 'environment'\) names 'Shop', not one of --env's environments"):
        batch_of(tokenizer, tmp_path, [row("?", env="Shop")], environments)


def test_a_template_that_ignores_tools_stops_the_run(tool_tokenizer, tmp_path):
    from transformers import PreTrainedTokenizerFast

    schemas = list(load_environments(episode_spec(None, ["multiply"])).schemas("").values())
    plain = PreTrainedTokenizerFast(tokenizer_object=tool_tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    with pytest.raises(ValueError, match="has no chat template; pass --chat-template chatml_tools"):
        check_tool_template(plain, schemas, ["<|im_end|>"])
    plain.chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    with pytest.raises(ValueError, match="ignores tools .* pass --chat-template chatml_tools"):
        check_tool_template(plain, schemas, ["<|im_end|>"])
    # like Qwen3's: the last assistant turn alone shows its thinking, so a tool message after it changes it
    plain.chat_template = tool_tokenizer.chat_template.replace(
        "{{- '<|im_start|>assistant' }}", "{{- '<|im_start|>assistant' + ('\\n<think></think>' if loop.last else '') }}"
    )
    with pytest.raises(ValueError, match="renders the assistant's tool call differently once a tool message follows"):
        check_tool_template(plain, schemas, ["<|im_end|>"])
    check_tool_template(tool_tokenizer, schemas, ["<|im_end|>"])


# Tools in a few characters, for the tiny model's 128 positions; its turn ends with its own EOS.
COMPACT_TEMPLATE = (
    "{%- if tools %}T:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
    "{%- for m in messages %}{% if m.role == 'assistant' %}A:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<eos>"
    "{% elif m.role == 'tool' %}R:{{ m.content }}{% else %}U:{{ m.content }}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}A:{% endif %}"
)


def test_grpo_steps_with_a_tool_in_isolated_processes(demo_files, tmp_path):
    import pyarrow.parquet as pq

    (tmp_path / "compact.jinja").write_text(COMPACT_TEMPLATE)
    model, train, val = demo_files
    pq.write_table(pq.read_table(val).slice(0, 8), tmp_path / "val.parquet")  # validation: 8 prompts suffice
    flags = ["--model-path", model, "--train-files", train, "--val-files", str(tmp_path / "val.parquet")]
    flags += ["--max-prompt-length", "24"]
    flags += ["--max-response-length", "24", "--tools", "multiply", "--chat-template", str(tmp_path / "compact.jinja")]
    flags += ["--in-process", "--reward-workers", "1", "--total-steps", "1", "--train-batch-size", "4", "--n", "2"]
    flags += ["--mini-batch-size", "4", "--no-val-before-train", "--val-batch-size", "8"]
    result = run_script("grpo_hybrid.py", *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _, [step] = metrics_of(tmp_path)
    assert step["env/turns_mean"] >= 1 and step["env/ended_error"] == step["env/ended_timeout"] == 0
    assert "env/tool_calls" in step and "env/tool_errors" in step


def test_tools_without_a_template_for_them_stop_before_any_worker(demo_files, tmp_path, monkeypatch):
    model, train, _ = demo_files
    flags = ["--model-path", model, "--train-files", train, "--tools", "multiply"]
    stop = stop_in_process("grpo_hybrid.py", *flags, cwd=tmp_path, monkeypatch=monkeypatch)
    assert "--tools: the model's tokenizer has no chat template; pass --chat-template chatml_tools" in stop
    assert "PolicyWorker" not in stop
    stop = stop_in_process("grpo_hybrid.py", *flags, "--chat-template", "chatml_tool", cwd=tmp_path, monkeypatch=monkeypatch)
    assert "--chat-template chatml_tool: no such file, and no built-in of that name (chatml_tools)" in stop
    (tmp_path / "echo.py").write_text("class Echo:\n    def step(self, text):\n        return None\n")
    flags += ["--env", f"{tmp_path}/echo.py:Echo"]
    stop = stop_in_process("grpo_hybrid.py", *flags, cwd=tmp_path, monkeypatch=monkeypatch)
    assert "a step(text) environment reads the model's turns itself" in stop


def test_the_spec_travels_as_flags(tools_file):
    spec = episode_spec(f"{tools_file}:Store", ["multiply", f"{tools_file}:listing"])
    assert shlex.split(spec) == ["--env", f"{tools_file}:Store", "--tools", "multiply", f"{tools_file}:listing"]
    assert list(load_environments(spec).schemas("Store")) == ["multiply", "listing", "guess"]
