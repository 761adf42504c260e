"""qrun chat: the session logic in-process, and the terminal program through a pty."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sys

import pytest
from rich.console import Console

from qrun import chat
from qrun.chat import ChatApp, ChatSession, parse_settings
from qrun.errors import QrunError
from qrun.llm import LLM
from qrun.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory=8 * 2**20, max_model_len=160)


def ask(session: ChatSession, text: str):
    session.messages.append({"role": "user", "content": text})
    ids, _ = session.fit()
    *_, output = session.llm.stream_outputs(ids, session.params)
    session.messages.append({"role": "assistant", "content": output.text})
    return output


def test_second_turn_prefills_only_the_new_message(tiny_llm):
    session = ChatSession(tiny_llm, SamplingParams(max_tokens=8, temperature=0), system="Be brief.")
    first = ask(session, "Tell me something about the sea, please.")
    assert first.metrics.num_cached_tokens == 0
    second = ask(session, "And about mountains?")
    # Everything up to the first answer is in the prefix cache, in whole blocks.
    assert second.metrics.num_cached_tokens >= (first.metrics.num_prompt_tokens // 16) * 16 > 0


def test_context_overflow_drops_the_oldest_turns(tiny_llm):
    session = ChatSession(tiny_llm, SamplingParams(max_tokens=20, temperature=0))
    for turn in range(3):
        session.messages += [{"role": "user", "content": f"question {turn} " + "x" * 40},
                             {"role": "assistant", "content": "y" * 40}]
    session.messages.append({"role": "user", "content": "the newest question"})
    ids, dropped = session.fit()
    assert dropped >= 2 and dropped % 2 == 0
    assert len(ids) + 20 <= session.context_limit
    assert session.messages[0]["role"] == "user" and session.messages[-1]["content"] == "the newest question"
    session.messages = [{"role": "user", "content": "z" * 400}]
    with pytest.raises(QrunError, match="exceeds the context"):
        session.fit()
    assert session.messages == []


def test_a_failed_answer_is_an_error_and_leaves_the_conversation_as_it_was(tiny_llm, monkeypatch):
    from qrun.errors import RequestFailed
    from qrun.tokenizer import IncrementalDetokenizer

    def detokenizer_fault(*args):
        raise RuntimeError("injected fault")

    session = ChatSession(tiny_llm, SamplingParams(max_tokens=8, temperature=0))
    app = ChatApp(session, Console(file=io.StringIO()))
    monkeypatch.setattr(IncrementalDetokenizer, "add", detokenizer_fault)
    with pytest.raises(RequestFailed, match="injected fault"):
        app.answer("hello")
    assert session.messages == []  # nothing half-answered for the next turn to build on


def test_ctrl_c_before_the_answer_streams_interrupts_the_turn_and_leaves_the_conversation(tiny_llm, monkeypatch):
    session = ChatSession(tiny_llm, SamplingParams(max_tokens=8, temperature=0))
    screen = io.StringIO()
    app = ChatApp(session, Console(file=screen))

    def interrupted_fit():
        raise KeyboardInterrupt

    monkeypatch.setattr(session, "fit", interrupted_fit)
    app.answer("hello")  # no KeyboardInterrupt escapes to end the chat
    assert "interrupted" in screen.getvalue()
    assert session.messages == []
    monkeypatch.undo()
    app.answer("hello")
    assert [m["role"] for m in session.messages] == ["user", "assistant"]


@pytest.mark.parametrize("when", ["inside the console's bookkeeping", "as an output streams"])
def test_ctrl_c_anywhere_in_an_answer_stops_it_and_leaves_the_display_working(tiny_llm, monkeypatch, when):
    session = ChatSession(tiny_llm, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True)  # so the answer's display renders as it streams
    app = ChatApp(session, console)
    if when == "inside the console's bookkeeping":
        # the first time the display starts buffering, between its count and the `with` that undoes it: a
        # KeyboardInterrupt raised there left every later print in the buffer (the chat went silent)
        enter_buffer = Console._enter_buffer

        def interrupted_once(self):
            enter_buffer(self)
            monkeypatch.setattr(Console, "_enter_buffer", enter_buffer)
            os.kill(os.getpid(), signal.SIGINT)

        monkeypatch.setattr(Console, "_enter_buffer", interrupted_once)
    else:
        stream_outputs = tiny_llm.stream_outputs

        def interrupted_after_three(*args):
            for n, output in enumerate(stream_outputs(*args)):
                if n == 2:
                    os.kill(os.getpid(), signal.SIGINT)
                yield output

        monkeypatch.setattr(tiny_llm, "stream_outputs", interrupted_after_three)
    app.answer("hello")
    monkeypatch.undo()
    console.print("still printing")  # nothing left buffered for good
    assert screen.getvalue().rstrip().endswith("still printing")
    assert "interrupted" in screen.getvalue()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if when == "inside the console's bookkeeping":  # before any of the answer showed: the turn did not happen
        assert session.messages == []
    else:  # the answer as far as it showed stays in the conversation
        assert [m["role"] for m in session.messages] == ["user", "assistant"]
        assert 0 < len(tiny_llm.tokenizer.encode(session.messages[1]["content"])) < 40
    app.answer("again")
    assert session.messages[-1]["role"] == "assistant" and not tiny_llm.engine.has_unfinished_requests()


def test_ctrl_c_as_an_answer_finishes_printing_keeps_the_answer_and_the_chat(tiny_llm, monkeypatch):
    session = ChatSession(tiny_llm, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    screen = io.StringIO()
    app = ChatApp(session, Console(file=screen, force_terminal=True))
    line_of = chat.stats_line

    def interrupted_stats_line(*args):  # the answer is complete; its last line is printing
        os.kill(os.getpid(), signal.SIGINT)
        return line_of(*args)

    monkeypatch.setattr(chat, "stats_line", interrupted_stats_line)
    try:
        app.answer("hello")
    except KeyboardInterrupt:  # what ended the chat before: failed here, not as an interrupt of the whole run
        pytest.fail("Ctrl-C while the answer's last line printed escaped answer()")
    finally:
        monkeypatch.undo()
    uninterrupted = ChatSession(tiny_llm, session.params)
    ChatApp(uninterrupted, Console(file=io.StringIO())).answer("hello")
    assert session.messages == uninterrupted.messages  # the whole answer, kept
    assert "interrupted" not in screen.getvalue()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_set_parses_values_and_rejects_bad_ones():
    params = parse_settings(SamplingParams(), ["temperature=0.7", "top_p=0.9", "max_tokens=30", "stop=END"])
    assert (params.temperature, params.top_p, params.max_tokens, params.stop_strings) == (0.7, 0.9, 30, ("END",))
    for bad in (["temperature"], ["colour=blue"], ["top_p=2"], ["temperature=hot"]):
        with pytest.raises(ValueError):
            parse_settings(params, bad)


def test_commands_save_load_reset_system(tiny_llm, tmp_path):
    session = ChatSession(tiny_llm, SamplingParams(max_tokens=8))
    app = ChatApp(session, Console(file=io.StringIO()))
    session.messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert app.command("/system Talk like a pirate.") and session.system == "Talk like a pirate."
    assert app.command("/set temperature=0.2") and session.params.temperature == 0.2
    path = tmp_path / "conversation.json"
    app.command(f"/save {path}")
    assert json.loads(path.read_text())["messages"][1]["content"] == "hello"
    app.command("/reset")
    assert session.messages == []
    session.system, session.params = None, SamplingParams()
    app.command(f"/load {path}")
    assert len(session.messages) == 2 and session.system == "Talk like a pirate."
    assert session.params.temperature == 0.2 and session.params.max_tokens == 8
    with pytest.raises(ValueError, match="unknown command"):
        app.command("/frobnicate")
    assert app.command("/quit") is False


def test_terminal_session_streams_interrupts_and_quits(tiny_llama_dir, tmp_path):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(sys.executable, ["-m", "qrun.cli", "chat", str(tiny_llama_dir), "--temperature", "0",
                                           "--max-tokens", "12", "--kv-cache-memory", "8MiB", "--device", "cpu"],
                          encoding="utf-8", timeout=120, dimensions=(40, 120), env={"TERM": "xterm", **_env()})
    stats = r"cached (\d+)/(\d+) prompt tokens"
    try:
        child.expect(">>> ")
        child.sendline("Hello! Please tell me a long story about the sea.")
        child.expect(stats)
        assert int(child.match.group(1)) == 0
        child.expect(">>> ")
        child.sendline("Another one, about the mountains.")
        child.expect(stats)
        assert int(child.match.group(1)) > 0  # the first turn came from the prefix cache
        child.expect(">>> ")
        child.sendline("/set max_tokens=300 ignore_eos=true")
        child.expect(">>> ")
        child.sendline("Now a very long one.")
        child.expect("Now a very long one.\r\n")  # the echo
        # then interrupt once the answer's display starts (it hides the cursor): the terminal is out of input()'s
        # line editing by then, so Ctrl-C is a signal, and the tiny model's 300 tokens take a fraction of a second
        child.expect(re.escape("\x1b[?25l"))
        child.sendintr()
        child.expect("interrupted")
        child.expect(">>> ")
        child.sendline("/help")
        child.expect("/reset")
        child.expect(">>> ")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before
    transcript = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", child.before or "")
    assert "Traceback" not in transcript


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "TERM"}
