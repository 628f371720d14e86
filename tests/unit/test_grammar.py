"""Grammar-constrained decoding with a tiny model: every output is one JSON value valid
against its schema, greedy or sampled, n > 1, batched with unconstrained requests (whose
tokens do not change), under overlap scheduling and under preemption; a bad schema is
an error naming `json_schema`; no matcher outlives its sequence."""

from __future__ import annotations

import json

import jsonschema
import pytest

from minisgl import LLM, SamplingParams

# bounded schemas: a random tiny model cannot ramble inside them (no free strings)
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "digit": {"type": "integer", "minimum": 0, "maximum": 9},
            "side": {"enum": ["left", "right"]},
            "ok": {"type": "boolean"},
        },
        "required": ["digit", "side", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"enum": [1, 2, 3]},
        "minItems": 1,
        "maxItems": 3,
    },
    {
        "type": "object",
        "properties": {
            "inner": {
                "type": "object",
                "properties": {"n": {"type": "null"}},
                "required": ["n"],
                "additionalProperties": False,
            }
        },
        "required": ["inner"],
        "additionalProperties": False,
    },
]
PROMPTS = [[(i * 37 + j * 11) % 500 + 3 for j in range(5 + 7 * i)] for i in range(4)]


def _params(schema: dict, **kw) -> SamplingParams:
    return SamplingParams(json_schema=json.dumps(schema), max_tokens=64, **kw)


def _check(llm: LLM, outs, schemas) -> None:
    for out, schema in zip(outs, schemas):
        assert out.error is None, out.error
        for choice in out.outputs:
            assert choice.finish_reason == "stop", (choice.text, choice.finish_reason)
            jsonschema.validate(json.loads(choice.text), schema)
    assert llm.scheduler.state().grammar_matchers == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_is_valid_json_for_its_schema(temperature, tiny_dirs) -> None:
    llm = LLM(str(tiny_dirs["llama"]), device="cpu", page_size=4)
    prompts = [p for p in PROMPTS for _ in SCHEMAS][: 3 * len(SCHEMAS)]
    schemas = [s for _ in PROMPTS for s in SCHEMAS][: len(prompts)]
    params = [_params(s, temperature=temperature, seed=i, n=2) for i, s in enumerate(schemas)]
    _check(llm, llm.generate(prompts, params), schemas)


# what would cut a value short or hold its end off: every token of the tiny vocabulary that
# a JSON value uses ends up in a stop string or a stop token
CUTOFFS = {
    "stop_strings": {"stop": ['"', ":", "}", "]"]},
    "stop_token_ids": {"stop_token_ids": list(range(3, 200))},
    "min_tokens": {"min_tokens": 60},
    "penalties": {"presence_penalty": 2.0, "frequency_penalty": 2.0, "repetition_penalty": 2.0},
}


@pytest.mark.parametrize("cutoff", list(CUTOFFS))
def test_stops_min_tokens_and_penalties_leave_the_value_whole(cutoff, tiny_dirs) -> None:
    llm = LLM(str(tiny_dirs["llama"]), device="cpu", page_size=4)
    params = [
        _params(s, temperature=1.0, seed=i, n=2, **CUTOFFS[cutoff]) for i, s in enumerate(SCHEMAS)
    ]
    assert all(not p.stop and not p.stop_token_ids and not p.min_tokens for p in params)
    _check(llm, llm.generate(PROMPTS[: len(SCHEMAS)], params), SCHEMAS)


def test_unconstrained_requests_in_the_same_batch_are_unchanged(tiny_dirs) -> None:
    llm = LLM(str(tiny_dirs["qwen3"]), device="cpu", page_size=4)
    free = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(PROMPTS, free)]
    mixed = llm.generate(PROMPTS + PROMPTS, [free] * 4 + [_params(SCHEMAS[0])] * 4)
    assert [o.token_ids for o in mixed[:4]] == alone
    _check(llm, mixed[4:], [SCHEMAS[0]] * 4)


@pytest.mark.parametrize("setting", ["overlap", "preemption"])
def test_constrained_outputs_stay_valid_under_overlap_and_preemption(setting, tiny_dirs) -> None:
    options = {"overlap_schedule": True} if setting == "overlap" else {"num_pages": 24}
    llm = LLM(str(tiny_dirs["qwen2"]), device="cpu", page_size=4, **options)
    schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(8)]
    prompts = [PROMPTS[i % len(PROMPTS)] + [7] * (3 * i) for i in range(8)]
    outs = llm.generate(
        prompts, [_params(s, temperature=1.0, seed=i) for i, s in enumerate(schemas)]
    )
    _check(llm, outs, schemas)
    if setting == "preemption":
        assert llm.scheduler.policy.num_preemptions > 0


@pytest.mark.parametrize("bad", ["{not json", '{"type": "no-such-type"}'])
def test_a_bad_schema_is_an_error_naming_json_schema(bad, tiny_dirs) -> None:
    llm = LLM(str(tiny_dirs["llama"]), device="cpu", page_size=4)
    (out,) = llm.generate([PROMPTS[0]], SamplingParams(json_schema=bad, max_tokens=4))
    assert out.error is not None and "JSON schema" in out.error
    assert llm.scheduler.state().grammar_matchers == 0


def test_a_schema_that_crashes_the_grammar_library_fails_only_its_request(tiny_dirs) -> None:
    # llguidance 1.x segfaults on this one; it compiles in a process of its own
    crashing = {"type": "integer", "minimum": -9223372036854775807, "maximum": -9223372036854775807}
    crashing["x-guidance"] = {"whitespace_flexible": False}
    with LLM(str(tiny_dirs["llama"]), device="cpu", page_size=4) as llm:
        bad, good = llm.generate(
            [PROMPTS[0], PROMPTS[1]],
            [_params(crashing), _params(SCHEMAS[1], temperature=1.0, seed=1)],
        )
        assert bad.error is not None and "crashed (signal SIGSEGV)" in bad.error, bad.error
        assert bad.error.startswith("json_schema")
        _check(llm, [good], [SCHEMAS[1]])


def test_a_constraint_the_grammar_library_gives_up_on_is_an_error_not_a_finish(tiny_dirs):
    # hundreds of optional properties: llguidance's parser row limit (2000 items) is hit
    # after the first token; the output so far ("{") would not parse
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(500)}}
    with LLM(str(tiny_dirs["llama"]), device="cpu", page_size=4) as llm:
        free = SamplingParams(max_tokens=6, ignore_eos=True)
        broken, fine = llm.generate(
            [PROMPTS[0], PROMPTS[1]], [_params(wide, temperature=1.0, seed=2, n=2), free]
        )
        assert broken.error is not None and "could not follow" in broken.error, broken
        assert all(o.finish_reason is None for o in broken.outputs)
        assert len(fine.token_ids) == 6 and fine.error is None
        state = llm.scheduler.state()
        assert state.grammar_matchers == 0 and state.kv_pages_used == 0
