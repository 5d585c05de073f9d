#!/usr/bin/env python3
"""Independent reference for nflash's chat formats (runtime/text/chat_template.h): renders the chat templates the
model families nflash runs publish in their tokenizer_config.json, with jinja2 set up as transformers sets it up
(apply_chat_template: trim_blocks, lstrip_blocks, the loopcontrols extension, raise_exception), for a few
conversations, and prints JSON: {"cases": [{"format", "template", "bos", "eos", "messages", "rendered" | "error"}]}.
tests/unit/chat_template_test.cc detects each template's format with nflash and compares nflash's text with
"rendered" (less a leading BOS, which nflash's tokenizer adds).

The templates are as published on the Hugging Face Hub for the model named beside each (tokenizer_config.json,
"chat_template"), reduced to the parts these conversations reach where a template also handles tools. Qwen3's
reasoning templates are rendered with no enable_thinking, true and false, and with two more conversations each.
Usage: python3 tests/reference/chat_templates.py   (needs python3-jinja2)
"""
import json
import sys

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATES = [
    # OpenHermes-2.5-Mistral-7B and other ChatML models.
    ("chatml", "<s>", "<|im_end|>",
     "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
     "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    # Qwen2-7B-Instruct: ChatML, with a default system message when the conversation has none.
    ("chatml", "", "<|im_end|>",
     "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
     "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
     "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
     "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    # Qwen2.5-7B-Instruct, its branch without tools: the default system message is the second system turn it writes.
    ("chatml", "", "<|im_end|>",
     "{%- if messages[0]['role'] == 'system' %}\n"
     "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
     "{%- else %}\n"
     "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
     "{%- endif %}\n"
     "{%- for message in messages %}\n"
     "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
     "(message.role == \"assistant\" and not message.tool_calls) %}\n"
     "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
     "    {%- endif %}\n"
     "{%- endfor %}\n"
     "{%- if add_generation_prompt %}\n"
     "    {{- '<|im_start|>assistant\\n' }}\n"
     "{%- endif %}\n"),
    # Meta-Llama-3.1-8B-Instruct, its branch without tools: a system turn always, with the cutoff and a fixed date.
    ("llama3", "<|begin_of_text|>", "<|eot_id|>",
     "{{- bos_token }}\n"
     "{%- if not date_string is defined %}\n"
     "    {%- set date_string = \"26 Jul 2024\" %}\n"
     "{%- endif %}\n"
     "{%- if messages[0]['role'] == 'system' %}\n"
     "    {%- set system_message = messages[0]['content']|trim %}\n"
     "    {%- set messages = messages[1:] %}\n"
     "{%- else %}\n"
     "    {%- set system_message = \"\" %}\n"
     "{%- endif %}\n"
     "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
     "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n"
     "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
     "{{- system_message }}\n"
     "{{- \"<|eot_id|>\" }}\n"
     "{%- for message in messages %}\n"
     "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
     "'<|eot_id|>' }}\n"
     "{%- endfor %}\n"
     "{%- if add_generation_prompt %}\n"
     "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
     "{%- endif %}\n"),
    # Meta-Llama-3-8B-Instruct.
    ("llama3", "<|begin_of_text|>", "<|eot_id|>",
     "{% set loop_messages = messages %}{% for message in loop_messages %}"
     "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
     " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
     "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    # Llama-2-7b-chat-hf.
    ("llama2", "<s>", "</s>",
     "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
     "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
     "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
     "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
     "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
     "{% if loop.index0 == 0 and system_message != false %}"
     "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
     "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
     "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
     "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"),
    # Mistral-7B-Instruct-v0.1 (and Mixtral-8x7B-Instruct-v0.1).
    ("mistral", "<s>", "</s>",
     "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
     "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
     "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
     "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
     "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"),
    # Phi-3-mini-4k-instruct (the revision with a system role).
    ("phi3", "<s>", "<|endoftext|>",
     "{% for message in messages %}{% if message['role'] == 'system' %}"
     "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
     "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
     "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
     "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"),
    # zephyr-7b-beta and TinyLlama-1.1B-Chat-v1.0 (written over several lines: trim_blocks matters).
    ("zephyr", "<s>", "</s>",
     "{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
     "{{ '<|user|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n"
     "{{ '<|system|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'assistant' %}\n"
     "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n"
     "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}"),
]

# Qwen3's reasoning templates, without their tool branches: the system turn, the last user query found from the end, an
# assistant message split at </think> (its thinking kept only after the last query), and the generation prompt.
QWEN3_BODY = (
    "{%- if messages[0].role == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n"
    "        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n")
REASONING_TEMPLATES = [
    # Qwen3-8B (the hybrid models: enable_thinking false opens the reply with an empty think block).
    ("chatml", "", "<|im_end|>", QWEN3_BODY +
     "{%- if add_generation_prompt %}\n"
     "    {{- '<|im_start|>assistant\\n' }}\n"
     "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
     "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
     "    {%- endif %}\n"
     "{%- endif %}"),
    # Qwen3-4B-Thinking-2507 (every reply opens in the think block).
    ("chatml", "", "<|im_end|>", QWEN3_BODY +
     "{%- if add_generation_prompt %}\n"
     "    {{- '<|im_start|>assistant\\n<think>\\n' }}\n"
     "{%- endif %}"),
]

CONVERSATIONS = [
    [{"role": "user", "content": "Tell me a story."}],
    [{"role": "system", "content": "You write short stories for children.\n"},
     {"role": "user", "content": "  Tell me a story about a dog.\n"},
     {"role": "assistant", "content": " Once upon a time, there was a dog named Max. "},
     {"role": "user", "content": "What did Max like?"}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello. How can I help?"},
     {"role": "user", "content": "Say \"yes\" in French: {{ not jinja }}"}],
    # A reasoning model's earlier reply, its thinking kept as it came (other templates write it as it is).
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "<think>\nThe user greets me.\n\n</think>\n\nHello! How can I help?"},
     {"role": "user", "content": "Tell me a story."}],
]
# Only for the reasoning templates: assistant messages after the last user message keep their thinking (the last one
# always), and a reply continued from a thinking prefix.
REASONING_CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "A story?"},
     {"role": "assistant", "content": "First <think>\n\nA dog.\n</think>Once</think>\n\nupon a time"},
     {"role": "assistant", "content": "No thinking here."}],
    [{"role": "user", "content": "A story?"},
     {"role": "assistant", "content": "\nOnce upon a time"}],
]


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def main():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    cases = []
    runs = [(t, CONVERSATIONS, {}) for t in TEMPLATES]
    for t in REASONING_TEMPLATES:
        for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
            runs.append((t, CONVERSATIONS + REASONING_CONVERSATIONS, kwargs))
    for (fmt, bos, eos, source), conversations, kwargs in runs:
        template = env.from_string(source)
        for messages in conversations:
            case = {"format": fmt, "template": source, "bos": bos, "eos": eos, "messages": messages,
                    "kwargs": kwargs}
            try:
                case["rendered"] = template.render(messages=messages, bos_token=bos, eos_token=eos,
                                                   add_generation_prompt=True, **kwargs)
            except jinja2.exceptions.TemplateError as e:
                case["error"] = str(e)
            cases.append(case)
    json.dump({"cases": cases}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
