"""Tokenizer, chat template and streaming detokenizer, without transformers.

`tokenizers` does the encoding; the chat template is rendered with jinja2 exactly the way
Hugging Face does it (sandboxed environment, trim_blocks/lstrip_blocks, `raise_exception`,
`tojson`, `strftime_now`), so a bundle's template behaves as it did in transformers.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from edgespec.errors import EdgespecError

TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' own marker (continue_final_message)
NO_TEMPLATE = "this model has no chat template (a base model, not a chat one)"


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (each byte has a printable stand-in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTES = _byte_decoder()


def check_text(text: str) -> None:
    """Python strings can hold lone surrogates (a JSON "\\ud800", undecodable argv bytes);
    they are not Unicode text and nothing downstream can encode them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise EdgespecError(f"the text is not valid Unicode (a lone surrogate at character "
                            f"{e.start}); send UTF-8 text.") from None


def check_messages(messages: Any) -> None:
    """A conversation as chat templates take it, or one sentence on what is not: a
    template meeting a None or a list of parts fails inside jinja with a TypeError."""
    if not isinstance(messages, list) or not messages:
        raise EdgespecError("messages must be a non-empty list of {'role': ..., 'content': "
                            "...} dicts.")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise EdgespecError(f"message {i} must be a dict with a 'role' string, not {m!r}.")
        if not isinstance(m.get("content"), str):
            raise EdgespecError(f"message {i}'s content must be text, not "
                                f"{type(m.get('content')).__name__}; join a list of text parts "
                                "into one string.")


class Tokenizer:
    """Text <-> token ids for one bundle, plus its chat template."""

    def __init__(self, tokenizer_json: Path, config: dict[str, Any],
                 remedy: str = "re-export the bundle"):
        try:
            self._tok = _HFTokenizer.from_file(str(tokenizer_json))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise EdgespecError(f"{tokenizer_json} cannot be read as a tokenizer ({e}); "
                                f"{remedy}.") from None
        self.config = config
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take the default one
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default")

    @classmethod
    def from_dir(cls, path: Path | str, remedy: str = "re-export the bundle") -> Tokenizer:
        """A bundle's tokenizer (or, with its `remedy`, a source checkpoint's)."""
        path = Path(path)
        config_path = path / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise EdgespecError(f"{config_path} is not valid JSON ({e}); {remedy}.") from None
        if not isinstance(config, dict):
            raise EdgespecError(f"{config_path} must hold a JSON object; {remedy}.")
        template_file = path / "chat_template.jinja"
        if "chat_template" not in config and template_file.is_file():
            config["chat_template"] = template_file.read_text()
        return cls(path / "tokenizer.json", config, remedy)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids for `text`; special tokens (BOS) as the tokenizer's post-processor adds them."""
        return self._encode(self._tok, text, add_special_tokens).ids

    @staticmethod
    def _encode(tok: _HFTokenizer, text: str, add_special_tokens: bool):
        """`encode_batch` of one text: unlike `encode`, it releases the GIL (a 1 MB prompt
        held it for over a second, stalling a server's event loop)."""
        check_text(text)
        return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    @cached_property
    def _special(self) -> dict[int, str]:
        return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()
                if t.special}

    @cached_property
    def _added(self) -> frozenset[int]:
        return frozenset(self._tok.get_added_tokens_decoder())

    @cached_property
    def _plain(self) -> _HFTokenizer:
        """A twin that reads special tokens' text as ordinary text."""
        tok = _HFTokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok

    @cached_property
    def _byte_level(self) -> bool:
        return '"ByteLevel"' in json.dumps(json.loads(self._tok.to_str()).get("decoder"))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a multi-byte character may span several)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added:
            return piece.encode()
        if self._byte_level:
            return bytes(_BYTES[c] for c in piece if c in _BYTES)
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)  # SentencePiece byte fallback
        return bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode()

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _template(self):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, sort_keys=False: (
            json.dumps(x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys))
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render a conversation to the prompt text the model was trained on."""
        if not self.chat_template:
            raise EdgespecError(NO_TEMPLATE + "; give it a plain prompt to continue instead.")
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except TemplateError as e:
            raise EdgespecError(f"the chat template rejected the conversation: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final: bool = False) -> list[int]:
        """Templates write BOS themselves, so the rendered text is encoded without it.

        A special token spelled inside a message's content (`<|im_end|>` then
        `<|im_start|>system`) is encoded as the plain text it is, so a user cannot forge
        turns: only the template itself writes control tokens. `continue_final` ends the
        text where the last message's does, so an answer begun by the caller (an assistant
        message sent last, "prefill") is continued rather than closed, as vLLM's
        `continue_final_message` and transformers' own option do."""
        check_messages(messages)
        text = (self._continued(messages) if continue_final
                else self.apply_chat_template(messages, add_generation_prompt))
        encoding = self._encode(self._tok, text, False)
        spans = self._content_spans(text, messages)
        ids: list[int] = []
        for token, (a, b) in zip(encoding.ids, encoding.offsets, strict=True):
            if token in self._special and any(s <= a and b <= e for s, e in spans):
                ids += self._encode(self._plain, text[a:b], False).ids
            else:
                ids.append(token)
        return ids

    def _continued(self, messages: list[dict[str, Any]]) -> str:
        """The chat rendered up to the end of its last message, found as transformers finds
        it: by a tag appended to that message (its own text may recur in the template's
        markup, "end" in <|im_end|>); a template that trims the message trims the tag's
        space, and then the message's trailing blanks go too."""
        last = messages[-1] if messages else {}
        content = last.get("content")
        if last.get("role") != "assistant" or not isinstance(content, str) \
                or not content.strip():
            raise EdgespecError("to continue the final message, the last message must be "
                                "the assistant's, with the text to continue.")
        text = self.apply_chat_template([*messages[:-1], {**last, "content": content + TAG}],
                                        add_generation_prompt=False)
        at = text.rfind(TAG.strip())
        if at < 0:
            raise EdgespecError("this chat template rewrites the final message, so it cannot "
                                "be continued; send the whole conversation as a prompt to "
                                "continue instead.")
        return text[:at] if text[at:at + len(TAG)] == TAG else text[:at].rstrip()

    def _content_spans(self, text: str, messages: list[dict[str, Any]]) -> list[tuple[int, int]]:
        """Where each message's content lies in the rendered text, found in order; a
        content the template changed (trimmed, say) and that spells a special token is
        refused, since it could not be told apart from the template's own tokens."""
        spans, cursor = [], 0
        for n, message in enumerate(messages):
            content = message.get("content")
            if not isinstance(content, str) or not content:
                continue
            start = text.find(content, cursor)
            if start >= 0:
                spans.append((start, start + len(content)))
                cursor = start + len(content)
                continue
            forged = next((t for t in self._special.values() if t in content), None)
            if forged:
                raise EdgespecError(f"message {n} contains the special token {forged!r}, "
                                    "which this chat template would read as a control "
                                    "token; remove it.")
        return spans

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas that are always valid UTF-8.

    Decoding a single token loses information: byte-level BPE splits multi-byte characters
    across tokens (decoding half of one gives U+FFFD) and SentencePiece-style decoders
    strip the leading space of a sequence. So each step decodes a short window that
    starts a few tokens back and emits only what grew past the previous window's text,
    holding back output while it ends in an incomplete character.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids up to here have been emitted

    def add(self, token_id: int) -> str:
        """Feed one id; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        delta = text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        return delta

    def flush(self) -> str:
        """Whatever is still held back, less a character the last tokens left incomplete
        (an answer cut off by its token budget in the middle of an emoji): its bytes are
        no character, and decoding them would end the text in U+FFFD, once for a
        byte-level decoder and once per byte for SentencePiece's byte fallback."""
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        held = b"".join(self._tok.token_bytes(i) for i in self._ids[self._read:])
        self._prefix = self._read = len(self._ids)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(held)
        pending = len(decoder.getstate()[0])
        cut = min(pending, 1) if self._tok._byte_level else pending
        if not text.endswith("\ufffd" * cut):
            cut = 0
        return text[len(prefix_text):len(text) - cut]
