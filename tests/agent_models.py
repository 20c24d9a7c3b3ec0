"""Models for the agents tests (tests/test_tools.py and the clients' tests).

- `make_thinking_tool_model`: the tiny random-weight model with a chat template written here that
  takes tools and thinks (a Qwen3-like shape: `<think>` tags, `<tool_call>` JSON calls, tool answers
  in `<tool_response>`), its tags special tokens of the tokenizer.

Tests whose replies must make sense use the real model (the `real_model` fixture:
tests/test_real_model_agents.py).
"""

from __future__ import annotations

from pathlib import Path

THINK_TOOL_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

# Written for these tests: system, tools, the history (calls and answers), then the reply's start. With
# enable_thinking false the reply starts after an empty think block; with open_think (a variable only
# chat_template_kwargs set) inside an open one, as DeepSeek-R1's template leaves it.
THINKING_TOOL_TEMPLATE = (
    "{%- if tools or messages[0].role == 'system' %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "{%- if tools %}\nTools:\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>{% endif %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role != 'system' %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- elif open_think is defined and open_think %}<think>\n{% endif %}"
    "{%- endif %}"
)


def make_thinking_tool_model(path: str | Path) -> Path:
    from worker.tiny_model import make_tiny_model

    return make_tiny_model(path, extra_special_tokens=THINK_TOOL_TOKENS, chat_template=THINKING_TOOL_TEMPLATE)
