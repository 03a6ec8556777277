"""Tools: typed Python functions that the model calls by name, in the format of its chat template.

A tool is a function with a type hint on every argument and a Google-style docstring:

    def multiply(a: int, b: int) -> int:
        \"\"\"Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        \"\"\"
        return a * b

`--tools multiply my_tools.py:lookup,search` names them (a built-in by its name, or functions of a file); an
environment whose public methods are tools (common/envs.py) brings its own. Their JSON schemas come from transformers'
`get_json_schema` and reach the model through its chat template (`apply_chat_template(messages, tools=schemas)`).
The model's calls are read by the tokenizer's `parse_response` with its `response_template`, or, for a tokenizer that
has none, with TOOL_CALL_FRAMING: Qwen's and Hermes' `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A model
whose template knows no tools (plain ChatML) renders that framing with `--chat-template chatml_tools`.

Token in, token out: the model's tokens stay the engine's; only a call's result is encoded, as the template renders a
`tool` message after the assistant's call (ToolResultFraming).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Callable

CHAT_TEMPLATES = Path(__file__).parent / "chat_templates"

# How a tokenizer without a response template of its own reads the model's calls (transformers' response template
# format, as TRL gives Qwen's templates): each <tool_call> block holds a JSON object {"name": ..., "arguments": {...}}.
TOOL_CALL_FRAMING = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


BUILTIN_TOOLS = {"multiply": multiply}


def builtin_chat_templates() -> list[str]:
    return sorted(path.stem for path in CHAT_TEMPLATES.glob("*.jinja"))


def read_chat_template(value: str) -> str:
    """The text of --chat-template `value`: a built-in's name (common/chat_templates/NAME.jinja) or a Jinja file."""
    builtin = CHAT_TEMPLATES / f"{value}.jinja"
    if "/" not in value and builtin.is_file():
        return builtin.read_text()
    if not os.path.isfile(value):
        raise ValueError(
            f"--chat-template {value}: no such file, and no built-in of that name ({', '.join(builtin_chat_templates())})"
        )
    return Path(value).read_text()


def tool_schema(function: Callable, where: str) -> dict:
    """The JSON schema of `function` as chat templates take it; `where` names the flag it came from, for the error."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as error:  # transformers' DocstringParsingException, TypeHintParsingException
        raise ValueError(
            f"{where}: the tool {function.__name__} has no schema transformers can read ({error}); give every argument "
            "a type hint and write a Google-style docstring that describes the tool and, under Args:, each argument"
        ) from None


def load_tools(specs: list[str]) -> dict[str, Callable]:
    """The tools of --tools `specs`, by name: each spec a built-in's name or `path/to/file.py:function_a,function_b`."""
    from common.isolation import load_user_file

    tools = {}
    for spec in specs:
        if spec in BUILTIN_TOOLS:
            found = {spec: BUILTIN_TOOLS[spec]}
        else:
            path, _, names = spec.rpartition(":")
            if not path or not names:
                builtins = ", ".join(BUILTIN_TOOLS)
                raise ValueError(f"--tools {spec}: name a built-in ({builtins}) or write path/to/file.py:fn_a,fn_b")
            if not os.path.isfile(path):
                raise ValueError(f"--tools {spec}: no file {path}")
            module = load_user_file(path)
            found = {name: getattr(module, name, None) for name in names.split(",")}
            for name, function in found.items():
                if not inspect.isfunction(function):
                    raise ValueError(f"--tools {spec}: {path} defines no function '{name}'")
        for name, function in found.items():
            if name in tools:
                raise ValueError(f"--tools: two tools are named '{name}'; the model calls a tool by its name")
            tool_schema(function, f"--tools {spec}")
        tools |= found
    return tools


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
    """`messages` as the chat template writes them, with `tools`' schemas; a template that fails names the flag."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except TemplateError as error:
        raise ValueError(f"the chat template cannot render a conversation with tools ({error}); {TEMPLATE_HINT}") from None


TEMPLATE_HINT = (
    "pass --chat-template chatml_tools (ChatML with Qwen's and Hermes' <tool_call> framing, for a model whose template "
    "knows no tools) or --chat-template path/to/template.jinja, one that renders `tools`, an assistant's `tool_calls` "
    "and `tool` messages"
)


def check_tool_template(tokenizer, schemas: list[dict], eos_texts: list[str]) -> None:
    """Stop unless the chat template shows the model `schemas`, renders a call and its result, and renders the
    conversation before a result alike whatever follows (what ToolResultFraming relies on)."""
    if not tokenizer.chat_template:
        raise ValueError(f"--tools: the model's tokenizer has no chat template; {TEMPLATE_HINT}")
    user = [{"role": "user", "content": "?"}]
    if render(tokenizer, user, schemas) == render(tokenizer, user):
        raise ValueError(
            f"--tools: the chat template ignores tools (the prompt renders the same with and without them); {TEMPLATE_HINT}"
        )
    call = {"name": "tool_name_sentinel", "arguments": {"argument_sentinel": "value_sentinel"}}
    conversation = user + [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "name": call["name"], "content": "result_sentinel"},
    ]
    rendered = render(tokenizer, conversation)
    lost = [s for s in ("tool_name_sentinel", "argument_sentinel", "value_sentinel", "result_sentinel") if s not in rendered]
    if lost:
        raise ValueError(f"--tools: the chat template drops a tool call or its result (lost: {lost}); {TEMPLATE_HINT}")
    ToolResultFraming(tokenizer, eos_texts).text([call], ["result"], ended_with_eos=True)


def parse_tool_calls(tokenizer, text: str, prefix: str, schemas: list[dict]) -> list[dict]:
    """The calls in the model's turn `text` (`prefix`: the conversation before it), each {"name", "arguments"}, or
    {"error": message} for one it wrote wrong; [] for a turn without a call (the model's answer). Arguments are cast to
    the schemas' types where they say so ("7" -> 7 for an integer)."""
    framing = getattr(tokenizer, "response_template", None) or TOOL_CALL_FRAMING
    try:
        message = tokenizer.parse_response(text, framing, prefix=prefix, tools=schemas)
    except Exception:  # a call that is not JSON, or not closed: the parser's errors have no common type
        return [{"error": "error: the tool call could not be parsed; write it as the system message shows"}]
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else None
        arguments = function.get("arguments", {}) if isinstance(function, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not isinstance(arguments, dict):
            calls.append({"error": 'error: a tool call is an object {"name": "...", "arguments": {...}}'})
        else:
            calls.append({"name": function["name"], "arguments": arguments})
    return calls


# What each JSON schema type admits of the values json.loads makes.
JSON_TYPES = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def argument_problem(schema: dict, arguments: dict) -> str | None:
    """What is wrong with `arguments` for the tool of `schema`, as the model reads it; None when they fit."""
    function = schema["function"]
    parameters = function.get("parameters", {})
    properties, required = parameters.get("properties", {}), parameters.get("required", [])
    expected = ", ".join(properties) or "none"
    for key in arguments:
        if key not in properties:
            return f"{function['name']} takes no argument '{key}' (its arguments: {expected})"
    for key in required:
        if key not in arguments:
            return f"{function['name']} needs the argument '{key}' (its arguments: {expected})"
    for key, value in arguments.items():
        types = properties[key].get("type")
        types = [types] if isinstance(types, str) else types or []
        if types and not any(JSON_TYPES.get(kind, lambda v: True)(value) for kind in types):
            return f"{function['name']}'s argument '{key}' must be {' or '.join(types)}, not {value!r}"
    return None


class EnvironmentLost(Exception):
    """Raised by a tool when what its environment stands on is gone (a server that died): the episode ends with score
    0, where another exception of a tool answers the model with it."""


def call_tool(function: Callable, schema: dict, arguments: dict) -> tuple[str, bool]:
    """The result the model reads of calling `function` with `arguments`, and whether it is an error message: a wrong
    argument gets one; a result that is not a string becomes one with str(), as TRL does. What the tool raises, it
    raises: the environment's act (common/envs.py) answers the model with it."""
    problem = argument_problem(schema, arguments)
    if problem:
        return f"error: {problem}", True
    result = function(**arguments)
    return (result if isinstance(result, str) else str(result)), False


class ToolResultFraming:
    """The tokens that append tool results to an episode after the model's turn that called the tools, as the chat
    template renders them: the conversation is rendered up to the assistant's call, then with the `tool` messages and
    the next assistant message's start; what the second adds is encoded. Both are cut at the call's end of turn (the
    last of `eos_texts` in the first), which the model's turn holds if it ended with an EOS; what precedes the cut must
    render alike in both (a template that changes earlier turns when a result follows is refused)."""

    def __init__(self, tokenizer, eos_texts: list[str]):
        self.tokenizer, self.eos_texts = tokenizer, [t for t in eos_texts if t]

    def text(self, calls: list[dict], results: list[str], ended_with_eos: bool) -> str:
        names = [call.get("name", "tool") for call in calls]
        tool_calls = [{"type": "function", "function": {"name": name, "arguments": {}}} for name in names]
        conversation = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": tool_calls}]
        before = render(self.tokenizer, conversation, add_generation_prompt=False)
        results = [{"role": "tool", "name": name, "content": result} for name, result in zip(names, results)]
        after = render(self.tokenizer, conversation + results)
        ends = [(before.rfind(eos), eos) for eos in self.eos_texts if eos in before]
        cut, eos = max(ends) if ends else (len(before), "")
        if not after.startswith(before[:cut]):
            raise ValueError(
                "the chat template renders the assistant's tool call differently once a tool message follows it, so "
                f"the model's tokens would not be the conversation's; {TEMPLATE_HINT}"
            )
        return after[cut + len(eos) if ended_with_eos else cut :]

    def __call__(self, calls: list[dict], results: list[str], ended_with_eos: bool) -> list[int]:
        text = self.text(calls, results, ended_with_eos)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
