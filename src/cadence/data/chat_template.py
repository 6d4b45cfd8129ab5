"""Chat templates: a model's Jinja template rendered in a sandbox, as transformers' ``apply_chat_template`` does.

:class:`ChatTemplate` renders a :class:`~cadence.data.conversation.Conversation` with the same variables, filters and
globals as transformers, so the text is what the model will see at inference; a template that raises or reaches for
Python internals is a :class:`~cadence.data.conversation.ChatTemplateError`. ``{% generation %}`` blocks, where a
template has them, are traced (their output's characters) for :mod:`cadence.data.chat` to check its mask against.
Nothing here reads files of the user's except :meth:`ChatTemplate.from_file`; ``jinja2`` (a dependency of
transformers) is imported when a template is first rendered.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from cadence.data.conversation import ChatTemplateError

_OPEN, _CLOSE = "\U000f0000", "\U000f0001"  # private-use characters around {% generation %} output while rendering
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


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



def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300] or type(error).__name__


__all__ = ["CHATML_TEMPLATE", "ChatTemplate"]
