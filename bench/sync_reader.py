"""One WAN reader of ``bench sync``: a process in its own network namespace that follows a weight prefix.

Driven by JSON lines on stdin, answering JSON lines on stdout (pipes, not the shaped network: the
command stands for the control plane's "version N is out" message)::

    {"fetch": N}  -> {"version": N, "t0": .., "t1": .., "wire_bytes": .., "frame_bytes": .., "cpu_s": ..,
                      "path": ..}
    {"digest": 1} -> {"version": N, "digest": ..}

``t0``/``t1`` are ``time.monotonic()`` (one clock for every process on the machine) around the
fetch: the first fetch builds the weights from the newest start (full version or snapshot), every
later one patches the held weights in place (``fetch(inplace=True)``, as the rollout worker does).
The fetch verifies every chunk's digest against the manifest; ``digest`` (of the whole model) lets
the bench compare the bits with what was published. It is a separate command because it is the
bench's check, not part of a sync: the bench asks for it once every reader has answered the fetch,
so one reader's hash of the whole model (~20 ms of a core) never competes with another's fetch
for the cores the readers share here (each would have its own machine in a deployment).
``wire_bytes`` is what the namespace's link received meanwhile (``/sys/class/net/eth0``: headers
included), ``frame_bytes`` the frame bytes the reader planned to download, ``cpu_s`` this
process's CPU seconds in the fetch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

RX = Path("/sys/class/net/eth0/statistics/rx_bytes")


def model_digest(tensors: dict[str, Any]) -> str:
    """xxh3-128 over every tensor's name and bytes, in name order (the bench hashes the same way)."""
    import xxhash

    from infra.weightsync.rawbytes import tensor_bytes

    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        h.update(name.encode() + b"\0")
        h.update(tensor_bytes(tensors[name]))
    return h.hexdigest()


def _rx() -> int:
    try:
        return int(RX.read_text())
    except OSError:
        return -1


def serve(endpoint: str, bucket: str, prefix: str, threads: int) -> None:
    """Answer fetch commands until stdin closes."""
    from infra.gcpause import freeze_startup_objects
    from infra.storage import S3Store
    from infra.weightsync import VersionReader

    reader = VersionReader(S3Store(f"s3://{bucket}", endpoint_url=endpoint), prefix, threads=threads)
    have: dict[str, Any] | None = None
    version: int | None = None
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if "digest" in cmd:
            print(json.dumps({"version": version, "digest": model_digest(have) if have else None}), flush=True)
            continue
        target = int(cmd["fetch"])
        rx0, c0, t0 = _rx(), time.process_time(), time.monotonic()
        first = have is None
        if first:
            have, version = reader.fetch(target)
        else:
            have, version = reader.fetch(target, have, version, inplace=True)
        t1 = time.monotonic()
        out = {"version": version, "t0": t0, "t1": t1, "wire_bytes": _rx() - rx0,
               "frame_bytes": reader.last_stats.get("bytes_read"), "cpu_s": time.process_time() - c0,
               "path": reader.last_stats.get("path")}
        print(json.dumps(out), flush=True)
        if first:
            # start-up ends with the first weights held (that fetch imports torch), as the rollout
            # worker freezes once its model is loaded: later collections do not walk start-up's
            # ~145k objects (a gen-1 or gen-2 collection of them mid-fetch cost 50-80 ms)
            freeze_startup_objects()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    serve(args.endpoint, args.bucket, args.prefix, args.threads)


if __name__ == "__main__":
    main()
