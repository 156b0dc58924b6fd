"""A small Chrome DevTools Protocol client over `--remote-debugging-pipe`, standard
library only: headless Chromium (Debian's `chromium`) reads commands on its fd 3 and
writes replies and events on its fd 4, each message one JSON object ended by a NUL byte.

    async with Browser.launch(tmp_path) as browser:
        page = await browser.new_page()
        await page.send("Network.enable")
        await page.navigate("http://127.0.0.1:8000/")
        event = await browser.wait_for(lambda e: e.method == "Network.responseReceived")

Every event the browser sends is kept (`Browser.events`), so a test waits for a condition
on what happened (`wait_for`, with a deadline) rather than for a while. The browser runs
in a process group of its own, ended as a whole when the context closes."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
FLAGS = (
    "--headless",
    "--no-sandbox",  # as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    # nothing but the test's own traffic: the network beyond this machine is closed
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--mute-audio",
    "--remote-debugging-pipe",
)
MESSAGE_LIMIT = 64 * 1024 * 1024


def chromium() -> str | None:
    """The Chromium executable, if installed (`CHROMIUM` overrides the path)."""
    path = os.environ.get("CHROMIUM", CHROMIUM)
    return path if os.access(path, os.X_OK) else shutil.which("chromium")


class CDPError(Exception):
    """A command the browser answered with an error."""


@dataclass(frozen=True)
class Event:
    method: str
    params: dict[str, Any]
    session: str | None


@dataclass
class Browser:
    pid: int
    reader: asyncio.StreamReader
    writer: asyncio.WriteTransport
    log_path: Path
    events: list[Event] = field(default_factory=list)
    _pending: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    _next_id: int = 0
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _closed: bool = False
    _receiving: asyncio.Task[None] | None = None

    @classmethod
    @contextlib.asynccontextmanager
    async def launch(cls, folder: Path, *flags: str) -> AsyncIterator[Browser]:
        """Chromium with a new profile in `folder` (its output in `folder/chromium.log`)."""
        executable = chromium()
        if executable is None:
            raise FileNotFoundError(f"{CHROMIUM}: Chromium is not installed")
        profile = folder / "profile"
        profile.mkdir(parents=True, exist_ok=True)
        log_path = folder / "chromium.log"
        commands_r, commands_w = _pipe()  # the browser reads fd 3
        replies_r, replies_w = _pipe()  # and writes fd 4
        pid = _spawn(
            [executable, *FLAGS, f"--user-data-dir={profile}", *flags, "about:blank"],
            commands_r, replies_w, log_path,
        )  # fmt: skip
        os.close(commands_r)
        os.close(replies_w)
        browser: Browser | None = None
        try:
            loop = asyncio.get_running_loop()
            reader = asyncio.StreamReader(limit=MESSAGE_LIMIT)
            await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(replies_r, "rb", 0)
            )
            writer, _ = await loop.connect_write_pipe(
                asyncio.Protocol, os.fdopen(commands_w, "wb", 0)
            )
            browser = cls(pid, reader, writer, log_path)
            browser._receiving = asyncio.create_task(browser._receive())
            await browser.send("Browser.getVersion")
            yield browser
        finally:
            if browser is not None:
                await browser._close()
            else:  # it never answered: end it all the same
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                await _reap(pid)

    # -- commands and events --------------------------------------------------------------

    async def send(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        """The result of one command (`CDPError` if the browser refuses it)."""
        if self._closed:
            raise CDPError(f"{method}: the browser is gone\n{self.log()}")
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = reply
        self.writer.write(json.dumps(message).encode() + b"\0")
        async with asyncio.timeout(30):
            return await reply

    async def _receive(self) -> None:
        try:
            while True:
                try:
                    raw = await self.reader.readuntil(b"\0")
                except asyncio.IncompleteReadError:
                    return
                message = json.loads(raw[:-1])
                if "id" in message:
                    reply = self._pending.pop(message["id"], None)
                    if reply is None or reply.done():
                        continue
                    if "error" in message:
                        reply.set_exception(CDPError(json.dumps(message["error"])))
                    else:
                        reply.set_result(message.get("result", {}))
                    continue
                event = Event(message["method"], message.get("params", {}),
                              message.get("sessionId"))  # fmt: skip
                async with self._changed:
                    self.events.append(event)
                    self._changed.notify_all()
        finally:
            self._closed = True
            for reply in self._pending.values():
                if not reply.done():
                    reply.set_exception(CDPError(f"the browser is gone\n{self.log()}"))
            async with self._changed:
                self._changed.notify_all()

    async def wait_for(
        self, predicate: Callable[[Event], bool], within_s: float = 30, what: str = ""
    ) -> Event:
        """The first event, already received or to come, for which `predicate` holds."""

        def found() -> Event | None:
            return next((e for e in self.events if predicate(e)), None)

        try:
            async with asyncio.timeout(within_s), self._changed:
                while (event := found()) is None:
                    if self._closed:
                        raise CDPError(f"the browser is gone\n{self.log()}")
                    await self._changed.wait()
                return event
        except TimeoutError:
            raise AssertionError(
                f"no {what or 'such event'} within {within_s} s; events: "
                + ", ".join(e.method for e in self.events[-30:])
            ) from None

    def select(self, method: str, **where: Any) -> list[Event]:
        """The events of `method` whose params hold `where`."""
        return [
            e
            for e in self.events
            if e.method == method and all(e.params.get(k) == v for k, v in where.items())
        ]

    async def new_page(self) -> Page:
        """A new tab, attached (flat session), with the Page and Runtime domains on."""
        target = await self.send("Target.createTarget", {"url": "about:blank"})
        attached = await self.send(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
        )
        page = Page(self, attached["sessionId"])
        await page.send("Page.enable")
        await page.send("Runtime.enable")
        return page

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    # -- the end --------------------------------------------------------------------------

    async def _close(self) -> None:
        if not self._closed:
            with contextlib.suppress(CDPError, TimeoutError):
                async with asyncio.timeout(5):
                    await self.send("Browser.close")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        await _reap(self.pid)
        self.writer.close()
        if self._receiving is not None:
            await self._receiving


@dataclass
class Page:
    browser: Browser
    session: str

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self.browser.send(method, params, self.session)

    async def navigate(self, url: str) -> None:
        reply = await self.send("Page.navigate", {"url": url})
        if reply.get("errorText"):
            raise CDPError(f"{url}: {reply['errorText']}")

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        reply = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in reply:
            raise CDPError(f"{expression}: {json.dumps(reply['exceptionDetails'])}")
        return reply["result"].get("value")

    async def wait_until(self, expression: str, within_s: float = 30) -> Any:
        """The value of `expression` once it is truthy: the page checks it every 20 ms
        and answers then; an `AssertionError` after `within_s`."""
        waiting = (
            "new Promise((resolve) => { const check = () => { const value = (" + expression
            + "); if (value) resolve(value); else setTimeout(check, 20); }; check(); })"
        )  # fmt: skip
        try:
            async with asyncio.timeout(within_s):
                return await self.evaluate(waiting)
        except TimeoutError:
            raise AssertionError(f"{expression} still false after {within_s} s") from None


def _spawn(argv: list[str], commands: int, replies: int, log_path: Path) -> int:
    """Start the browser with `commands` as its fd 3 and `replies` as its fd 4, its
    output to `log_path`, in a process group of its own (its helpers end with it)."""
    with log_path.open("wb") as log:
        return os.posix_spawn(
            argv[0],
            argv,
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, log.fileno(), 1),
                (os.POSIX_SPAWN_DUP2, log.fileno(), 2),
                # the sources are above 9 (`_pipe`): these two overwrite none of them
                (os.POSIX_SPAWN_DUP2, commands, 3),
                (os.POSIX_SPAWN_DUP2, replies, 4),
            ],
            setpgroup=0,
        )


def _pipe() -> tuple[int, int]:
    """A pipe whose two ends are fds above 9, not inherited."""
    ends = []
    for end in os.pipe():
        ends.append(fcntl.fcntl(end, fcntl.F_DUPFD_CLOEXEC, 10))
        os.close(end)
    return ends[0], ends[1]


async def _reap(pid: int) -> None:
    """Wait for the child `pid` to end, without blocking the loop (a pidfd), and reap it."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    ended = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(pidfd, ended.set)
    try:
        async with asyncio.timeout(30):
            await ended.wait()
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    _collect(pid)


def _collect(pid: int) -> None:
    """Reap `pid`, which has ended (its pidfd said so): no waiting."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
