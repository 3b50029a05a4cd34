"""The fused CPU decode step: a whole decode forward pass in one call into compiled C (``decode_step.c``)."""
