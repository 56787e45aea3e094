"""N ouro-fast replicas on consecutive ports, one GPU each, behind one HAProxy.

    python deploy/haproxy/replicas.py --gpus 0,1,2,3,4,5,6,7 --run-dir run -- --model /models/ouro-1.4b

Replica i serves on --base-port + i with CUDA_VISIBLE_DEVICES set to the i-th of --gpus; HAProxy
listens on --port, its stats page on --stats-port. Everything after `--` goes to each `ouro-fast
serve`. A replica that exits is started again (so `kill -TERM` of one replica restarts it: a
rolling restart, see docs/deploy.md). SIGTERM or SIGINT stops everything: HAProxy stops listening
and finishes its open requests while the replicas drain; the launcher waits for all, exits 0.
Logs and pid files go to --run-dir. Only the standard library: it runs in the server's venv.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

TEMPLATE = Path(__file__).with_name("haproxy.cfg.in")
RESTART_PAUSE_S = 5.0  # after a replica failed: a model that cannot load does not spin
STOP_TIMEOUT_S = 600.0  # longer than any replica's drain delay plus grace: then SIGKILL


def render_config(ports: list[int], port: int, bind: str = "0.0.0.0", stats_port: int = 8404,
                  stats_bind: str = "127.0.0.1") -> str:  # fmt: skip
    """haproxy.cfg for replicas on 127.0.0.1:ports, named replica-0, replica-1, ..."""
    servers = "\n".join(f"    server replica-{i} 127.0.0.1:{p} check" for i, p in enumerate(ports))
    values = {"BIND": bind, "PORT": str(port), "STATS_BIND": stats_bind, "STATS_PORT": str(stats_port),
              "SERVERS": servers}  # fmt: skip
    text = TEMPLATE.read_text()
    for name, value in values.items():
        text = text.replace("{{" + name + "}}", value)
    return text


def serve_command() -> list[str]:
    """`ouro-fast` beside the launcher's interpreter (a venv), else on PATH (a system Python keeps its
    scripts elsewhere), else the interpreter running the module (-P where there is one: not a source
    tree in the working directory)."""
    script = Path(sys.executable).with_name("ouro-fast")
    if script.exists():
        return [str(script)]
    found = shutil.which("ouro-fast")
    if found:
        return [found]
    return [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", "ouro_fast.cli"]


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class Replica:
    """One `ouro-fast serve` on one GPU and port, logging to run_dir/replica-<i>.log."""

    def __init__(self, index: int, gpu: str, port: int, serve_args: list[str], run_dir: Path):
        self.index, self.gpu, self.port, self.serve_args, self.run_dir = index, gpu, port, serve_args, run_dir
        self.proc: subprocess.Popen | None = None
        self.exited_at: float | None = None

    def start(self) -> None:
        argv = [*serve_command(), "serve", "--host", "127.0.0.1", "--port", str(self.port), *self.serve_args]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": self.gpu}
        with open(self.run_dir / f"replica-{self.index}.log", "ab") as log:
            # Its own session: a Ctrl-C at the launcher's terminal reaches the launcher only.
            self.proc = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        (self.run_dir / f"replica-{self.index}.pid").write_text(f"{self.proc.pid}\n")
        self.exited_at = None
        print(f"replica-{self.index}: pid {self.proc.pid}, GPU {self.gpu}, port {self.port}", flush=True)

    def supervise(self) -> None:
        """Start the replica again once it exited: at once after a clean stop, else after a pause."""
        code = self.proc.poll()
        if code is None:
            return
        now = time.monotonic()
        if self.exited_at is None:
            self.exited_at = now
            print(f"replica-{self.index}: exited with {code}; starting it again", flush=True)
        if code == 0 or now - self.exited_at >= RESTART_PAUSE_S:
            self.start()


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", required=True, metavar="LIST", help="comma-separated GPU ids, one replica each")
    p.add_argument("--port", type=int, default=8000, metavar="N", help="HAProxy's port (default 8000)")
    p.add_argument("--bind", default="0.0.0.0", metavar="ADDRESS", help="HAProxy's address (default 0.0.0.0)")
    p.add_argument("--base-port", type=int, default=8001, metavar="N", help="replica i serves on N + i")
    p.add_argument(
        "--stats-port", type=int, default=8404, metavar="N", help="HAProxy's stats page, on 127.0.0.1"
    )
    p.add_argument(
        "--run-dir", type=Path, default=Path("run"), metavar="DIR", help="logs, pid files, haproxy.cfg"
    )
    p.add_argument("--haproxy", default="haproxy", metavar="PATH", help="the haproxy executable")
    return p.parse_args(own), serve_args


def main(argv: list[str] | None = None) -> int:
    args, serve_args = parse_args(sys.argv[1:] if argv is None else argv)
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    args.run_dir.mkdir(parents=True, exist_ok=True)
    replicas = [Replica(i, g, args.base_port + i, serve_args, args.run_dir) for i, g in enumerate(gpus)]
    config = args.run_dir / "haproxy.cfg"
    config.write_text(render_config([r.port for r in replicas], args.port, args.bind, args.stats_port))
    subprocess.run([args.haproxy, "-c", "-q", "-f", str(config)], check=True)
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    for r in replicas:
        r.start()
    with open(args.run_dir / "haproxy.log", "ab") as log:
        haproxy = subprocess.Popen(
            [args.haproxy, "-db", "-f", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    print(
        f"haproxy: pid {haproxy.pid}, http://{args.bind}:{args.port}, stats http://127.0.0.1:{args.stats_port}/stats",
        flush=True,
    )
    announced = False
    while not stopping and haproxy.poll() is None:
        for r in replicas:
            r.supervise()
        if not announced and all(healthy(r.port) for r in replicas):
            announced = True
            print(f"all {len(replicas)} replicas ready", flush=True)
        time.sleep(1.0)
    return stop(haproxy, replicas)


def stop(haproxy: subprocess.Popen, replicas: list[Replica]) -> int:
    """HAProxy stops listening and finishes its open requests (SIGUSR1) while each replica drains."""
    if haproxy.poll() is None:
        haproxy.send_signal(signal.SIGUSR1)
    running = [r.proc for r in replicas if r.proc.poll() is None]
    for proc in running:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    codes = []
    for proc in [*running, haproxy]:
        try:
            codes.append(proc.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    print(f"stopped: exit codes {codes}", flush=True)
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
