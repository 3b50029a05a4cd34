"""Test and benchmark harness: closed-loop agents against the real scheduler and a fake executor on a
simulated clock (``sim``), and the fake executor with its cost model (``fake_executor``)."""
