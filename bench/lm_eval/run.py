"""lm-evaluation-harness, unmodified, against `ouro-fast serve`: the local tasks of this folder through its
local-completions model (loglikelihood and generate_until) and its local-chat-completions model
(generate_until), then every loglikelihood it reports checked against the engine's own offline scoring.

    bash bench/lm_eval/setup.sh                       # lm-eval in its own venv (LM_EVAL_VENV)
    python -m bench.lm_eval.run [--lm-eval PYTHON] [--out DIR]

Serves the embedded tiny model (or --model) on CPU. Exits 1 when lm_eval fails, when a task reports no
result, or when a reported loglikelihood differs from the offline one by more than --tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.benchlib import default_out
from bench.serve_bench import Server, free_port

HERE = Path(__file__).resolve().parent
TASKS = ("ouro_local_loglikelihood", "ouro_local_generate")
MODEL = "ouro-local"


def lm_eval(python: str, model: str, url: str, tasks: str, tokenizer: str, out: Path, chat: bool) -> Path:
    """Run lm_eval once; returns the folder it wrote its results and samples into."""
    args = f"model={MODEL},base_url={url},num_concurrent=2,max_retries=1,tokenizer_backend=huggingface"
    args += f",tokenizer={tokenizer}" + (",tokenized_requests=False" if chat else "")
    cmd = [python, "-m", "lm_eval", "--model", model, "--model_args", args, "--tasks", tasks,
           "--include_path", str(HERE), "--output_path", str(out), "--log_samples",
           "--seed", "0"]  # fmt: skip
    if chat:
        cmd.append("--apply_chat_template")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = out / f"{model}.log"
    out.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        rc = subprocess.run(
            cmd, cwd=HERE, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=900
        ).returncode
    if rc != 0:
        raise SystemExit(
            f"lm_eval ({model}) failed ({rc}):\n" + "\n".join(log.read_text().splitlines()[-40:])
        )
    return out


def samples(out: Path, task: str) -> list[dict]:
    files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        raise SystemExit(f"lm_eval wrote no samples for {task} under {out}")
    return [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]


def offline_loglikelihoods(model_dir: str, pairs: list[tuple[str, str]]) -> list[float]:
    """The engine's own score of each pair (score.py, in a child interpreter outside the repository)."""
    child = subprocess.run(
        [sys.executable, "-P", str(HERE / "score.py"), model_dir], input=json.dumps(pairs), text=True,
        capture_output=True, cwd=os.path.expanduser("~"), timeout=900,
    )  # fmt: skip
    if child.returncode != 0:
        raise SystemExit(f"offline scoring failed ({child.returncode}):\n{child.stderr[-4000:]}")
    return json.loads(child.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lm-eval", default=os.environ.get("LM_EVAL_PYTHON", "/tmp/ouro_fast-lm-eval/bin/python"),
                   help="the Python of lm-eval's venv")  # fmt: skip
    p.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = args.out or default_out("lm-eval")
    out.mkdir(parents=True, exist_ok=True)
    from ouro_fast.model.checkpoints import default_model_dir

    model_dir = args.model or str(default_model_dir())
    tokenizer = str(Path(model_dir) / "tokenizer") if (Path(model_dir) / "tokenizer").is_dir() else model_dir
    port = free_port()
    cmd = [sys.executable, "-m", "ouro_fast.cli", "serve", "--port", str(port), "--served-model-name", MODEL,
           "--device", "cpu", "--dtype", "float32"]  # fmt: skip
    cmd += ["--model", model_dir] if args.model else []
    server = Server(cmd, dict(os.environ), out, out / "server.log", port)
    try:
        print(f"server ready in {server.wait_healthy(300):.1f} s", flush=True)
        t = time.perf_counter()
        base = f"http://127.0.0.1:{port}/v1"
        lm_eval(
            args.lm_eval, "local-completions", base + "/completions", ",".join(TASKS), tokenizer, out, False
        )
        lm_eval(args.lm_eval, "local-chat-completions", base + "/chat/completions", TASKS[1], tokenizer,
                out / "chat", True)  # fmt: skip
        print(f"lm_eval ran in {time.perf_counter() - t:.1f} s", flush=True)
    finally:
        server.stop()
    ll = samples(out, TASKS[0])
    pairs = [(s["doc"]["context"], s["doc"]["continuation"]) for s in ll]
    reported = [float(s["resps"][0][0][0]) for s in ll]
    want = offline_loglikelihoods(model_dir, pairs)
    worst = max(abs(a - b) for a, b in zip(reported, want))
    print(f"{len(ll)} loglikelihoods, worst difference from the offline engine {worst:.2e}")
    gen = samples(out, TASKS[1]) + samples(out / "chat", TASKS[1])
    print(f"{len(gen)} generations, e.g. {gen[0]['resps'][0][0]!r}")
    if worst > args.tolerance or not all(isinstance(s["resps"][0][0], str) for s in gen):
        print("FAILED: the reported loglikelihoods are not the engine's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
