"""Start and stop: /health before readiness, configuration and model-load failures, SIGTERM with
open streams on `sanic ouro_fast.server:app` in its default mode (a main process and one worker), and
the watchdog stopping the server (exit 1) when the engine-owner thread dies or stalls."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from ouro_fast import cli
from tests.server_helpers import ServerProcess, bench_stream

GRACE_S = 4.0
DRAIN_S = 3.0
LONG_TOKENS = 1500
MODEL = "ouro-tiny-random"


def test_bad_configuration_exits_2(tmp_path, capsys):
    saved = dict(os.environ)
    try:
        for args, env, message in (
            (["--model", str(tmp_path)], {}, "not a checkpoint directory"),
            ([], {"OURO_FAST_MAX_NUM_SEQS": "many"}, "OURO_FAST_MAX_NUM_SEQS"),
            (["--shutdown-grace", "-1"], {}, "--shutdown-grace must be >= 0"),  # the flag given is named
            (["--drain-delay", "-1"], {}, "--drain-delay must be >= 0"),
            (["--dtype", "foo"], {}, "--dtype must be one of auto"),
            (["--device", "gpu"], {}, "--device must be auto, cpu, cuda or cuda:N"),
            (["--stall-limit", "0"], {}, "--stall-limit must be > 0"),
            (["--api-key-file", str(tmp_path / "none")], {}, "--api-key-file: cannot read"),
            (["--api-key-file", "f"], {"OURO_FAST_API_KEY": "k"}, "give one of OURO_FAST_API_KEY and --api"),
            (
                ["--api-key", "k"],
                {"OURO_FAST_API_KEY_FILE": "f"},
                "one of --api-key and OURO_FAST_API_KEY_FILE,",
            ),
        ):
            os.environ.update(env)
            assert cli.main(["serve", *args]) == 2
            assert message in capsys.readouterr().err
            os.environ.clear()
            os.environ.update(saved)
    finally:
        os.environ.clear()  # serve() writes its options into the environment
        os.environ.update(saved)


def test_model_load_failure_stops_the_server(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    srv = ServerProcess("cli", {}, ("--model", str(tmp_path)))
    try:
        assert srv.proc.wait(120) == 1
    finally:
        srv.stop()
    assert "the engine failed to start" in srv.log()


def test_sigterm_with_open_streams():
    """Admission stops, a short request finishes, a long one is aborted at the end of the grace period
    with a clean end of stream, the owner thread is joined and the process exits 0."""
    env = {"OURO_FAST_SHUTDOWN_GRACE": str(GRACE_S), "OURO_FAST_NUM_KV_BLOCKS": "1024"}
    srv = ServerProcess("multi", env)
    try:
        srv.wait_ready()
        # Not ready until the model is loaded and a first inference ran.
        loading = [body for status, body in srv.health_seen if status == 503]
        assert loading and all(body == {"status": "loading"} for body in loading)
        url = srv.url + "/v1/completions"
        results, started = {}, {"long": threading.Event(), "short": threading.Event()}

        def run(name: str, max_tokens: int, **extra) -> None:
            body = {"model": MODEL, "prompt": name, "max_tokens": max_tokens, "ignore_eos": True, **extra}
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            results[name] = bench_stream(url, body, on_first_chunk=started[name].set)

        # The long one runs every token through all 4 loops: it cannot finish within the grace period.
        # The short one exits every token after one loop: it finishes well within it.
        threads = [threading.Thread(target=run, args=("long", 2000))]
        threads.append(threading.Thread(target=run, args=("short", 40), kwargs={"max_loops": 1}))
        for t, name in zip(threads, ("long", "short")):
            t.start()
            assert started[name].wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        # While in-flight requests drain (the listener is still open), new ones are refused.
        time.sleep(0.3)
        r = httpx.post(url, json={"model": MODEL, "prompt": "late", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
        assert httpx.get(srv.url + "/health").status_code == 503
        for t in threads:
            t.join(60)
        assert srv.proc.wait(60) == 0
        elapsed = time.monotonic() - t0
    finally:
        srv.stop()
    short, long = results["short"], results["long"]
    assert short.done and short.text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert short.usage["completion_tokens"] == 40
    # The long one is cut at the grace deadline, but its stream still ends properly.
    assert long.done and long.error is None
    assert long.text_chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert 0 < long.usage["completion_tokens"] < 2000
    assert GRACE_S <= elapsed < GRACE_S + 20
    log = srv.log()
    assert "aborting 1 requests still in flight" in log and "the engine owner thread has ended" in log
    assert "Traceback" not in log


def test_sigterm_drains_before_admission_stops():
    """On SIGTERM /health turns 503 at once while requests are still served for the drain delay (the
    balancer's health check notices first); then admission stops with 503 + Retry-After, a stream
    started before the signal runs to its end, and the process exits 0."""
    env = {"OURO_FAST_DRAIN_DELAY": str(DRAIN_S), "OURO_FAST_SHUTDOWN_GRACE": "120"}
    srv = ServerProcess("cli", env)
    url = srv.url + "/v1/completions"
    late = {"model": MODEL, "prompt": "late", "max_tokens": 2}
    try:
        srv.wait_ready()
        started, result = threading.Event(), {}

        def run() -> None:
            # All 4 loops per token: it outlives the drain delay, and finishes well within the grace.
            body = {"model": MODEL, "prompt": "long", "max_tokens": LONG_TOKENS, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            result["long"] = bench_stream(url, body, on_first_chunk=started.set)

        stream = threading.Thread(target=run)
        stream.start()
        assert started.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "draining"}, health.text
        assert health.headers["Retry-After"] == "1"
        during = httpx.post(url, json=late, timeout=30)
        assert during.status_code == 200, during.text
        assert time.monotonic() - signalled < DRAIN_S, "the drain delay ended before its checks ran"
        while (after := httpx.post(url, json=late, timeout=30)).status_code == 200:
            assert time.monotonic() - signalled < DRAIN_S + 30, "admission never stopped"
            time.sleep(0.1)
        assert after.status_code == 503 and after.headers["Retry-After"] == "1", after.text
        assert stream.is_alive(), "the stream ended before admission stopped: it tests nothing"
        stream.join(120)
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()
    long = result["long"]
    assert long.done and long.error is None
    assert long.text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert long.usage["completion_tokens"] == LONG_TOKENS
    assert "Traceback" not in srv.log()


def test_a_second_signal_aborts_in_flight_requests_at_once():
    """With a long drain delay and grace period, a second SIGTERM ends both: the stream in flight is aborted
    with a clean end of stream and the process exits 0 well before either would have run out."""
    long_stop = {"OURO_FAST_DRAIN_DELAY": "600", "OURO_FAST_SHUTDOWN_GRACE": "600"}
    srv = ServerProcess("cli", {**long_stop, "OURO_FAST_NUM_KV_BLOCKS": "1024"})
    try:
        srv.wait_ready()
        started, result = threading.Event(), {}

        def run() -> None:
            body = {"model": MODEL, "prompt": "long", "max_tokens": 2000, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            result["long"] = bench_stream(srv.url + "/v1/completions", body, on_first_chunk=started.set)

        stream = threading.Thread(target=run)
        stream.start()
        assert started.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "draining"}, health.text
        assert srv.proc.poll() is None and stream.is_alive(), "the stream ended before the second signal"
        signalled = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        stream.join(60)
        assert srv.proc.wait(60) == 0
        assert time.monotonic() - signalled < 30
    finally:
        srv.stop()
    long = result["long"]
    assert long.done and long.error is None
    assert long.text_chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert 0 < long.usage["completion_tokens"] < 2000
    log = srv.log()
    assert "a second stop signal" in log and "aborting 1 requests still in flight" in log
    assert "Traceback" not in log


def test_make_checkpoint_does_not_import_the_server():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from ouro_fast import cli\n"
        "try:\n    cli.main(['make-checkpoint', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'sanic' not in sys.modules and 'ouro_fast.server.app' not in sys.modules\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


DIE_SEED, STALL_SEED = 4242, 4343  # seeds the owner fault hook watches
STALL_LIMIT_S = 1.0


@pytest.mark.parametrize("fault, mode", [("die", "cli"), ("stall", "cli"), ("die", "sanic")])
def test_owner_death_or_stall_fails_requests_and_exits_1(fault, mode):
    """The owner's loop raises outside the engine step (die), or one step makes no progress past the
    stall limit (stall): within a second /health and new requests answer 503, the stream in flight
    gets an error event and a cut connection, the non-streamed request a 500, and the process exits 1."""
    env = {
        "OURO_FAST_TEST_OWNER_FAULTS": f"die@{DIE_SEED},stall@{STALL_SEED}",
        "OURO_FAST_NUM_KV_BLOCKS": "1024",
    }
    args = ("--stall-limit", str(STALL_LIMIT_S)) if mode == "cli" else ()
    env = env if mode == "cli" else {**env, "OURO_FAST_STALL_LIMIT": str(STALL_LIMIT_S)}
    srv = ServerProcess(mode, env, args)
    try:
        srv.wait_ready()
        url = srv.url + "/v1/completions"
        long = {"model": MODEL, "prompt": "long", "max_tokens": 2000, "ignore_eos": True}
        results, streaming = {}, threading.Event()

        def stream() -> None:
            body = {**long, "stream": True}
            results["stream"] = bench_stream(url, body, on_first_chunk=streaming.set)

        def plain() -> None:
            results["plain"] = httpx.post(url, json=long, timeout=60)

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert streaming.wait(60)
        seed = DIE_SEED if fault == "die" else STALL_SEED
        fault_at = time.monotonic()
        r = httpx.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": 2, "seed": seed}, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
        health = httpx.get(srv.url + "/health", timeout=10)
        # The contract: within 1 s of the failure (the fault, or the stall limit after it); generous here.
        assert time.monotonic() - fault_at < (STALL_LIMIT_S if fault == "stall" else 0) + 2.0
        assert health.status_code == 503 and health.headers["Retry-After"] == "1"
        assert health.json()["status"].startswith("failed: the engine owner"), health.text
        late = httpx.post(url, json={"model": MODEL, "prompt": "late", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "not_ready", late.text
        for t in threads:
            t.join(60)
        assert srv.proc.wait(60) == 1
    finally:
        srv.stop()
    streamed, plain_answer = results["stream"], results["plain"]
    assert not streamed.done and "error" in streamed.chunks[-1]  # an error event, then the cut
    assert plain_answer.status_code == 500 and plain_answer.json()["error"]["code"] == "engine_error"
    log = srv.log()
    if fault == "die":
        assert "the engine owner thread died: OwnerFault: injected owner fault" in log
    else:
        assert "the engine owner made no progress for" in log and "the engine owner thread has ended" in log
