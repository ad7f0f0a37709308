"""Real broker processes for tests: start on free 127.0.0.1 ports, kill -9, restart.

The broker binds port 0 and logs ``listening client=HOST:PORT health=HOST:PORT ...``; we read the ports from
its log file (polled with a deadline, never a fixed sleep).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

_LISTENING = re.compile(r"listening client=(\S+):(\d+) tls=(\S+) health=(\S+) metrics=(\S+)")


class BrokerProcess:
    """One ``cursus-broker`` subprocess with its own log dir and log file."""

    def __init__(self, log_dir: Path, *, settings: dict[str, object] | None = None,
                 env: dict[str, str] | None = None, health: bool = True) -> None:
        self.log_dir = Path(log_dir)
        self.settings = dict(settings or {})
        self.env = dict(env or {})
        self.health = health
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.health_port = 0
        self.metrics_port = 0
        self.starts = 0
        self.output_path = self.log_dir.parent / f"{self.log_dir.name}.broker.log"

    @property
    def address(self) -> tuple[str, int]:
        return "127.0.0.1", self.port

    @property
    def bootstrap(self) -> str:
        """The client listener as an SDK bootstrap string, ``"host:port"``."""
        host, port = self.address
        return f"{host}:{port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "cursus.cli.broker", "--host", "127.0.0.1", "--port", str(self.port or 0),
               "--health-port", "0" if self.health else "-1", "--metrics-port", "-1",
               "--log-dir", str(self.log_dir)]
        for key, value in self.settings.items():
            cmd += ["--set", f"{key}={value}"]
        return cmd

    def start(self, *, timeout_s: float = 30.0, expect_ready: bool = True) -> BrokerProcess:
        """Start (or restart, on the same port) and wait for the ``listening`` line."""
        assert self.proc is None or self.proc.poll() is not None
        self.starts += 1
        env = {**os.environ, **self.env}
        with open(self.output_path, "ab") as out:
            out.write(f"--- start {self.starts} ---\n".encode())
            offset = out.tell()
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, env=env)
        if not expect_ready:
            return self
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.output_path.read_bytes()[offset:].decode(errors="replace")
            match = _LISTENING.search(text)
            if match and "ready" in text[match.end():]:
                self.port = int(match.group(2))
                health, metrics = match.group(4), match.group(5)
                self.health_port = int(health.rsplit(":", 1)[1]) if health != "off" else 0
                self.metrics_port = int(metrics.rsplit(":", 1)[1]) if ":" in metrics else 0
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}:\n{text}")
            time.sleep(0.02)
        raise TimeoutError(f"broker not ready in {timeout_s}s:\n{self.output()}")

    def output(self) -> str:
        return self.output_path.read_text(errors="replace") if self.output_path.exists() else ""

    def wait_exit(self, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        """kill -9: no flush, no clean-shutdown marker."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets but does nothing (a GC pause, a stuck VM)."""
        assert self.proc is not None and self.proc.poll() is None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait for the clean shutdown to finish."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def restart(self, *, kill: bool = True) -> BrokerProcess:
        if kill:
            self.kill()
        else:
            self.terminate()
        return self.start()

    def http_get(self, path: str, *, port: int | None = None) -> tuple[int, bytes]:
        """GET ``path`` from the health port (or ``port``); returns (status, body)."""
        try:
            url = f"http://127.0.0.1:{port or self.health_port}{path}"
            with urllib.request.urlopen(url, timeout=5) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()  # a paused broker cannot handle SIGTERM
            try:
                self.terminate(timeout_s=15)
            except subprocess.TimeoutExpired:
                self.kill()
