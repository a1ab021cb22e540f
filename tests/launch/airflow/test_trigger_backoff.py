"""The deferred trigger's poll interval backs off: 2 s growing by half up to the cap, the same
for a trigger rebuilt from its serialized kwargs; a trigger serialized before the field existed
keeps its fixed interval."""

from __future__ import annotations

import asyncio

from dtrain.launch.airflow.trigger import DistributedJobTrigger, next_interval
from dtrain.launch.backends import JobHandle


def handle(tmp_path) -> dict:
    return JobHandle("ssh", "job", "job", str(tmp_path), 2, 0.0,
                     data={"hosts": ["a"], "ssh": {}, "detached": True}).to_dict()


def test_next_interval_grows_by_half_up_to_the_cap():
    waits, wait = [], 2.0
    for _ in range(8):
        waits.append(wait)
        wait = next_interval(wait, 30.0)
    assert waits == [2.0, 3.0, 4.5, 6.75, 10.125, 15.1875, 22.78125, 30.0]
    assert next_interval(2.0, None) == 2.0 and next_interval(40.0, 30.0) == 40.0


def test_the_trigger_waits_longer_each_poll_and_survives_serialization(tmp_path, monkeypatch):
    trigger = DistributedJobTrigger(handle=handle(tmp_path), poll_interval=2, max_poll_interval=5)
    classpath, kwargs = trigger.serialize()
    assert kwargs["max_poll_interval"] == 5.0
    rebuilt = DistributedJobTrigger(**kwargs)
    polls, waits = [], []

    async def poll():
        polls.append(1)
        return {"status": "success"} if len(polls) == 5 else None

    async def sleep(seconds):
        waits.append(seconds)

    monkeypatch.setattr(rebuilt, "_poll", poll)
    monkeypatch.setattr("dtrain.launch.airflow.trigger.asyncio.sleep", sleep)

    async def first():
        async for event in rebuilt.run():
            return event.payload

    assert asyncio.run(first()) == {"status": "success"}
    assert waits == [2.0, 3.0, 4.5, 5.0]


def test_a_trigger_serialized_before_backoff_keeps_its_fixed_interval(tmp_path):
    trigger = DistributedJobTrigger(handle=handle(tmp_path), poll_interval=2.0, hang_timeout=None)
    assert trigger.max_poll_interval is None and next_interval(trigger.poll_interval, None) == 2.0
