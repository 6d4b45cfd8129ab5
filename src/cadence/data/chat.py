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

Step 1 is :mod:`cadence.data.conversation`, step 2 :mod:`cadence.data.chat_template`, step 3 (the mask) is here.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from cadence.data.chat_template import ChatTemplate
from cadence.data.conversation import ChatTemplateError, Conversation

TrainOn = Literal["assistant", "last", "all"]
TRAIN_ON: tuple[str, ...] = ("assistant", "last", "all")
"""``assistant``: every assistant message; ``last``: the final assistant message only; ``all``: every token."""



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


__all__ = ["TRAIN_ON", "ChatExample", "ChatTokenizer", "TrainOn", "tokenize_conversation"]
