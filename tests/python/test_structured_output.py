"""Structured output (SamplingParams(structured_outputs=StructuredOutputsParams(...)), xgrammar)
on the bundled model: JSON schemas (every output parses and validates with `jsonschema`), any JSON
object, regexes (fullmatch), choices (an exact member), an EBNF grammar; greedy and seeded
sampling, sync and async scheduling; unconstrained requests in the same batch give what they
give alone; invalid constraints are a ValueError naming the field and the engine keeps serving."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.output_processor import RequestSetupError
from pagedllm.sampling_params import StructuredOutputsParams as S

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                      "population": {"type": "number", "minimum": 0, "maximum": 1e8}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "maxItems": 3},
                                      "ok": {"type": "boolean"}},
     "required": ["tags", "ok"], "additionalProperties": False},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                          "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                         "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
     "required": ["start", "end"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "number", "exclusiveMinimum": 0,
                                                                              "maximum": 10}},
     "required": ["kind", "radius"], "additionalProperties": False},
]
SCHEMAS += [
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 20},
                                      "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                      "rating": {"type": "number", "minimum": 0, "maximum": 5}},
     "required": ["title", "year"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
        "required": ["id", "email"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 6},
                                                                 "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                                "required": ["sku", "qty"], "additionalProperties": False},
     "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error", 404, None]}}, "required": ["status"],
     "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                          {"type": "string", "maxLength": 5}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                      "lon": {"type": "number", "minimum": -180, "maximum": 180}},
     "required": ["lat", "lon"], "additionalProperties": False},
    {"$defs": {"node": {"type": "object", "properties": {"label": {"type": "string", "maxLength": 6},
                                                         "weight": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["label", "weight"], "additionalProperties": False}},
     "type": "object", "properties": {"nodes": {"type": "array", "items": {"$ref": "#/$defs/node"}, "minItems": 1,
                                                "maxItems": 3}},
     "required": ["nodes"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                      "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
     "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 10},
                                      "nickname": {"type": ["string", "null"], "maxLength": 10}},
     "required": ["name", "nickname"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50}}, "required": ["c"],
        "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
     "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "format": "date"},
                                      "count": {"type": "integer", "minimum": 0, "maximum": 1000}},
     "required": ["date", "count"], "additionalProperties": False},
]
PROMPTS = ["Give me JSON about a person:", "A city as JSON:", "Some small numbers:", "Tags:",
           "A line from one point to another:", "A shape:", "A movie:", "An account:", "An order:", "A status:",
           "A 2x2 matrix:", "A value:", "A place on Earth:", "A small graph:", "Is water wet?", "A product code:",
           "A name and nickname:", "Three flags:", "Deeply nested:", "A day and a count:"]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(dtype="float32", max_model_len=512, seed=0)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_json_schemas_validate(llm, temperature):
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=160,
                             structured_outputs=S(json=schema, disable_any_whitespace=True))
              for i, schema in enumerate(SCHEMAS)]
    assert len(SCHEMAS) == len(PROMPTS) == 20
    checker = jsonschema.FormatChecker()
    for out, schema in zip(llm.generate(PROMPTS, params, use_tqdm=False), SCHEMAS):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema, format_checker=checker)


def test_json_object_regex_choice_grammar(llm):
    cases = [
        (S(json_object=True, disable_any_whitespace=True), lambda t: isinstance(json.loads(t), dict)),
        (S(regex=r"\d{3}-\d{4}"), lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
        (S(regex=r"(yes|no), because [a-z ]{1,20}\."), lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", t)),
        (S(choice=["Paris", "London", "Rome"]), lambda t: t in ("Paris", "London", "Rome")),
        (S(choice=["positive", "negative"]), lambda t: t in ("positive", "negative")),
        (S(grammar='root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]'),
         lambda t: re.fullmatch(r"The answer is [0-9][0-9]?\.", t)),
    ]
    prompts = ['{"name": "Ann", "age": 30}\n{"name": "Bob", "age": 41}\n', "Phone:", "Is it raining?",
               "The capital of France is", "Sentiment of 'great!':", "6 x 7?"]
    for temperature in (0.0, 1.0):
        # sampled, an unbounded JSON object may go on inside a string past any max_tokens: greedy only
        chosen = cases if temperature == 0.0 else cases[1:]
        params = [SamplingParams(temperature=temperature, seed=3, max_tokens=120, structured_outputs=c)
                  for c, _ in chosen]
        batch = prompts if temperature == 0.0 else prompts[1:]
        for out, (_, check) in zip(llm.generate(batch, params, use_tqdm=False), chosen):
            assert out.outputs[0].finish_reason == "stop" and check(out.outputs[0].text), out.outputs[0].text


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["Once upon a time", "The weather today"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    mixed = llm.generate(prompts + ["JSON:", "Phone:"],
                         [plain, plain, SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=S(json=SCHEMAS[0])),
                          SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=S(regex=r"\d{3}-\d{4}"))],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone


def test_properties_come_in_the_schemas_order(llm):
    schema = {"type": "object", "properties": {"zeta": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "alpha": {"type": "boolean"}, "mid": {"enum": ["x", "y"]}},
              "required": ["zeta", "alpha", "mid"], "additionalProperties": False}
    out = llm.generate(["Some JSON:"], SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=S(
        json=schema, disable_any_whitespace=True)), use_tqdm=False)[0].outputs[0].text
    assert list(json.loads(out)) == ["zeta", "alpha", "mid"], out


def test_async_scheduling_gives_the_same_constrained_outputs(llm):
    params = [SamplingParams(temperature=0.0, max_tokens=160, structured_outputs=S(json=s, disable_any_whitespace=True))
              for s in SCHEMAS[:3]]
    sync = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
    other = LLM(dtype="float32", max_model_len=512, seed=0, async_scheduling=True)
    try:
        got = [o.outputs[0].token_ids for o in other.generate(PROMPTS[:3], params, use_tqdm=False)]
    finally:
        other.shutdown()
    assert got == sync


@pytest.mark.parametrize("bad, field", [
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar="root ::= missing_rule"), "structured_outputs.grammar"),
])
def test_invalid_constraints_are_refused_and_the_engine_keeps_serving(llm, bad, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=S(**bad)), use_tqdm=False)
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_bad_params_are_value_errors():
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        S(json='{"type": "object"')
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        S(choice=[])


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        S(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        S()


def test_a_grammar_other_masks_contradict_fails_no_neighbour(llm):
    """min_tokens masks the EOS a finished choice needs: that sequence leaves its grammar (logged),
    and the request beside it in the batch gives what it gives alone."""
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], plain, use_tqdm=False)[0].outputs[0].token_ids
    odd = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=6, structured_outputs=S(choice=["yes", "no"]))
    mixed = llm.generate(["Once upon a time", "Yes or no?"], [plain, odd], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    assert len(mixed[1].outputs[0].token_ids) >= 6


def test_n_sequences_each_follow_the_schema(llm):
    """n > 1: every sequence has its own matcher (the children start at the prompt's end)."""
    schema = SCHEMAS[0]
    out = llm.generate(["A person:"], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=80,
                                                     structured_outputs=S(json=schema, disable_any_whitespace=True)),
                       use_tqdm=False)[0]
    texts = [c.text for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1  # seeds + i: the draws differ


class _GatedCompile:
    """Wraps the grammar compiler: compiles wait until release() (or raise `error`)."""

    def __init__(self, compiler, error=None):
        import threading
        self.compiler, self.error, self.gate = compiler, error, threading.Event()

    def compile_grammar(self, grammar):
        self.gate.wait(timeout=60)
        if self.error is not None:
            raise self.error
        return self.compiler.compile_grammar(grammar)

    def release(self):
        self.gate.set()


@pytest.fixture
def gated(llm):
    """The engine's grammar compiler, gated (the cache is emptied before and after)."""
    manager = llm.llm_engine.output_processor.structured_output_manager()
    real = manager._compiler
    manager._compiled.clear()
    holder = {}

    def install(error=None):
        holder["gate"] = _GatedCompile(real, error)
        manager._compiler = holder["gate"]
        return holder["gate"]

    yield install
    if "gate" in holder:
        holder["gate"].release()
    manager._compiler = real
    manager._compiled.clear()


def test_grammars_compile_off_the_step_loop(llm, gated):
    """While a request's grammar compiles, the engine steps the other requests; the constrained
    request starts once its grammar is ready and still follows it; an abort meanwhile leaks nothing."""
    engine = llm.llm_engine
    gate = gated()
    free_blocks = engine.core.stats().num_free_blocks
    engine.add_request("plain", "Once upon a time", engine.tokenizer.encode("Once upon a time"),
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.add_request("json", "A person:", engine.tokenizer.encode("A person:"),
                       SamplingParams(temperature=0.0, max_tokens=80,
                                      structured_outputs=S(json=SCHEMAS[0], disable_any_whitespace=True)))
    engine.add_request("dropped", "A city:", engine.tokenizer.encode("A city:"),
                       SamplingParams(max_tokens=8, structured_outputs=S(json=SCHEMAS[1])))
    waiting = {m.name: m.value for m in engine.get_metrics() if hasattr(m, "value")}["pagedllm:num_requests_waiting"]
    assert waiting == 3  # the two compiling requests count as waiting (--max-queued-requests sees them)
    done = {}
    for _ in range(6):  # the plain request runs to its end while both grammars wait
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {"plain"} and len(done["plain"].outputs[0].token_ids) == 6
    assert engine.has_unfinished_requests()
    aborted = engine.abort_request("dropped")
    assert aborted.finished and aborted.outputs == []  # as any request aborted before its first step
    gate.release()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {"plain", "json"}
    jsonschema.validate(json.loads(done["json"].outputs[0].text), SCHEMAS[0])
    assert engine.core.stats().num_free_blocks == free_blocks


def test_a_grammar_that_fails_to_compile_ends_its_request_alone(llm, gated):
    engine = llm.llm_engine
    gate = gated(RuntimeError("compiler exploded"))
    engine.add_request("plain", "Hello", engine.tokenizer.encode("Hello"),
                       SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    engine.add_request("json", "A person:", engine.tokenizer.encode("A person:"),
                       SamplingParams(max_tokens=20, structured_outputs=S(json=SCHEMAS[0])))
    gate.release()
    done, errors = {}, []
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RequestSetupError as exc:  # names the request; the engine goes on with the others
            errors.append(exc)
            continue
        for out in outs:
            if out.finished:
                done[out.request_id] = out
    assert [list(e.failures) for e in errors] == [["json"]]
    assert "failed to compile: compiler exploded" in str(errors[0])
    assert set(done) == {"plain"} and len(done["plain"].outputs[0].token_ids) == 5
    assert not engine.has_request("json")
    # once known to fail, the same constraint is refused when added
    with pytest.raises(ValueError, match="failed to compile"):
        engine.add_request("again", "A person:", engine.tokenizer.encode("A person:"),
                           SamplingParams(max_tokens=20, structured_outputs=S(json=SCHEMAS[0])))
    assert not engine.has_request("again")


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_sync_and_async_scheduling_follow_the_schemas():
    """On a GPU (CUDA graphs; sync and async scheduling), a random tiny Llama with SmolLM2's
    tokenizer: every output of the bounded schemas validates, and both schedules agree."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from server_utils import tiny_model_dir

    folder = str(tiny_model_dir())
    bounded = [s for s in SCHEMAS if "pattern" not in json.dumps(s)][:12]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=200,
                             structured_outputs=S(json=s, disable_any_whitespace=True))
              for i, s in enumerate(bounded) for t in (0.0, 1.0)]
    prompts = [f"Item {i}:" for i in range(len(params))]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(folder, dtype="float32", max_model_len=512, seed=0, async_scheduling=async_scheduling)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.shutdown()
        for out, p in zip(outs, params):
            text = out.outputs[0].text
            assert out.outputs[0].finish_reason == "stop", text
            jsonschema.validate(json.loads(text), p.structured_outputs.json)
        results.append([o.outputs[0].token_ids for o in outs])
    assert results[0] == results[1]


def test_preempted_sequences_keep_their_grammar(llm):
    """A KV pool too small for the batch: sequences are preempted and recomputed mid-JSON; their
    matchers keep their state, so the outputs equal those of a pool that fits everything."""
    params = [SamplingParams(temperature=0.0, max_tokens=120,
                             structured_outputs=S(json=s, disable_any_whitespace=True)) for s in SCHEMAS[:8]]
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:8], params, use_tqdm=False)]
    # SmolLM2-135M in float32: 30 layers x 3 KV heads x 64 x 4 bytes x (K, V) = 46,080 bytes per
    # token; 8 blocks of 16 tokens, where the 8 sequences (17-45 tokens each) need 16
    small = LLM(dtype="float32", max_model_len=512, seed=0, kv_cache_memory_bytes=8 * 16 * 46080, block_size=16)
    try:
        outs = small.generate(PROMPTS[:8], params, use_tqdm=False)
        preemptions = small.llm_engine.core.stats().num_preemptions
    finally:
        small.shutdown()
    assert preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    for out, s in zip(outs, SCHEMAS[:8]):
        jsonschema.validate(json.loads(out.outputs[0].text), s)


def test_chat_hands_tool_call_arguments_to_the_template_as_objects(llm):
    """LLM.chat as the server: an assistant message's tool_calls arguments (JSON text, as OpenAI's
    messages carry them) reach the template as an object."""
    from pagedllm.entrypoints.chat_templates import load_chat_template
    from pagedllm.entrypoints.chat_utils import chat_prompt_token_ids

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "21"}]
    tok = llm.llm_engine.tokenizer
    ids = chat_prompt_token_ids(tok, history, load_chat_template("hermes_tools"), tools=tools)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in tok.decode(ids)
    out = llm.chat(history, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False, chat_template="hermes_tools",
                   tools=tools)[0]
    assert out.prompt_token_ids == ids
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\].function.arguments is not JSON"):
        bad = [history[0], {**history[1], "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]
        llm.chat(bad, use_tqdm=False)
