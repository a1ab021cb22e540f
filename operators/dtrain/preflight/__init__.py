"""Preflight: before an expensive training job, check every node can run it."""
