"""Chat records read into one :class:`Conversation`, whatever format fine-tuning data comes in.

:func:`parse_conversation` reads a record (a JSON line, a dataset row) in the ``messages``, conversational
``prompt``/``completion`` or ShareGPT ``conversations`` format and normalises it for a chat template, refusing a
malformed record with a one-line :class:`ChatDataError` (the caller adds the file and the row). The errors of the chat
path live here, at its bottom: :mod:`cadence.data.chat_template` and :mod:`cadence.data.chat` raise them too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have (templates rename them, e.g. Gemma's "model", themselves)."""


CHAT_FORMATS = ("messages", "conversational", "sharegpt")
"""What :func:`detect_chat_format` answers for a chat record."""

SHAREGPT_ROLES: Mapping[str, str] = MappingProxyType({
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system", "tool": "tool",
})
"""ShareGPT's ``from`` names and the role each becomes."""

_PASSED_KEYS = ("tool_calls", "name", "tool_call_id")  # given to the template as they are, when present
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")  # names data uses for a message's reasoning


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



__all__ = [
    "CHAT_FORMATS", "ROLES", "SHAREGPT_ROLES", "ChatDataError", "ChatError", "ChatTemplateError", "Conversation",
    "NothingToTrain", "detect_chat_format", "parse_conversation",
]
