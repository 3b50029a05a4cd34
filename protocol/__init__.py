"""The contracts between AgentServe's processes and packages (torch-free; msgspec only).

- ``client_messages``: the client wire protocol (ZeroMQ ingress ⇄ SDK / gateway).
- ``endpoints``: endpoint strings, defaults and the loopback rule.
- ``ring_messages``: what crosses the shared-memory rings (orchestrator ⇄ executor).
- ``sampling``, ``stopping``, ``lanes``: the domain types and rules both processes apply.
- ``stats``: the stats snapshot ``agentserve top`` reads.
"""
