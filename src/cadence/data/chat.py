"""Chat conversations rendered under a model's own chat template, with an exact mask of the trained tokens.

One record (a JSON line, a dataset row) becomes token ids and the half-open ranges of token positions that are
trained targets, in three steps:

1. :func:`parse_conversation` reads the record in any of the formats fine-tuning data comes in (``messages``,
   conversational ``prompt``/``completion``, ShareGPT ``conversations``) into one :class:`Conversation`, refusing a
   malformed record with a one-line :class:`ChatDataError` (the caller adds the file and the row).
2. :class:`ChatTemplate` renders it with the model's Jinja template in a sandbox, as transformers'
   ``apply_chat_template`` does (same variables, filters and globals), so the text is what the model will see at
   inference; a template that raises or reaches for Python internals is a :class:`ChatTemplateError`.
3. :func:`tokenize_conversation` finds each trained message's characters by rendering prefixes of the conversation
   (never from ``{% generation %}`` markers, which stock templates lack; where a template has them they are checked
   against what was found) and maps them to tokens through the tokenizer's offsets on the whole rendering.

The mask rule: a trained message trains its content and the template's end of that turn (``<|im_end|>``,
``<|eot_id|>``, ``<end_of_turn>``, ``</s>``: a model that never learns it never stops), never the role header before
it nor the separator after the end of turn. For an assistant message "its content" is everything the model writes
after the generation prompt: reasoning, tool calls and text.

Nothing here reads files of the user's except :meth:`ChatTemplate.from_file`, and nothing imports above ``data``.
``jinja2`` (a dependency of transformers) is imported when a template is first rendered.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Protocol

ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have (templates rename them, e.g. Gemma's "model", themselves)."""

TrainOn = Literal["assistant", "last", "all"]
TRAIN_ON: tuple[str, ...] = ("assistant", "last", "all")
"""``assistant``: every assistant message; ``last``: the final assistant message only; ``all``: every token."""

CHAT_FORMATS = ("messages", "conversational", "sharegpt")
"""What :func:`detect_chat_format` answers for a chat record."""

SHAREGPT_ROLES: Mapping[str, str] = MappingProxyType({
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system", "tool": "tool",
})
"""ShareGPT's ``from`` names and the role each becomes."""

_PASSED_KEYS = ("tool_calls", "name", "tool_call_id")  # given to the template as they are, when present
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")  # names data uses for a message's reasoning
_OPEN, _CLOSE = "\U000f0000", "\U000f0001"  # private-use characters around {% generation %} output while rendering
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


# ------------------------------------------------------------------------------------------------ errors
class ChatError(ValueError):
    """A chat record or template cadence cannot use; the message is one line, the caller adds the file and row."""


class ChatDataError(ChatError):
    """A record that is not a usable conversation (not a list, an unknown role, content that is not text, ...)."""


class NothingToTrain(ChatDataError):
    """A well-formed conversation with nothing to train on (no assistant turn, no message marked to train): skipped
    and counted, like an example too long for --seq-len; only a data set where none is left is refused."""


class ChatTemplateError(ChatError):
    """A chat template that cannot be used on a conversation: it raised, it tried to leave the sandbox, or its
    rendering cannot be split into turns (no end of turn found, generation markers that disagree, ...)."""


# ------------------------------------------------------------------------------------------------ conversations
@dataclass(frozen=True, kw_only=True)
class Conversation:
    """One conversation, normalised for a chat template."""

    messages: tuple[Mapping[str, Any], ...]
    """Each message as the template reads it: ``role`` (one of :data:`ROLES`), ``content`` (a string; text parts
    joined), and ``tool_calls``, ``reasoning_content``, ``name``, ``tool_call_id`` when the record has them. Values are
    plain JSON data (dicts, lists, strings, numbers)."""
    train: tuple[bool | None, ...]
    """Each message's own ``"train": true|false``, None when it has none (then ``train_on`` decides)."""
    prompt_length: int = 0
    """How many leading messages came from a conversational record's ``prompt``: untrained under ``train_on``
    assistant or last unless their own ``train`` says otherwise (``all`` still trains them)."""
    tools: tuple[Mapping[str, Any], ...] | None = None
    """The record's tools (JSON-schema function descriptions) for the template, None when it has none."""

    def __post_init__(self) -> None:
        if len(self.train) != len(self.messages) or not 0 <= self.prompt_length <= len(self.messages):
            raise ValueError("Conversation: train needs one entry per message and prompt_length at most their count")


def detect_chat_format(record: Mapping[str, Any], *, messages_field: str | None = None) -> str | None:
    """Which chat format ``record`` is in (one of :data:`CHAT_FORMATS`), or None when it is not chat.

    ``messages_field`` names the column holding the messages (``--messages-field``): "messages" when the record has
    it. Otherwise a ``messages`` key is "messages", a ``conversations`` key "sharegpt", and ``prompt`` + ``completion``
    with either one a list "conversational" (string prompt and completion are the plain, non-chat format). A key
    that is present but holds the wrong type still counts, so that :func:`parse_conversation` says what is wrong."""
    if messages_field is not None:
        return "messages" if messages_field in record else None
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "prompt" in record and "completion" in record and (_is_list(record["prompt"]) or _is_list(record["completion"])):
        return "conversational"
    return None


def parse_conversation(record: Mapping[str, Any], *, messages_field: str | None = None,
                       for_training: bool = True) -> Conversation:
    """The conversation in ``record`` (see :func:`detect_chat_format` for the formats), or a :class:`ChatDataError`.

    A conversational record's prompt messages are untrained unless their ``train`` says so; its completion must not
    be empty. A record whose messages hold no assistant turn and no message marked ``"train": true`` has nothing to
    train and is refused (:class:`NothingToTrain`) unless ``for_training`` is False (a prompt to answer)."""
    if not isinstance(record, Mapping):
        raise ChatDataError(f"the row is {_kind(record)}, not an object")
    chat_format = detect_chat_format(record, messages_field=messages_field)
    fields = ", ".join(repr(str(key)) for key in record) or "none"
    if chat_format is None:
        if messages_field is not None:
            raise ChatDataError(f"the row has no field {messages_field!r} (--messages-field); its fields are {fields}")
        raise ChatDataError("the row holds no conversation: expected 'messages', 'conversations' (ShareGPT) or "
                            f"'prompt' + 'completion' lists of messages; its fields are {fields}")
    prompt_length = 0
    if chat_format == "conversational":
        prompt = _as_list(record["prompt"], "prompt")
        completion = _as_list(record["completion"], "completion")
        if not completion:
            raise ChatDataError("'completion' is an empty list: it needs the assistant message(s) to train on")
        parsed = [_message(m, f"prompt[{i}]", sharegpt=False) for i, m in enumerate(prompt)]
        parsed += [_message(m, f"completion[{i}]", sharegpt=False) for i, m in enumerate(completion)]
        prompt_length = len(prompt)
    else:
        key = messages_field if messages_field is not None else (
            "messages" if chat_format == "messages" else "conversations")
        raw = _as_list(record[key], key)
        parsed = [_message(m, f"{key}[{i}]", sharegpt=chat_format == "sharegpt") for i, m in enumerate(raw)]
    if not parsed:
        raise ChatDataError(f"the conversation is empty: {'messages' if messages_field is None else messages_field} "
                            "holds no message")
    messages = tuple(MappingProxyType(message) for message, _ in parsed)
    train = tuple(flag for _, flag in parsed)
    if for_training and not any(m["role"] == "assistant" for m in messages) and True not in train:
        roles = ", ".join(sorted({m["role"] for m in messages}))
        raise NothingToTrain(f"the conversation has no assistant turn (its roles: {roles}): nothing to train on")
    return Conversation(messages=messages, train=train, prompt_length=prompt_length, tools=_tools(record.get("tools")))


def _message(raw: Any, where: str, *, sharegpt: bool) -> tuple[dict[str, Any], bool | None]:
    """One message normalised for the template, and its ``train`` flag."""
    if not isinstance(raw, Mapping):
        raise ChatDataError(f"{where} is {_kind(raw)}, not an object with a role and content")
    if sharegpt and "from" in raw:  # ShareGPT rows; some "conversations" columns hold role/content messages instead
        role_key, content_key, names = "from", "value", SHAREGPT_ROLES
    else:
        role_key, content_key, names = "role", "content", MappingProxyType({role: role for role in ROLES})
    name = raw.get(role_key)
    if name is None:
        raise ChatDataError(f"{where} has no {role_key!r}")
    if not isinstance(name, str) or name not in names:
        raise ChatDataError(f"{where} has unknown {role_key} {name!r}; allowed: {', '.join(names)}")
    role = names[name]
    message: dict[str, Any] = {"role": role}
    for key in _PASSED_KEYS:
        # None means absent: datasets gives every message of a column every key, None where a message has none.
        if raw.get(key) is not None:
            message[key] = _plain(raw[key], f"{where}.{key}")
    if "tool_calls" in message and not (_is_list(message["tool_calls"]) and all(
            isinstance(call, Mapping) for call in message["tool_calls"])):
        raise ChatDataError(f"{where}.tool_calls is not a list of objects")
    for key in ("name", "tool_call_id"):
        if key in message and not isinstance(message[key], str):
            raise ChatDataError(f"{where}.{key} is {_kind(message[key])}, not a string")
    reasoning = next((raw[key] for key in _REASONING_KEYS if raw.get(key) is not None), None)
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise ChatDataError(f"{where} has reasoning that is {_kind(reasoning)}, not a string")
        message["reasoning_content"] = reasoning
    message["content"] = _content(raw.get(content_key), f"{where}.{content_key}",
                                  may_be_missing=role == "assistant" and "tool_calls" in message)
    flag = raw.get("train")
    if flag is not None and not isinstance(flag, bool):
        raise ChatDataError(f"{where}.train is {flag!r}; it must be true or false")
    return message, flag


def _content(value: Any, where: str, *, may_be_missing: bool) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts joined."""
    if value is None:
        if may_be_missing:  # an assistant message that only calls tools
            return ""
        raise ChatDataError(f"{where} is missing: a message needs its text")
    if isinstance(value, str):
        return value
    if not _is_list(value):
        raise ChatDataError(f"{where} is {_kind(value)}, not a string or a list of text parts")
    texts = []
    for index, part in enumerate(value):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"a part of type {kind!r}" if kind not in (None, "text") else f"{_kind(part)} without text"
            raise ChatDataError(f"{where}[{index}] is {what}: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                "are read")
        texts.append(part["text"])
    return "".join(texts)


def _tools(value: Any) -> tuple[Mapping[str, Any], ...] | None:
    """The record's tool list; a JSON string holding one is read (some data sets store it that way)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ChatDataError(f"'tools' is a string that is not JSON ({error.msg})") from None
    if not _is_list(value) or not all(isinstance(tool, Mapping) for tool in value):
        raise ChatDataError(f"'tools' is {_kind(value)}, not a list of function descriptions (objects)")
    return tuple(MappingProxyType(_plain(tool, "tools")) for tool in value) or None


def _plain(value: Any, where: str) -> Any:
    """JSON data rebuilt from plain types: nothing else reaches the sandbox (a rich object's methods could be
    called from a template)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(key): _plain(item, where) for key, item in value.items()}
    if _is_list(value):
        return [_plain(item, where) for item in value]
    if isinstance(value, (str, int, float)):  # subclasses (numpy scalars, enums) back to the plain type
        return str(value) if isinstance(value, str) else (int(value) if isinstance(value, int) else float(value))
    raise ChatDataError(f"{where} holds {_kind(value)}, which is not JSON data")


def _as_list(value: Any, key: str) -> list[Any]:
    if not _is_list(value):
        raise ChatDataError(f"{key!r} is {_kind(value)}, not a list of messages")
    return list(value)


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    names = {str: "a string", int: "a number", float: "a number", dict: "an object", list: "a list"}
    return next((name for kind, name in names.items() if isinstance(value, kind)),
                "an object" if isinstance(value, Mapping) else f"a {type(value).__name__}")


# ------------------------------------------------------------------------------------------------ templates
CHATML_TEMPLATE = """\
{%- if tools %}
    {%- set ns = namespace(tools='# Tools\\n\\nYou may call these functions; write each call as a JSON object \
{"name": ..., "arguments": ...} inside <tool_call></tool_call> tags.\\n<tools>') %}
    {%- for tool in tools %}{%- set ns.tools = ns.tools + '\\n' + (tool | tojson) %}{%- endfor %}
    {%- set ns.tools = ns.tools + '\\n</tools>' %}
{%- endif %}
{%- for message in messages %}
    {%- if loop.first and tools and message.role != 'system' %}
        {{- '<|im_start|>system\\n' + ns.tools + '<|im_end|>\\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.role == 'assistant' and message.reasoning_content %}
        {{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}
    {%- endif %}
    {{- message.content }}
    {%- if loop.first and tools and message.role == 'system' %}
        {{- '\\n\\n' + ns.tools }}
    {%- endif %}
    {%- for call in message.tool_calls or [] %}
        {%- set call = call.function if call.function is defined else call %}
        {{- ('\\n' if message.content or not loop.first else '') + '<tool_call>\\n{"name": ' + (call.name | tojson) }}
        {{- ', "arguments": ' + (call.arguments if call.arguments is string else call.arguments | tojson) }}
        {{- '}\\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
"""The default chat template (ChatML), for byte-level models and tokenizers without a template of their own.

Each message is ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n``; the generation prompt is ``<|im_start|>assistant\\n``.
An assistant's ``reasoning_content`` comes before its content as ``<think>\\nREASONING\\n</think>\\n\\n`` (every turn's,
so history is never rewritten), each of its tool calls after the content as
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``; a record's tools are listed as JSON in the system
turn (one is added when the conversation has none). Tool results are ``tool`` turns."""


@dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    """A Jinja chat template and the values it is rendered with."""

    source: str
    """The Jinja source."""
    name: str
    """Where it came from, for messages: ``"ChatML (cadence's default)"``, ``"the tokenizer's (DIR)"``, a path."""
    bos_token: str = ""
    """What the template's ``bos_token`` is (the tokenizer's BOS; empty when it has none)."""
    eos_token: str = ""
    """What the template's ``eos_token`` is (the tokenizer's EOS; empty when it has none)."""
    end_of_turn: str | None = None
    """The text that ends a turn, when the tokenizer does not hold it as a special token (the byte tokenizer has
    none): ``<|im_end|>`` for the ChatML default. Otherwise the end of a turn is found among the tokenizer's special
    and added tokens, and the EOS."""

    @classmethod
    def chatml(cls, *, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        """The documented default, :data:`CHATML_TEMPLATE`; its turns end with ``<|im_end|>``."""
        return cls(source=CHATML_TEMPLATE, name="ChatML (cadence's default)", bos_token=bos_token,
                   eos_token=eos_token, end_of_turn="<|im_end|>")

    @classmethod
    def from_tokenizer(cls, hf_tokenizer: Any) -> ChatTemplate | None:
        """The transformers tokenizer's own template (``chat_template``), None when it has none. A tokenizer with
        several named templates gives its ``"default"`` one."""
        source = getattr(hf_tokenizer, "chat_template", None)
        if isinstance(source, Mapping):
            source = source.get("default")
        if not isinstance(source, str) or not source.strip():
            return None
        where = getattr(hf_tokenizer, "name_or_path", "") or type(hf_tokenizer).__name__
        return cls(source=source, name=f"the tokenizer's ({where})", bos_token=hf_tokenizer.bos_token or "",
                   eos_token=hf_tokenizer.eos_token or "")

    @classmethod
    def from_file(cls, path: Path | str, *, bos_token: str = "", eos_token: str = "",
                  end_of_turn: str | None = None) -> ChatTemplate:
        """A Jinja file (``--chat-template FILE``); unreadable or not UTF-8 is a :class:`ChatTemplateError`."""
        try:
            source = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ChatTemplateError(f"cannot read the chat template {path}: {_one_line(error)}") from None
        if not source.strip():
            raise ChatTemplateError(f"the chat template {path} is empty")
        return cls(source=source, name=str(path), bos_token=bos_token, eos_token=eos_token, end_of_turn=end_of_turn)

    @property
    def has_generation_blocks(self) -> bool:
        """Whether the template marks assistant output with ``{% generation %}``: then they are checked."""
        return _GENERATION_TAG.search(self.source) is not None

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = False) -> str:
        """The template's text for these messages, as ``apply_chat_template(..., tokenize=False)`` gives it."""
        return self.render_traced(messages, tools=tools, add_generation_prompt=add_generation_prompt)[0]

    def render_traced(self, messages: Sequence[Mapping[str, Any]], *,
                      tools: Sequence[Mapping[str, Any]] | None = None,
                      add_generation_prompt: bool = False) -> tuple[str, tuple[tuple[int, int], ...]]:
        """The text, and the character spans of its ``{% generation %}`` blocks (none when it has none)."""
        try:
            compiled = _compile(self.source)
        except ImportError:
            raise ChatTemplateError("chat templates need the jinja2 package: pip install 'cadence[hf]'") from None
        except Exception as error:  # noqa: BLE001 - jinja2's syntax errors
            raise ChatTemplateError(f"chat template {self.name} does not compile: {_one_line(error)}") from None
        # Fresh plain dicts: the template may read every key (tojson of a message needs real dicts), and the
        # reasoning is also given as "thinking", which some templates (gpt-oss) read, as transformers does.
        plain = [{**({"thinking": m["reasoning_content"]} if "reasoning_content" in m else {}), **m}
                 for m in messages]
        try:
            # documents=None as transformers passes it: `documents is not none` must be false, as it is there.
            raw = compiled.render(messages=plain, tools=[dict(tool) for tool in tools] if tools else None,
                                  documents=None, add_generation_prompt=add_generation_prompt,
                                  bos_token=self.bos_token, eos_token=self.eos_token)
        except Exception as error:  # noqa: BLE001 - a template can raise anything; each becomes one line
            raise _template_error(self.name, error) from None
        if _OPEN not in raw and _CLOSE not in raw:
            return raw, ()
        return _strip_generation_marks(raw, self.name)


def _template_error(name: str, error: Exception) -> ChatTemplateError:
    from jinja2.exceptions import SecurityError

    if isinstance(error, _Raised):
        return ChatTemplateError(f"chat template {name} refused the conversation: {_one_line(error)}")
    if isinstance(error, SecurityError):
        return ChatTemplateError(f"chat template {name} tried to reach Python internals from its sandbox "
                                 f"({_one_line(error)}); it is not rendered")
    return ChatTemplateError(f"chat template {name} failed: {type(error).__name__}: {_one_line(error)}")


def _strip_generation_marks(raw: str, name: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    """The text without the marks put around ``{% generation %}`` output, and where those blocks are in it."""
    parts, spans, start, length, inside = [], [], 0, 0, False
    for piece in re.split(f"([{_OPEN}{_CLOSE}])", raw):
        if piece in (_OPEN, _CLOSE):
            if (piece == _OPEN) == inside:  # nested blocks, or the text itself holds a mark character
                raise ChatTemplateError(f"chat template {name}: its {{% generation %}} blocks are nested or "
                                        "unbalanced (or the text holds U+F0000/U+F0001); cadence cannot trace them")
            inside = piece == _OPEN
            if inside:
                start = length
            elif length > start:
                spans.append((start, length))
            continue
        parts.append(piece)
        length += len(piece)
    if inside:
        raise ChatTemplateError(f"chat template {name}: a {{% generation %}} block is not closed")
    return "".join(parts), tuple(spans)


class _Raised(Exception):
    """``raise_exception(...)`` called by a template: its message is the reason the user reads."""


@lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    """The template compiled in a sandbox set up as transformers sets it up (``trim_blocks``, ``lstrip_blocks``,
    loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape HTML and takes
    ``indent``), plus the ``{% generation %}`` tag; any attribute the sandbox finds unsafe raises at once."""
    import jinja2
    from jinja2 import nodes
    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
            # Jinja's default hands back an Undefined that prints as "" (so `{{ ''.__class__ }}` renders quietly):
            # a template that reaches for an internal is refused outright instead.
            raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is unsafe")

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: its output between two private-use marks, which
        :func:`_strip_generation_marks` turns into spans. Marks in the text, not positions counted while rendering,
        so a block inside a macro or a ``{% set %}`` block is still placed right."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            return f"{_OPEN}{caller()}{_CLOSE}"

    class Raised(_Raised, TemplateError):
        pass

    def raise_exception(message: Any) -> None:
        raise Raised(str(message))

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return environment.from_string(source)


# ------------------------------------------------------------------------------------------------ the mask
class ChatTokenizer(Protocol):
    """What :func:`tokenize_conversation` needs of a tokenizer (:class:`cadence.data.hf.ByteTokenizer` and
    :class:`cadence.data.hf.HFTokenizer` have it)."""

    @property
    def special_tokens(self) -> tuple[str, ...]: ...  # the strings it keeps whole as one token (special and added)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]: ...  # ids, and each one's first char


@dataclass(frozen=True, kw_only=True)
class ChatExample:
    """One tokenised conversation (or, under a template that rewrites history, one of its trained turns)."""

    ids: tuple[int, ...]
    """The rendering's tokens, special tokens written by the template included, nothing added by the tokenizer."""
    trained: tuple[tuple[int, int], ...]
    """Half-open ranges of positions in ``ids`` whose tokens are trained targets (each predicted from the token
    before it, so position 0 is never one): sorted, disjoint, not touching, none empty."""
    text: str
    """The rendered text ``ids`` were made from (a doubled BOS, dropped from ``ids``, is still in it)."""

    @property
    def trained_tokens(self) -> int:
        """How many targets the example has."""
        return sum(end - start for start, end in self.trained)


def tokenize_conversation(conversation: Conversation, template: ChatTemplate, tokenizer: ChatTokenizer, *,
                          train_on: TrainOn = "assistant") -> list[ChatExample]:
    """The conversation rendered with ``template`` and tokenised, with its trained tokens: usually one example;
    one per trained message when the template rewrites history (see below); none when nothing is trained.

    Which messages are trained: under ``train_on="assistant"`` every assistant message, under ``"last"`` the final
    one (a conversational record's prompt messages are never chosen this way), and a message's own ``train`` flag
    overrides either. Under ``"all"`` every token after the first is trained except the turns of messages whose
    ``train`` is false.

    A template rewrites history when a conversation's rendering does not start with the rendering of its first
    messages (Qwen3 drops the reasoning of assistant turns before the last user message): each trained message then
    gets an example of its own, the conversation up to it rendered as the model sees it when it writes that turn.
    """
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
    turns = _Turns(conversation, template, tokenizer)
    count = len(conversation.messages)
    if train_on == "all":
        chosen = [i for i in range(count) if conversation.train[i] is False]  # the turns left out
    else:
        chosen = [i for i in range(count) if _chosen(conversation, i, train_on)]
        if not chosen:
            return []
    assistants = [i for i in range(count) if conversation.messages[i]["role"] == "assistant"]
    checked = assistants if template.has_generation_blocks else []
    full_text, generation = turns.rendering(count)
    if all(full_text.startswith(turns.rendering(i + 1)[0]) for i in {*chosen, *checked}):
        spans = {i: turns.span(i) for i in {*chosen, *checked}}
        if checked:
            regions = {i: (len(turns.rendering(i)[0]), len(turns.rendering(i + 1)[0])) for i in checked}
            _check_generation(template, full_text, generation, {i: spans[i] for i in checked}, regions, everywhere=True)
        if train_on == "all":
            example = turns.example(full_text, [(0, len(full_text))], left_out=[spans[i] for i in chosen])
        else:
            example = turns.example(full_text, [spans[i] for i in chosen])
        return [example] if example.trained else []
    if train_on == "all":
        if chosen:
            raise ChatTemplateError(
                f"chat template {template.name} rewrites earlier turns (a conversation's rendering does not start "
                "with the rendering of its first messages), so a message's \"train\": false cannot be left out of "
                "--train-on all")
        example = turns.example(full_text, [(0, len(full_text))])  # every token: where turns start does not matter
        return [example] if example.trained else []
    examples = []
    for i in chosen:
        text, generation = turns.rendering(i + 1)
        span = turns.span(i)
        if conversation.messages[i]["role"] == "assistant" and template.has_generation_blocks:
            region = (len(turns.rendering(i)[0]), len(text))
            _check_generation(template, text, generation, {i: span}, {i: region}, everywhere=False)
        example = turns.example(text, [span])
        if example.trained:
            examples.append(example)
    return examples


def _chosen(conversation: Conversation, index: int, train_on: str) -> bool:
    """Whether message ``index`` is trained under ``train_on`` "assistant" or "last"."""
    flag = conversation.train[index]
    if flag is not None:
        return flag
    if index < conversation.prompt_length or conversation.messages[index]["role"] != "assistant":
        return False
    if train_on == "last":
        return index == max(i for i, m in enumerate(conversation.messages) if m["role"] == "assistant")
    return True


class _Turns:
    """Renderings of the conversation's prefixes (each made once), and where each message's turn is in them."""

    def __init__(self, conversation: Conversation, template: ChatTemplate, tokenizer: ChatTokenizer) -> None:
        self.conversation, self.template, self.tokenizer = conversation, template, tokenizer
        self._renderings: dict[tuple[int, bool], tuple[str, tuple[tuple[int, int], ...]]] = {}
        # What can end a turn: a token the tokenizer keeps whole, the EOS, or the template's declared end. Longest
        # first, so that "</s>" never wins over a longer token ending the same way.
        ends = {*tokenizer.special_tokens, template.eos_token, template.end_of_turn or ""} - {""}
        self.ends = sorted(ends, key=lambda end: (-len(end), end))

    def rendering(self, count: int, generation_prompt: bool = False) -> tuple[str, tuple[tuple[int, int], ...]]:
        """The first ``count`` messages rendered (with the generation prompt after them when asked)."""
        key = (count, generation_prompt)
        if key not in self._renderings:
            try:
                self._renderings[key] = self.template.render_traced(
                    self.conversation.messages[:count], tools=self.conversation.tools,
                    add_generation_prompt=generation_prompt)
            except ChatTemplateError:
                if count or generation_prompt:
                    raise
                # Many templates read messages[0] and cannot render no messages: nothing comes before the first
                # turn then (its content is still searched for from the start of the text).
                self._renderings[key] = ("", ())
        return self._renderings[key]

    def span(self, index: int) -> tuple[int, int]:
        """The characters message ``index`` trains, in the rendering of the messages up to it (and so in any
        rendering that starts with that one): from its content's start (for an assistant, from the end of the
        generation prompt: its reasoning and tool calls are written by the model too) to the end of its end-of-turn
        token; the separator after that (ChatML's newline) is the next turn's business."""
        message = self.conversation.messages[index]
        name, role = self.template.name, message["role"]
        what = f"message {index} ({role})"
        before = self.rendering(index)[0]
        turn = self.rendering(index + 1)[0]
        if not turn.startswith(before):
            raise ChatTemplateError(
                f"chat template {name} renders the conversation before {what} differently once {what} is added; "
                "its rendering cannot be split into turns")
        tail = len(turn.rstrip())  # the turn without the whitespace that separates it from the next
        content = message["content"].strip()
        # The last occurrence: a system prompt folded into a user turn (Gemma) or reasoning that mentions the
        # answer comes before the message's own text.
        found = turn.rfind(content, len(before), tail) if content else -1
        if role == "assistant":
            prompt = self.rendering(index, generation_prompt=True)[0]
            start = max(_common_prefix(prompt, turn), len(before))
            if found >= 0 and len(prompt) == len(before) and turn[start:found].strip():
                # No generation prompt, yet text before the reply: a role header the model would be taught to write.
                raise ChatTemplateError(
                    f"chat template {name} writes {turn[start:found].strip()[:40]!r} before {what}'s content but "
                    "nothing for add_generation_prompt: cadence cannot tell its header from the reply")
            content_end = found + len(content) if found >= 0 else start  # a template may rewrite the content
        else:
            if found < 0:
                raise ChatTemplateError(f"chat template {name}: the content of {what}, marked to be trained, is not "
                                        "in the template's rendering of it")
            start, content_end = found, found + len(content)
        after = turn[content_end:tail]
        end = next((end for end in self.ends if after.endswith(end)), None)
        if end is None:
            shown = f"writes {after[-40:]!r}" if after else "writes nothing"
            known = ", ".join(self.ends[:6]) or "none"
            raise ChatTemplateError(
                f"chat template {name}: cannot find where {what} ends: after its content the template {shown}, "
                f"which does not end with an end-of-turn token (known: {known}); the end of a turn must be trained")
        return start, tail

    def example(self, text: str, spans: list[tuple[int, int]],
                left_out: Sequence[tuple[int, int]] = ()) -> ChatExample:
        """``text`` tokenised once, whole (tokens at a turn's edge are what they are in the full text), with the
        tokens of ``spans`` trained and those of ``left_out`` not."""
        ids, starts = self.tokenizer.encode_with_offsets(text)
        if len(ids) != len(starts):
            raise ValueError("encode_with_offsets gave a different number of ids and offsets")
        bos = self.tokenizer.encode_with_offsets(self.template.bos_token)[0] if self.template.bos_token else []
        if len(bos) == 1 and ids[:2] == bos * 2:
            # A BOS written twice (by the template and by text that starts with it): the model saw one in
            # pretraining. (Nothing is added by the tokenizer itself: the template writes its own BOS.)
            ids, starts = ids[1:], starts[1:]
        mask = bytearray(len(ids))
        for spans_of, value in ((spans, 1), (left_out, 0)):
            for begin, end in spans_of:
                first, last = _token_range(starts, begin, end)
                mask[first:last] = bytes([value]) * (last - first)
        if mask:
            mask[0] = 0  # the first token is predicted from nothing
        trained, start = [], None
        for position, flag in enumerate([*mask, 0]):
            if flag and start is None:
                start = position
            elif not flag and start is not None:
                trained.append((start, position))
                start = None
        return ChatExample(ids=tuple(ids), trained=tuple(trained), text=text)


def _token_range(starts: list[int], begin: int, end: int) -> tuple[int, int]:
    """The tokens of characters ``[begin, end)``: the token holding ``begin`` and every token starting before
    ``end``. A token that starts inside the range is what the model writes during that turn; one that begins
    before it but holds its first character (a leading space merged into a word, Mistral's " Paris" after
    "[/INST]") must be trained too, or the turn's first word would be lost. End-of-turn tokens are whole special
    tokens, so nothing after the range's end is trained with them."""
    if begin >= end or not starts:
        return 0, 0
    first = max(bisect_right(starts, begin) - 1, 0)
    last = bisect_left(starts, end)
    return first, max(last, first + 1)


def _check_generation(template: ChatTemplate, text: str, generation: tuple[tuple[int, int], ...],
                      spans: Mapping[int, tuple[int, int]], regions: Mapping[int, tuple[int, int]], *,
                      everywhere: bool) -> None:
    """Refuse a template whose ``{% generation %}`` blocks and the turns found disagree on some character other than
    whitespace (blocks differ on whether a turn's trailing newline is inside). ``everywhere``: compare the whole text
    (a block around something that is no assistant turn counts too); else only the assistant turns' regions."""
    ours, theirs = bytearray(len(text)), bytearray(len(text))
    for begin, end in spans.values():
        ours[begin:end] = b"\x01" * (end - begin)
    for begin, end in generation:
        theirs[begin:end] = b"\x01" * (end - begin)
    ranges = [(0, len(text))] if everywhere else list(regions.values())
    for begin, end in ranges:
        for position in range(begin, end):
            if ours[position] != theirs[position] and not text[position].isspace():
                index = next((i for i, (a, b) in regions.items() if a <= position < b), None)
                where = f"message {index}" if index is not None else "text outside every assistant turn"
                trains = "the template's blocks only" if theirs[position] else "cadence's turn only"
                stop = position  # the whole run of characters that differ the same way, to show it
                while stop < min(end, position + 40) and ours[stop] != theirs[stop] and theirs[stop] == theirs[
                        position]:
                    stop += 1
                raise ChatTemplateError(
                    f"chat template {template.name}: its {{% generation %}} blocks disagree with the turns cadence "
                    f"found, in {where}: {text[position:stop]!r} is in {trains}")


def _common_prefix(a: str, b: str) -> int:
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    low, high = 0, limit  # binary search on prefix equality: renderings are long, their prefixes mostly equal
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300] or type(error).__name__


__all__ = [
    "CHATML_TEMPLATE", "CHAT_FORMATS", "ROLES", "SHAREGPT_ROLES", "TRAIN_ON", "ChatDataError", "ChatError",
    "ChatExample", "ChatTemplate", "ChatTemplateError", "ChatTokenizer", "Conversation", "NothingToTrain", "TrainOn",
    "detect_chat_format", "parse_conversation", "tokenize_conversation",
]
