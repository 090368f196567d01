"""The cascading-failure benchmark's harness (`kvgate bench cascading-failure`): the phases and their fault
schedule (phases.py), the tenants' open-loop workload (workload.py), the openai SDK clients that drive it and
count their own retries (client.py, records.py), the two-pool sim fleet, its capacity and the routers put in
front of it (fleet.py, capacity.py, routers.py), one configuration's run through every phase (run.py), and
the arithmetic of its figures (figures.py, analysis.py)."""
