"""When a sequence stops: eos / stop token ids, max tokens, context length (torch-free).

The rule both ends of the ring apply to a :class:`SamplingParams`: the executor decides a step's finish
with it, the scheduler checks it again on every token, and the simulated executor uses it too.
"""

from __future__ import annotations

from collections.abc import Collection

from agentserve.protocol.sampling import Finish, SamplingParams


def finish_reason(
    token_id: int,
    num_generated: int,
    params: SamplingParams,
    eos_token_ids: Collection[int],
    seq_len: int | None = None,
    max_model_len: int | None = None,
) -> Finish:
    """Why a sequence stops after sampling ``token_id`` as its ``num_generated``-th token.

    A stop token id always stops; eos stops unless ``ignore_eos``; then ``max_tokens``, then a
    sequence of ``seq_len`` tokens that has filled the context (``max_model_len``).
    """
    if token_id in params.stop_token_ids:
        return Finish.STOP
    if not params.ignore_eos and token_id in eos_token_ids:
        return Finish.STOP
    if num_generated >= params.max_tokens:
        return Finish.LENGTH
    if seq_len is not None and max_model_len is not None and seq_len >= max_model_len:
        return Finish.LENGTH
    return Finish.NONE
