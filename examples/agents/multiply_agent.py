"""The multiply-tool task (common/demo.py's `multiply_tool` data) as an agent program: its own loop and tool dispatch
with the `openai` client, trained as it is (docs/agents.md):

    python algos/grpo_hybrid.py --agent examples/agents/multiply_agent.py:solve --chat-template chatml_tools ...
"""

import json

from transformers.utils import get_json_schema

from common.tools import multiply

TOOLS = {"multiply": multiply}
SCHEMAS = [get_json_schema(function) for function in TOOLS.values()]


def solve(row, client, max_requests: int = 3):
    """Ask until the model answers without a call; the task's reward function scores that answer (None), as it scores
    the episodes of --tools; no answer within `max_requests` scores 0."""
    messages = list(row["prompt"])
    for _ in range(max_requests):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=SCHEMAS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None
        for call in message.tool_calls:
            try:
                result = str(TOOLS[call.function.name](**json.loads(call.function.arguments)))
            except Exception as error:  # the model reads its mistake, as --tools answers it
                result = f"error: {type(error).__name__}: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": result})
    return 0.0  # no answer within its requests
