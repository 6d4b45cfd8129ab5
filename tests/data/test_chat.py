"""Chat records under chat templates: formats, the trained-token mask (hand-written expectations under five template
families and the byte default), templates that rewrite history, generation markers, and every refusal.

Each template family gets an offline byte-level BPE with that family's special tokens, trained in memory on a few
sentences; the templates are Jinja strings modelled on the real ones (ChatML/Qwen2.5, Llama-3, Gemma, Mistral, and
Qwen3's history rewriting).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cadence.data.chat import ChatExample, tokenize_conversation
from cadence.data.chat_template import ChatTemplate
from cadence.data.conversation import (
    ROLES,
    ChatDataError,
    ChatTemplateError,
    Conversation,
    detect_chat_format,
    parse_conversation,
)
from cadence.data.hf import ByteTokenizer, HFTokenizer

pytest.importorskip("jinja2")
pytest.importorskip("transformers")

# ------------------------------------------------------------------------------------------------ templates
QWEN25 = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" \
and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3 = """\
{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions. Respond with a JSON function call.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + \
'<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {{- message.content }}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

GEMMA = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim -}}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

MISTRAL = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with an optional system message first') }}
    {%- endif %}
{%- endfor %}
"""

# Qwen3: the reasoning of assistant turns before the last user message is dropped, and the last turn always gets a
# <think> block: the rendering of a conversation's first turns is not where its whole rendering starts.
QWEN3 = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') \
and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]\
.lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + \
'\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# ChatML with {% generation %} markers, as TRL documents them: around each assistant reply and its end of turn.
_CHATML_HEAD = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.role == 'assistant' %}"
_CHATML_TAIL = ("{% else %}{{ m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
GENERATION_AGREES = (_CHATML_HEAD + "{% generation %}{{ m.content + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
                     + _CHATML_TAIL)
GENERATION_WITH_NEWLINE = (_CHATML_HEAD + "{% generation %}{{ m.content + '<|im_end|>\\n' }}{% endgeneration %}"
                           + _CHATML_TAIL)
GENERATION_WITHOUT_END = (_CHATML_HEAD + "{% generation %}{{ m.content }}{% endgeneration %}{{ '<|im_end|>\\n' }}"
                          + _CHATML_TAIL)
GENERATION_ON_USER = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% generation %}"
                      "{{ m.content + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% endfor %}"
                      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
NO_TURN_END = ("{% for m in messages %}{{ m.role + ': ' + m.content + '\\n\\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
NO_GENERATION_PROMPT = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}" \
                       "{% endfor %}"
TWO_BOS = "{{ bos_token }}" + GEMMA

# ------------------------------------------------------------------------------------------------ tokenizers
CORPUS = [
    "You are terse. What is 2+2? It is 4. And 3+3? It is 6.", "Weather in Paris? It is 21 degrees.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}', "system user assistant model tool",
    "Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024", "[INST] [/INST] 2 and 2 make 4.",
]


@dataclass(frozen=True)
class Family:
    template: str
    special: tuple[str, ...]  # special tokens (the trainer adds them first, in this order)
    bos: str | None
    eos: str
    adds_bos: bool = False  # the tokenizer puts BOS in front by itself (Llama, Gemma, Mistral)
    added: tuple[str, ...] = ()  # added tokens that are not special (Qwen's <tool_call>, <think>)


FAMILIES = {
    "qwen2.5": Family(QWEN25, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>",
                      added=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")),
    "qwen3": Family(QWEN3, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>",
                    added=("<think>", "</think>", "<tool_call>", "</tool_call>")),
    "llama3": Family(LLAMA3, ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                     "<|begin_of_text|>", "<|eot_id|>", adds_bos=True),
    "gemma": Family(GEMMA, ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<eos>",
                    adds_bos=True),
    "mistral": Family(MISTRAL, ("<unk>", "<s>", "</s>"), "<s>", "</s>", adds_bos=True),
}


@functools.cache
def hf_tokenizer(family: str) -> Any:
    """The family's tokenizer, its chat template set, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(spec.special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 4, trainer)
    if spec.adds_bos:
        assert spec.bos is not None
        backend.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", special_tokens=[(spec.bos, backend.token_to_id(spec.bos))])
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=spec.bos, eos_token=spec.eos,
                                 clean_up_tokenization_spaces=False)
    hf.add_tokens(list(spec.added))
    hf.chat_template = spec.template
    return hf


@functools.cache
def tokenizer(family: str) -> HFTokenizer | ByteTokenizer:
    return ByteTokenizer() if family == "bytes" else HFTokenizer(hf_tokenizer(family))


def template(family: str) -> ChatTemplate:
    if family == "bytes":
        return ChatTemplate.chatml()
    found = ChatTemplate.from_tokenizer(hf_tokenizer(family))
    assert found is not None
    return found


def decode(family: str, ids: tuple[int, ...]) -> str:
    if family == "bytes":
        return bytes(ids).decode()
    return hf_tokenizer(family).decode(list(ids), skip_special_tokens=False)


def trained_texts(family: str, example: ChatExample) -> list[str]:
    return [decode(family, example.ids[start:end]) for start, end in example.trained]


def run(family: str, record: dict[str, Any], train_on: str = "assistant",
        chat_template: ChatTemplate | None = None) -> list[ChatExample]:
    return tokenize_conversation(parse_conversation(record), chat_template or template(family), tokenizer(family),
                                 train_on=train_on)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ records
def msg(role: str, content: Any, **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **extra}


BASIC = [msg("system", "You are terse."), msg("user", "What is 2+2?"), msg("assistant", "It is 4."),
         msg("user", "And 3+3?"), msg("assistant", "It is 6.")]
SHAREGPT = {"conversations": [{"from": "system", "value": "You are terse."}, {"from": "human", "value": "What is 2+2?"},
                              {"from": "gpt", "value": "It is 4."}, {"from": "human", "value": "And 3+3?"},
                              {"from": "gpt", "value": "It is 6."}]}
CONVERSATIONAL = {"prompt": BASIC[:4], "completion": BASIC[4:]}
FLAGGED = [*BASIC[:2], {**BASIC[2], "train": False}, {**BASIC[3], "train": True}, BASIC[4]]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
WEATHER_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_RECORD = {"tools": TOOLS, "messages": [
    msg("user", "Weather in Paris?"), {"role": "assistant", "tool_calls": [WEATHER_CALL], "content": None},
    msg("tool", '{"temp": 21}'), msg("assistant", "It is 21 degrees.")]}

CHATML_ALL = ("system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
              "It is 4.<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\nIt is 6.<|im_end|>\n")
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'

# (family, record, train_on, the trained text of each span, hand-written)
CASES: list[tuple[str, dict[str, Any], str, list[str]]] = [
    # messages, each train_on, each family: the reply and its end of turn, never the header or the newline after
    ("qwen2.5", {"messages": BASIC}, "assistant", ["It is 4.<|im_end|>", "It is 6.<|im_end|>"]),
    ("qwen2.5", {"messages": BASIC}, "last", ["It is 6.<|im_end|>"]),
    ("qwen2.5", {"messages": BASIC}, "all", [CHATML_ALL]),  # every token after the first (<|im_start|>)
    ("llama3", {"messages": BASIC}, "assistant", ["It is 4.<|eot_id|>", "It is 6.<|eot_id|>"]),
    ("llama3", {"messages": BASIC}, "last", ["It is 6.<|eot_id|>"]),
    ("gemma", {"messages": BASIC}, "assistant", ["It is 4.<end_of_turn>", "It is 6.<end_of_turn>"]),
    ("gemma", {"messages": BASIC}, "last", ["It is 6.<end_of_turn>"]),
    # no generation prompt: the reply starts right after [/INST], with the space the template writes before it
    ("mistral", {"messages": BASIC}, "assistant", [" It is 4.</s>", " It is 6.</s>"]),
    ("mistral", {"messages": BASIC}, "last", [" It is 6.</s>"]),
    ("bytes", {"messages": BASIC}, "assistant", ["It is 4.<|im_end|>", "It is 6.<|im_end|>"]),
    ("bytes", {"messages": BASIC}, "all", ["|im_start|>" + CHATML_ALL]),  # bytes: only the first byte "<" is not
    # the other formats give the same conversation
    ("qwen2.5", SHAREGPT, "assistant", ["It is 4.<|im_end|>", "It is 6.<|im_end|>"]),
    ("llama3", SHAREGPT, "assistant", ["It is 4.<|eot_id|>", "It is 6.<|eot_id|>"]),
    ("qwen2.5", CONVERSATIONAL, "assistant", ["It is 6.<|im_end|>"]),  # the prompt's assistant turn is not trained
    ("gemma", CONVERSATIONAL, "assistant", ["It is 6.<end_of_turn>"]),
    ("qwen2.5", CONVERSATIONAL, "all", [CHATML_ALL]),
    ("qwen2.5", {"prompt": [*BASIC[:2], {**BASIC[2], "train": True}, BASIC[3]], "completion": BASIC[4:]}, "assistant",
     ["It is 4.<|im_end|>", "It is 6.<|im_end|>"]),
    # per-message flags: a user message trains its content and end of turn
    ("qwen2.5", {"messages": FLAGGED}, "assistant", ["And 3+3?<|im_end|>", "It is 6.<|im_end|>"]),
    ("llama3", {"messages": FLAGGED}, "last", ["And 3+3?<|eot_id|>", "It is 6.<|eot_id|>"]),
    # Gemma folds the system prompt into the first user turn: only the user's own text is that message's
    ("gemma", {"messages": [*BASIC[:1], {**BASIC[1], "train": True}, *BASIC[2:]]}, "last",
     ["What is 2+2?<end_of_turn>", "It is 6.<end_of_turn>"]),
    ("gemma", {"messages": [msg("system", "Say 'What is 2+2?' back."), {**BASIC[1], "train": True}, BASIC[2]]}, "last",
     ["What is 2+2?<end_of_turn>", "It is 4.<end_of_turn>"]),  # the user's text, not its copy in the system prompt
    ("llama3", {"messages": [{**BASIC[0], "train": False}, *BASIC[1:]]}, "all", [
        "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024"
        "\n\n", "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|><|start_header_id|>assistant"
        "<|end_header_id|>\n\nIt is 4.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnd 3+3?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nIt is 6.<|eot_id|>"]),
    ("qwen2.5", {"messages": FLAGGED}, "all", [
        "system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\nIt is 6.<|im_end|>\n"]),
    # tools and tool calls: the call is what the model writes, the tool's answer is not trained
    ("qwen2.5", TOOL_RECORD, "assistant", [QWEN_CALL, "It is 21 degrees.<|im_end|>"]),
    ("llama3", TOOL_RECORD, "assistant",
     ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "It is 21 degrees.<|eot_id|>"]),
    ("bytes", TOOL_RECORD, "assistant", [QWEN_CALL, "It is 21 degrees.<|im_end|>"]),
    ("bytes", {"tools": TOOLS, "messages": [TOOL_RECORD["messages"][0], {"role": "assistant", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]}, "assistant", [QWEN_CALL]),
    ("bytes", {"messages": [msg("user", "Ça coûte combien ?"), msg("assistant", "Trois € — ½ prix.")]}, "assistant",
     ["Trois € — ½ prix.<|im_end|>"]),
    # nothing trained: no example
    ("qwen2.5", {"messages": [*BASIC[:4], {**BASIC[4], "train": False}]}, "last", []),
]


@pytest.mark.parametrize(("family", "record", "train_on", "expected"), CASES,
                         ids=[f"{c[0]}-{next(iter(c[1]))}-{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_trained_tokens_are_each_turn_and_its_end(family: str, record: dict[str, Any], train_on: str,
                                                  expected: list[str]) -> None:
    examples = run(family, record, train_on)
    assert len(examples) == (1 if expected else 0)
    if not expected:
        return
    example = examples[0]
    assert trained_texts(family, example) == expected
    assert decode(family, example.ids) == example.text  # the ids are the rendering, nothing added
    assert example.trained_tokens == sum(end - start for start, end in example.trained) > 0
    assert all(0 < start < end <= len(example.ids) for start, end in example.trained)


def test_history_rewriting_template_gives_one_example_per_trained_turn() -> None:
    record = {"messages": [msg("user", "What is 2+2?"), msg("assistant", "It is 4.", reasoning_content="2 and 2 make 4."),
                           msg("user", "And 3+3?"), msg("assistant", "It is 6.", reasoning_content="3 and 3 make 6.")]}
    whole = template("qwen3").render(parse_conversation(record).messages)
    assert "2 and 2 make 4." not in whole  # Qwen3 drops an earlier turn's reasoning: a prefix is rendered otherwise
    first, second = run("qwen3", record)
    assert trained_texts("qwen3", first) == ["<think>\n2 and 2 make 4.\n</think>\n\nIt is 4.<|im_end|>"]
    assert first.text.endswith("It is 4.<|im_end|>\n") and "3+3" not in first.text  # as the model saw it then
    assert trained_texts("qwen3", second) == ["<think>\n3 and 3 make 6.\n</think>\n\nIt is 6.<|im_end|>"]
    assert second.text == whole
    only_last = run("qwen3", record, "last")
    assert len(only_last) == 1 and only_last[0] == second
    # ChatML (no rewriting) keeps every turn's reasoning in one example
    (chatml,) = run("bytes", record)
    assert trained_texts("bytes", chatml) == ["<think>\n2 and 2 make 4.\n</think>\n\nIt is 4.<|im_end|>",
                                              "<think>\n3 and 3 make 6.\n</think>\n\nIt is 6.<|im_end|>"]


@pytest.mark.parametrize("family", ["qwen2.5", "llama3", "gemma", "mistral", "qwen3"])
def test_rendering_and_ids_match_transformers_apply_chat_template(family: str) -> None:
    hf = hf_tokenizer(family)
    record = TOOL_RECORD if family in ("qwen2.5", "llama3") else {"messages": BASIC}
    conversation = parse_conversation(record)
    messages = [dict(m) for m in conversation.messages]
    tools = [dict(t) for t in conversation.tools] if conversation.tools else None
    for prompt in (False, True):
        ours = template(family).render(conversation.messages, tools=conversation.tools, add_generation_prompt=prompt)
        assert ours == hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=prompt)
    example = run(family, record, "all")[-1]
    theirs = hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"]
    assert list(example.ids) == list(theirs)


def test_a_declared_end_of_turn_and_a_token_across_a_turns_start() -> None:
    # Mistral's user turn ends with [/INST], plain text to this tokenizer: declared, it can end a trained user turn.
    # Its first word's token " And" starts at the space before the content and is trained with it.
    declared = ChatTemplate(source=MISTRAL, name="mistral", bos_token="<s>", eos_token="</s>", end_of_turn="[/INST]")
    (example,) = run("mistral", {"messages": FLAGGED}, chat_template=declared)
    tokens = hf_tokenizer("mistral").convert_ids_to_tokens(list(example.ids))
    assert "ĠAnd" in tokens  # the case this test is about: a token that starts before the content it holds
    assert trained_texts("mistral", example) == [" And 3+3? [/INST] It is 6.</s>"]
    with pytest.raises(ChatTemplateError, match="cannot find where message 3 \\(user\\) ends"):
        run("mistral", {"messages": FLAGGED})  # without the declaration there is no end to that turn


def test_one_bos_when_the_tokenizer_would_add_another() -> None:
    hf = hf_tokenizer("llama3")
    bos = hf.convert_tokens_to_ids("<|begin_of_text|>")
    assert tokenizer("llama3").bos_id == bos  # this tokenizer adds a BOS to every text by itself
    (example,) = run("llama3", {"messages": BASIC})
    assert hf(example.text)["input_ids"][:2] == [bos, bos]  # the trap: the rendering already starts with BOS
    assert example.ids[0] == bos and example.ids.count(bos) == 1


def test_a_bos_written_twice_is_kept_once() -> None:
    doubled = ChatTemplate(source=TWO_BOS, name="two-bos", bos_token="<bos>", eos_token="<eos>")
    assert doubled.render(parse_conversation({"messages": BASIC}).messages).startswith("<bos><bos><start_of_turn>")
    (example,) = run("gemma", {"messages": BASIC}, chat_template=doubled)
    bos = hf_tokenizer("gemma").convert_tokens_to_ids("<bos>")
    assert example.ids[0] == bos and example.ids[1] != bos
    assert trained_texts("gemma", example) == ["It is 4.<end_of_turn>", "It is 6.<end_of_turn>"]


# ------------------------------------------------------------------------------------------------ generation markers
@pytest.mark.parametrize("source", [GENERATION_AGREES, GENERATION_WITH_NEWLINE])
def test_generation_markers_that_agree_are_accepted_and_match_transformers(source: str) -> None:
    marked = ChatTemplate(source=source, name="marked", eos_token="<|im_end|>")
    (example,) = run("qwen2.5", {"messages": BASIC}, chat_template=marked)
    assert trained_texts("qwen2.5", example) == ["It is 4.<|im_end|>", "It is 6.<|im_end|>"]
    text, blocks = marked.render_traced(parse_conversation({"messages": BASIC}).messages)
    assert [text[a:b].rstrip("\n") for a, b in blocks] == ["It is 4.<|im_end|>", "It is 6.<|im_end|>"]
    if source is GENERATION_AGREES:  # transformers' own mask from the markers: the same tokens
        theirs = hf_tokenizer("qwen2.5").apply_chat_template(
            [dict(m) for m in BASIC], chat_template=source, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True)["assistant_masks"]
        ours = [any(a <= p < b for a, b in example.trained) for p in range(len(example.ids))]
        assert ours == [bool(flag) for flag in theirs]


@pytest.mark.parametrize(("source", "reason"), [
    (GENERATION_WITHOUT_END, "'<|im_end|>' is in cadence's turn only"),
    (GENERATION_ON_USER, "is in the template's blocks only"),
])
def test_generation_markers_that_disagree_are_refused(source: str, reason: str) -> None:
    marked = ChatTemplate(source=source, name="marked.jinja", eos_token="<|im_end|>")
    with pytest.raises(ChatTemplateError, match="marked.jinja: its {% generation %} blocks disagree") as caught:
        run("qwen2.5", {"messages": BASIC}, chat_template=marked)
    assert reason in str(caught.value)


# ------------------------------------------------------------------------------------------------ refused templates
@pytest.mark.parametrize(("family", "source", "record", "reason"), [
    ("qwen2.5", NO_TURN_END, {"messages": BASIC},
     "cannot find where message 2 (assistant) ends: after its content the template writes nothing"),
    ("bytes", NO_TURN_END, {"messages": BASIC}, "cannot find where message 2 (assistant) ends"),
    ("qwen2.5", NO_GENERATION_PROMPT, {"messages": BASIC}, "cannot tell its header from the reply"),
    ("gemma", GEMMA, {"messages": [msg("user", "a"), msg("user", "b"), msg("assistant", "c")]},
     "refused the conversation: Conversation roles must alternate user/assistant"),
    ("llama3", LLAMA3, {"messages": [msg("user", "a"), {"role": "assistant", "tool_calls": [WEATHER_CALL] * 2}]},
     "refused the conversation: This model only supports single tool-calls at once!"),
    ("mistral", MISTRAL, {"messages": [msg("user", "a"), msg("tool", "b"), msg("user", "c"), msg("assistant", "d")]},
     "refused the conversation: Only user and assistant roles are supported"),
    ("qwen2.5", "{{ ''.__class__.__mro__ }}", {"messages": BASIC}, "tried to reach Python internals"),
    ("qwen2.5", "{{ ''.__class__.__mro__[1].__subclasses__() }}", {"messages": BASIC}, "from its sandbox"),
    ("qwen2.5", "{{ cycler.__init__.__globals__ }}", {"messages": BASIC}, "tried to reach Python internals"),
    ("qwen2.5", "{{ messages.__class__ }}", {"messages": BASIC}, "tried to reach Python internals"),  # not a quiet ''
    ("qwen2.5", "{% set _ = messages.append(messages[0]) %}x", {"messages": BASIC}, "tried to reach Python internals"),
    ("qwen2.5", "{% for m in messages %}{{ m.content + 1 }}{% endfor %}", {"messages": BASIC}, "failed: TypeError"),
    ("qwen2.5", "{% for m in messages %}{{ m.content }", {"messages": BASIC}, "does not compile"),
])
def test_templates_that_cannot_be_used_are_refused_in_one_line(family: str, source: str, record: dict[str, Any],
                                                               reason: str) -> None:
    bad = ChatTemplate(source=source, name="bad.jinja", eos_token="" if family == "bytes" else FAMILIES[family].eos,
                       bos_token="" if family == "bytes" else FAMILIES[family].bos or "")
    with pytest.raises(ChatTemplateError) as caught:
        run(family, record, chat_template=bad)
    message = str(caught.value)
    assert "bad.jinja" in message and reason in message and "\n" not in message


def test_leaving_a_turn_out_of_train_on_all_needs_a_template_that_keeps_history() -> None:
    record = {"messages": [msg("user", "a"), msg("assistant", "b", reasoning_content="r"), msg("user", "c"),
                           msg("assistant", "d")]}
    (every,) = run("qwen3", record, "all")  # nothing left out: the whole rendering, whatever it rewrites
    assert every.trained == ((1, len(every.ids)),)
    record["messages"][1]["train"] = False
    with pytest.raises(ChatTemplateError, match="rewrites earlier turns .* cannot be left out of --train-on all"):
        run("qwen3", record, "all")


def test_template_sources(tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(GEMMA, encoding="utf-8")
    loaded = ChatTemplate.from_file(path, bos_token="<bos>", eos_token="<eos>")
    assert loaded.source == GEMMA and loaded.name == str(path) and loaded == ChatTemplate(
        source=GEMMA, name=str(path), bos_token="<bos>", eos_token="<eos>")
    with pytest.raises(ChatTemplateError, match="cannot read the chat template"):
        ChatTemplate.from_file(tmp_path / "missing.jinja")
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(tokenizer_object=hf_tokenizer("qwen2.5").backend_tokenizer)
    assert ChatTemplate.from_tokenizer(bare) is None
    found = ChatTemplate.from_tokenizer(hf_tokenizer("llama3"))
    assert found is not None and found.source == LLAMA3
    assert (found.bos_token, found.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
    chatml = ChatTemplate.chatml()
    assert chatml.end_of_turn == "<|im_end|>" and not chatml.has_generation_blocks
    assert chatml.render([msg("user", "hi")], add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    helpers = ChatTemplate(source="{{ {'a': [1]} | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}", name="h")
    assert helpers.render([]) == '{\n  "a": [\n    1\n  ]\n}|4'


# ------------------------------------------------------------------------------------------------ records
def test_formats_are_detected_and_parse_to_the_same_conversation() -> None:
    messages = parse_conversation({"messages": BASIC})
    assert parse_conversation(SHAREGPT) == messages
    parts = [*BASIC[:1], msg("user", [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]),
             *BASIC[2:]]
    assert parse_conversation({"chat": parts, "messages": "not this one"}, messages_field="chat") == messages
    conversational = parse_conversation(CONVERSATIONAL)
    assert conversational.messages == messages.messages and conversational.prompt_length == 4
    assert conversational.train == (None,) * 5
    table = [({"messages": []}, "messages"), (SHAREGPT, "sharegpt"), (CONVERSATIONAL, "conversational"),
             ({"prompt": "a", "completion": "b"}, None), ({"text": "a"}, None), ({"messages": "x"}, "messages")]
    for record, expected in table:
        assert detect_chat_format(record) == expected, record
    assert detect_chat_format({"chat": []}, messages_field="chat") == "messages"
    assert detect_chat_format({"messages": []}, messages_field="chat") is None


def test_messages_keep_what_templates_read_and_nothing_else() -> None:
    record = {"tools": '[{"type": "function", "function": {"name": "f"}}]', "messages": [
        msg("user", "hi", train=None, weight=1, tool_calls=None),
        {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL], "thinking": "why", "train": True},
        msg("tool", "21", name="get_weather", tool_call_id="call_1")]}
    conversation = parse_conversation(record)
    assert [dict(m) for m in conversation.messages] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL], "reasoning_content": "why"},
        {"role": "tool", "content": "21", "name": "get_weather", "tool_call_id": "call_1"}]
    assert conversation.train == (None, True, None)
    assert conversation.tools == ({"type": "function", "function": {"name": "f"}},)
    assert parse_conversation({"messages": BASIC}).tools is None
    with pytest.raises(TypeError):
        conversation.messages[0]["content"] = "changed"  # type: ignore[index]


@pytest.mark.parametrize(("record", "reason"), [
    ({"messages": "hello"}, "'messages' is a string, not a list of messages"),
    ({"messages": {"role": "user"}}, "'messages' is an object, not a list of messages"),
    ({"messages": None}, "'messages' is null, not a list of messages"),
    ({"messages": []}, "the conversation is empty"),
    ({"messages": [msg("robot", "hi"), msg("assistant", "x")]},
     "messages[0] has unknown role 'robot'; allowed: " + ", ".join(ROLES)),
    ({"messages": [msg("user", 5), msg("assistant", "x")]}, "messages[0].content is a number, not a string"),
    ({"messages": [msg("user", "hi"), msg("assistant", None)]}, "messages[1].content is missing"),
    ({"messages": [{"content": "hi"}, msg("assistant", "x")]}, "messages[0] has no 'role'"),
    ({"messages": ["hi", msg("assistant", "x")]}, "messages[0] is a string, not an object with a role and content"),
    ({"messages": [msg("user", [{"type": "image_url", "image_url": "x"}]), msg("assistant", "x")]},
     "messages[0].content[0] is a part of type 'image_url': only text parts"),
    ({"messages": [msg("user", "hi"), msg("assistant", "x", train="yes")]}, "messages[1].train is 'yes'"),
    ({"messages": [msg("system", "s"), msg("user", "hi")]},
     "the conversation has no assistant turn (its roles: system, user)"),
    ({"conversations": [{"from": "bot", "value": "x"}]}, "conversations[0] has unknown from 'bot'; allowed: human"),
    ({"conversations": [{"from": "gpt"}]}, "conversations[0].value is missing"),
    ({"prompt": [msg("user", "hi")], "completion": "hello"}, "'completion' is a string, not a list of messages"),
    ({"prompt": [msg("user", "hi")], "completion": []}, "'completion' is an empty list"),
    ({"text": "hi"}, "the row holds no conversation: expected 'messages'"),
    ({"messages": BASIC, "tools": "{not json"}, "'tools' is a string that is not JSON"),
    ({"messages": BASIC, "tools": {"name": "f"}}, "'tools' is an object, not a list of function descriptions"),
    ({"messages": [msg("user", "hi"), {"role": "assistant", "tool_calls": "f()"}]},
     "messages[1].tool_calls is not a list of objects"),
])
def test_bad_records_are_refused_in_one_line(record: dict[str, Any], reason: str) -> None:
    with pytest.raises(ChatDataError) as caught:
        parse_conversation(record)
    assert reason in str(caught.value) and "\n" not in str(caught.value)


def test_a_missing_messages_field_names_it() -> None:
    with pytest.raises(ChatDataError, match="no field 'chat' \\(--messages-field\\); its fields are 'messages'"):
        parse_conversation({"messages": BASIC}, messages_field="chat")


def test_train_on_is_checked_and_conversations_are_consistent() -> None:
    conversation = parse_conversation({"messages": BASIC})
    with pytest.raises(ValueError, match="train_on must be one of assistant, last, all"):
        tokenize_conversation(conversation, ChatTemplate.chatml(), ByteTokenizer(), train_on="every")  # type: ignore
    with pytest.raises(ValueError, match="one entry per message"):
        Conversation(messages=conversation.messages, train=(None,))
