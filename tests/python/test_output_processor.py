"""OutputProcessor driven by scripted engine steps (UpdateResult-shaped objects) and the real
Sampler: stop strings reported for finish_sequence, output kinds, EOS text, logprobs, n > 1,
prompt-only requests, abort."""

from types import SimpleNamespace

import numpy as np
import torch

from _tokenizers import smollm2_tokenizer
from pagedllm.output_processor import OutputProcessor
from pagedllm.sample import Sampler, compute_prompt_logprobs
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

torch.set_num_threads(1)
EOS = 2


class ScriptedEngine:
    """Plays the engine's part: each step every live sequence appends its next scripted token;
    EOS finishes with "stop", the end of the script with "length"."""

    def __init__(self, proc: OutputProcessor, vocab: int):
        self.proc, self.vocab = proc, vocab
        self.scripts: dict[int, tuple[str, int, list[int]]] = {}
        self.pending_new: list = []
        self.next_seq = 100
        self.finished_seqs: set[int] = set()

    def add(self, request_id, script_per_index):
        for index, script in enumerate(script_per_index):
            self.scripts[self.next_seq] = (request_id, index, list(script))
            self.pending_new.append((self.next_seq, request_id, index))
            self.next_seq += 1

    def step(self):
        sched = SimpleNamespace(new_seqs=self.pending_new)
        self.pending_new = []
        self.proc.on_schedule(sched)
        live = [s for s, (_, _, sc) in self.scripts.items() if s not in self.finished_seqs and sc]
        logits = torch.full((len(live), self.vocab), -10.0)
        for r, s in enumerate(live):
            logits[r, self.scripts[s][2][0]] = 10.0
        out = self.proc.sampler(logits, np.array(live, dtype=np.int64))
        finished = []
        for r, s in enumerate(live):
            rid, index, script = self.scripts[s]
            tok = script.pop(0)
            assert tok == out.sampled_token_ids[r]
            if tok == EOS:
                finished.append((rid, s, index, "stop", None))
            elif not script:
                finished.append((rid, s, index, "length", None))
        # prompt-only sequences (empty script) finish with "length" at once
        for s, (rid, index, script) in self.scripts.items():
            if not script and s not in self.finished_seqs and s not in live:
                finished.append((rid, s, index, "length", None))
        result = SimpleNamespace(
            seq_ids=np.array(live, dtype=np.int64),
            token_ids=out.sampled_token_ids,
            finished=finished,
        )
        outputs, stops = self.proc.on_update(result, np.array(live, dtype=np.int64), out)
        self.finished_seqs |= {f[1] for f in finished} | {s for s, _ in stops}
        return outputs, stops


def make(vocab=None):
    tok = smollm2_tokenizer()
    sampler = Sampler(len(tok))
    proc = OutputProcessor(tok, sampler, [EOS])
    return tok, proc, ScriptedEngine(proc, len(tok))


def greedy(**kw):
    return SamplingParams(temperature=0, **kw)


def test_stop_string_reported_once_and_text_cut():
    tok, proc, eng = make()
    ids = tok.encode("Hello world. STOP here and more", add_special_tokens=False)
    proc.add_request("r", "p", [1, 5], greedy(stop=["STOP"], max_tokens=50, output_kind=RequestOutputKind.DELTA))
    eng.add("r", [ids])
    deltas, all_stops, last = [], [], None
    while proc.requests:
        outputs, stops = eng.step()
        all_stops += stops
        for o in outputs:
            deltas.append(o.outputs[0].text if o.outputs else "")
            last = o
    assert [s for _, s in all_stops] == ["STOP"]  # the caller is told to finish the sequence
    assert last.finished and last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == "STOP"
    assert "".join(deltas) == "Hello world. "
    assert proc.sampler.num_sequences == 0


def test_eos_text_left_out_and_cumulative_outputs():
    tok, proc, eng = make()
    body = tok.encode("The answer is 42.", add_special_tokens=False)
    proc.add_request("r", None, [1], greedy(skip_special_tokens=False, logprobs=2))
    eng.add("r", [body + [EOS]])
    outs = []
    while proc.requests:
        outs += eng.step()[0]
    assert len(outs) == len(body) + 1  # CUMULATIVE: one output per step
    final = outs[-1].outputs[0]
    assert final.text == tok.decode(body, skip_special_tokens=False) == "The answer is 42."
    assert final.token_ids == body + [EOS] and final.finish_reason == "stop" and final.stop_reason is None
    assert len(final.logprobs) == len(final.token_ids)
    assert all(final.token_ids[i] in final.logprobs[i] for i in range(len(final.token_ids)))
    np.testing.assert_allclose(final.cumulative_logprob, sum(d[t].logprob for d, t in zip(final.logprobs, final.token_ids)), rtol=1e-6)
    assert final.logprobs[0][body[0]].decoded_token == tok.decode([body[0]])
    assert [o.finished for o in outs].count(True) == 1


def test_n_sequences_final_only_and_prompt_only():
    tok, proc, eng = make()
    a = tok.encode(" first answer", add_special_tokens=False)
    b = tok.encode(" second, longer answer here", add_special_tokens=False)
    proc.add_request("n2", "q", [1, 2, 3], SamplingParams(n=2, output_kind=RequestOutputKind.FINAL_ONLY, max_tokens=20))
    proc.add_request("p0", "q", [1, 2, 3], SamplingParams(max_tokens=0, prompt_logprobs=1, output_kind=RequestOutputKind.FINAL_ONLY))
    eng.add("n2", [a, b])
    eng.add("p0", [[]])
    logits = torch.randn(2, len(tok))
    proc.add_prompt_logprobs("p0", 0, compute_prompt_logprobs(logits, [2, 3], 1))
    outs = []
    while proc.requests:
        outs += eng.step()[0]
    by_id = {o.request_id: o for o in outs}
    assert len(outs) == 2  # FINAL_ONLY: one output per request
    n2 = by_id["n2"]
    assert [c.index for c in n2.outputs] == [0, 1]
    assert [c.text for c in n2.outputs] == [" first answer", " second, longer answer here"]
    assert all(c.finish_reason == "length" for c in n2.outputs)
    p0 = by_id["p0"]
    assert p0.outputs[0].token_ids == [] and p0.outputs[0].finish_reason == "length" and p0.outputs[0].text == ""
    assert p0.prompt_logprobs[0] is None and 2 in p0.prompt_logprobs[1] and 3 in p0.prompt_logprobs[2]


def test_abort_returns_final_output():
    tok, proc, eng = make()
    proc.add_request("r", "p", [1], greedy(max_tokens=50))
    eng.add("r", [tok.encode("some long text that goes on", add_special_tokens=False)])
    eng.step()
    eng.step()
    out = proc.abort_request("r")
    assert out.finished and out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) == 2
    assert proc.sampler.num_sequences == 0 and not proc.requests
    assert proc.abort_request("r") is None
