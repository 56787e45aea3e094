#!/usr/bin/env bash
# lm-evaluation-harness 0.4.13 in its own venv (LM_EVAL_VENV, default /tmp/ouro_fast-lm-eval): it pins
# packages of its own, and the server's environment stays as it is. transformers gives its tokenizer
# backend; no torch is needed. About a minute; a venv already there is reused.
set -euo pipefail
VENV=${LM_EVAL_VENV:-/tmp/ouro_fast-lm-eval}
if [ ! -x "$VENV/bin/lm_eval" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "lm-eval[api]==0.4.13" "transformers>=4.40"
fi
echo "$VENV/bin/python"
