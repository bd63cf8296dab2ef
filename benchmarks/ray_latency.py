"""Round-trip time of a Ray actor call on this machine: back to back, with a 50 KB argument, right after the actor
was busy for 30 ms, and after the caller idled for 50 ms (the RL loop's pattern: each process waits for the
others every step). Plain actors and actors with a concurrency group (as `EngineActor`) alike, and the same actor's
methods as express calls (`beamrl.loop.express`: a Unix socket to the actor's own server, docs/express-calls.md).

    .venv/bin/python benchmarks/ray_latency.py [--calls 200]

On the 2-core CI-class VM (2026-12-03) a call after an idle gap took 2.2 ms against 0.8 ms back to back: what a
process pays for waking up, which a single busy process (TRL's step) never does (docs/benchmarks.md, issue 14).
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200, help="calls per back-to-back row (40 per gap row)")
    args = ap.parse_args(argv)
    import numpy as np
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")

    import threading

    from beamrl.loop.express import ExpressClient, ExpressServer

    class _Actor:
        def __init__(self):
            self._serial = threading.RLock()
            self._express = None

        def open_express(self):
            if self._express is None:
                self._express = ExpressServer(self, ("f", "busy"), self._serial, "bench",
                                              ray.get_runtime_context().get_node_id())
            return self._express.address

        def f(self, x=None):
            return 1

        def busy(self, seconds: float) -> int:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass
            return 1

    plain = ray.remote(_Actor)
    grouped = ray.remote(concurrency_groups={"control": 1})(_Actor)
    payload = pickle.dumps(np.zeros(12500, np.float32))  # ~50 KB, a train step's micro-batches
    print("| actor | call | median ms | p10 ms |\n|---|---|---|---|")
    try:
        for name, cls in (("plain", plain), ("with a concurrency group", grouped)):
            a = cls.remote()
            ray.get(a.f.remote(), timeout=60)

            def timed(call, before=lambda: None, n=args.calls):
                ts = []
                for _ in range(n):
                    before()
                    t0 = time.perf_counter()
                    ray.get(call(), timeout=60)
                    ts.append(time.perf_counter() - t0)
                return statistics.median(ts) * 1e3, sorted(ts)[len(ts) // 10] * 1e3

            rows = {"trivial, back to back": timed(lambda: a.f.remote()),
                    "50 KB argument, back to back": timed(lambda: a.f.remote(payload)),
                    "trivial, after the actor was busy 30 ms": timed(
                        lambda: a.f.remote(), lambda: ray.get(a.busy.remote(0.03), timeout=60), n=40),
                    "trivial, after the caller idled 50 ms": timed(lambda: a.f.remote(), lambda: time.sleep(0.05),
                                                                   n=40)}
            for call, (med, p10) in rows.items():
                print(f"| {name} | {call} | {med:.2f} | {p10:.2f} |")
        a = plain.remote()
        client = ExpressClient(ray.get(a.open_express.remote(), timeout=60), "bench")

        def express(call, before=lambda: None, n=args.calls):
            ts = []
            for _ in range(n):
                before()
                t0 = time.perf_counter()
                call().result(60)
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts) * 1e3, sorted(ts)[len(ts) // 10] * 1e3

        rows = {"trivial, back to back": express(lambda: client.call_async("f")),
                "50 KB argument, back to back": express(lambda: client.call_async("f", payload)),
                "trivial, after the actor was busy 30 ms": express(
                    lambda: client.call_async("f"), lambda: client.call_async("busy", 0.03).result(60), n=40),
                "trivial, after the caller idled 50 ms": express(lambda: client.call_async("f"),
                                                                 lambda: time.sleep(0.05), n=40)}
        for call, (med, p10) in rows.items():
            print(f"| plain, as express calls | {call} | {med:.2f} | {p10:.2f} |")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
