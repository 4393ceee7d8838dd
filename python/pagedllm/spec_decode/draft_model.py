"""Draft-model proposals (vLLM's method "draft_model"; Leviathan et al. 2023, Chen et al. 2023): a
smaller model with the target's vocabulary proposes k tokens per sequence, greedily (vLLM's default
draft_sample_method "greedy"), so a proposal is deterministic — q one-hot — and the native
scheduler's verification (accept while the target's sample equals the draft, pagedllm/spec_decode.h)
is exact for every sampling setting of the target.

KV cache: the draft has its own KV tensors (its layers, heads and dtype) over the SAME block ids and
slots as the target — one native KV manager (pagedllm._C.EngineCore) and one block table per
sequence serve both, so prefix caching, copy-on-write and preemption apply to the draft's cache as
they do to the target's, and the slots of rejected drafts are released once for both.

Per step (``propose(sched)``, before the target runs the step; the scheduler reserved up to k draft
rows per speculating sequence with external_drafts, draft token 0):
  1. one draft forward over every token of the step except the draft rows (prompt chunks and plain
     decodes keep the draft's KV in step with the target's; a speculating sequence contributes its
     last committed token, whose logits give draft 0);
  2. then, for j = 1 .. k, one decode forward of the speculating sequences over draft j - 1 at its
     reserved slot: its logits give draft j, and the last pass writes the KV of the last draft (so
     that the draft's cache has every token the target's has, whatever is accepted).
The drafts go into sched.input_ids (the draft rows) and sched.draft_token_ids in place.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch


class DraftModelProposer:
    """runner: the draft's ModelRunner (its KV cache built with the target's num_blocks and
    block_size); k: num_speculative_tokens."""

    def __init__(self, runner, k: int):
        self.runner = runner
        self.k = int(k)
        self.vocab_size = runner.config.vocab_size
        self.num_passes = 0

    def propose(self, sched) -> None:
        """Fill the draft rows of `sched` (a SchedulerOutput with num_draft_tokens > 0) in place;
        without draft rows, keep the draft's KV in step (pass 1 only)."""
        qsl = np.asarray(sched.query_start_loc, dtype=np.int64)
        S = int(sched.num_seqs)
        qlen = np.diff(qsl)
        nd = np.zeros(S, dtype=np.int64)  # drafts per sequence row
        if int(sched.num_draft_tokens):
            counts: dict[int, int] = {}
            for s, d in zip(np.asarray(sched.sample_seq_ids).tolist(), np.asarray(sched.draft_token_ids).tolist()):
                if d >= 0:
                    counts[s] = counts.get(s, 0) + 1
            seq_ids = np.asarray(sched.seq_ids).tolist()
            nd = np.array([counts.get(s, 0) for s in seq_ids], dtype=np.int64)
        spec_rows = np.nonzero(nd)[0]
        # 1. every token but the draft rows
        keep_len = qlen - nd
        keep = np.concatenate([np.arange(qsl[i], qsl[i] + keep_len[i]) for i in range(S)]) if S else np.zeros(0, np.int64)
        new_qsl = np.concatenate([[0], np.cumsum(keep_len)]).astype(np.int32)
        last_rows = new_qsl[1:][spec_rows] - 1  # a speculating sequence's committed last token
        first = self._batch(sched, keep, np.asarray(sched.seq_lens) - nd, new_qsl, np.asarray(sched.block_tables),
                            last_rows, copy_orders=np.asarray(sched.copy_orders))
        logits = self._run(first)
        if not len(spec_rows):
            return
        drafts = np.zeros((len(spec_rows), self.k), dtype=np.int64)
        drafts[:, 0] = self._argmax(logits)
        # 2. decode passes over draft j - 1 (j = 1 .. max drafts); the last one only writes KV
        bt = np.asarray(sched.block_tables)[spec_rows]
        base = qsl[spec_rows]  # row of the sequence's last committed token in sched
        ctx = np.asarray(sched.seq_lens)[spec_rows] - nd[spec_rows]  # context incl. that token
        for j in range(1, int(nd[spec_rows].max()) + 1):
            active = np.nonzero(nd[spec_rows] >= j)[0]
            rows = base[active] + j  # the draft row j - 1 of each active sequence in sched
            want = nd[spec_rows][active] > j  # its logits give draft j
            batch = self._decode_batch(sched, rows, drafts[active, j - 1], ctx[active] + j, bt[active],
                                       np.nonzero(want)[0])
            out = self._run(batch)
            if want.any():
                drafts[active[want], j] = self._argmax(out)
        # the drafts into the step: input rows and the verification's draft ids
        ids = sched.input_ids
        dti = sched.draft_token_ids
        samp = np.asarray(sched.sample_seq_ids)
        seq_ids = np.asarray(sched.seq_ids)
        for r, i in enumerate(spec_rows.tolist()):
            n = int(nd[i])
            ids[qsl[i] + 1: qsl[i] + 1 + n] = drafts[r, :n]
            first_row = int(np.nonzero((samp == seq_ids[i]) & (np.asarray(dti) >= 0))[0][0])
            dti[first_row: first_row + n] = drafts[r, :n]

    # ------------------------------------------------------------------ batches
    def _batch(self, sched, token_rows, seq_lens, qsl, block_tables, logits_rows, copy_orders=None):
        qlen = np.diff(qsl)
        return SimpleNamespace(
            step_id=int(sched.step_id), num_tokens=len(token_rows), num_seqs=len(seq_lens),
            num_sampled=len(logits_rows), num_placeholders=0,
            max_query_len=int(qlen.max()) if len(qlen) else 0,
            input_ids=np.ascontiguousarray(np.asarray(sched.input_ids)[token_rows], dtype=np.int32),
            positions=np.ascontiguousarray(np.asarray(sched.positions)[token_rows], dtype=np.int64),
            slot_mapping=np.ascontiguousarray(np.asarray(sched.slot_mapping)[token_rows], dtype=np.int64),
            seq_lens=np.ascontiguousarray(seq_lens, dtype=np.int32), query_start_loc=np.ascontiguousarray(qsl),
            block_tables=np.ascontiguousarray(block_tables, dtype=np.int32),
            logits_indices=np.ascontiguousarray(logits_rows, dtype=np.int64),
            sample_seq_ids=np.zeros(len(logits_rows), dtype=np.int64),
            prev_sample_rows=np.full(len(token_rows), -1, dtype=np.int32),
            copy_orders=np.zeros((0, 2), np.int64) if copy_orders is None else copy_orders,
            prompt_logprob_rows=[])

    def _decode_batch(self, sched, rows, token_ids, seq_lens, block_tables, logits_rows):
        b = self._batch(sched, rows, seq_lens, np.arange(len(rows) + 1, dtype=np.int32), block_tables, logits_rows)
        b.input_ids = np.ascontiguousarray(token_ids, dtype=np.int32)
        return b

    def _run(self, batch) -> torch.Tensor:
        self.num_passes += 1
        if batch.num_tokens == 0:
            return torch.zeros(0, self.vocab_size)
        return self.runner.execute_model(batch).logits

    def _argmax(self, logits: torch.Tensor) -> np.ndarray:
        return logits[:, : self.vocab_size].argmax(dim=-1).cpu().numpy()


__all__ = ["DraftModelProposer"]
