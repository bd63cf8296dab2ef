"""Wait until a Ray cluster has N live nodes, or fail after a timeout (used by the launchers).

    python launch/wait_for_ray.py --address HEAD:6379 --nodes 12 --timeout 600
Exit 0 when ready; exit 1 with the count of nodes that did join otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True, help="head address host:port")
    p.add_argument("--nodes", type=int, required=True, help="number of live nodes to wait for")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds")
    args = p.parse_args(argv)
    import ray

    deadline = time.monotonic() + args.timeout
    alive, last = 0, -1
    while True:
        try:
            if not ray.is_initialized():
                ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
            alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        except Exception as e:  # the head may not accept connections yet
            if time.monotonic() > deadline:
                print(f"wait_for_ray: cannot reach the Ray head at {args.address}: {e}", file=sys.stderr)
                return 1
        if alive != last:
            print(f"wait_for_ray: {alive}/{args.nodes} nodes alive", flush=True)
            last = alive
        if alive >= args.nodes:
            return 0
        if time.monotonic() > deadline:
            print(f"wait_for_ray: only {alive}/{args.nodes} nodes joined {args.address} within {args.timeout:.0f} s",
                  file=sys.stderr)
            return 1
        time.sleep(2.0)


if __name__ == "__main__":
    sys.exit(main())
