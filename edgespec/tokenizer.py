"""Tokenizer, chat template and streaming detokenizer, without transformers.

`tokenizers` does the encoding; the chat template is rendered with jinja2 exactly the way
Hugging Face does it (sandboxed environment, trim_blocks/lstrip_blocks, `raise_exception`,
`tojson`, `strftime_now`), so a bundle's template behaves as it did in transformers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from edgespec.errors import EdgespecError


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class Tokenizer:
    """Text <-> token ids for one bundle, plus its chat template."""

    def __init__(self, tokenizer_json: Path, config: dict[str, Any]):
        try:
            self._tok = _HFTokenizer.from_file(str(tokenizer_json))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise EdgespecError(f"{tokenizer_json} cannot be read as a tokenizer ({e}); "
                                "re-export the bundle.") from None
        self.config = config
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take the default one
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default")

    @classmethod
    def from_dir(cls, path: Path | str) -> Tokenizer:
        path = Path(path)
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_file = path / "chat_template.jinja"
        if "chat_template" not in config and template_file.is_file():
            config["chat_template"] = template_file.read_text()
        return cls(path / "tokenizer.json", config)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids for `text`; special tokens (BOS) as the tokenizer's post-processor adds them."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

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
            raise EdgespecError("this model has no chat template; use `edgespec generate` "
                                "with a plain prompt instead.")
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except TemplateError as e:
            raise EdgespecError(f"the chat template rejected the conversation: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]],
                    add_generation_prompt: bool = True) -> list[int]:
        """Templates write BOS themselves, so the rendered text is encoded without it."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

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
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text):]
