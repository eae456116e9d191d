"""A data-parallel trainer that exchanges its gradients through its node's
rendezvousd: the trainer of deploy/ (the image's /app/train.py).

One trainer per node. Every node fits the same linear model to its own
shard of a synthetic regression problem. Each step a trainer sends its
gradient (64 KiB of float32 by default: shared memory on the local hop) and
its loss (4 bytes: inline) to every other node's trainer, keyed by step,
receives theirs through its daemon, averages them in node order and takes an
SGD step, so every node holds the same parameters after every step. At the
end each trainer prints one line: its node, the loss across all shards
before and after, and a digest of the parameters (the same on every node).

It runs as the daemon's child, which sets RENDEZVOUS_LOCAL_ADDRESS, and the
job ends when every trainer has:

    mpiexec -n 2 -ppn 1 rendezvousd --cluster cluster.json --job-name node \\
        --protocol grpc+mpi -- python examples/mpijob_train.py --cluster cluster.json

The number of nodes is the number of tasks of the daemon's job in the
cluster file (--cluster, else $RENDEZVOUS_CLUSTER, else
/etc/rendezvous/cluster.json); this trainer's node is its daemon's task.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import numpy as np

from rendezvous import make_key
from rendezvous.client import Client
from rendezvous.cluster import ClusterSpec

SAMPLES_PER_NODE = 64
#: keys of incarnation 0 are taken by any incarnation of their producer's daemon
INCARNATION = 0


def shard(node: int, features: int) -> tuple[np.ndarray, np.ndarray]:
    """This node's samples: targets from a hidden linear model shared by all nodes."""
    truth = np.random.default_rng(1).standard_normal(features).astype(np.float32)
    rng = np.random.default_rng(1000 + node)
    x = rng.standard_normal((SAMPLES_PER_NODE, features)).astype(np.float32) / np.float32(np.sqrt(features))
    y = x @ truth + np.float32(0.01) * rng.standard_normal(SAMPLES_PER_NODE).astype(np.float32)
    return x, y


def device(job: str, node: int) -> str:
    return f"/job:{job}/replica:0/task:{node}/device:CPU:0"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="SGD steps (default 200)")
    p.add_argument("--features", type=int, default=16384, help="model size in float32 (default 16384: 64 KiB)")
    p.add_argument("--lr", type=float, default=16.0, help="learning rate (default 16)")
    p.add_argument("--cluster", default=os.environ.get("RENDEZVOUS_CLUSTER") or "/etc/rendezvous/cluster.json",
                   help="the daemons' cluster file (default $RENDEZVOUS_CLUSTER, else /etc/rendezvous/cluster.json)")
    p.add_argument("--address", default=None,
                   help="the daemon's local address (default $RENDEZVOUS_LOCAL_ADDRESS, else the default socket)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one recv may wait (default 120)")
    args = p.parse_args(argv)

    with Client(args.address) as client:
        # "/job:node/replica:0/task:3" -> ("node", 3)
        fields = dict(part.split(":", 1) for part in client.task.strip("/").split("/"))
        job, me = fields["job"], int(fields["task"])
        nodes = len(ClusterSpec.from_any(args.cluster).jobs[job])
        others = [n for n in range(nodes) if n != me]
        print(f"mpijob_train: node {me} of {nodes}: training, {args.steps} steps, through {client.address}",
              flush=True)
        x, y = shard(me, args.features)
        w = np.zeros(args.features, np.float32)
        first = last = None
        for step in range(1, args.steps + 1):
            error = x @ w - y
            loss = np.array([0.5 * float(error @ error) / len(y)], np.float32)
            grad = (x.T @ error / np.float32(len(y))).astype(np.float32)
            for other in others:
                client.send(make_key(device(job, me), device(job, other), "grad", incarnation=INCARNATION),
                            grad, step_id=step)
                client.send(make_key(device(job, me), device(job, other), "loss", incarnation=INCARNATION),
                            loss, step_id=step)
            grads, losses = {me: grad}, {me: loss}
            for other in others:
                grads[other] = client.recv(make_key(device(job, other), device(job, me), "grad",
                                                    incarnation=INCARNATION), step_id=step, timeout=args.timeout)
                losses[other] = client.recv(make_key(device(job, other), device(job, me), "loss",
                                                     incarnation=INCARNATION), step_id=step, timeout=args.timeout)
            # the same sum in the same order on every node: the same parameters everywhere
            total = np.zeros_like(w)
            for n in range(nodes):
                total += grads[n]
            del grads  # received tensors are views on the daemon's shared memory: give them back
            w -= np.float32(args.lr) * total / np.float32(nodes)
            last = sum(float(losses[n][0]) for n in range(nodes)) / nodes
            first = last if first is None else first
        digest = hashlib.sha256(w.tobytes()).hexdigest()[:16]
        print(f"mpijob_train: node {me} of {nodes}: {args.steps} steps, loss {first:.6f} -> {last:.6f}, "
              f"params {digest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
