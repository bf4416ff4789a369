"""Elastic pools: the workers of each pool started, drained and stopped while serving. No torch."""
