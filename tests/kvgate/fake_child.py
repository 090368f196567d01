"""A stand-in child process for supervisor tests: serves /health, and misbehaves on request.

usage: fake_child.py PORT [--health-after S] [--crash-after S] [--grandchild PIDFILE] [--ignore-term]
"""

import argparse
import http.server
import signal
import subprocess
import sys
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--health-after", type=float, default=0.0)
    parser.add_argument("--crash-after", type=float)
    parser.add_argument("--grandchild")
    parser.add_argument("--ignore-term", action="store_true")
    args = parser.parse_args()
    started = time.monotonic()
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.grandchild:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(args.grandchild, "w") as f:
            f.write(str(child.pid))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ready = time.monotonic() - started >= args.health_after
            self.send_response(200 if ready and self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"fake child listening on {args.port}", flush=True)
    if args.crash_after is not None:
        def crash() -> None:
            time.sleep(args.crash_after)
            print("fake child: simulated crash", flush=True)
            sys.stdout.flush()
            import os
            os._exit(3)
        threading.Thread(target=crash, daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
