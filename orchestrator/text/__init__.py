"""The text room: tokenisation, chat templates, streaming detokenisation, stop strings, tool calls.

Torch-free; used by the orchestrator process and by offline generation (``agentserve.cli.offline``).
"""
