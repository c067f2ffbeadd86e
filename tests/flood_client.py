"""A separate process that keeps sending large-but-legal requests to a server, for the gap tests.

    python tests/flood_client.py URL BODIES.json THREADS

``BODIES.json`` is a list of ``[path, body]``. ``THREADS`` threads post them in turn, each waiting for
its answer, until this process's stdin is closed; then it prints one JSON line: the status of every
answer, in order. In its own process, the clients take nothing from the server's interpreter (its
lock, its CPU time slices): what the server's streams see is the server's own work.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading


def main(url: str, bodies_file: str, threads: int) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with open(bodies_file) as f:
        loads = [(path, json.dumps(body).encode()) for path, body in json.load(f)]
    done = threading.Event()
    statuses: list[int] = []

    def flood() -> None:
        while not done.is_set():
            for path, raw in loads:
                c = http.client.HTTPConnection(host, int(port), timeout=60)
                try:
                    c.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
                    r = c.getresponse()
                    r.read()
                    statuses.append(r.status)
                except OSError:
                    statuses.append(0)
                finally:
                    c.close()
                if done.is_set():
                    return

    workers = [threading.Thread(target=flood, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    print("flooding", flush=True)
    sys.stdin.read()                 # until the test closes our stdin
    done.set()
    for w in workers:
        w.join(60)
    print(json.dumps(statuses), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
