"""Shared by the server tests: a real server process on 127.0.0.1, an SSE reader that parses
exactly as `vllm bench serve` does, and a Prometheus text parser."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent
READY_TIMEOUT_S = 180.0


def serve_command() -> list[str]:
    """How deploy/haproxy/replicas.py starts `ouro-fast` (the console script, or the installed module)."""
    path = Path(__file__).resolve().parents[1] / "deploy" / "haproxy" / "replicas.py"
    spec = importlib.util.spec_from_file_location("ouro_fast_replicas", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.serve_command()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server started as a subprocess in its own process group; stop() always ends it."""

    def __init__(self, mode: str, env: dict[str, str] | None = None, args: tuple[str, ...] = (),
                 port: int | None = None):  # fmt: skip
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if mode == "cli":
            exe = serve_command()
            argv = [*exe, "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        else:
            # The console script beside the interpreter, else the module (wheels installed with --target).
            script = BIN / "sanic"
            sanic = [str(script)] if script.exists() else [sys.executable, "-P", "-m", "sanic"]
            argv = [
                *sanic,
                "ouro_fast.server:app",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ]
            argv += ["--single-process"] if mode == "single" else []
        # No drain delay unless a test asks for one: no balancer watches these servers' /health.
        quiet = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "OURO_FAST_DRAIN_DELAY": "0"}
        full_env = {**os.environ, **quiet, **(env or {})}
        fd, self.log_path = tempfile.mkstemp(prefix="ouro-server-", suffix=".log")
        self._log_text: str | None = None
        try:
            self.proc = subprocess.Popen(
                argv, env=full_env, stdout=fd, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            os.close(fd)

    def log(self) -> str:
        """Everything the server printed so far (kept after stop(), which removes the file)."""
        if self._log_text is not None:
            return self._log_text
        return Path(self.log_path).read_text(errors="replace")

    def wait_ready(self) -> ServerProcess:
        """Poll /health until 200; self.health_seen keeps every (status, body) answered before."""
        self.health_seen: list[tuple[int, dict]] = []
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                self.health_seen.append((r.status_code, r.json()))
                if r.status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the server was not ready within {READY_TIMEOUT_S}s:\n{self.log()}")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL to the process group this test created if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log_text is None:
            self._log_text = self.log()
            os.unlink(self.log_path)
            print(f"--- the server's output ({self.url}) ---\n{self._log_text}")  # pytest shows it on failure
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{label="v",...}': value} with the model_name label dropped."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"malformed metrics line {line!r}"
        labels = [f'{k}="{v}"' for k, v in _LABEL.findall(m.group(2) or "") if k != "model_name"]
        out[m.group(1) + ("{" + ",".join(labels) + "}" if labels else "")] = float(m.group(3))
    return out


def sample(metrics, name: str, **labels: str) -> float | None:
    """One series of a ServerMetrics' registry, read directly (model_name implied)."""
    return metrics.registry.get_sample_value(name, {"model_name": metrics.model_name, **labels})


@dataclass
class BenchStream:
    """What `vllm bench serve` gets from one streamed request."""

    status: int
    chunks: list[dict] = field(default_factory=list)  # every parsed data object, in order
    done: bool = False  # saw data: [DONE]
    raw: bytes = b""
    error: Exception | None = None  # the transport broke mid-stream
    body: dict | None = None  # the JSON body of a non-200 answer

    @property
    def text_chunks(self) -> list[dict]:
        return [c for c in self.chunks if c.get("choices")]

    @property
    def text(self) -> str:
        key = "text"
        parts = []
        for c in self.text_chunks:
            choice = c["choices"][0]
            parts.append(choice[key] if key in choice else choice["delta"].get("content") or "")
        return "".join(parts)

    @property
    def usage(self) -> dict | None:
        # The bench client reads usage only from chunks without choices.
        return next((c["usage"] for c in self.chunks if not c.get("choices") and c.get("usage")), None)


def bench_stream(url: str, body: dict, headers: dict | None = None, stop_after: int | None = None,
                 client: httpx.Client | None = None, on_first_chunk=None) -> BenchStream:  # fmt: skip
    """POST body and read the SSE stream as vllm bench does: each network read decoded on its own,
    messages split on blank lines, ':' comments dropped, the 'data: ' prefix removed, [DONE] skipped.
    stop_after: close the connection after that many parsed chunks; on_first_chunk: called once
    when the first chunk has been parsed."""
    own = client is None
    client = client or httpx.Client(timeout=120)
    result = BenchStream(status=0)
    try:
        with client.stream("POST", url, json=body, headers=headers) as resp:
            result.status = resp.status_code
            if resp.status_code != 200:
                result.body = json.loads(resp.read())
                return result
            buffer = ""
            try:
                for piece in resp.iter_raw():
                    result.raw += piece
                    buffer += piece.decode("utf-8")  # strict: a split multibyte character fails here
                    while "\n\n" in buffer:
                        message, buffer = buffer.split("\n\n", 1)
                        message = "\n".join(
                            ln for ln in message.strip().split("\n") if not ln.startswith(":")
                        )
                        if not message:
                            continue
                        data = message.removeprefix("data: ")
                        if data == "[DONE]":
                            result.done = True
                        else:
                            result.chunks.append(json.loads(data))
                            if on_first_chunk is not None and len(result.chunks) == 1:
                                on_first_chunk()
                    if stop_after is not None and len(result.chunks) >= stop_after:
                        return result
            except httpx.HTTPError as e:
                result.error = e
    finally:
        if own:
            client.close()
    return result
