"""`qrun chat`: an interactive, multi-turn terminal chat with streamed markdown answers.

Each turn re-sends the whole conversation; the engine's prefix cache recognises the
already-computed turns, so only the newest message is prefilled (the stats line shows it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live
from rich.markdown import Markdown

from qrun.atomic import atomic_write_text
from qrun.errors import QrunError, RequestFailed
from qrun.sampling_params import SamplingParams
from qrun.tokenizer import chat_messages

if TYPE_CHECKING:  # torch stays unimported until a chat really starts
    from qrun.llm import LLM
    from qrun.sequence import RequestOutput

HELP = """\
/help              this help
/reset             forget the conversation (the system prompt stays)
/system TEXT       set the system prompt (empty TEXT removes it)
/set k=v ...       change sampling, e.g. /set temperature=0.7 top_p=0.9 max_tokens=200; /set alone shows them
/set json on|off   answers must be (or need no longer be) a JSON object
/save FILE         write the conversation as JSON
/load FILE         read a conversation saved by /save
/quit              exit (Ctrl-D works too); Ctrl-C stops an answer"""

# Markdown re-rendering is O(answer length); a few frames per second look live and stay cheap.
REFRESH_SECONDS = 0.1


def stats_line(output: RequestOutput, elapsed: float) -> str:
    """`N tokens, X tokens/s, TTFT Y ms, C/P prompt tokens cached` for one finished request."""
    metrics = output.metrics
    tokens = len(output.token_ids)
    ttft = (metrics.first_token_time - metrics.arrival_time) * 1000 if metrics.first_token_time else float("nan")
    return (f"{tokens} tokens, {tokens / max(elapsed, 1e-9):.1f} tokens/s, time to first token {ttft:.0f} ms, "
            f"cached {metrics.num_cached_tokens}/{metrics.num_prompt_tokens} prompt tokens")


def parse_settings(params: SamplingParams, assignments: list[str]) -> SamplingParams:
    """Apply `key=value` pairs to `params`; values are JSON (numbers, true, "text") or bare text.
    `json on` / `json off` switches JSON-object answers."""
    from qrun.options import SAMPLING_FIELDS
    from qrun.sampling_params import StructuredOutputsParams

    if assignments[:1] == ["json"]:
        if assignments[1:] not in (["on"], ["off"]):
            raise ValueError("use /set json on or /set json off")
        json_object = StructuredOutputsParams(json_object=True) if assignments[1] == "on" else None
        return dataclasses.replace(params, structured_outputs=json_object)
    changes: dict[str, Any] = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in SAMPLING_FIELDS:
            raise ValueError(f"{item!r}: use key=value with key one of {', '.join(SAMPLING_FIELDS)}")
        try:
            changes[key] = json.loads(raw)
        except json.JSONDecodeError:
            changes[key] = raw
    try:
        return dataclasses.replace(params, **changes)
    except TypeError as err:  # a string where a number belongs fails SamplingParams' comparisons
        raise ValueError(f"bad value in {' '.join(assignments)!r}: {err}") from None


class ChatSession:
    """The conversation and its settings, and turning it into prompts for the engine."""

    def __init__(self, llm: LLM, params: SamplingParams, system: str | None = None,
                 template: str | None = None):
        self.llm = llm
        self.params = params
        self.system = system
        self.template = template
        self.messages: list[dict[str, str]] = []

    @property
    def context_limit(self) -> int:
        """Most tokens one request may span: the model's context, or the whole KV cache if smaller."""
        return self.llm.engine.request_token_limit

    def prompt_ids(self) -> list[int]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return self.llm.tokenizer.encode_chat(system + self.messages, template=self.template)

    def fit(self) -> tuple[list[int], int]:
        """Prompt ids for the conversation, dropping the oldest turns until it fits with room to
        answer; returns (ids, number of messages dropped). Raises QrunError when even the
        newest message alone does not fit."""
        dropped = 0
        while True:
            ids = self.prompt_ids()
            if len(ids) + self.params.max_tokens <= self.context_limit:
                return ids, dropped
            if len(self.messages) <= 1:
                self.messages.clear()
                raise QrunError(
                    f"the message ({len(ids)} tokens) plus max_tokens={self.params.max_tokens} exceeds the "
                    f"context of {self.context_limit} tokens; send a shorter message or /set max_tokens=...")
            # Drop through the oldest user message and the answer that followed it.
            cut = next((i for i, m in enumerate(self.messages[1:], 1) if m["role"] == "user"), 1)
            dropped += cut
            del self.messages[:cut]

    def to_json(self) -> dict[str, Any]:
        return {"system": self.system, "messages": self.messages,
                "sampling": {k: getattr(self.params, k) for k in ("max_tokens", "temperature", "top_p", "top_k",
                                                                 "min_p", "repetition_penalty", "seed")}}

    def load_json(self, data: Any) -> None:
        """Accept what to_json wrote, or a bare list of {role, content} messages."""
        if isinstance(data, list):
            data = {"messages": data}
        messages = data.get("messages") if isinstance(data, dict) else None
        if not isinstance(messages, list):
            raise ValueError("expected {\"messages\": [{\"role\": ..., \"content\": ...}, ...]}")
        checked = chat_messages(messages) if messages else []  # a saved conversation may be empty
        params = dataclasses.replace(self.params, **data.get("sampling") or {})
        self.system = data.get("system", self.system)
        self.messages = [{"role": m["role"], "content": m["content"]} for m in checked]
        self.params = params


class ChatApp:
    """The read-eval-print loop: input with readline history, commands, streamed answers."""

    def __init__(self, session: ChatSession, console: Console):
        self.session = session
        self.console = console

    def run(self) -> None:
        import readline  # noqa: F401  (importing it gives input() arrow-key history and editing)

        self.console.print("[dim]Type a message; /help for commands, Ctrl-D or /quit to exit.[/dim]")
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                self.console.print()
                return
            except KeyboardInterrupt:  # Ctrl-C at the prompt clears the line, as in a shell
                self.console.print()
                continue
            line = line.strip()
            if not line:
                continue
            try:
                if line.startswith("/"):
                    if not self.command(line):
                        return
                else:
                    self.answer(line)
            except (QrunError, ValueError, OSError) as err:
                self.console.print(f"[red]error:[/red] {err}", highlight=False)

    def command(self, line: str) -> bool:
        """Run a /command; False means quit."""
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        session = self.session
        if name in ("/quit", "/exit"):
            return False
        if name == "/help":
            self.console.print(HELP, highlight=False, markup=False)
        elif name == "/reset":
            session.messages.clear()
            self.console.print("[dim]conversation cleared[/dim]")
        elif name == "/system":
            session.system = rest or None
            self.console.print(f"[dim]system prompt {'set' if rest else 'removed'}[/dim]")
        elif name == "/set":
            if rest:
                session.params = parse_settings(session.params, rest.split())
            self.console.print(f"[dim]{session.to_json()['sampling']}[/dim]", highlight=False)
        elif name == "/save":
            if not rest:
                raise ValueError("usage: /save FILE")
            atomic_write_text(Path(rest).expanduser(), json.dumps(session.to_json(), indent=2, ensure_ascii=False))
            self.console.print(f"[dim]saved {len(session.messages)} messages to {rest}[/dim]", highlight=False)
        elif name == "/load":
            if not rest:
                raise ValueError("usage: /load FILE")
            try:
                data = json.loads(Path(rest).expanduser().read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"{rest} is not JSON ({err})") from None
            session.load_json(data)
            self.console.print(f"[dim]loaded {len(session.messages)} messages from {rest}[/dim]", highlight=False)
        else:
            raise ValueError(f"unknown command {name}; /help lists them")
        return True

    def answer(self, text: str) -> None:
        session = self.session
        session.messages.append({"role": "user", "content": text})
        answer, output, stream = "", None, None
        start = time.perf_counter()
        with ctrl_c_pressed() as pressed:  # from here on Ctrl-C interrupts the answer
            try:
                ids, dropped = session.fit()
                if dropped:
                    self.console.print(f"[yellow]context full: dropped the oldest {dropped} messages[/yellow]")
                if pressed.is_set():  # while the prompt was tokenized: the turn does not start
                    raise KeyboardInterrupt
                stream = session.llm.stream_outputs(ids, session.params)
                with Live(Markdown(""), console=self.console, auto_refresh=False,
                          vertical_overflow="visible") as live:
                    shown = time.perf_counter()
                    for streamed in stream:
                        if pressed.is_set():
                            live.update(Markdown(answer), refresh=True)  # what is kept is what was shown
                            break
                        output, answer = streamed, streamed.text
                        if output.finished or time.perf_counter() - shown >= REFRESH_SECONDS:
                            live.update(Markdown(answer), refresh=True)
                            shown = time.perf_counter()
                interrupted = pressed.is_set() and (output is None or not output.finished)
            except KeyboardInterrupt:  # raised by other means than the terminal's Ctrl-C
                interrupted = True
            # still under the handler: a Ctrl-C while the turn's last lines print is too late to stop it
            if interrupted:
                if stream is not None:
                    stream.close()  # aborts the request
                self.console.print("[yellow]interrupted[/yellow]")
            if output is None:  # interrupted before the engine answered: the turn did not happen
                session.messages.pop()
                return
            if output.error is not None:
                session.messages.pop()  # the turn did not happen: the user may ask again
                raise RequestFailed(f"no answer: {output.error}")
            # A partial answer stays in the conversation: it is what the user saw.
            session.messages.append({"role": "assistant", "content": answer})
            self.console.print(stats_line(output, time.perf_counter() - start), style="dim", highlight=False)


@contextlib.contextmanager
def ctrl_c_pressed() -> Iterator[threading.Event]:
    """An event that Ctrl-C (SIGINT) sets while the block runs, in place of raising KeyboardInterrupt
    wherever the main thread happens to be: raised inside rich's bookkeeping (between the console's
    buffer count and the `with` that undoes it), it left every later print buffered, and the chat went
    silent at its prompt (one run in 68 of the terminal test's session, looped). The answer stops at
    its next streamed output instead (a long prompt's prefill runs to its first token). Off the main
    thread, where no handler can be set, the event stays clear and Ctrl-C raises as before."""
    pressed = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield pressed
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.set())
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def run_chat(args: argparse.Namespace) -> None:
    from qrun.options import engine_args_from, load_llm, sampling_params_from

    template = None
    if args.chat_template:
        try:
            template = Path(args.chat_template).read_text()
        except OSError as err:
            raise QrunError(f"cannot read the chat template {args.chat_template}: {err.strerror}") from None
    llm = load_llm(args.model, engine_args_from(args))
    console = Console(highlight=False)
    if template is None and llm.tokenizer.chat_template is None:
        console.print(f"[yellow]{args.model} has no chat template: using a plain 'role: content' format; "
                      "pass --chat-template FILE for the model's own format[/yellow]")
    session = ChatSession(llm, sampling_params_from(args), args.system, template)
    ChatApp(session, console).run()
