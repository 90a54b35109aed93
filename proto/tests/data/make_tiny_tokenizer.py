#!/usr/bin/env python3
"""Regenerates the tokenizer fixtures of kvroute-proto's `openai` tests.

Writes, next to this script:
  tiny-tokenizer.json          a 400-token byte-level BPE (Llama-3-style special tokens,
                               a post-processor that prepends <|begin_of_text|>)
  tiny-tokenizer_config.json   the matching tokenizer_config.json: bos/eos tokens and the
                               chat template read from llama3-style.jinja
  tiny-harmony-tokenizer.json  the same BPE with gpt-oss's Harmony special tokens added
                               (ids 400-405)
  tiny-harmony-tokenizer_config.json   a template in Harmony's format (what makes a model
                               gpt-oss to kvroute), for the Harmony tests

and prints the reference vectors that proto/tests/openai.rs records as literals:
token ids from Python `tokenizers` (the same library vLLM uses) and the chat rendering
done with jinja2 configured the way transformers' apply_chat_template configures it.

Usage:  pip install tokenizers==0.23.3 jinja2 && python3 make_tiny_tokenizer.py
Training is deterministic for a fixed corpus, but the committed JSON is the fixture:
regenerate only on purpose, then update the literals in the tests.
"""
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))

SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A cache-aware router sends each request to the replica that already holds its prefix.",
    "Large language models keep attention keys and values in blocks of tokens.",
    "When two requests share a system prompt, they share the first blocks of the cache.",
    "Hello, world! How are you today? I am fine, thank you.",
    "You are a helpful assistant. Answer the question in one sentence.",
    "The router and the replica must compute the same token ids for the same request.",
    "user assistant system tool: what is the capital of France? Paris is the capital.",
    "Numbers like 12, 345 and 6789 are split into small pieces by the tokenizer.",
]


def build() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tok.token_to_id(bos))],
    )
    return tok


CONVERSATION = [
    {"role": "system", "content": "  You are a helpful assistant.  "},
    {"role": "user", "content": "Hello, world!"},
    {"role": "assistant", "content": " Hello! How are you today?\n"},
    {"role": "user", "content": "What is the capital of France?"},
]


def render(template: str, messages, add_generation_prompt=True, **kwargs) -> str:
    """jinja2 set up like transformers' apply_chat_template (trim/lstrip blocks, loop controls)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        **kwargs,
    )


HARMONY_SPECIAL = ["<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|call|>", "<|constrain|>"]
HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>"
                    "{{ m.content }}<|end|>{% endfor %}")


def write_harmony(tok: Tokenizer) -> None:
    data = json.loads(tok.to_str())
    for i, special in enumerate(HARMONY_SPECIAL):
        data["added_tokens"].append({"id": 400 + i, "content": special, "single_word": False,
                                     "lstrip": False, "rstrip": False, "normalized": False,
                                     "special": True})
    with open(os.path.join(HERE, "tiny-harmony-tokenizer.json"), "w") as f:
        json.dump(data, f)
    with open(os.path.join(HERE, "tiny-harmony-tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": HARMONY_TEMPLATE}, f)


def main() -> None:
    tok = build()
    tok.save(os.path.join(HERE, "tiny-tokenizer.json"))
    with open(os.path.join(HERE, "llama3-style.jinja")) as f:
        template = f.read()
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": {"content": "<|eot_id|>", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False, "special": True},
        "chat_template": template,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    with open(os.path.join(HERE, "tiny-tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")

    write_harmony(tok)

    # Reload from disk, as the Rust side does.
    tok = Tokenizer.from_file(os.path.join(HERE, "tiny-tokenizer.json"))
    print("vocab_size(with added):", tok.get_vocab_size(with_added_tokens=True))
    for text in ["Hello, world!", "The quick brown fox jumps over the lazy dog.",
                 "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", "naïve 東京 42"]:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special).ids
            print(f"encode({text!r}, add_special_tokens={special}) = {ids}")
    for gen, kwargs in ((True, {}), (False, {}), (True, {"enable_thinking": False})):
        rendered = render(template, CONVERSATION, add_generation_prompt=gen, **kwargs)
        print(f"render(add_generation_prompt={gen}, {kwargs}) = {json.dumps(rendered)}")
        print("  ids =", tok.encode(rendered, add_special_tokens=False).ids)


if __name__ == "__main__":
    main()
