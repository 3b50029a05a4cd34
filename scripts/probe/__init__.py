"""The sections of ``scripts/gpu_probe.py``: one module per question the device probe answers.

Every section is a :class:`~probe.common.Section`: ``run(ctx)`` measures on the GPU, ``dry(ctx)`` walks
every part that needs no GPU (plans, CPU stand-ins) so CI can run it; both return a JSON-ready dict.
"""
