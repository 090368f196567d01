"""Engine core: block manager, scheduler and the step loop (no torch)."""
