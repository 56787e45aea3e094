"""The manifest of an AIPerf run against ouro_fast, and the summary table made from it.

A manifest records what a result can be reproduced and judged from: the git
commit and whether the tree had uncommitted changes (and which paths), the
SHA-256 of every config file the run read, the AIPerf version, the machine,
the model (preset, dtype, device, runner), the depth policy, the server's
command and settings, and per scenario the AIPerf command, the headline
figures, the server's counters over the run and every validation error.
Pure standard library.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import shlex
import subprocess
from pathlib import Path

from bench.benchlib import REPO, cpu_model

# Paths whose uncommitted changes make a result "dirty" (what the run's code and configs come from).
DIRTY_SCOPE = ("csrc", "ouro_fast", "bench", "setup.py", "pyproject.toml")


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def config_hashes(paths: list[Path], root: Path = REPO) -> dict[str, str]:
    """{path relative to the repo: SHA-256} of each config file."""
    out = {}
    for p in paths:
        p = Path(p).resolve()
        key = str(p.relative_to(root)) if p.is_relative_to(root) else str(p)
        out[key] = sha256_file(p)
    return out


def git_state(root: Path = REPO, given: str | None = None) -> dict:
    """{"commit", "dirty", "dirty_paths"}: dirty is None when unknown (no git or no .git, e.g. a copied
    tree). `given` ("SHA" or "SHA+dirty", for such a tree) wins over what git says."""
    state: dict = {"commit": "unknown", "dirty": None, "dirty_paths": []}
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", *DIRTY_SCOPE],
                                capture_output=True, text=True)  # fmt: skip
    except OSError:
        head = status = None
    if head is not None and head.returncode == 0 and status.returncode == 0:
        paths = [line[3:] for line in status.stdout.splitlines() if line.strip()]
        state = {"commit": head.stdout.strip(), "dirty": bool(paths), "dirty_paths": paths[:50]}
    if given:
        state["commit"] = given.removesuffix("+dirty")
        state["dirty"] = True if given.endswith("+dirty") else state["dirty"]
    return state


def gpu_name() -> str | None:
    """The GPUs nvidia-smi reports, comma-separated; None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return ", ".join(x.strip() for x in out.stdout.splitlines() if x.strip()) or None


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine_info() -> dict:
    """CPU model, cores, GPU, Python, platform and the load average now."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "gpu": gpu_name(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": loadavg(),
    }


def aiperf_version(aiperf: str, env: dict | None = None) -> str:
    """What `<aiperf> --version` prints (its last line), or 'unknown (why)'."""
    try:
        out = subprocess.run([*shlex.split(aiperf), "--version"], capture_output=True, text=True,
                             timeout=120, env=env)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    lines = out.stdout.strip().splitlines()
    return lines[-1].strip() if out.returncode == 0 and lines else f"unknown ({out.stderr.strip()[-200:]})"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def depth_policy(exit_threshold: float) -> dict:
    """The depth policy every request carries (extra body exit_threshold)."""
    label = "full depth" if exit_threshold >= 1.0 else f"exit_threshold={exit_threshold:g}"
    return {"exit_threshold": exit_threshold, "label": label}


def headline(summary: dict) -> dict:
    """The figures summary.md shows, from AIPerf's profile_export_aiperf.json (ms, tokens/s)."""

    def stat(key: str, s: str = "avg"):
        v = summary.get(key)
        return round(v[s], 3) if isinstance(v, dict) and isinstance(v.get(s), (int, float)) else None

    return {
        "request_count": stat("request_count"),
        "benchmark_duration_s": stat("benchmark_duration"),
        "request_throughput": stat("request_throughput"),
        "output_token_throughput": stat("output_token_throughput"),
        "ttft_ms": {s: stat("time_to_first_token", s) for s in ("avg", "p50", "p99")},
        "itl_ms": {s: stat("inter_token_latency", s) for s in ("avg", "p50", "p99")},
        "inter_chunk_ms": {s: stat("inter_chunk_latency", s) for s in ("avg", "p50", "p99")},
        "request_latency_ms": {s: stat("request_latency", s) for s in ("avg", "p50", "p99")},
        "output_tps_per_user": stat("output_token_throughput_per_user"),
    }


def write_json(path: str | Path, obj: object) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1) + "\n")


def _f(v: object, nd: int = 2) -> str:
    return f"{v:,.{nd}f}" if isinstance(v, (int, float)) else "-"


_DIRTY = {True: " (uncommitted changes)", False: "", None: " (working-tree state unknown)"}


def render_summary(manifest: dict) -> str:
    """summary.md: the run's setting, then one row per scenario (AIPerf's figures; TPOT is AIPerf's ITL)."""
    m, mach, git = manifest["model"], manifest["machine"], manifest["git"]
    gpu = f", GPU {mach['gpu']}" if mach.get("gpu") else ""
    lines = [
        f"# AIPerf scenarios: {m['served_name']} ({m.get('preset') or 'a given checkpoint'}, {m['dtype']}, "
        f"{manifest['depth_policy']['label']})",
        "",
        f"- Machine: {mach['cpu']}, {mach['cores']} cores{gpu}; load average {mach['loadavg_start']} at the "
        f"start, {mach.get('loadavg_end')} at the end.",
        f"- Commit `{git['commit']}`{_DIRTY[git['dirty']]}; AIPerf {manifest['aiperf']['version']}; device "
        f"{m['device']}, runner {m['runner']}.",
        f"- Validation: {'all scenarios valid' if manifest['ok'] else 'SOME SCENARIOS INVALID'}.",
        "",
        "| scenario | server settings | requests | output tok/s | req/s | TTFT avg / p99 (ms) | "
        "ITL=TPOT p50 / p99 (ms) | inter-chunk p50 (ms) | latency p50 (ms) | mean exit depth | valid |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in manifest["scenarios"]:
        h = s.get("headline") or {}
        env_items = (s.get("server_env") or {}).items()
        env = ", ".join(f"{k.removeprefix('OURO_FAST_')}={v}" for k, v in env_items) or "-"
        depth = (s.get("server_delta") or {}).get("mean_exit_depth")
        cells = [
            s["scenario"], env, s["requests"], _f(h.get("output_token_throughput"), 1),
            _f(h.get("request_throughput")),
            f"{_f((h.get('ttft_ms') or {}).get('avg'))} / {_f((h.get('ttft_ms') or {}).get('p99'))}",
            f"{_f((h.get('itl_ms') or {}).get('p50'))} / {_f((h.get('itl_ms') or {}).get('p99'))}",
            _f((h.get("inter_chunk_ms") or {}).get("p50")),
            _f((h.get("request_latency_ms") or {}).get("p50")),
            _f(depth), "yes" if s.get("ok") else "NO",
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    failures = [(s["scenario"], e) for s in manifest["scenarios"] for e in s.get("errors") or []]
    failures += [("run", e) for e in manifest.get("errors") or []]
    if failures:
        lines += ["", "## Validation errors", ""] + [f"- {name}: {e}" for name, e in failures]
    return "\n".join(lines) + "\n"
