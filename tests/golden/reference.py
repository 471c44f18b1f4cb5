"""reference.py - an independent numpy reference for fedinfer's engine.

A plain Llama forward pass over a GGUF file (written for the golden tests,
not derived from the C engine), computed in float64 from weights that
gguf.quants.dequantize turns into float32 (exact values of the quantised
blocks), plus an HF `tokenizers` tokenizer built from the GGUF's vocabulary
and merges.

Used by make_golden.py; can also be run on its own:
    python3 tests/golden/reference.py [model.gguf] [prompt]
which greedy-decodes a chat answer (sanity check).
"""

import sys

import numpy as np
import gguf
from gguf import GGUFReader
from gguf.quants import dequantize


def _field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


class Config:
    def __init__(self, reader):
        self.n_layers = int(_field(reader, "llama.block_count"))
        self.dim = int(_field(reader, "llama.embedding_length"))
        self.ffn_dim = int(_field(reader, "llama.feed_forward_length"))
        self.n_heads = int(_field(reader, "llama.attention.head_count"))
        self.n_kv_heads = int(_field(reader, "llama.attention.head_count_kv"))
        self.head_dim = self.dim // self.n_heads
        self.rope_theta = float(_field(reader, "llama.rope.freq_base"))
        # Stored as float32 in the file: keep that exact value.
        self.norm_eps = float(np.float32(_field(reader, "llama.attention.layer_norm_rms_epsilon")))


class Model:
    """Weights as float64 arrays, matrices as (out_features, in_features)."""

    def __init__(self, path):
        self.path = path
        self.reader = GGUFReader(path)
        self.cfg = Config(self.reader)
        tensors = {t.name: t for t in self.reader.tensors}

        def load(name):
            t = tensors[name]
            w = dequantize(t.data, t.tensor_type)
            # GGUF shape [ne0, ne1] = [in, out]; the reader's array (after
            # dequantisation) is (ne1, ne0) = (out, in), row-major.
            ne = [int(x) for x in t.shape]
            if len(ne) == 2:
                assert w.shape == (ne[1], ne[0]), (name, w.shape, ne)
            else:
                w = w.reshape(ne[0])
            return np.ascontiguousarray(w, dtype=np.float64)

        c = self.cfg
        self.tok_embd = load("token_embd.weight")          # (vocab, dim)
        self.n_vocab = self.tok_embd.shape[0]
        self.output_norm = load("output_norm.weight")
        self.output = load("output.weight") if "output.weight" in tensors else self.tok_embd
        # Diagnostics only (Session act_q8): which matrices are quantised.
        floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                  gguf.GGMLQuantizationType.BF16)
        self.quantised = {n: t.tensor_type not in floats for n, t in tensors.items()}
        self.output_quantised = self.quantised["output.weight" if "output.weight" in tensors
                                               else "token_embd.weight"]
        self.layers = []
        for i in range(c.n_layers):
            p = "blk.%d." % i
            L = {k: load(p + k + ".weight") for k in
                 ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
            assert L["attn_q"].shape == (c.dim, c.dim)
            assert L["attn_k"].shape == (c.n_kv_heads * c.head_dim, c.dim)
            assert L["ffn_gate"].shape == (c.ffn_dim, c.dim)
            assert L["ffn_down"].shape == (c.dim, c.ffn_dim)
            L["_q"] = {k: self.quantised[p + k + ".weight"] for k in L}
            self.layers.append(L)
        # RoPE inverse frequencies: theta^(-2i/head_dim), i < head_dim/2.
        hd = c.head_dim
        self.inv_freq = c.rope_theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)


def rmsnorm(x, g, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def rope(x, pos, inv_freq):
    """x: (n, heads, head_dim); adjacent pairs (2i, 2i+1) rotate by
    pos * inv_freq[i]."""
    ang = pos[:, None].astype(np.float64) * inv_freq[None, :]     # (n, hd/2)
    cos = np.cos(ang)[:, None, :]
    sin = np.sin(ang)[:, None, :]
    x0 = x[..., 0::2]
    x1 = x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def quantise_q8(x):
    """Diagnostics: what an engine that quantises activations for integer
    dot products sees: blocks of 32, scale d = amax/127 (float32),
    q = round-half-even(x/d), x' = q*d."""
    s = x.shape
    b = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(b * inv)
    d = (amax / np.float32(127)).astype(np.float32)
    return (q * d).astype(np.float64).reshape(s)


class Session:
    """One sequence with a KV cache (float64).

    The golden data uses the defaults. act_q8 (activations of quantised
    matrices rounded as quantise_q8 does) and kv_f16 (K and V stored as
    float16) are diagnostics: they model an engine that does so, to tell
    quantisation effects from bugs (make_golden.py --emulate)."""

    def __init__(self, model, n_ctx=512, act_q8=False, kv_f16=False):
        c = model.cfg
        self.m = model
        self.pos = 0
        self.act_q8 = act_q8
        self.kv_f16 = kv_f16
        kvd = (c.n_layers, n_ctx, c.n_kv_heads, c.head_dim)
        self.k = np.zeros(kvd)
        self.v = np.zeros(kvd)

    def eval(self, toks):
        """Runs toks at the current position; returns (n, vocab) logits."""
        m, c = self.m, self.m.cfg
        toks = np.asarray(toks, dtype=np.int64)
        n = len(toks)
        p0 = self.pos
        pos = np.arange(p0, p0 + n)
        H, KV, hd = c.n_heads, c.n_kv_heads, c.head_dim
        group = H // KV
        scale = 1.0 / np.sqrt(hd)
        # Causal mask: query t (position p0+t) sees key positions <= p0+t.
        kpos = np.arange(p0 + n)
        mask = kpos[None, :] > pos[:, None]                         # (n, p0+n)

        def mm(x, L, name):
            if self.act_q8 and L["_q"][name]:
                x = quantise_q8(x)
            return x @ L[name].T

        x = m.tok_embd[toks].copy()                                 # (n, dim)
        for li, L in enumerate(m.layers):
            h = rmsnorm(x, L["attn_norm"], c.norm_eps)
            q = mm(h, L, "attn_q").reshape(n, H, hd)
            k = mm(h, L, "attn_k").reshape(n, KV, hd)
            v = mm(h, L, "attn_v").reshape(n, KV, hd)
            q = rope(q, pos, m.inv_freq)
            k = rope(k, pos, m.inv_freq)
            if self.kv_f16:
                k = k.astype(np.float16).astype(np.float64)
                v = v.astype(np.float16).astype(np.float64)
            self.k[li, p0:p0 + n] = k
            self.v[li, p0:p0 + n] = v
            K = self.k[li, :p0 + n]                                 # (T, KV, hd)
            V = self.v[li, :p0 + n]
            att = np.empty((n, H, hd))
            for hh in range(H):
                kv = hh // group
                s = (q[:, hh, :] @ K[:, kv, :].T) * scale           # (n, T)
                s = np.where(mask, -np.inf, s)
                s = s - s.max(axis=1, keepdims=True)
                e = np.exp(s)
                w = e / e.sum(axis=1, keepdims=True)
                att[:, hh, :] = w @ V[:, kv, :]
            x = x + mm(att.reshape(n, c.dim), L, "attn_output")
            h = rmsnorm(x, L["ffn_norm"], c.norm_eps)
            g = mm(h, L, "ffn_gate")
            u = mm(h, L, "ffn_up")
            a = g / (1.0 + np.exp(-g)) * u
            x = x + mm(a, L, "ffn_down")
        x = rmsnorm(x, m.output_norm, c.norm_eps)
        self.pos += n
        if self.act_q8 and m.output_quantised:
            x = quantise_q8(x)
        return x @ m.output.T                                       # (n, vocab)


# --- tokenizer -----------------------------------------------------------

def build_tokenizer(reader):
    """HF tokenizers BPE from tokenizer.ggml.{tokens,merges,token_type}
    (gpt2 byte-level, SmolLM2's 'smollm' pre-tokenizer: each digit alone,
    then the GPT-2 regex). Control tokens become added special tokens."""
    from tokenizers import Tokenizer, AddedToken, models, pre_tokenizers, decoders

    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    pre = _field(reader, "tokenizer.ggml.pre")
    assert pre == "smollm", pre
    toks = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = _field(reader, "tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(toks)}
    assert len(vocab) == len(toks)
    pairs = [tuple(mm.split(" ")) for mm in merges]
    assert all(len(p) == 2 for p in pairs)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tk.decoder = decoders.ByteLevel()
    specials = [toks[i] for i, ty in enumerate(types) if ty == 3]   # CONTROL
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    for s in specials:
        assert tk.token_to_id(s) == vocab[s]
    return tk


def encode(tk, text):
    return tk.encode(text, add_special_tokens=False).ids


CHAT_PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
               "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
               "<|im_end|>\n<|im_start|>assistant\n")


def greedy(sess, prompt_ids, n):
    """Greedy continuation; returns (tokens, per-step logits list)."""
    logits = sess.eval(prompt_ids)
    out, steps = [], []
    last = logits[-1]
    for _ in range(n):
        steps.append(last)
        t = int(np.argmax(last))
        out.append(t)
        last = sess.eval([t])[0]
    return out, steps, logits


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct.Q4_1.gguf"
    prompt = sys.argv[2] if len(sys.argv) > 2 else CHAT_PROMPT
    m = Model(path)
    tk = build_tokenizer(m.reader)
    ids = encode(tk, prompt)
    print("prompt ids:", ids)
    out, _, _ = greedy(Session(m), ids, 32)
    print("greedy ids:", out)
    print("text:", repr(tk.decode(out, skip_special_tokens=False)))


if __name__ == "__main__":
    main()
