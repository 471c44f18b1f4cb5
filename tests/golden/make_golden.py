#!/usr/bin/env python3
"""make_golden.py - writes the golden files tests/test_golden.c compares the
engine against, from the float64 numpy reference in reference.py.

    python3 tests/golden/make_golden.py [model.gguf]
    python3 tests/golden/make_golden.py --emulate [model.gguf]

--emulate writes nothing: it applies test_golden.c's rules to a model of an
engine that quantises activations to 8 bits per 32 (and keeps K/V in
float16), to tell what such an engine must be expected to fail from bugs.

(default: models/SmolLM2-135M-Instruct.Q4_1.gguf under the repository root).
Needs python3 with gguf, numpy and tokenizers; the C tests only read the
text files. Deterministic: running it twice writes identical files.

Files (both start with a comment block describing the format):
  golden.txt       per prompt: text, token ids, 32 greedy tokens, the top-2
                   logit gap of each step, and for some positions the 8 best
                   ids with logits plus the logits of a fixed subset of 256
                   vocab ids.
  logits_full.txt  one full logit row (all 49152 ids, "%.3f"): the last
                   position of the prompt "The capital of France is".
"""

import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("MKL_NUM_THREADS", "2")

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import reference as ref  # noqa: E402

N_GEN = 32           # greedy tokens per prompt
N_TOP = 8            # best ids stored per position (the test checks 5)
N_SUBSET = 256       # fixed vocab subset for cosine estimates
PROMPT_POS = 4       # first prompt positions with logit records
GEN_STEPS = (0, 1, 4, 16, 31)   # generation steps with logit records (0: last prompt pos)
SUBSET_SEED = 0x5EED2026
FULL_PROMPT = "completion"   # prompt whose last position gets a full row

PROMPTS = [
    ("completion", "The capital of France is"),
    ("chat", ref.CHAT_PROMPT),
    ("code", "def fibonacci(n):\n"),
    ("accented", "À Paris, l'été est très chaud. Les Français aiment aller à la plage où ils"),
    ("cjk", "中国的首都是北京。日本的首都是"),
    ("emoji", "Party time 🎉🥳! We ordered 12 pizzas 🍕 for 30 people, so each person gets"),
]


def subset_ids(n_vocab):
    """N_SUBSET distinct ids from a 64-bit LCG (no library RNG, so the list
    never depends on a numpy version); sorted."""
    s = SUBSET_SEED
    ids = set()
    while len(ids) < N_SUBSET:
        s = (s * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        ids.add((s >> 33) % n_vocab)
    return sorted(ids)


def fmt(x):
    return "%.5f" % x


def top_record(where, i, row):
    order = np.argsort(-row, kind="stable")[:N_TOP]   # ties: lower id first
    parts = ["top", where, str(i), str(N_TOP)]
    for t in order:
        parts += [str(int(t)), fmt(row[t])]
    return " ".join(parts)


def sub_record(where, i, row, sub):
    return " ".join(["sub", where, str(i), str(len(sub))] + [fmt(row[t]) for t in sub])


def gap(row):
    a = np.partition(row, -2)[-2:]
    return float(a[1] - a[0])


def emulate(m, tk, sub):
    """test_golden.c's checks (subset cosine, top-5 modulo near ties,
    greedy up to the first reference near tie) on a quantising engine's
    logits, teacher-forced on the reference tokens."""
    def cos(a, b):
        return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))

    def top5(e, r):
        o = np.argsort(-r, kind="stable")[:N_TOP]
        bad = []
        for i, t in enumerate(np.argsort(-e, kind="stable")[:5]):
            if t not in o or abs(r[t] - r[o[i]]) > 0.05:
                bad.append("rank %d id %d (ref logit %+.3f from rank %d's)" % (i, t, r[t] - r[o[i]], i))
        return bad

    print("== engine model: activations of quantised matrices at 8 bits per 32, K/V float16")
    for name, text in PROMPTS:
        ids = ref.encode(tk, text)
        gen, steps, plog = ref.greedy(ref.Session(m), ids, N_GEN)
        n = len(ids)
        e = ref.Session(m, act_q8=True, kv_f16=True).eval(ids + gen)
        rows = [("p%d" % i, e[i], plog[i]) for i in range(min(PROMPT_POS, n))]
        rows += [("g%d" % s, e[n - 1 + s], steps[s]) for s in GEN_STEPS]
        msgs = []
        for tag, er, rr in rows:
            c = cos(er[sub], rr[sub])
            bad = top5(er, rr)
            if c < 0.999 or bad:
                msgs.append("%s cos %.5f%s" % (tag, c, "; top-5: " + ", ".join(bad) if bad else ""))
        gaps = [gap(r) for r in steps]
        cmp_, why = N_GEN, "all steps"
        for i in range(N_GEN):
            if gaps[i] < 0.05:
                cmp_, why = i, "reference near tie"
                break
            if int(np.argmax(e[n - 1 + i])) != gen[i]:
                cmp_, why = i, "MISMATCH: engine %d, reference %d, reference gap %.3f" % (
                    int(np.argmax(e[n - 1 + i])), gen[i], gaps[i])
                break
        allc = [cos(er[sub], rr[sub]) for _, er, rr in rows]
        print("%-10s greedy %2d/%d (%s); subset cosine min %.5f; max|d| %.3f"
              % (name, cmp_, N_GEN, why, min(allc),
                 max(float(np.abs(er - rr).max()) for _, er, rr in rows)))
        for msg in msgs:
            print("    FAIL " + msg)


def main():
    root = os.path.dirname(os.path.dirname(HERE))
    args = [a for a in sys.argv[1:] if a != "--emulate"]
    path = args[0] if args else os.path.join(root, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    m = ref.Model(path)
    tk = ref.build_tokenizer(m.reader)
    sub = subset_ids(m.n_vocab)
    if "--emulate" in sys.argv[1:]:
        emulate(m, tk, sub)
        return

    lines = [
        "# fedinfer golden v1: written by tests/golden/make_golden.py from the float64 numpy",
        "# reference tests/golden/reference.py; read by tests/test_golden.c. Do not edit.",
        "# Whitespace-separated tokens; '#' starts a comment that runs to the end of the line.",
        "# Records:",
        "#   model <file name>",
        "#   subset <n> <id>*n           vocab ids whose logits 'sub' records hold (sorted)",
        "#   prompt <name>               starts a prompt; records up to 'end' belong to it",
        "#   text_hex <hex>              the prompt's UTF-8 bytes in hex",
        "#   tokens <n> <id>*n           its ids (special tokens parsed: fi_tok_encode(...,1,...))",
        "#   gen <n> <id>*n              greedy continuation (argmax; lowest id wins a tie)",
        "#   gap <n> <g>*n               top1 - top2 logit of the logits that chose gen[i]",
        "#   top <w> <i> <k> (<id> <logit>)*k   the k best ids, best first, at position <i>:",
        "#                               w=p: prompt position i; w=g: generation step i (the",
        "#                               logits that chose gen[i]; step 0 = last prompt position)",
        "#   sub <w> <i> <n> <logit>*n   logits of the subset ids at that position",
        "#   end",
        "model %s" % os.path.basename(path),
        "subset %d %s" % (len(sub), " ".join(str(t) for t in sub)),
    ]
    full_row = None
    for name, text in PROMPTS:
        ids = ref.encode(tk, text)
        assert tk.decode(ids, skip_special_tokens=False) == text, name
        sess = ref.Session(m)
        gen, steps, plog = ref.greedy(sess, ids, N_GEN)
        gaps = [gap(r) for r in steps]
        lines.append("prompt %s" % name)
        lines.append("text_hex %s" % text.encode("utf-8").hex())
        lines.append("tokens %d %s" % (len(ids), " ".join(map(str, ids))))
        lines.append("gen %d %s" % (len(gen), " ".join(map(str, gen))))
        lines.append("gap %d %s" % (len(gaps), " ".join(fmt(g) for g in gaps)))
        for i in range(min(PROMPT_POS, len(ids))):
            lines.append(top_record("p", i, plog[i]))
            lines.append(sub_record("p", i, plog[i], sub))
        for s in GEN_STEPS:
            lines.append(top_record("g", s, steps[s]))
            lines.append(sub_record("g", s, steps[s], sub))
        lines.append("end")
        if name == FULL_PROMPT:
            full_row = (len(ids) - 1, plog[-1])
        n_cmp = next((i for i, g in enumerate(gaps) if g < 0.05), len(gaps))
        print("%-10s %3d prompt tokens; comparable greedy steps %2d/%d; min gap %.4f; %r"
              % (name, len(ids), n_cmp, len(gaps), min(gaps),
                 tk.decode(gen, skip_special_tokens=False)))
    with open(os.path.join(HERE, "golden.txt"), "w", encoding="ascii", newline="\n") as f:
        f.write("\n".join(lines) + "\n")

    pos, row = full_row
    out = [
        "# fedinfer golden v1: one full logit row from the float64 numpy reference",
        "# (tests/golden/make_golden.py). Whitespace-separated; '#' comments to end of line.",
        "#   full <prompt name> <prompt position> <n_vocab>  then n_vocab logits (\"%.3f\"),",
        "#   in vocab id order. The prompt's ids are in golden.txt.",
        "full %s %d %d" % (FULL_PROMPT, pos, len(row)),
    ]
    for i in range(0, len(row), 16):
        out.append(" ".join("%.3f" % v for v in row[i:i + 16]))
    with open(os.path.join(HERE, "logits_full.txt"), "w", encoding="ascii", newline="\n") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
