"""Run AIPerf scenarios against ouro_fast, validate every run, and write manifests.

For the chosen scenarios (bench/aiperf/scenarios.json; their AIPerf configs in
bench/aiperf/scenarios/) it takes or generates a checkpoint (as
bench/serve_bench.py does), lays the tokenizer out as a Hugging Face hub cache
(AIPerf loads it offline as `local/<name>`), and starts `ouro-fast serve` once
per distinct set of server settings a scenario asks for (e.g. a small KV pool).
Per scenario it reads /metrics, runs `aiperf profile --config <scenario>.yaml`
with the run's values in the config's ${OURO_*} variables, reads /metrics
again, and validates (bench/aiperf/validate.py): no request error, every
request returned exactly its max_tokens as counted by the server, the server's
counters agree with AIPerf's records, AIPerf's server-metrics export lists the
vLLM-named and ouro_fast:* metrics and meets the scenario's expectations.

Output (--out DIR, default bench/results/aiperf-<UTC time>): manifest.json and summary.md for
the run; per scenario DIR/<scenario>/ with its own manifest.json, AIPerf's summary
(profile_export_aiperf.json/.csv), per-request records (profile_export.jsonl),
the server-metrics export (server_metrics_export.json/.csv) and aiperf.log
(--keep-all also keeps inputs.json, AIPerf's logs and per-phase files); server
logs as server-<n>.log. Exit status 1 if any scenario is invalid (after
everything is written), 2 on bad arguments.

  bash bench/aiperf/setup.sh                  # the AIPerf venv, /tmp/ouro_fast-aiperf
  python -m bench.aiperf.run --scenario smoke --preset tiny --dtype float32 --device cpu --runner torch
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.aiperf import manifest as mf
from bench.aiperf.validate import validate_artifacts
from bench.benchlib import default_out
from bench.serve_bench import Server, free_port, metrics_delta, model_facts, parse_metrics, prepare_model

HERE = Path(__file__).resolve().parent
CATALOGUE = HERE / "scenarios.json"
DEFAULT_AIPERF = os.environ.get("AIPERF_VENV", "/tmp/ouro_fast-aiperf") + "/bin/aiperf"
# AIPerf files kept in a scenario folder; the rest (prompts, its logs, per-phase copies) only with --keep-all.
KEEP = ("profile_export_aiperf.json", "profile_export_aiperf.csv", "profile_export.jsonl",
        "server_metrics_export.json", "server_metrics_export.csv", "aiperf.log", "manifest.json")  # fmt: skip
LOG_TAIL_LINES = 300
HUB_REVISION = "0" * 40


def load_catalogue(path: Path = CATALOGUE) -> dict[str, dict]:
    """{scenario name: its entry}, in file order."""
    return json.loads(path.read_text())["scenarios"]


def select(catalogue: dict[str, dict], names: list[str]) -> list[str]:
    """Scenario names in catalogue order; 'all' means every one but smoke. SystemExit on an unknown name."""
    wanted = [n for part in names for n in part.split(",") if n]
    if "all" in wanted:
        wanted = [n for n in catalogue if n != "smoke"] + [n for n in wanted if n not in ("all",)]
    unknown = [n for n in wanted if n not in catalogue]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; known: {', '.join(catalogue)}")
    return [n for n in catalogue if n in wanted]


def server_groups(catalogue: dict[str, dict], names: list[str]) -> list[tuple[dict, list[str]]]:
    """Scenarios grouped by the server settings they need (one server per group), in first-use order."""
    groups: list[tuple[dict, list[str]]] = []
    for n in names:
        env = catalogue[n].get("server_env") or {}
        for genv, members in groups:
            if genv == env:
                members.append(n)
                break
        else:
            groups.append((env, [n]))
    return groups


def hub_cache(tokenizer_dir: Path, hf_home: Path) -> str:
    """Lay the tokenizer files out as a hub cache under hf_home; the repo id to pass as AIPerf's tokenizer.

    AIPerf loads a tokenizer through the hub's snapshot lookup, which with HF_HUB_OFFLINE=1 only finds
    `hub/models--local--NAME/snapshots/<revision>` named by `refs/main`. NAME comes from tokenizer.json's
    hash, so different tokenizers never share a folder.
    """
    name = "ouro-" + mf.sha256_file(tokenizer_dir / "tokenizer.json")[:12]
    repo = hf_home / "hub" / f"models--local--{name}"
    snap = repo / "snapshots" / HUB_REVISION
    snap.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            shutil.copyfile(f, snap / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(HUB_REVISION)
    return f"local/{name}"


def aiperf_env(base: dict, values: dict[str, str], hf_home: Path) -> dict[str, str]:
    """AIPerf's environment: the config's ${OURO_*} values, the hub cache, offline."""
    return {**base, **values, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def prune(folder: Path, keep_all: bool) -> None:
    """Drop what is not in KEEP (unless keep_all); keep the tail of aiperf.log."""
    log = folder / "aiperf.log"
    if log.exists():
        lines = log.read_text(errors="replace").splitlines()
        if len(lines) > LOG_TAIL_LINES:
            log.write_text("\n".join([f"[first {len(lines) - LOG_TAIL_LINES} lines dropped]",
                                      *lines[-LOG_TAIL_LINES:]]) + "\n")  # fmt: skip
    if keep_all:
        return
    for p in folder.iterdir():
        if p.name not in KEEP:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def quiet_samples(server: Server) -> list | None:
    """/metrics once nothing is in flight, parsed; None if unreadable."""
    try:
        return parse_metrics(server.quiet_metrics())
    except (OSError, RuntimeError, ValueError) as e:
        print(f"[aiperf] /metrics unreadable: {e}", file=sys.stderr)
        return None


def run_scenario(args, name: str, entry: dict, server: Server, ctx: dict, out: Path) -> dict:
    """One scenario against the running server: AIPerf, /metrics around it, validation; its record."""
    folder = out / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    config = HERE / "scenarios" / entry["config"]
    requests = max(1, int(math.ceil(entry["requests"] * args.requests_scale)))
    values = {
        "OURO_URL": server.base, "OURO_MODEL": ctx["served_name"], "OURO_TOKENIZER": ctx["tokenizer_id"],
        "OURO_REQUESTS": str(requests), "OURO_ARTIFACT_DIR": str(folder),
        "OURO_EXIT_THRESHOLD": f"{args.exit_threshold:g}",
    }  # fmt: skip
    cmd = [*shlex.split(args.aiperf), "profile", "--config", str(config)]
    rec = {"scenario": name, "config": str(config.relative_to(mf.REPO)), "requests": requests,
           "server_env": entry.get("server_env") or {}, "expect": entry.get("expect") or [],
           "command": " ".join(f"{k}={shlex.quote(v)}" for k, v in values.items()) + " " + shlex.join(cmd),
           "loadavg_before": mf.loadavg()}  # fmt: skip
    before = quiet_samples(server)
    t0 = time.perf_counter()
    with open(folder / "aiperf.log", "w") as log:
        try:
            env = aiperf_env(dict(os.environ), values, ctx["hf_home"])
            done = subprocess.run(cmd, env=env, cwd=ctx["work"], stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.aiperf_timeout)  # fmt: skip
            rc = done.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    rec["wall_seconds"] = round(time.perf_counter() - t0, 2)
    after = quiet_samples(server) if server.alive() else None
    delta = metrics_delta(before, after) if before is not None and after is not None else None
    errors = [] if rc == 0 else [f"aiperf exited {rc} (see {name}/aiperf.log)"]
    if not server.alive():
        errors.append(f"the server died during the run:\n{server.tail(10)}")
    found, facts = validate_artifacts(folder, requests, delta, rec["expect"])
    errors += found
    summary_path = folder / "profile_export_aiperf.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    rec.update(exit_code=rc, loadavg_after=mf.loadavg(), server_delta=delta, headline=mf.headline(summary),
               **facts, ok=not errors, errors=errors)  # fmt: skip
    own = {**ctx["header"], "server": ctx["server"], "scenarios": [rec], "ok": rec["ok"]}
    mf.write_json(folder / "manifest.json", own)
    prune(folder, args.keep_all)
    status = "ok" if not errors else "INVALID:\n  " + "\n  ".join(errors)
    print(f"[aiperf] {name}: {status}", file=sys.stderr)
    return rec


def start_server(args, model_dir: Path, name: str, env: dict, log: Path, work: Path) -> tuple[Server, dict]:
    """`ouro-fast serve` with the run's flags plus the group's OURO_FAST_* settings; (server, its record)."""
    port = free_port()
    cmd = [args.server_python, "-m", "ouro_fast.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", str(model_dir), "--served-model-name", name, "--dtype", args.dtype,
           "--device", args.device, "--runner", args.runner]  # fmt: skip
    extra = {**dict(kv.split("=", 1) for kv in args.env), **env}
    rec = {"command": shlex.join(cmd), "env": extra, "log": log.name}
    server = Server(cmd, {**os.environ, **extra}, work, log, port)
    try:
        rec["startup_seconds"] = round(server.wait_healthy(args.startup_timeout), 2)
        samples = parse_metrics(server.metrics_text())
    except BaseException:
        rec["exit_code"] = server.stop()
        raise
    rec["kv_blocks_total"] = int(sum(v for n, _, v in samples if n == "ouro_fast:kv_blocks_total"))
    print(f"[aiperf] server ready in {rec['startup_seconds']} s on {server.base} ({extra or 'defaults'})",
          file=sys.stderr)  # fmt: skip
    return server, rec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.aiperf.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", action="append", required=True,
                   help="scenarios, comma-separated or repeated; 'all': every one but smoke")  # fmt: skip
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory to serve")
    src.add_argument("--preset", help="generate this preset (ouro-fast make-checkpoint) into --ckpt-dir")
    p.add_argument("--ckpt-dir", default="/tmp/ouro_fast-aiperf-ckpt", help="cache of generated checkpoints")
    p.add_argument("--gate-bias", type=float, default=-1.0, help="make-checkpoint's exit-gate centre")
    p.add_argument("--ckpt-seed", type=int, default=0)
    p.add_argument("--tokenizer", help="tokenizer folder (default <checkpoint>/tokenizer, else <checkpoint>)")
    p.add_argument("--served-model-name", help="default: the preset, or the checkpoint folder's name")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--runner", default="auto", help="auto, torch or triton")
    p.add_argument("--exit-threshold", type=float, default=1.0,
                   help="the depth policy every request carries (1.0: full depth)")  # fmt: skip
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="server environment for every scenario (a scenario's own settings win)")  # fmt: skip
    p.add_argument("--server-python", default=sys.executable, help="interpreter with ouro_fast installed")
    p.add_argument("--aiperf", default=DEFAULT_AIPERF, help="AIPerf's command ($AIPERF_VENV/bin/aiperf)")
    p.add_argument("--requests-scale", type=float, default=1.0, help="multiplies every scenario's requests")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--aiperf-timeout", type=float, default=900.0, help="seconds one AIPerf run may take")
    p.add_argument("--commit", help="the commit to record when the tree has no .git ('SHA' or 'SHA+dirty')")
    p.add_argument("--keep-all", action="store_true", help="keep every AIPerf file (inputs, logs, phases)")
    p.add_argument("--out", help="results folder (default: bench/results/aiperf-<UTC time>)")
    return p


def _terminate(signum: int, frame: object) -> None:
    # SIGTERM (an outer `timeout`) unwinds like an exception: servers stopped, manifests written.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for kv in args.env:
        if "=" not in kv:
            raise SystemExit(f"--env {kv!r}: want KEY=VALUE")
    catalogue = load_catalogue()
    names = select(catalogue, args.scenario)
    signal.signal(signal.SIGTERM, _terminate)
    out = Path(args.out or default_out("aiperf")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.ckpt_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    configs = [CATALOGUE] + [HERE / "scenarios" / catalogue[n]["config"] for n in names]
    header = {
        "tool": "bench/aiperf/run.py", "argv": sys.argv[1:] if argv is None else argv,
        "started_utc": mf.utc_now(), "machine": mf.machine_info(), "git": mf.git_state(given=args.commit),
        "config_sha256": mf.config_hashes(configs),
        "aiperf": {"command": args.aiperf, "version": mf.aiperf_version(args.aiperf)},
        "depth_policy": mf.depth_policy(args.exit_threshold),
    }  # fmt: skip
    manifest = {**header, "servers": [], "scenarios": [], "errors": []}
    servers: list[Server] = []
    try:
        model_dir, provenance = prepare_model(args)
        served = args.served_model_name or args.preset or model_dir.name
        tok_dir = Path(args.tokenizer) if args.tokenizer else model_dir / "tokenizer"
        tok_dir = tok_dir if tok_dir.is_dir() else model_dir
        hf_home = work / "hf-home"
        model = {"preset": args.preset, "dir": str(model_dir), "served_name": served, "dtype": args.dtype,
                 "device": args.device, "runner": args.runner, "tokenizer": str(tok_dir), **provenance,
                 "config": model_facts(model_dir)}  # fmt: skip
        header["model"] = manifest["model"] = model
        ctx = {"served_name": served, "tokenizer_id": hub_cache(tok_dir, hf_home), "hf_home": hf_home,
               "work": work, "header": header}  # fmt: skip
        for i, (env, members) in enumerate(server_groups(catalogue, names)):
            server, srec = start_server(args, model_dir, served, env, out / f"server-{i}.log", work)
            servers.append(server)
            srec["scenarios"] = members
            manifest["servers"].append(srec)
            ctx["server"] = srec
            for name in members:
                manifest["scenarios"].append(run_scenario(args, name, catalogue[name], server, ctx, out))
            srec["exit_code"] = server.stop()
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        manifest["errors"].append(str(e))
        print(f"[aiperf] FAILED: {e}", file=sys.stderr)
    finally:
        for s in servers:
            s.stop()
        done = {s["scenario"] for s in manifest["scenarios"]}
        manifest["errors"] += [f"{n}: not run" for n in names if n not in done]
        manifest["ok"] = not manifest["errors"] and all(s["ok"] for s in manifest["scenarios"])
        manifest["machine"]["loadavg_end"] = mf.loadavg()
        manifest["finished_utc"] = mf.utc_now()
        mf.write_json(out / "manifest.json", manifest)
        if "model" in manifest:
            (out / "summary.md").write_text(mf.render_summary(manifest))
    print(f"[aiperf] {'all scenarios valid' if manifest['ok'] else 'FAILED'}: {out}", file=sys.stderr)
    return 0 if manifest["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
