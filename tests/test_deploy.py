"""Two replicas behind a real HAProxy with deploy/haproxy's configuration: load, a replica killed
mid-run, and a rolling restart under load.

The replicas run the embedded tiny model with the shipped drain delay and HAProxy checks /health
as the shipped haproxy.cfg.in says. Needs the haproxy executable (.ci/run installs it).
"""

from __future__ import annotations

import csv
import importlib.util
import io
import itertools
import json
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.server_helpers import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
HAPROXY = shutil.which("haproxy")
pytestmark = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (apt-get install haproxy)")

MODEL = "ouro-tiny-random"
MAX_TOKENS = 12
# Room for all 16 concurrent requests on one replica, and a grace that lets them finish.
REPLICA_ENV = {
    "OURO_FAST_SHUTDOWN_GRACE": "60",
    "OURO_FAST_DRAIN_DELAY": "5",
    "OURO_FAST_NUM_KV_BLOCKS": "512",
}
STATE_TIMEOUT_S = 60.0


def load_launcher():
    spec = importlib.util.spec_from_file_location("replicas", ROOT / "deploy/haproxy/replicas.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Outcome:
    """One request through HAProxy, as the client saw it."""

    stream: bool
    started: float
    ended: float = 0.0
    status: int = 0
    replica: str | None = None
    ok: bool = False
    detail: str = ""


def request(client: httpx.Client, url: str, i: int, stream: bool) -> Outcome:
    """One completion; ok only for the full answer (all MAX_TOKENS, finish_reason length)."""
    out = Outcome(stream, time.monotonic())
    body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    try:
        with client.stream("POST", url, json=body) as resp:
            out.status, out.replica = resp.status_code, resp.headers.get("x-ouro-replica")
            if resp.status_code != 200:
                out.detail = json.loads(resp.read())["error"]["code"]
            elif stream:
                out.ok, out.detail = read_stream(resp)
            else:
                answer = json.loads(resp.read())
                out.ok = answer["usage"]["completion_tokens"] == MAX_TOKENS
                out.detail = answer["choices"][0]["finish_reason"]
    except httpx.HTTPError as e:
        out.detail = type(e).__name__ + ": " + str(e)
    out.ended = time.monotonic()
    return out


def read_stream(resp: httpx.Response) -> tuple[bool, str]:
    chunks, done = [], False
    for line in resp.iter_lines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            chunks.append(json.loads(line[6:]))
    usage = next((c["usage"] for c in chunks if not c.get("choices") and c.get("usage")), {})
    return done and usage.get("completion_tokens") == MAX_TOKENS, "done" if done else "no [DONE]"


def run_load(url: str, concurrency: int, count: int | None = None, stop: threading.Event | None = None,
             on_done=None) -> list[Outcome]:  # fmt: skip
    """`count` requests (or until `stop`) from `concurrency` clients; every other one streams."""
    outcomes: list[Outcome] = []
    numbers, lock = itertools.count(), threading.Lock()

    def worker() -> None:
        with httpx.Client(timeout=60) as client:
            while not (stop is not None and stop.is_set()):
                with lock:
                    i = next(numbers)
                if count is not None and i >= count:
                    return
                out = request(client, url, i, stream=i % 2 == 1)
                with lock:
                    outcomes.append(out)
                if on_done is not None:
                    on_done(len(outcomes))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not any(t.is_alive() for t in threads), "a client never got an answer"
    return outcomes


class Balancer:
    """HAProxy with the rendered haproxy.cfg.in in front of replicas on the given ports."""

    def __init__(self, ports: list[int], tmp: Path):
        self.port, self.stats_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp / "haproxy.cfg"
        text = load_launcher().render_config(ports, self.port, "127.0.0.1", self.stats_port)
        config.write_text(text)
        check = subprocess.run([HAPROXY, "-c", "-f", str(config)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        self.log_path = tmp / "haproxy.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [HAPROXY, "-db", "-f", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def status(self, replica: str) -> str:
        """HAProxy's view of a replica from the stats page: UP, DOWN, 'UP 1/2' (going down), ..."""
        try:
            text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text
        except httpx.TransportError:
            return "not listening yet"
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return next(r["status"] for r in rows if r["svname"] == replica)

    def wait_status(self, replica: str, wanted: str) -> float:
        """Wait until the replica's status starts with `wanted`; returns when that was seen."""
        deadline = time.monotonic() + STATE_TIMEOUT_S
        while not self.status(replica).startswith(wanted):
            assert self.proc.poll() is None, self.log_path.read_text()
            assert time.monotonic() < deadline, f"{replica} is not {wanted}: {self.status(replica)}"
            time.sleep(0.05)
        return time.monotonic()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)


class Cluster:
    def __init__(self, tmp: Path):
        self.ports = [free_port(), free_port()]
        self.replicas: list[ServerProcess] = []
        self.balancer: Balancer | None = None
        try:
            for port in self.ports:
                self.replicas.append(self.start(port))
            self.balancer = Balancer(self.ports, tmp)
            for i in range(len(self.replicas)):
                self.balancer.wait_status(f"replica-{i}", "UP")
        except BaseException:
            self.stop()  # a failed set-up leaves no process behind
            raise

    @staticmethod
    def start(port: int) -> ServerProcess:
        return ServerProcess("cli", REPLICA_ENV, port=port).wait_ready()

    def restart(self, i: int) -> None:
        """Start replica i again on its port and wait until HAProxy routes to it."""
        self.replicas[i] = self.start(self.ports[i])
        self.balancer.wait_status(f"replica-{i}", "UP")

    def stop(self) -> None:
        if self.balancer is not None:
            self.balancer.stop()
        for srv in self.replicas:
            if srv.proc.poll() is None:
                srv.proc.send_signal(signal.SIGTERM)
        for srv in self.replicas:
            srv.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("haproxy"))
    try:
        yield c
    finally:
        c.stop()


def failures(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if not o.ok]


def test_200_requests_through_haproxy(cluster):
    outcomes = run_load(cluster.balancer.url + "/v1/completions", concurrency=16, count=200)
    assert len(outcomes) == 200 and failures(outcomes) == []
    # leastconn spreads them over both replicas.
    served = {o.replica for o in outcomes}
    assert served == {"replica-0", "replica-1"}, served


def test_sigkill_fails_only_the_requests_in_flight_on_that_replica(cluster):
    victim = cluster.replicas[1]
    killed = {}
    kill_once = threading.Lock()
    stop = threading.Event()

    def kill_midway(done: int) -> None:
        # SIGKILL after 60 answers, with requests in flight on both replicas; the load goes on until
        # 32 more answers came after HAProxy marked the replica DOWN.
        if done >= 60 and kill_once.acquire(blocking=False):
            try:
                killed["sent"] = time.monotonic()
                victim.proc.send_signal(signal.SIGKILL)
                victim.proc.wait(30)
                killed["dead"] = time.monotonic()
                killed["down"] = cluster.balancer.wait_status("replica-1", "DOWN")
                killed["answers_at_down"] = done
            finally:
                if "down" not in killed:
                    stop.set()
        elif "answers_at_down" in killed and done >= killed["answers_at_down"] + 32:
            stop.set()

    try:
        outcomes = run_load(
            cluster.balancer.url + "/v1/completions", concurrency=16, stop=stop, on_done=kill_midway
        )
        assert "down" in killed, "the replica was never marked DOWN"
        failed = failures(outcomes)
        assert failed, "no request was in flight on the killed replica: the test tested nothing"
        for o in failed:
            # In flight on the killed replica when it died: sent before, still open after.
            assert o.started < killed["dead"] and o.ended > killed["sent"], o
            assert o.replica in ("replica-1", None), o
            if o.stream and o.status == 200:
                # A stream it had started is cut: no [DONE], the connection closed by HAProxy.
                assert o.detail == "no [DONE]" or o.detail.startswith("RemoteProtocolError: peer closed"), o
            else:
                # An answer it had not started: HAProxy's 502 in the OpenAI error shape, or, for a request
                # that was not its connection's first, the connection closed without an answer.
                silent = "RemoteProtocolError: Server disconnected without sending a response."
                assert (o.status, o.detail) in ((502, "replica_failed"), (0, silent)), o
        # Every request sent after the kill (the health check's verdict included) succeeded.
        after = [o for o in outcomes if o.started > killed["dead"]]
        assert after and all(o.ok for o in after)
        assert any(o.started > killed["down"] for o in after)
    finally:
        victim.stop()
        cluster.restart(1)


def test_rolling_restart_under_load_fails_nothing(cluster):
    stop = threading.Event()
    outcomes: list[Outcome] = []
    load = threading.Thread(
        target=lambda: outcomes.extend(run_load(cluster.balancer.url + "/v1/completions", 8, stop=stop))
    )
    load.start()
    try:
        time.sleep(2)
        for i, srv in enumerate(list(cluster.replicas)):
            # SIGTERM: /health 503 at once, HAProxy takes it out within the drain delay, in-flight finish.
            srv.proc.send_signal(signal.SIGTERM)
            cluster.balancer.wait_status(f"replica-{i}", "DOWN")
            assert srv.proc.wait(60) == 0
            srv.stop()
            assert "Traceback" not in srv.log()
            cluster.restart(i)
        restarted = time.monotonic()
        time.sleep(3)
    finally:
        stop.set()
        load.join(120)
    assert len(outcomes) > 50
    assert failures(outcomes) == []
    # Both restarted replicas are back in rotation.
    assert {o.replica for o in outcomes if o.started > restarted} == {"replica-0", "replica-1"}


def test_proxy_latency_benchmark_measures_both_paths(capsys):
    from bench import proxy_latency

    assert proxy_latency.main(["--requests", "3", "--haproxy", HAPROXY]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests_per_path"] == 3
    assert out["direct"]["p50_ms"] > 0 and out["haproxy"]["p50_ms"] > 0
    assert out["added_ms"]["p50_ms"] == pytest.approx(
        out["haproxy"]["p50_ms"] - out["direct"]["p50_ms"], abs=1e-3
    )
