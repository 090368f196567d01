"""The load-test library: workloads, the load driver, fleets, faults, reports, the harness parts and peers'
launchers benchmarks share; the benchmarks themselves are in loadtest/benchmarks/ (`kvgate bench list`).
It drives kvgate over HTTP only (docs/architecture.md, "Inside each package")."""
