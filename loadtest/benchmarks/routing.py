"""The routing sections of docs/benchmarks.md, rerun: routing-multi-tenant and routing-multi-turn (policies on
8 `sim` workers, sglang-router cache_aware beside them), routing-replicas-multi-tenant and -multi-turn (kv_aware
through 1 to 8 gateway replicas behind a round-robin nginx).

Each is one fleet run (`kvgate bench fleet ...`, loadtest/fleet.py) whose whole command the section records
on its `Command:` line, and that line stays the one source of its options: this reruns a section by running
its recorded command, which writes the section again (`--bench-doc`). Changing a routing section's options
means running `kvgate bench fleet` with the new ones once; from then on the section carries them.
Run: kvgate bench routing [SECTION ...] [--dry-run]   (no SECTION: all four, one after another)
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

from loadtest.benchdoc import section_commands
from loadtest.paths import DOC_PATH, ROOT

SECTIONS = ("routing-multi-tenant", "routing-multi-turn", "routing-replicas-multi-tenant", "routing-replicas-multi-turn")
FLEET = "kvgate bench fleet "


def recorded_argv(doc: str, section: str) -> list[str]:
    """The fleet command section records, as argv after `kvgate`."""
    command = section_commands(doc).get(section) or ""
    if not command.startswith(FLEET):
        raise ValueError(f"{DOC_PATH.name} records no `{FLEET.strip()} ...` command in section {section}")
    return shlex.split(command)[1:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench routing", description=__doc__.split("\n\n")[0])
    parser.add_argument("sections", nargs="*", choices=[[], *SECTIONS], metavar="SECTION",
                        help=f"which to rerun (default: all of {', '.join(SECTIONS)})")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    doc = DOC_PATH.read_text()
    for section in args.sections or SECTIONS:
        fleet_argv = recorded_argv(doc, section)
        print(f"{section}: kvgate {shlex.join(fleet_argv)}", flush=True)
        if not args.dry_run:
            subprocess.run([sys.executable, "-m", "kvgate", *fleet_argv], cwd=ROOT, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
