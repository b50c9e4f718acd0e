"""A process that connects to Ray as a rank service does (`share_ray`), for tests/test_ray_share.py.

argv: ADDRESS|- JOB|-: prints one JSON line {"gcs", "started"} once connected, then holds the Ray until
stdin closes (and stops it if it started it, once no other process uses it)."""

import json
import logging
import sys

from batchd.preprocess import share_ray

logging.basicConfig(level=logging.INFO, format="%(message)s")
address, job = (None if a == "-" else a for a in sys.argv[1:3])
shared = share_ray(address, num_cpus=1, who="probe", job=job)
print(json.dumps({"gcs": shared.address, "started": shared.started}), flush=True)
sys.stdin.read()
shared.close()
