"""A stand-in child process for supervisor tests: serves /health, and misbehaves on request.

usage: fake_child.py PORT [--health-after S] [--crash-after S] [--grandchild PIDFILE] [--ignore-term]
                        [--crash-if-exists PATH] [--stall-if-exists PATH] [--on-hup]
"""

import argparse
import http.server
import os
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
    parser.add_argument("--crash-if-exists", metavar="PATH", help="exit 4 at once when PATH exists")
    parser.add_argument("--stall-if-exists", metavar="PATH", help="never healthy when PATH exists")
    parser.add_argument("--on-hup", action="store_true", help="log SIGHUP instead of dying of it")
    args = parser.parse_args()
    started = time.monotonic()
    if args.crash_if_exists and os.path.exists(args.crash_if_exists):
        print("fake child: broken on purpose", flush=True)
        sys.exit(4)
    stalled = bool(args.stall_if_exists and os.path.exists(args.stall_if_exists))
    if args.on_hup:
        signal.signal(signal.SIGHUP, lambda *_: print("fake child: got SIGHUP", flush=True))
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.grandchild:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(args.grandchild, "w") as f:
            f.write(str(child.pid))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ready = time.monotonic() - started >= args.health_after and not stalled
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
            os._exit(3)
        threading.Thread(target=crash, daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
