"""Execute one :class:`Plan` on the model: feed tokens, sample, decide token-level finishes.

A plan whose sequences all feed one token runs as a batched decode; anything else (prefill chunks,
or resume chunks riding beside decodes) runs as one ragged prefill in which a decode is a chunk of
one token.  Only sequences with ``sample`` set are sampled.  Stop strings and aborts are the
orchestrator's business; eos, stop token ids, ``max_tokens`` and the context limit are decided here
so the decode lane can run ahead without waiting for the orchestrator.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from agentserve.executor.fused.helper import DecodeHelper
from agentserve.executor.grammar import advance, mask_logits
from agentserve.executor.runner import DecodeItem, ModelRunner, PrefillChunk
from agentserve.executor.sampler import Sampler
from agentserve.executor.sequences import SeqState, SequenceTable
from agentserve.protocol.ring_messages import Plan, SeqPlan, SeqResult
from agentserve.protocol.sampling import Finish
from agentserve.protocol.stopping import finish_reason


class StepExecutor:
    def __init__(self, runner: ModelRunner, table: SequenceTable, eos_token_ids: Collection[int]) -> None:
        self.runner = runner
        self.table = table
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = runner.max_model_len

    def run(self, plan: Plan, helper: DecodeHelper | None = None) -> list[SeqResult]:
        """Run ``plan``; sequences that already finished (a plan sent ahead) are skipped.  ``helper``: the decode
        helper a fused decode batch may share (:mod:`.fused.helper`)."""
        work = [(sp, st) for sp in plan.seqs if (st := self.table.admit(sp)).finish == Finish.NONE]
        if not work:
            return []
        feeds = [st.tokens_for(sp) for sp, st in work]
        logits = self._forward(work, feeds, plan.rung, helper)
        return self._sample(work, feeds, logits)

    def _forward(self, work: list[tuple[SeqPlan, SeqState]], feeds: list[list[int]], rung: int,
                 helper: DecodeHelper | None) -> torch.Tensor:
        pairs = zip(work, feeds, strict=True)
        if all(len(f) == 1 for f in feeds):
            items = [DecodeItem(f[0], sp.start_pos, st.block_table) for (sp, st), f in pairs]
            return self.runner.decode(items, rung, helper)  # the rung's decode graph where one was captured
        return self.runner.prefill([PrefillChunk(f, sp.start_pos, st.block_table) for (sp, st), f in pairs])

    def _sample(
        self, work: list[tuple[SeqPlan, SeqState]], feeds: list[list[int]], logits: torch.Tensor
    ) -> list[SeqResult]:
        rows = [i for i, (sp, _) in enumerate(work) if sp.sample]
        results = [SeqResult(sp.seq_id) for sp, _ in work]
        if not rows:
            if logits.is_cuda:  # nothing was read back: the KV writes must be done before we report
                torch.cuda.current_stream(logits.device).synchronize()
            return results
        states = [work[i][1] for i in rows]
        picked = logits[rows]
        if any(st.matcher is not None for st in states):
            mask_logits(picked, [st.matcher for st in states])
        tokens, logprobs, tops = self.sampler.sample_with_top(
            picked, [st.sampling for st in states], [st.generator for st in states]
        )
        for i, st, token, logprob, (top_ids, top_lps) in zip(rows, states, tokens, logprobs, tops, strict=True):
            sp = work[i][0]
            st.last_token = token
            st.num_generated += 1
            seq_len = sp.start_pos + len(feeds[i])
            st.finish = finish_reason(
                token, st.num_generated, st.sampling, self.eos_token_ids, seq_len + 1, self.max_model_len
            )
            if st.matcher is not None and advance(st.matcher, token) and st.finish == Finish.NONE:
                st.finish = Finish.STOP  # the grammar is complete: nothing more may follow
            results[i] = SeqResult(sp.seq_id, token, logprob, st.finish, top_ids, top_lps)
        return results
