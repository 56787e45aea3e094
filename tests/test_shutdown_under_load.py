"""SIGTERM while 32 streams are open, on `ouro-fast serve` in one process.

test_server_lifecycle.py covers one short and one long stream in Sanic's two-process
mode; this one holds 32 long streams at once, some of them never read after their first
chunk, and checks that every stream ends (finished with [DONE], or cut by the grace
deadline with finish_reason "abort", usage and [DONE]; none hangs), that the process
exits 0 within the grace period plus a bound, and that the owner thread was joined.
"""

from __future__ import annotations

import signal
import threading
import time

from tests.server_helpers import ServerProcess, bench_stream

MODEL = "ouro-tiny-random"
STREAMS = 32
RUNNING = 16  # OURO_FAST_MAX_NUM_SEQS: the other 16 streams wait in the scheduler
MAX_TOKENS = 1000
GRACE_S = 1.0
EXIT_BOUND_S = GRACE_S + 15.0  # the grace, the abort hand-off, the owner join and process teardown


def test_sigterm_with_32_open_streams():
    env = {
        "OURO_FAST_SHUTDOWN_GRACE": str(GRACE_S),
        "OURO_FAST_MAX_NUM_SEQS": str(RUNNING),
        "OURO_FAST_NUM_KV_BLOCKS": "8192",  # room for all 16 running to the end: no preemption
    }
    srv = ServerProcess("cli", env)
    try:
        srv.wait_ready()
        url = srv.url + "/v1/completions"
        results: dict[int, object] = {}
        signalled = threading.Event()

        def run(i: int) -> None:
            # Long enough that none can finish before the signal: all 4 loops per token.
            body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            # Even streams stop reading after their first chunk until the signal (slow readers).
            on_first = (lambda: signalled.wait(60)) if i % 2 == 0 else None
            results[i] = bench_stream(url, body, on_first_chunk=on_first)

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(STREAMS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120

        def all_admitted(m: dict) -> bool:
            engine = m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"]
            return (
                m["ouro_fast:requests_in_flight"] == engine == STREAMS
                and m["vllm:generation_tokens_total"] >= RUNNING
            )

        while not all_admitted(m := srv.metrics()):
            assert time.monotonic() < deadline, m
            time.sleep(0.05)
        # 16 hold KV and stream, 16 wait in the scheduler behind them.
        assert (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]) == (
            RUNNING,
            STREAMS - RUNNING,
        )
        srv.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        signalled.set()
        code = srv.proc.wait(EXIT_BOUND_S + 30)
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a client is still waiting on its stream"
    finally:
        srv.stop()
    log = srv.log()
    assert code == 0, log[-3000:]
    assert elapsed < EXIT_BOUND_S, elapsed
    assert "the engine owner thread has ended" in log and "Traceback" not in log
    assert f"aborting {STREAMS} requests still in flight" in log
    assert len(results) == STREAMS
    started = [got for got in results.values() if got.status == 200]
    unstarted = [got for got in results.values() if got.status != 200]
    assert len(started) == RUNNING, [got.status for got in results.values()]
    for got in started:
        # Cut at the deadline, cleanly: the last text chunk says abort, usage counts what was
        # sent, then [DONE]; no transport error.
        assert got.done and got.error is None, (got.error, got.raw[-300:])
        assert got.text_chunks[-1]["choices"][0]["finish_reason"] == "abort", got.chunks[-2:]
        assert 0 < got.usage["completion_tokens"] < MAX_TOKENS
    for got in unstarted:
        # Aborted before their first token: a real HTTP status, retryable.
        assert got.status == 503 and got.body["error"]["code"] == "aborted", (got.status, got.body)
