"""bench/gpu/loop_ab.py: settings run in their own processes with their environment, rounds alternate,
failures are reported in the table and the exit status, and a bad setting is refused before anything runs."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "gpu"))
import loop_ab  # noqa: E402

# Stands for step_bench: logs its tag, sleeps SLEEP s, fails where FAIL is set, reports FAKE_MS + rows / 1000.
STUB = """
import json, os, sys
args = sys.argv[1:]
tag = args[args.index("--tag") + 1]
rows = [int(v) for v in args[args.index("--rows") + 1 : args.index("--replays")]]
with open(os.environ["ORDER_LOG"], "a") as f:
    f.write(tag + "\\n")
if os.environ.get("SLEEP"):
    import time; time.sleep(float(os.environ["SLEEP"]))
if os.environ.get("FAIL"):
    sys.exit("broken on purpose")
ms = float(os.environ.get("FAKE_MS", "1.0"))
print(json.dumps({"tag": tag, **{f"rows_{r}_ms": ms + r / 1000 for r in rows}}))
"""


@pytest.fixture
def stub(tmp_path, monkeypatch):
    path = tmp_path / "stub.py"
    path.write_text(STUB)
    monkeypatch.setenv("ORDER_LOG", str(tmp_path / "order.log"))
    return f"{sys.executable} {path}"


def test_settings_alternate_by_round_with_their_own_environment(tmp_path, stub, capsys):
    out = tmp_path / "step.jsonl"
    rc = loop_ab.main(["--rows", "1", "8", "--rounds", "2", "--out", str(out), "--step", stub,
                       "base", "fast FAKE_MS=0.5 OTHER=x=y,z"])  # fmt: skip
    assert rc == 0
    assert (tmp_path / "order.log").read_text().split() == ["base-a", "fast-a", "base-b", "fast-b"]
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["tag"] for r in runs] == ["base-a", "fast-a", "base-b", "fast-b"]
    assert runs[1]["rows_1_ms"] == pytest.approx(0.501) and runs[0]["rows_8_ms"] == pytest.approx(1.008)
    printed = capsys.readouterr().out
    assert "| fast | 0.5010 / 0.5010 | 0.5080 / 0.5080 |" in printed
    assert "| base | 1.0010 / 1.0010 | 1.0080 / 1.0080 |" in printed


def test_a_failed_run_is_a_dash_and_exit_status_one_and_the_rest_still_run(tmp_path, stub, capsys):
    out = tmp_path / "step.jsonl"
    rc = loop_ab.main(
        ["--rows", "1", "--rounds", "1", "--out", str(out), "--step", stub, "bad FAIL=1", "good"]
    )
    assert rc == 1
    printed = capsys.readouterr().out
    assert "bad-a: rc 1, broken on purpose" in printed
    assert "| bad | - |" in printed and "| good | 1.0010 |" in printed
    assert "broken on purpose" in (tmp_path / "step.jsonl.err").read_text()


def test_a_run_past_its_timeout_is_reported_and_the_next_runs(tmp_path, stub, capsys):
    out = tmp_path / "step.jsonl"
    rc = loop_ab.main(
        ["--rounds", "1", "--timeout", "0.5", "--out", str(out), "--step", stub, "slow SLEEP=5", "ok"]
    )
    assert rc == 1
    printed = capsys.readouterr().out
    assert "slow-a: past 0.5 s" in printed and "| ok | 1.0010 | 1.0080 |" in printed


def test_bad_settings_are_refused_before_anything_runs(tmp_path, stub):
    with pytest.raises(ValueError, match="not VAR=VALUE"):
        loop_ab.main(["--out", str(tmp_path / "o.jsonl"), "--step", stub, "base NOT_AN_ASSIGNMENT"])
    with pytest.raises(SystemExit):
        loop_ab.main(["--out", str(tmp_path / "o.jsonl"), "--step", stub, "base", "base X=1"])
    assert not (tmp_path / "order.log").exists()
