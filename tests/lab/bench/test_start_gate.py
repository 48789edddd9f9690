"""The start gate of the namespace benchmark's ranks (``stoker_lab.bench.start_gate``), without Ray."""

from __future__ import annotations

import asyncio

import pytest

from stoker_lab.bench.start_gate import StartGate, pass_gate


def test_no_caller_passes_before_the_last_arrives_and_keys_are_separate():
    async def scenario():
        gate = StartGate()
        first = [asyncio.ensure_future(gate.wait("job/0", 3)) for _ in range(2)]
        other = asyncio.ensure_future(gate.wait("job/1", 1))  # a one-party key opens at once
        await asyncio.sleep(0.05)
        assert other.done() and not any(f.done() for f in first)
        last = await gate.wait("job/0", 3)
        released = await asyncio.gather(*first)
        assert all(abs(t - last) < 1.0 for t in released)
        late = await asyncio.wait_for(gate.wait("job/0", 3), 1.0)  # an open gate stays open for its key
        return late

    assert asyncio.run(scenario()) > 0


def test_a_gate_needs_a_party_and_none_means_no_gate():
    with pytest.raises(ValueError, match="at least one party"):
        asyncio.run(StartGate().wait("k", 0))
    assert pass_gate(None, "k", 3, 0.1) > 0
