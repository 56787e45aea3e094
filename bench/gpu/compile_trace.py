"""Which kernel variants an engine build compiles, when, and for how long: before, during or after the
start-up's parallel compile walk (kernels/precompile.py).

    TRITON_CACHE_DIR=$(mktemp -d) python3 -P bench/gpu/compile_trace.py CKPT [--out trace.json]

Run it with an empty TRITON_CACHE_DIR to see every compile (with a warm cache the "compiles" are loads).
Prints the build's seconds, the misses per phase, and each kernel compiled outside the walk with its
seconds (a compile's time is from triton's pre-compile hook to its post-compile hook on one thread).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--out")
    args = p.parse_args()
    from triton import knobs
    from triton.runtime.jit import JITFunction

    from ouro_fast.engine.engine import Engine, EngineConfig

    original, t0, events, started = JITFunction.run, time.perf_counter(), [], {}
    phase = {"now": "before"}

    def pre(key, repr, fn, **_):
        walking = JITFunction.run is not original
        if walking:
            phase["now"] = "walk"
        elif phase["now"] == "walk":
            phase["now"] = "after"
        started[(fn.name, str(key))] = time.perf_counter()
        events.append({"kernel": fn.name, "phase": phase["now"], "t": time.perf_counter() - t0,
                       "thread": threading.current_thread().name, "repr": repr[:300]})  # fmt: skip

    def post(key, fn, **_):
        begun = started.pop((fn.name, str(key)), None)
        for e in reversed(events):
            if e["kernel"] == fn.name and "s" not in e:
                e["s"] = None if begun is None else time.perf_counter() - begun
                break

    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = pre, post
    engine = Engine(EngineConfig(model=args.model, dtype="bfloat16"))
    build = time.perf_counter() - t0
    by_phase = collections.Counter(e["phase"] for e in events)
    print(f"engine build {build:.1f} s; misses by phase {dict(by_phase)}")
    for name, n in collections.Counter(e["kernel"] for e in events if e["phase"] != "walk").most_common():
        secs = sum(e.get("s") or 0 for e in events if e["kernel"] == name and e["phase"] != "walk")
        print(f"  outside the walk: {name} x{n}, {secs:.2f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"build_s": build, "events": events}, f, indent=1)
    del engine
    return 0


if __name__ == "__main__":
    sys.exit(main())
