"""Closed-loop agent benchmarks: workloads, drivers, replayer, metrics, report (``agentserve bench``)."""
