"""Executors: run one scheduled step (model math on torch, or the sim timing model)."""
