"""Serving benchmark: ouro_fast behind HTTP, measured by the unmodified vLLM 0.33.0 client.

One invocation serves one configuration: it generates (or takes) a checkpoint,
starts `ouro-fast serve` (as `python -m ouro_fast.cli serve`, outside the repo
root) on 127.0.0.1 at a free port and waits for GET /health == 200 (generation,
start-up and warm-up are not measured; the start-up time is recorded). Then, per
depth policy (full depth, and each --exit-threshold sent through the client's
--extra-body, same server), it runs one warm-up `vllm bench serve` and the
measured runs: every --concurrency C:N (request rate inf) and, for full depth,
the --rate R:N run (Poisson arrivals, no concurrency cap).

Every result file is validated: zero failed, all prompts completed, every
output_len equal to --output-len, every input_len (the server's usage count,
which the client adopts) equal to the length the client's own tokenizer gave
that prompt (the runs' datasets are rebuilt in the client's interpreter before
the server starts), and against the server's /metrics deltas over the run:
total_input_tokens equal to the prompt tokens the server counted, the output
tokens equal to the server's, every request finished for length, nothing
rejected or aborted; and TTFT/TPOT/ITL/E2EL means, medians and p99 present.
All runs go ahead; the exit status is 1 if any run failed validation, after
manifest.json and summary.md are written.

Output (--out DIR, default bench/results/serve-<UTC time>): results/<run>.json (the client's raw
files, --save-detailed), manifest.json (machine, commit, model, server and client command lines, start-up
seconds, per-run /metrics deltas with the loop-depth histogram, the final /metrics
text), summary.md, server.log and logs/<run>.log.

Run from the repo root:
  python -m bench.serve_bench --preset tiny --dtype float32 --device cpu --runner torch --quick \
      --exit-threshold 0.5
  python3 -m bench.serve_bench --preset ouro-1.4b --dtype bfloat16 --device cuda \
      --client-python python3 --exit-threshold 0.5     # GPU machine (bench/gpu/serve_gpu.sh does this)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.benchlib import cpu_model, default_out, git_commit

DEFAULT_CLIENT_PYTHON = "/tmp/ouro_fast-vllm-client/bin/python"
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "p99")
# Counters whose deltas must be zero over a clean run.
MUST_STAY_ZERO = ("ouro_fast:requests_rejected_total", "ouro_fast:requests_aborted_total")


# ---- /metrics parsing and deltas ----------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text page as (name, labels, value); comments and blank lines skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"unparsable /metrics line: {line!r}")
        labels = dict(_LABEL.findall(m.group(3) or ""))
        samples.append((m.group(1), labels, float(m.group(4))))
    return samples


def metric_sum(samples: list, name: str, **want: str) -> float:
    """Sum of `name` over every label set that carries the `want` labels."""
    return sum(
        v for n, labels, v in samples if n == name and all(labels.get(k) == x for k, x in want.items())
    )


def _by_label(samples: list, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for n, labels, v in samples:
        if n == name and label in labels:
            out[labels[label]] = out.get(labels[label], 0.0) + v
    return out


def metrics_delta(before: list, after: list) -> dict:
    """What the server counted between two /metrics snapshots (ints where the counter is a count)."""

    def d(name: str, **want: str) -> float:
        return metric_sum(after, name, **want) - metric_sum(before, name, **want)

    def labelled(name: str, label: str) -> dict[str, int]:
        a, b = _by_label(after, name, label), _by_label(before, name, label)
        return {k: int(round(v - b.get(k, 0.0))) for k, v in a.items() if round(v - b.get(k, 0.0))}

    # The depth histogram is cumulative by `le`: difference of neighbours gives tokens per depth.
    cum_a = _by_label(after, "ouro_fast:token_exit_depth_bucket", "le")
    cum_b = _by_label(before, "ouro_fast:token_exit_depth_bucket", "le")
    depths = sorted((k for k in cum_a if k != "+Inf"), key=float)
    hist, prev = {}, 0
    for k in depths:
        c = int(round(cum_a[k] - cum_b.get(k, 0.0)))
        hist[str(int(float(k)))] = c - prev
        prev = c
    depth_count = int(round(d("ouro_fast:token_exit_depth_count")))
    depth_sum = d("ouro_fast:token_exit_depth_sum")
    return {
        "prompt_tokens": int(round(d("vllm:prompt_tokens_total"))),
        "generation_tokens": int(round(d("vllm:generation_tokens_total"))),
        "finished_by_reason": labelled("vllm:request_success_total", "finished_reason"),
        "rejected": labelled("ouro_fast:requests_rejected_total", "reason"),
        "aborted": labelled("ouro_fast:requests_aborted_total", "reason"),
        "engine_steps": int(round(d("ouro_fast:engine_steps_total"))),
        # Steps the device drove, the runs they came in, and the prompts that rode in them.
        "run_ahead_steps": int(round(d("ouro_fast:run_ahead_steps_total"))),
        "run_ahead_runs": int(round(d("ouro_fast:run_ahead_runs_total"))),
        "run_ahead_riders": int(round(d("ouro_fast:run_ahead_riders_total"))),
        # Of run_ahead_steps, those where a row exited (the rest skipped the lm_head).
        "run_ahead_exit_steps": int(round(d("ouro_fast:run_ahead_exit_steps_total"))),
        "run_ahead_rider_steps": int(round(d("ouro_fast:run_ahead_rider_steps_total"))),
        "run_ahead_shared_prefix_steps": int(round(d("ouro_fast:run_ahead_shared_prefix_steps_total"))),
        "engine_step_failures": int(round(d("ouro_fast:engine_step_failures_total"))),
        "loop_rows": labelled("ouro_fast:loop_rows_total", "loop"),
        "exit_depth_histogram": hist,
        "exit_depth_tokens": depth_count,
        "mean_exit_depth": round(depth_sum / depth_count, 3) if depth_count else None,
    }


# ---- validation of one result file --------------------------------------------------------------


def validate_result(
    result: dict, num_prompts: int, output_len: int, server: dict | None, prompt_lens: list[int] | None
) -> list[str]:
    """Every reason this client result (and the server's deltas over its run) is not a clean run.

    `server` is metrics_delta() over the run; `prompt_lens` the prompt lengths by
    the client's own tokenizer (client_prompt_lens()), in request order. The
    client replaces each input_lens[i] with the server's usage.prompt_tokens, so
    comparing the two checks both tokenizers per request. None for either means
    it could not be obtained, which is itself an error. An empty list means valid.
    """
    errors = []
    completed, failed = result.get("completed"), result.get("failed")
    if failed != 0:
        errs = [e for e in result.get("errors") or [] if e][:3]
        errors.append(f"failed = {failed} (want 0); first errors: {errs}")
    if completed != num_prompts:
        errors.append(f"completed = {completed}, want {num_prompts} (--num-prompts)")
    outs = result.get("output_lens")
    if not isinstance(outs, list) or len(outs) != num_prompts:
        errors.append(f"output_lens missing or not {num_prompts} long (was --save-detailed given?)")
    else:
        bad = [(i, n) for i, n in enumerate(outs) if n != output_len]
        if bad:
            errors.append(
                f"{len(bad)} output_lens != {output_len} (--ignore-eos), first (index, len): {bad[:5]}"
            )
    ins = result.get("input_lens")
    total_in = result.get("total_input_tokens")
    if not isinstance(ins, list) or len(ins) != num_prompts:
        errors.append(f"input_lens missing or not {num_prompts} long")
    elif sum(ins) != total_in:
        errors.append(f"sum(input_lens) = {sum(ins)} but total_input_tokens = {total_in}")
    elif prompt_lens is None:
        errors.append("the client's own prompt lengths are unknown: input_lens not cross-checked")
    elif ins != prompt_lens:
        bad = [(i, c, s) for i, (c, s) in enumerate(zip(prompt_lens, ins)) if c != s]
        bad += [("count", len(prompt_lens), len(ins))] if len(prompt_lens) != len(ins) else []
        errors.append(
            f"{len(bad)} prompts tokenized differently by the client and the server, first (index, client, "
            f"server): {bad[:5]}"
        )
    total_out = result.get("total_output_tokens")
    if total_out != num_prompts * output_len:
        errors.append(f"total_output_tokens = {total_out}, want {num_prompts} x {output_len}")
    for metric in PERCENTILE_METRICS:
        for stat in STATS:
            key = f"{stat}_{metric}_ms"
            v = result.get(key)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                errors.append(f"{key} missing or not a finite number >= 0: {v!r} (--percentile-metrics?)")
    ttfts = result.get("ttfts")
    if (
        not isinstance(ttfts, list)
        or len(ttfts) != num_prompts
        or not all(isinstance(t, (int, float)) and t > 0 for t in ttfts)
    ):
        errors.append("ttfts missing, short, or not all > 0")
    if output_len > 1 and not any(result.get("itls") or []):
        errors.append("itls empty: no request saw a second chunk")
    errors += _server_errors(server, total_in, total_out, num_prompts)
    return errors


def _server_errors(server: dict | None, total_in: object, total_out: object, num_prompts: int) -> list[str]:
    if server is None:
        return ["the server's /metrics could not be read around the run: token counts not cross-checked"]
    errors = []
    if server["prompt_tokens"] != total_in:
        errors.append(
            f"client total_input_tokens = {total_in} but the server counted {server['prompt_tokens']} "
            "prompt tokens (the client's tokenizer disagrees with the server's)"
        )
    if server["generation_tokens"] != total_out:
        errors.append(
            f"client total_output_tokens = {total_out}, server generated {server['generation_tokens']}"
        )
    if server["finished_by_reason"] != {"length": num_prompts}:
        errors.append(f"server finished {server['finished_by_reason']}, want {{'length': {num_prompts}}}")
    for key in ("rejected", "aborted"):
        if server[key]:
            errors.append(f"server {key} requests during the run: {server[key]}")
    if server["engine_step_failures"]:
        errors.append(f"{server['engine_step_failures']} engine steps raised during the run")
    return errors


def validate_file(
    path: str | Path, num_prompts: int, output_len: int, server: dict | None, prompt_lens: list[int] | None
) -> list[str]:
    """validate_result() of a saved result file; a missing or unreadable file is an error too."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        return [f"no readable result file {path}: {e}"]
    if not isinstance(result, dict):
        return [f"{path} does not hold a JSON object"]
    return validate_result(result, num_prompts, output_len, server, prompt_lens)


# ---- the server -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


class Server:
    """An `ouro-fast serve` subprocess; its output goes to a log file."""

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: Path, log: Path, port: int):
        self.cmd, self.port, self.log = cmd, port, log
        self.base = f"http://127.0.0.1:{port}"
        self._log = open(log, "w")  # noqa: SIM115 (closed in stop())
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float) -> float:
        """Seconds from launch to GET /health == 200; RuntimeError (with the log's tail) otherwise."""
        deadline = self.started + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}) before ready:\n{self.tail()}")
            try:
                if http_get(self.base + "/health", timeout=2.0)[0] == 200:
                    return time.perf_counter() - self.started
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the server was not ready within {timeout:g} s:\n{self.tail()}")

    def metrics_text(self) -> str:
        status, body = http_get(self.base + "/metrics")
        if status != 200:
            raise RuntimeError(f"GET /metrics answered {status}")
        return body

    def quiet_metrics(self, timeout: float = 30.0) -> str:
        """/metrics once no request is in flight (the counters of a finished run are all in)."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.metrics_text()
            if (
                metric_sum(parse_metrics(text), "ouro_fast:requests_in_flight") == 0
                or time.monotonic() > deadline
            ):
                return text
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self, grace: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


# ---- runs ------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One `vllm bench serve` invocation against the running server."""

    label: str
    policy: str  # "full" or "exit_threshold=X"
    num_prompts: int
    concurrency: int | None  # None: no cap (the rate run)
    request_rate: float  # inf: all at once
    extra_body: dict | None = None
    record: dict = field(default_factory=dict)


def parse_pairs(spec: str, kind: type) -> list[tuple]:
    """'1:32,8:64' -> [(1, 32), (8, 64)]; '' -> []."""
    pairs = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        a, _, b = part.partition(":")
        if not b:
            raise argparse.ArgumentTypeError(f"{part!r}: want VALUE:PROMPTS")
        pairs.append((kind(a), int(b)))
    return pairs


def plan_runs(args: argparse.Namespace) -> list[Run]:
    """Full depth: each concurrency, then the rate run; each exit threshold: each concurrency."""
    runs = []
    policies: list[tuple[str, dict | None]] = [("full", None)]
    policies += [(f"exit_threshold={t:g}", {"exit_threshold": t}) for t in args.exit_threshold]
    for policy, body in policies:
        tag = "full" if body is None else f"thr{body['exit_threshold']:g}"
        for c, n in args.concurrency:
            runs.append(Run(f"{tag}-c{c}", policy, n, c, math.inf, body))
        if body is None:
            for r, n in args.rate:
                runs.append(Run(f"{tag}-rate{r:g}", policy, n, None, r, body))
    return runs


def client_command(
    args: argparse.Namespace, base: str, name: str, tokenizer: Path, run: Run, out: Path | None, seed: int
) -> list[str]:
    """The client's command line; `out` None (the warm-ups) saves no result file."""
    cmd = [
        *shlex.split(args.client_python), "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", base,
        "--model", name, "--tokenizer", str(tokenizer), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(run.num_prompts), "--request-rate", f"{run.request_rate:g}",
        "--ignore-eos", "--percentile-metrics", ",".join(PERCENTILE_METRICS), "--seed", str(seed),
        "--disable-tqdm",
    ]  # fmt: skip
    if run.concurrency is not None:
        cmd += ["--max-concurrency", str(run.concurrency)]
    if run.extra_body:
        cmd += ["--extra-body", json.dumps(run.extra_body)]
    if out is not None:
        cmd += [
            "--save-result",
            "--save-detailed",
            "--result-dir",
            str(out.parent),
            "--result-filename",
            out.name,
        ]
    return cmd


def client_env() -> dict[str, str]:
    # VLLM_TARGET_DEVICE=cpu: the client must not look for vLLM's CUDA kernels; offline: local tokenizer only.
    return {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run_client(cmd: list[str], log: Path, cwd: Path, timeout: float) -> tuple[int, float]:
    """(exit status, wall seconds) of one client invocation; its output goes to `log`."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(
                cmd, env=client_env(), cwd=cwd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[serve_bench] client killed after {timeout:g} s\n")
            rc = 124
    return rc, round(time.perf_counter() - t0, 2)


def measure(
    args,
    server: Server,
    name: str,
    tokenizer: Path,
    run: Run,
    out: Path,
    work: Path,
    prompt_lens: list | None,
) -> None:
    """One measured run: counters before, the client, counters after, validation; fills run.record."""
    result = out / "results" / f"{run.label}.json"
    cmd = client_command(args, server.base, name, tokenizer, run, result, args.seed)
    rec = run.record
    rec.update(
        label=run.label,
        depth_policy=run.policy,
        num_prompts=run.num_prompts,
        concurrency=run.concurrency,
        request_rate="inf" if math.isinf(run.request_rate) else run.request_rate,
        extra_body=run.extra_body,
        command=shlex.join(cmd),
        result_file=f"results/{result.name}",
        loadavg_before=_loadavg(),
    )
    before = _try_metrics(server)
    rc, wall = run_client(cmd, out / "logs" / f"{run.label}.log", work, args.client_timeout)
    after = _try_metrics(server) if server.alive() else None
    server_delta = metrics_delta(before, after) if before is not None and after is not None else None
    errors = [] if rc == 0 else [f"the client exited {rc} (see logs/{run.label}.log)"]
    if not server.alive():
        errors.append(f"the server died during the run:\n{server.tail(10)}")
    errors += validate_file(result, run.num_prompts, args.output_len, server_delta, prompt_lens)
    log_text = (out / "logs" / f"{run.label}.log").read_text(errors="replace")
    rec.update(
        exit_code=rc,
        wall_seconds=wall,
        loadavg_after=_loadavg(),
        server_delta=server_delta,
        client_metrics=_headline(result),
        ok=not errors,
        errors=errors,
        notes=[ln.strip() for ln in log_text.splitlines() if "tokenizer mismatch" in ln],
    )
    status = "ok" if not errors else "INVALID:\n  " + "\n  ".join(errors)
    print(f"[serve_bench] {run.label}: {status}", file=sys.stderr)


# Run in the client's interpreter: each run's dataset rebuilt exactly as `vllm bench serve` builds it
# (same parser, seed and tokenizer), and the prompt lengths its own tokenizer gives.
_PROMPT_LENS_CODE = """
import json, sys
from vllm.benchmarks.datasets import get_samples
from vllm.benchmarks.serve import add_cli_args
from vllm.tokenizers import get_tokenizer
from vllm.utils.argparse_utils import FlexibleArgumentParser
spec = json.load(sys.stdin)
parser = FlexibleArgumentParser()
add_cli_args(parser)
tokenizer = get_tokenizer(spec["tokenizer"])
lens = {}
for label, argv in spec["runs"].items():
    lens[label] = [r.prompt_len for r in get_samples(parser.parse_args(argv), tokenizer)]
print("PROMPT_LENS " + json.dumps(lens))
"""


def client_prompt_lens(args, name: str, tokenizer: Path, runs: list[Run], work: Path, manifest: dict) -> dict:
    """{run label: prompt lengths by the client's tokenizer}, before any server starts; {} if that fails."""
    skip = len(shlex.split(args.client_python)) + 4  # python -m vllm.entrypoints.cli.main bench serve
    # The dataset depends on the dataset flags, seed and tokenizer only: the URL is a placeholder.
    argvs = {r.label: client_command(args, "http://127.0.0.1:0", name, tokenizer, r, None, args.seed)[skip:]
             for r in runs}  # fmt: skip
    spec = json.dumps({"tokenizer": str(tokenizer), "runs": argvs})
    cmd = [*shlex.split(args.client_python), "-c", _PROMPT_LENS_CODE]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, input=spec, capture_output=True, text=True, env=client_env(), cwd=work,
                              timeout=args.client_timeout)  # fmt: skip
        line = [ln for ln in done.stdout.splitlines() if ln.startswith("PROMPT_LENS ")]
        lens = json.loads(line[-1].split(" ", 1)[1]) if line else {}
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        done, lens = None, {}
        print(f"[serve_bench] prompt lengths: {e}", file=sys.stderr)
    if not lens and done is not None:
        print(f"[serve_bench] prompt lengths failed:\n{done.stderr[-2000:]}", file=sys.stderr)
    manifest["client_prompt_lens"] = {"seconds": round(time.perf_counter() - t0, 2), "by_run": lens}
    return lens


def _try_metrics(server: Server) -> list | None:
    try:
        return parse_metrics(server.quiet_metrics())
    except (OSError, RuntimeError, ValueError) as e:
        print(f"[serve_bench] /metrics unreadable: {e}", file=sys.stderr)
        return None


def _headline(result_path: Path) -> dict:
    """The figures summary.md shows, from a result file (empty if there is none)."""
    try:
        r = json.loads(result_path.read_text())
    except (OSError, ValueError):
        return {}
    keys = ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "max_concurrency", "request_rate"]  # fmt: skip
    keys += [f"{s}_{m}_ms" for m in PERCENTILE_METRICS for s in STATS]
    head = {k: r.get(k) for k in keys}
    # One ITL sample per chunk: fewer samples than tokens after the first means chunks carried several.
    itls, outs = r.get("itls") or [], r.get("output_lens") or []
    gaps = sum(max(n - 1, 0) for n in outs)
    head["itl_samples"] = sum(len(x) for x in itls)
    head["itl_samples_per_token"] = round(head["itl_samples"] / gaps, 4) if gaps else None
    return head


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---- the model, the machine, the report ----------------------------------------------------------


def prepare_model(args: argparse.Namespace) -> tuple[Path, dict]:
    """The checkpoint directory (generated once per settings with --preset) and how it was made."""
    if args.model:
        return Path(args.model).resolve(), {"source": "given"}
    name = f"{args.preset}-{args.dtype}-bias{args.gate_bias:g}-seed{args.ckpt_seed}"
    out = Path(args.ckpt_dir).resolve() / name
    cmd = [args.server_python, "-m", "ouro_fast.cli", "make-checkpoint", "--preset", args.preset,
           "--dtype", args.dtype, "--gate-bias", str(args.gate_bias), "--seed", str(args.ckpt_seed),
           "--quiet", "--out", str(out)]  # fmt: skip
    made = {"source": "generated", "command": shlex.join(cmd), "generate_seconds": None}
    if not (out / ".complete").exists():
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=out.parent, stdout=subprocess.DEVNULL)
        (out / ".complete").write_text("ok\n")
        made["generate_seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[serve_bench] generated {out} in {made['generate_seconds']} s", file=sys.stderr)
    return out, made


def model_facts(model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "total_ut_steps",
        "early_exit_threshold",
        "torch_dtype",
        "vocab_size",
    )
    facts = {k: cfg.get(k) for k in keys}
    facts["random_init"] = cfg.get("ouro_fast_random_init")
    return facts


def gpu_name() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return ", ".join(x.strip() for x in out.stdout.splitlines() if x.strip()) or None


def client_version(args: argparse.Namespace) -> str:
    code = "import importlib.metadata as m; print(m.version('vllm'))"
    try:
        out = subprocess.run([*shlex.split(args.client_python), "-c", code],
                             capture_output=True, text=True, env=client_env(), timeout=60)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    return out.stdout.strip() or f"unknown ({out.stderr.strip()[-200:]})"


def _ms(v: object) -> str:
    return f"{v:,.2f} ms" if isinstance(v, (int, float)) else "-"


_DIRTY = {True: " (uncommitted changes)", False: "", None: " (working-tree state unknown)"}


def render_summary(manifest: dict) -> str:
    """summary.md: what was served where, then one table row per run."""
    m, mach, srv = manifest["model"], manifest["machine"], manifest.get("server", {})
    gpu = f", GPU {mach['gpu']}" if mach.get("gpu") else ""
    lines = [
        f"# Serving benchmark: {m['served_name']} ({m.get('preset') or 'a given checkpoint'}, "
        f"{manifest['dtype']})",
        "",
        f"- Machine: {mach['cpu']}, {mach['cores']} cores{gpu}; load average {mach['loadavg_start']} at the "
        f"start, {mach['loadavg_end']} at the end.",
        f"- Commit `{manifest['commit']}`{_DIRTY[manifest['dirty']]}; "
        f"runner {manifest['runner']}, device {manifest['device']}, max_num_seqs {manifest['max_num_seqs']}; "
        f"client vLLM {manifest['client']['version']}.",
        f"- Server ready {srv['startup_seconds']:.1f} s after launch (`{srv.get('ready_log_line') or '-'}`)."
        if "startup_seconds" in srv
        else "- The server never became ready (see server.log).",
        f"- Workload: random dataset, {manifest['workload']['input_len']} tokens in, "
        f"{manifest['workload']['output_len']} out, --ignore-eos, seed {manifest['workload']['seed']}; "
        f"validation: {'all runs valid' if manifest['ok'] else 'SOME RUNS INVALID (see manifest.json)'}.",
        "",
        "| run | depth policy | concurrency | prompts | output tok/s | median TTFT | p99 TTFT | "
        "median TPOT | p99 TPOT | median ITL | mean exit depth | valid |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in manifest["runs"]:
        cm = r.get("client_metrics") or {}
        conc = r["concurrency"] if r["concurrency"] is not None else f"rate {r['request_rate']:g}/s"
        depth = (r.get("server_delta") or {}).get("mean_exit_depth")
        tput = cm.get("output_throughput")
        cells = [
            r["label"], r["depth_policy"], conc, r["num_prompts"],
            f"{tput:,.1f}" if tput is not None else "-",
            _ms(cm.get("median_ttft_ms")), _ms(cm.get("p99_ttft_ms")),
            _ms(cm.get("median_tpot_ms")), _ms(cm.get("p99_tpot_ms")),
            _ms(cm.get("median_itl_ms")), f"{depth:.2f}" if depth is not None else "-",
            "yes" if r.get("ok") else "NO",
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    failures = [(r["label"], e) for r in manifest["runs"] for e in r.get("errors") or []]
    failures += [
        (w["label"], f"the client exited {w['exit_code']}") for w in manifest["warmups"] if w["exit_code"]
    ]
    failures += [(label, "not run") for label in manifest.get("not_run", [])]
    if manifest.get("fatal"):
        failures.append(("serve_bench", manifest["fatal"]))
    if failures:
        lines += ["", "## Validation errors", ""] + [f"- {label}: {e}" for label, e in failures]
    return "\n".join(lines) + "\n"


# ---- main -------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serve_bench", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory to serve")
    src.add_argument("--preset", help="generate this preset (ouro-fast make-checkpoint) into --ckpt-dir")
    p.add_argument(
        "--ckpt-dir", default="/tmp/ouro_fast-serve-bench-ckpt", help="cache of generated checkpoints"
    )
    p.add_argument(
        "--gate-bias", type=float, default=-1.0, help="make-checkpoint's exit-gate centre (its default)"
    )
    p.add_argument("--ckpt-seed", type=int, default=0)
    p.add_argument("--served-model-name", help="default: the preset, or the checkpoint folder's name")
    p.add_argument("--dtype", default="float32", help="checkpoint and server dtype")
    p.add_argument("--device", default="auto")
    p.add_argument("--runner", default="auto", help="auto, torch or triton")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra server environment")
    p.add_argument("--server-python", default=sys.executable, help="interpreter with ouro_fast installed")
    p.add_argument(
        "--client-python",
        default=DEFAULT_CLIENT_PYTHON,
        help="interpreter that imports vllm 0.33.0 (the client venv, or python3 with PYTHONPATH)",
    )
    p.add_argument("--quick", action="store_true", help="small prompt counts (CPU tiny preset)")
    p.add_argument(
        "--concurrency", help="C:PROMPTS list at request rate inf (default 1:32,8:64; quick 1:8,8:16)"
    )
    p.add_argument(
        "--rate", help="RATE:PROMPTS list, full depth only, '' for none (default 4:64; quick 4:16)"
    )
    p.add_argument(
        "--exit-threshold",
        type=float,
        action="append",
        default=[],
        help="also run the concurrency list with --extra-body {exit_threshold: X} (repeatable)",
    )
    p.add_argument(
        "--warmup-prompts", type=int, help="prompts of each policy's warm-up run (default 16; quick 8)"
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="the client's dataset seed")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--client-timeout", type=float, default=900.0)
    p.add_argument("--commit", help="the commit to record when the tree has no .git (append +dirty if so)")
    p.add_argument("--out", help="results folder (default: bench/results/serve-<UTC time>)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.concurrency = parse_pairs(args.concurrency or ("1:8,8:16" if args.quick else "1:32,8:64"), int)
    args.rate = parse_pairs(args.rate if args.rate is not None else ("4:16" if args.quick else "4:64"), float)
    if args.warmup_prompts is None:
        args.warmup_prompts = 8 if args.quick else 16
    if not args.concurrency and not args.rate:
        raise SystemExit("nothing to run: --concurrency and --rate are both empty")
    for kv in args.env:
        if "=" not in kv:
            raise SystemExit(f"--env {kv!r}: want KEY=VALUE")
    return args


def _terminate(signum: int, frame: object) -> None:
    # SIGTERM (an outer `timeout`) unwinds like an exception: the server is stopped, the manifest written.
    raise SystemExit(128 + signum)


def commit_dirty(commit: str, detected: str) -> bool | None:
    """Whether the tree differs from `commit`: "+dirty" on it says so; otherwise git's state when git sees
    that very commit, else unknown (a copy without .git may sit inside another repository)."""
    if commit.endswith("+dirty"):
        return True
    same = detected and detected.removesuffix("+dirty").startswith(commit)
    return detected.endswith("+dirty") if same else None


def run_header(args: argparse.Namespace) -> dict:
    """The manifest's opening: machine, commit, settings, client, taken before anything runs."""
    detected = git_commit().replace("unknown", "")  # "" without git or a .git (the GPU machine's copy)
    commit = args.commit or detected or "unknown"
    dirty = commit_dirty(commit, detected)
    machine = {"cpu": cpu_model(), "cores": os.cpu_count(), "gpu": gpu_name(), "loadavg_start": _loadavg()}
    return {
        "tool": "bench/serve_bench.py",
        "argv": args.argv,
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "commit": commit.removesuffix("+dirty"),
        "dirty": dirty,
        "dtype": args.dtype, "device": args.device, "runner": args.runner, "max_num_seqs": args.max_num_seqs,
        "workload": {"dataset": "random", "input_len": args.input_len, "output_len": args.output_len,
                     "seed": args.seed, "warmup_prompts": args.warmup_prompts},
        "client": {"python": args.client_python, "version": client_version(args)},
        "warmups": [],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, _terminate)
    out = Path(args.out or default_out("serve")).resolve()
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    Path(args.ckpt_dir).mkdir(parents=True, exist_ok=True)
    # The cwd of every child: never the repo root, whose ouro_fast/ has no compiled core on the GPU machine.
    work = Path(args.ckpt_dir).resolve()
    manifest = run_header(args)
    model_dir, provenance = prepare_model(args)
    name = args.served_model_name or args.preset or model_dir.name
    manifest["model"] = {"preset": args.preset, "dir": str(model_dir), "served_name": name, **provenance,
                         "config": model_facts(model_dir)}  # fmt: skip
    tokenizer = model_dir / "tokenizer"
    runs = plan_runs(args)
    prompt_lens = client_prompt_lens(args, name, tokenizer, runs, work, manifest)
    server = None
    try:
        server = start_server(args, model_dir, name, out, work, manifest)
        for run in runs:
            if all(w["policy"] != run.policy for w in manifest["warmups"]):
                manifest["warmups"].append(warm_up(args, server, name, tokenizer, run, out, work))
            measure(args, server, name, tokenizer, run, out, work, prompt_lens.get(run.label))
        manifest["metrics_after"] = server.metrics_text() if server.alive() else None
    except (RuntimeError, OSError) as e:
        manifest["fatal"] = str(e)
        print(f"[serve_bench] FAILED: {e}", file=sys.stderr)
    finally:
        if server is not None:
            manifest["server"]["exit_code"] = server.stop()
        for r in runs:
            if r.record and "ok" not in r.record:
                r.record.update(ok=False, errors=["stopped before the run finished"])
        manifest["runs"] = [r.record for r in runs if r.record]
        manifest["not_run"] = [r.label for r in runs if not r.record]
        warm_ok = all(w["exit_code"] == 0 for w in manifest["warmups"])
        manifest["ok"] = "fatal" not in manifest and warm_ok and all(r.record.get("ok") for r in runs)
        manifest["machine"]["loadavg_end"] = _loadavg()
        manifest["finished_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        if "model" in manifest:
            (out / "summary.md").write_text(render_summary(manifest))
    print(f"[serve_bench] {'all runs valid' if manifest['ok'] else 'FAILED'}: {out}", file=sys.stderr)
    return 0 if manifest["ok"] else 1


def warm_up(args, server: Server, name: str, tokenizer: Path, first: Run, out: Path, work: Path) -> dict:
    """An unmeasured client run of the policy of `first`, at the highest concurrency; its record."""
    conc = max((c for c, _ in args.concurrency), default=None)
    label = "warmup-" + first.label.split("-")[0]
    warm = Run(label, first.policy, args.warmup_prompts, conc, math.inf, first.extra_body)
    # Other prompts than the measured runs', so no cache of any kind could carry over.
    cmd = client_command(args, server.base, name, tokenizer, warm, None, args.seed + 1)
    rc, wall = run_client(cmd, out / "logs" / f"{label}.log", work, args.client_timeout)
    print(f"[serve_bench] {label}: client exit {rc} in {wall} s", file=sys.stderr)
    return {"label": label, "policy": first.policy, "command": shlex.join(cmd), "exit_code": rc,
            "wall_seconds": wall}  # fmt: skip


def start_server(args, model_dir: Path, name: str, out: Path, work: Path, manifest: dict) -> Server:
    """Launch `ouro-fast serve` and wait for /health; records the command and start-up in the manifest."""
    port = free_port()
    cmd = [args.server_python, "-m", "ouro_fast.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", str(model_dir), "--served-model-name", name, "--dtype", args.dtype,
           "--device", args.device, "--runner", args.runner,
           "--max-num-seqs", str(args.max_num_seqs)]  # fmt: skip
    extra = dict(kv.split("=", 1) for kv in args.env)
    manifest["server"] = {"command": shlex.join(cmd), "extra_env": extra, "cwd": str(work)}
    server = Server(cmd, {**os.environ, **extra}, work, out / "server.log", port)
    try:
        manifest["server"]["startup_seconds"] = round(server.wait_healthy(args.startup_timeout), 2)
    except BaseException:
        manifest["server"]["exit_code"] = server.stop()
        raise
    ready = [
        ln for ln in server.log.read_text(errors="replace").splitlines() if "process start to ready" in ln
    ]
    manifest["server"]["ready_log_line"] = (
        ready[-1].split(": ", 1)[-1].split("; serving")[0] if ready else None
    )
    print(
        f"[serve_bench] server ready in {manifest['server']['startup_seconds']} s on {server.base}",
        file=sys.stderr,
    )
    return server


if __name__ == "__main__":
    sys.exit(main())
