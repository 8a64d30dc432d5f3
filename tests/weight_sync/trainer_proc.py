"""A trainer in a process of its own, for the tests that kill one mid-transfer:

    python -m tests.weight_sync.trainer_proc WEIGHTS_DIR VERSION ADDRESS... [--die-in-bucket K]
    python -m tests.weight_sync.trainer_proc WEIGHTS_DIR VERSION ADDRESS... --transport shm [--die-in-piece K]

It syncs the safetensors weights in WEIGHTS_DIR to the replicas at ADDRESS... over gloo (or shared
memory). With `--die-in-bucket K` it SIGKILLs itself while bucket K is on the wire: its broadcast
issued, some bytes sent, not complete. With `--die-in-piece K` (shm) it SIGKILLs itself after
filling piece K of its segment, before publishing it. With `--delta-from BASE_DIR` it first syncs
BASE_DIR in full under VERSION - 1, then WEIGHTS_DIR as a delta (`WeightSender(delta=True)`), and
the `--die-*` options count from the delta on."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("weights")
    parser.add_argument("version", type=int)
    parser.add_argument("addresses", nargs="+")
    parser.add_argument("--die-in-bucket", type=int)
    parser.add_argument("--transport", default="gloo", choices=["gloo", "shm"])
    parser.add_argument("--die-in-piece", type=int)
    parser.add_argument("--piece-bytes", type=int, default=64 * 1024)
    parser.add_argument("--bucket-bytes", type=int, default=32 * 1024)
    parser.add_argument("--timeout-s", type=float, default=3.0)
    parser.add_argument("--delta-from")
    args = parser.parse_args()
    armed = [args.delta_from is None]  # NOTE: the deaths below wait for the delta, if there is one

    from inference.models.loading import read_safetensors
    from rollout.client.sync import RolloutClient
    from weight_sync import Transport, WeightSender, memcopy
    from weight_sync.transports import distributed

    weights = read_safetensors(Path(args.weights), None)
    if args.die_in_bucket is not None:
        real = distributed.WeightGroup.pipeline
        calls = []

        def pipeline(self, pieces, on_piece=None):  # one call per bucket
            if not armed[0]:
                return real(self, pieces, on_piece)
            if len(calls) == args.die_in_bucket:
                self.broadcast_async(next(iter(pieces)))  # on the wire ...
                time.sleep(0.05)
                print(f"trainer: killed while bucket {len(calls)} is on the wire", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)  # ... and never finished
            calls.append(1)
            return real(self, pieces, on_piece)

        distributed.WeightGroup.pipeline = pipeline
    if args.die_in_piece is not None:
        publish = memcopy.publish

        def publish_or_die(header, slot, checksum, token):
            if armed[0] and slot == args.die_in_piece:
                time.sleep(0.3)  # NOTE: the source goes to the replicas on other threads: let it reach them all
                print(f"trainer: killed with piece {slot} of its segment filled, not published", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            publish(header, slot, checksum, token)

        memcopy.publish = publish_or_die
    clients = [RolloutClient(a, timeout=30) for a in args.addresses]
    sender = WeightSender(clients, Transport(args.transport), timeout_s=args.timeout_s, bucket_bytes=args.bucket_bytes,
                          piece_bytes=args.piece_bytes, delta=args.delta_from is not None)
    if args.delta_from is not None:
        base = sender.sync(read_safetensors(Path(args.delta_from), None), version=args.version - 1)
        print(f"trainer: base version {base}", flush=True)
        armed[0] = True
    print(f"trainer: synced version {sender.sync(weights, version=args.version)} (delta: {sender.stats.last_delta})",
          flush=True)
    sender.close()
    for c in clients:
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
