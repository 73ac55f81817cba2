"""Replay serving workloads through a GPU prefix cache and the offload tiers."""
