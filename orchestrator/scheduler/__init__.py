"""The scheduler room: requests, sessions' KV, queues, batches, the block pool and the rung ladder.

``scheduler.Scheduler`` is the entry point; the policies that fill each step live in
``agentserve.orchestrator.policies``.
"""
