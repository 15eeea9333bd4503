"""`modelpool credentials DIR`: the cluster's generated credentials in DIR, made where absent, kept where present.

What `modelpool up` makes in its data directory at a cluster's first start, for
clusters it does not start: compose runs it once in a volume that the gateway
and the workers mount; Kubernetes takes the same secret from a Secret
(docs/security.md). Every file is readable by its owner only.

    DIR/cluster-secret   signs calls to engines' internal ports and the KV they
                         move (MODELPOOL_CLUSTER_SECRET_FILE)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shared.internal_auth import MIN_SECRET_CHARS, make_secret_file

CLUSTER_SECRET_FILE = "cluster-secret"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="modelpool credentials", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    path = args.directory / CLUSTER_SECRET_FILE
    existed = path.exists() and len(path.read_text().strip()) >= MIN_SECRET_CHARS
    make_secret_file(path)
    print(f"{path}: {'kept' if existed else 'made'}")
    return 0
