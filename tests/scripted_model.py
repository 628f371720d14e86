"""A tiny Llama that says a script: each token's successor is fixed, so greedy (and, with
these logits, sampled) output is known token for token.

How: the vocabulary is a few whole pieces of text (a word-level tokenizer over byte-level
pieces, so that grammar libraries read its token table as they read GPT-2's), one-hot embeddings (hidden size = vocabulary size), attention
and MLP outputs zeroed, so the last hidden state is the last token's embedding; the LM head
row of `succ[t]` is t's one-hot, scaled so that its logit wins by far. The model then
continues any prompt from its last token along `SCRIPT`: the prompt `... assistant` gives
`<think>`, the reasoning, `</think>`, an answer, a tool call and the end token.

Used by the reasoning tests: a real chat template (`TEMPLATES`) around real `<think>` and
`<tool_call>` tokens, served by the real three-process server.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = ["<unk>", "<|im_end|>", "<|im_start|>"]  # <|im_end|> (id 1) is the end token
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # added tokens, not special
REASONING = "The user wants the weather in Paris."
ANSWER = "Let me check."
ARGUMENTS = '{"city": "Paris"}'
# the script: each token is followed by the next (every piece differs, so each has one
# successor); "assistant" ends the generation prompt
SCRIPT = [
    "assistant",
    "<think>",
    "\nThe user wants",
    " the weather in Paris.\n",
    "</think>",
    "\n\nLet me check.\n",
    "<tool_call>",
    '\n{"name": "get_weather", "arguments": ',
    '{"city": ',
    '"Paris"',
    "}",
    "}\n",
    "</tool_call>",
    "<|im_end|>",
]
WORDS = ["user", "system", "tool", "hi", "weather?", "sunny", "get_weather"]
# tokens of the script after the generation prompt, up to (and with) the answer
ANSWER_TOKENS = SCRIPT.index("\n\nLet me check.\n")

# Qwen3-style: the model opens the think block itself; enable_thinking false puts an empty
# block into the prompt. R1-style: the prompt opens the block, the model closes it.
_TURNS = (
    "{% if tools %}<|im_start|>system {% for t in tools %}{{ t.function.name }} {% endfor %}"
    "<tool_call><|im_end|>{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
)
TEMPLATES = {
    "qwen3": _TURNS + "{% if add_generation_prompt %}<|im_start|>assistant"
    "{% if enable_thinking is defined and not enable_thinking %} <think> </think>{% endif %}"
    "{% endif %}",
    "deepseek-r1": _TURNS + "{% if add_generation_prompt %}<|im_start|>assistant <think>"
    "{% endif %}",
}


def _vocab() -> list[str]:
    pieces = [*SPECIALS, *MARKERS]
    for p in [*SCRIPT, *WORDS]:
        if p not in pieces:
            pieces.append(p)
    if len(pieces) % 2:  # an even head size, for RoPE
        pieces.append("filler")
    return pieces


def make_scripted_checkpoint(out_dir: Path, template: str) -> Path:
    """Write the scripted model with chat template `template` (a key of TEMPLATES)."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from minisgl.tokenizer.tokenize import _bytes_to_unicode

    pieces = _vocab()
    ids = {p: i for i, p in enumerate(pieces)}
    byte_char = _bytes_to_unicode()
    vocab_of = {  # each piece in byte-level form: ByteLevel decoding gives the piece back
        (p if p in SPECIALS + MARKERS else "".join(byte_char[b] for b in p.encode())): i
        for p, i in ids.items()
    }
    vocab = len(pieces)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=vocab,  # one-hot embeddings
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=vocab,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=ids["<|im_end|>"],
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        head = torch.zeros(vocab, vocab)
        for token, successor in zip(SCRIPT, SCRIPT[1:]):
            head[ids[successor], ids[token]] = 10.0  # logit of the successor: 10 * sqrt(vocab)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(out_dir)

    tok = Tokenizer(models.WordLevel(vocab_of, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.ByteLevel()  # the byte-level pieces back to text
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>", pad_token="<unk>"
    )
    fast.chat_template = TEMPLATES[template]
    fast.save_pretrained(out_dir)
    return out_dir
