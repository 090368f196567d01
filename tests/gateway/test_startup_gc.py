"""What a gateway server process does to the collector once started (gateway/app.py
freeze_startup_objects), in a child interpreter: freezing is for the whole process."""

from __future__ import annotations

import json
import subprocess
import sys

from gateway.app import FULL_COLLECTION_THRESHOLD

PROBE = """
import gc, json
from gateway.app import freeze_startup_objects
before = gc.get_threshold()
freeze_startup_objects()
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen": gc.get_freeze_count()}))
"""


def test_startup_objects_are_frozen_and_full_collections_made_rarer():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    probe = json.loads(out.stdout)
    young, middle, _full = probe["before"]
    assert probe["after"] == [young, middle, FULL_COLLECTION_THRESHOLD]
    assert FULL_COLLECTION_THRESHOLD > probe["before"][2]
    assert probe["frozen"] > 1000  # the modules imported and everything startup built
