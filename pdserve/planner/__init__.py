"""The planner: each pool sized from its own phase's pressure against the SLOs (no torch)."""
