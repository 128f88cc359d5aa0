"""A headless Chromium driven over the DevTools protocol on a pipe.

``--remote-debugging-pipe`` speaks the protocol as NUL-terminated JSON
messages on file descriptors 3 (to the browser) and 4 (from it): no
websocket client is needed.  :class:`Browser` opens one page, keeps it open
across whatever the test does meanwhile (a daemon stopped under it), reads
its DOM with ``Runtime.evaluate`` and takes screenshots.

With CI=true a missing ``chromium`` is a failure, never a skip.
"""

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from typing import Any

from tests.servers import unavailable, wait_for


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        unavailable("chromium (Debian package chromium; scripts/ensure-system-deps.sh "
                    "installs it)")
    return path


class Browser:
    """One headless Chromium with one page of ``width`` x ``height``."""

    def __init__(self, test, width: int = 1280, height: int = 900):
        self._profile = tempfile.mkdtemp(prefix="chromium-profile-")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def fds():
            # Above 4 first (either end may be 3 or 4 already), then 3 and
            # 4, inheritable (dup2 onto itself would keep close-on-exec).
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_child_r, from_child_w)]
            for target, fd in zip((3, 4), high):
                os.dup2(fd, target)
                os.set_inheritable(target, True)

        self.proc = subprocess.Popen(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--hide-scrollbars", f"--window-size={width},{height}",
             f"--user-data-dir={self._profile}", "--remote-debugging-pipe", "about:blank"],
            preexec_fn=fds, pass_fds=(3, 4),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(from_child_w)
        test.addCleanup(self.close)
        self._next = 0
        self._buffer = b""
        targets = self.call("Target.getTargets")["targetInfos"]
        page = [t for t in targets if t["type"] == "page"][0]
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"],
                                 flatten=True)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width,
                  height=height, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, session: bool = False, **params) -> dict[str, Any]:
        """Send one command and wait for its answer (events are skipped)."""
        self._next += 1
        message = {"id": self._next, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._from_child, 1 << 16)
                if not chunk:
                    raise AssertionError(f"chromium exited during {method}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") == self._next:
                if "error" in answer:
                    raise AssertionError(f"{method}: {answer['error']}")
                return answer.get("result", {})

    def open(self, url: str) -> None:
        self.call("Page.navigate", session=True, url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", session=True, expression=expression,
                           returnByValue=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, expression: str, timeout: float, what: str) -> Any:
        """Wait until ``expression`` is truthy in the page; its value."""
        seen = []

        def check():
            seen[:] = [self.evaluate(expression)]
            return bool(seen[0])

        wait_for(check, timeout, what)
        return seen[0]

    def screenshot(self, path: str) -> str:
        data = self.call("Page.captureScreenshot", session=True, format="png",
                         captureBeyondViewport=True)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
        return path

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        for fd in (self._to_child, self._from_child):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)
