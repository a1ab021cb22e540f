"""FSx for Lustre deployment types as data (from the AWS FSx for Lustre performance docs).

Verify against the current AWS documentation before relying on it; override any of it
with ``dtrain plan --table FILE.json`` (same shape) or the ``table`` argument of the
planner and the operator. Capacities are AWS's nominal TiB (the console's 1.2 TiB is
1,200 GiB in the API); throughput is MB/s (10^6 bytes) per nominal TiB of storage.
"""

FSX_LUSTRE: dict[str, dict] = {
    "SCRATCH_1": {
        "throughput_mbps_per_tib": [200],
        "capacity_tib": {"first": [1.2, 2.4], "increment": 3.6},
        "note": "no replication; baseline read throughput",
    },
    "SCRATCH_2": {
        "throughput_mbps_per_tib": [200],
        "burst_mbps_per_tib": 1300,
        "capacity_tib": {"first": [1.2, 2.4], "increment": 2.4},
        "note": "no replication; baseline read throughput, bursts higher, writes lower",
    },
    "PERSISTENT_1": {
        "throughput_mbps_per_tib": [50, 100, 200],
        "capacity_tib": {"first": [1.2, 2.4], "increment": 2.4},
        "note": "SSD; replicated within one AZ",
    },
    "PERSISTENT_2": {
        "throughput_mbps_per_tib": [125, 250, 500, 1000],
        "capacity_tib": {"first": [1.2], "increment": 2.4},
        "note": "SSD; replicated within one AZ",
    },
}
