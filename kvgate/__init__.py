"""kvgate: shared config, the `kvgate` CLI and the process supervisor."""
