"""The OpenAI-compatible HTTP gateway: a process beside the orchestrator that speaks HTTP to agent
frameworks and the ZeroMQ protocol to the orchestrator (it is one more SDK client).

Started by ``agentserve up --http HOST:PORT``; run by hand with ``python -m agentserve.gateway``.
It never imports torch or the executor.
"""
