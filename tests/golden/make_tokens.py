#!/usr/bin/env python3
"""make_tokens.py - reference token ids for tests/test_tokenizer.c.

Builds a Hugging Face `tokenizers` Tokenizer from the vocabulary and merges
stored in a GGUF file (SmolLM2's "gpt2" byte-level BPE with the "smollm"
pre-tokenizer: each digit alone, then the GPT-2 pattern) and writes the ids
of a fixed set of prompts to tokens.txt beside this script.

Usage: make_tokens.py MODEL.gguf [OUT]
Needs: pip install gguf tokenizers. The C test suite reads only the output
file; it never runs Python.

Output format (one case per line, '#' lines are comments):
    <special> <hex> <id> <id> ...
special: 1 when control-token texts are parsed as tokens, else 0;
hex: the prompt's UTF-8 bytes in lower-case hex, or '-' when empty.
"""
import os
import sys

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

LONG = (
    "The history of computing is longer than the history of computing hardware "
    "and modern computing technology and includes the history of methods intended "
    "for pen and paper or for chalk and slate, with or without the aid of tables. "
    "Digital computing is intimately tied to the representation of numbers. But long "
    "before abstractions like the number arose, there were mathematical concepts to "
    "serve the purposes of civilization. These concepts are implicit in concrete "
    "practices such as one-to-one correspondence, the basis of counting, comparison "
    "to a standard, used for measurement, and the 3-4-5 right triangle, a device for "
    "assuring a right angle, using ropes with 12 evenly spaced knots. In 1642, Blaise "
    "Pascal built a mechanical calculator; Leibniz followed in 1672 (it's said he "
    "couldn't stop) -- and by the 1820s Babbage's Difference Engine was on paper!"
)

PROMPTS = [
    (0, "Hello world"),
    (0, "Hello, world! How are you today?"),
    (0, "The quick brown fox jumps over the lazy dog."),
    (0, " leading space and trailing space "),
    (0, "café naïve Ångström résumé coöperate"),
    (0, "Straße Œuvre ÆØÅ æøå İstanbul ﬁne"),
    (0, "日本語のテキスト 中文"),
    (0, "한국어 텍스트와 Русский текст и ελληνικά"),
    (0, "مرحبا بالعالم שלום עולם"),
    (0, "हिन्दी भाषा และภาษาไทย"),
    (0, "emoji 😀😃 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ ✨"),
    (0, "family:👩🏿‍🤝‍👩🏻 flags 🇫🇷🇯🇵"),
    (0, "def f(x):\n\tif x > 0:\n\t\treturn x * 2\n    else:\n        return -x\n"),
    (0, "int main(void) {\n    printf(\"%d\\n\", 42);\n    return 0;\n}\n"),
    (0, "a   b\n\n\n  c"),
    (0, "   \n\t  \r\n  x  \t\t y\u00a0\u00a0z\u3000w"),
    (0, "\n"),
    (0, "  "),
    (0, "end with spaces   "),
    (0, "12345 3.14159"),
    (0, "a 1 b  22 c   333"),
    (0, "Phone: +1 (555) 010-9999, year 2024, ½ ² ³ Ⅻ ٣٤ ５"),
    (0, "I'm don't they'll we've she'd it's you're"),
    (0, "I'M DON'T 'tis ''s 's 'S x's ?'re"),
    (0, "mixed: Hello世界Привет123abc 東京2020"),
    (0, "URL https://example.com/path?q=1&r=two#frag email a.b@c.de"),
    (0, "symbols !!! ??? ... --- === +++ *** ### $$$ %%% ^^^"),
    (0, "tabs\tand\ttabs\t\t\tend"),
    (0, "line1\r\nline2\rline3\n"),
    (0, "\u200b zero\u200bwidth \ufeffbom"),
    # \s is Unicode White_Space: U+0085 and U+2028 are, U+001C..1F, U+180E
    # and U+200B are not
    (0, "a\x1c\x1cb a\x85\x85b a\u180e\u180eb a\u2028\u2028b a\x1f b \u205f\u205fx\u1680"),
    (0, "<|im_start|>user\nhi<|im_end|>"),
    (1, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
    (1, "<|endoftext|><|endoftext|>text<|im_end|>"),
    (1, "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"),
    (1, "no special here"),
    (1, "<|im_start <|im_start|>x<|im_end| <|im_end|>"),
    (0, ""),
    (1, ""),
    # bytes whose byte-level symbol is not in SmolLM2's vocabulary are
    # dropped, and the symbols around them may merge
    (0, "!\x04! .\x04. \x04the h\x04e x\x14\x13y \x1d"),
    (0, "\x04"),
    (0, "\U00050000\U00050000 \U000F0000"),
    (0, LONG),
    (0, "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"),
    (0, "x" * 300 + " " + "ab" * 100),
]


def load(path):
    r = gguf.GGUFReader(path)

    def strs(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    tokens = strs("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in strs("tokenizer.ggml.merges")]
    tt = r.fields["tokenizer.ggml.token_type"]
    types = [int(tt.parts[i][0]) for i in tt.data]
    return tokens, merges, types


def byte_symbols():
    """GPT-2's bytes_to_unicode: byte -> its one-character symbol."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def build(tokens, merges, types):
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Control tokens (type 3) are special: matched in the raw text.
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    )
    return tok


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: make_tokens.py MODEL.gguf [OUT]")
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "tokens.txt")
    tokens, merges, types = load(sys.argv[1])
    full = build(tokens, merges, types)
    # Without special parsing: a tokenizer with no added tokens.
    plain = build(tokens, merges, [1] * len(tokens))
    missing = set(b for b, sym in byte_symbols().items() if sym not in set(tokens))
    lines = [
        "# Generated by tests/golden/make_tokens.py from %s" % os.path.basename(sys.argv[1]),
        "# <special 0|1> <prompt as UTF-8 hex, '-' if empty> <ids...>",
    ]
    for special, text in PROMPTS:
        t = full if special else plain
        ids = t.encode(text, add_special_tokens=False).ids
        # decoding gives the text back, less the bytes without a token
        # (the decoder replaces what is then no longer UTF-8 with U+FFFD)
        back = t.decode(ids, skip_special_tokens=False)
        raw = bytes(b for b in text.encode("utf-8") if b not in missing)
        assert back == raw.decode("utf-8", "replace"), text
        hx = text.encode("utf-8").hex() or "-"
        lines.append(" ".join([str(special), hx] + [str(i) for i in ids]))
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote %d cases to %s" % (len(PROMPTS), out))


if __name__ == "__main__":
    main()
