"""Tabular regression on synthetic data, written as a user package on top of dtrain's public API.

Modules: ``data`` (generate the CSV), ``prep`` (the per-row transform dtrain's preprocessing runs),
``train`` (the DDP script ``dtrain launch`` runs on every rank), ``evaluate`` (the held-out metrics).
"""
