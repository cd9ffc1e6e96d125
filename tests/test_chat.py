"""`edgespec chat` driven through a real pseudo-terminal, as a person would use it."""

from __future__ import annotations

import json
import os
import sys

import pexpect
import pytest

PROMPT = ">>> "


@pytest.fixture
def chat():
    child = pexpect.spawn(sys.executable, ["-m", "edgespec.cli", "chat", "--mode", "ar",
                                           "--max-new-tokens", "400"],
                          encoding="utf-8", codec_errors="replace", timeout=120,
                          dimensions=(40, 200))
    child.expect_exact(PROMPT)
    yield child
    child.close(force=True)


def test_turns_stats_and_exit(chat):
    chat.sendline("Write a Python function `add`: Add two numbers.")
    chat.expect(r"tok/s.*\[ar, cpu\]")  # the stats line after the answer
    chat.expect_exact(PROMPT)
    chat.sendline("/stats")
    chat.expect(r"\{.*\"mode\": \"ar\".*\}", timeout=30)
    chat.expect_exact(PROMPT)
    chat.sendline("/mode lookup")
    chat.expect_exact(PROMPT)
    chat.sendline("/statsline")
    chat.expect_exact(PROMPT)
    chat.sendline("and subtract?")
    chat.expect_exact(PROMPT)
    assert "tok/s" not in chat.before  # the stats line is off now
    chat.sendline("/stats")
    chat.expect_exact(PROMPT)
    stats = json.loads(chat.before[chat.before.index("{"):chat.before.rindex("}") + 1])
    assert stats["mode"] == "lookup" and stats["reused_tokens"] > 0  # turn 1's KV reused
    chat.sendeof()
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0


def test_ctrl_c_stops_the_answer_not_the_chat(chat):
    chat.sendline("Write a long Python module.")
    chat.expect(r"\S{8}")  # the answer is streaming
    chat.sendintr()
    chat.expect(r"tok/s")
    chat.expect_exact(PROMPT)
    chat.sendline("/stats")
    chat.expect_exact(PROMPT)
    stats = json.loads(chat.before[chat.before.index("{"):chat.before.rindex("}") + 1])
    assert stats["new_tokens"] < 400  # cut short
    chat.sendline("/exit")
    chat.expect(pexpect.EOF)


def test_chat_commands_say_what_they_did_and_refuse_bad_values(chat):
    for bad in ("-1", "nan", "inf", "warm"):
        chat.sendline(f"/temp {bad}")
        chat.expect_exact("usage: /temp T")
        chat.expect_exact(PROMPT)
    chat.sendline("/temp 0.5")
    chat.expect_exact("temperature 0.5.")
    chat.expect_exact(PROMPT)
    chat.sendline("/mode lookup")
    chat.expect_exact("mode lookup.")
    chat.expect_exact(PROMPT)
    chat.sendline("/statsline")
    chat.expect_exact("stats line off.")
    chat.expect_exact(PROMPT)
    chat.sendline("/bogus")
    chat.expect_exact("unknown command /bogus; commands: /help, /reset")
    chat.expect_exact(PROMPT)
    chat.sendline("/help")
    chat.expect_exact("commands: /help")
    assert "unknown" not in chat.before
    chat.expect_exact(PROMPT)
    chat.sendline("/reset")
    chat.expect_exact("new conversation.")
    chat.expect_exact(PROMPT)
    chat.sendline("/quit")
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0


def test_a_typed_line_that_is_not_utf8_or_too_long_is_one_plain_sentence(chat):
    """readline hands undecodable bytes over as lone surrogates, which the tokenizer refused
    as "not valid Unicode (a lone surrogate at character 118)" (a place in the rendered
    template) followed by "/reset starts over", which a first turn has no use for."""
    os.write(chat.child_fd, "hé ".encode() + b"\xff\xfe there\r")
    chat.expect_exact("that line is not UTF-8 text (byte 4), so it was skipped.")
    chat.expect_exact(PROMPT)
    chat.sendline("/mode  lookup")  # a second space is still the same command
    chat.expect_exact("mode lookup.")
    chat.expect_exact(PROMPT)
    chat.sendline("word " * 600)
    chat.expect_exact("shorten the prompt.")
    chat.expect_exact(PROMPT)
    assert "/reset" not in chat.before
    chat.sendline("/exit")
    chat.expect(pexpect.EOF)


def test_a_line_longer_than_the_terminals_buffer_arrives_whole(chat):
    """A terminal in its own line mode keeps 4095 bytes of a line and drops the rest
    silently; read through readline, a pasted line of 6,000 arrives whole."""
    import edgespec

    line = "#" * 5990 + " END"
    want = len(edgespec.load().tokenizer.encode_chat([{"role": "user", "content": line}]))
    chat.sendline(line)
    chat.expect(r"tok/s", timeout=120)
    chat.expect_exact(PROMPT)
    chat.sendline("/stats")
    chat.expect_exact(PROMPT)
    stats = json.loads(chat.before[chat.before.index("{"):chat.before.rindex("}") + 1])
    assert stats["prompt_tokens"] == want


@pytest.mark.parametrize("piped,expected", [
    (b"def f(): no newline at the end", "tok/s"),  # the last line is sent all the same
    (b"bad \xff bytes\n", "not UTF-8 text (byte 4), so it was skipped"),
])
def test_piped_lines(piped, expected):
    import subprocess

    out = subprocess.run([sys.executable, "-m", "edgespec.cli", "chat", "--mode", "ar",
                          "--max-new-tokens", "8"], input=piped, capture_output=True,
                         timeout=120)
    assert out.returncode == 0 and expected in out.stderr.decode(), out.stderr
