#!/usr/bin/env python3
"""Converts a Llama-architecture GGUF file (SmolLM2-135M-Instruct) into karakv's converted-model
format, which examples/llama/model.cc reads (parse_model, magic "KARAKVLM"). All little-endian:

  header   "KARAKVLM", u32 version=1,
           i32 layers, hidden, ffn, heads, kv_heads, vocab, max_context,
           f32 rope_theta, f32 rms_eps, i32 tied_output (1: output = token embedding),
           i32 bos_id, i32 eos_id
  tokens   vocab x (u32 length, UTF-8 bytes in GPT-2 byte-to-unicode form, u8 GGUF token type)
  merges   u32 count, count x (u32 length, bytes "left right")
  template u32 length, bytes (the Jinja chat template, kept for reference)
  tensors  float32, row-major out x in: token_embd [V][d], attn_norm [L][d], attn_q [L][d][d],
           attn_k [L][kv][d], attn_v [L][kv][d], attn_output [L][d][d], ffn_norm [L][d],
           ffn_gate [L][f][d], ffn_up [L][f][d], ffn_down [L][d][f], output_norm [d],
           then output [V][d] only when tied_output is 0.

Q and K stay as GGUF stores them: llama.cpp's converter permutes Hugging Face's rotate-half layout
into adjacent (2i, 2i+1) RoPE pairs, which is the pairing model.cc's rope() already uses.
Usage: convert_gguf.py IN.gguf OUT.bin (writes OUT.bin.tmp, then renames).
"""
import os
import struct
import sys
import time

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

MAGIC = b"KARAKVLM"
VERSION = 1


def field(reader, name, default=None):
    f = reader.fields.get(name)
    if f is None:
        if default is None:
            sys.exit(f"convert_gguf: metadata '{name}' missing")
        return default
    return f.contents()


def strings(reader, name):
    f = reader.fields[name]
    return [bytes(f.parts[i]) for i in f.data]


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: convert_gguf.py IN.gguf OUT.bin")
    src, dst = sys.argv[1], sys.argv[2]
    t0 = time.time()
    r = GGUFReader(src)
    if field(r, "general.architecture") != "llama":
        sys.exit("convert_gguf: only the llama architecture is supported")
    L = int(field(r, "llama.block_count"))
    d = int(field(r, "llama.embedding_length"))
    f = int(field(r, "llama.feed_forward_length"))
    hq = int(field(r, "llama.attention.head_count"))
    hk = int(field(r, "llama.attention.head_count_kv"))
    ctx = int(field(r, "llama.context_length"))
    theta = float(field(r, "llama.rope.freq_base", 10000.0))
    eps = float(field(r, "llama.attention.layer_norm_rms_epsilon"))
    head_dim = d // hq
    rope_dims = int(field(r, "llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        sys.exit(f"convert_gguf: partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    if field(r, "tokenizer.ggml.model") != "gpt2":
        sys.exit("convert_gguf: only byte-level BPE ('gpt2') tokenizers are supported")
    tokens = strings(r, "tokenizer.ggml.tokens")
    tf = r.fields["tokenizer.ggml.token_type"]
    types = [int(tf.parts[i][0]) for i in tf.data]
    merges = strings(r, "tokenizer.ggml.merges")
    bos = int(field(r, "tokenizer.ggml.bos_token_id"))
    eos = int(field(r, "tokenizer.ggml.eos_token_id"))
    template = field(r, "tokenizer.chat_template", "").encode()
    V = len(tokens)

    tensors = {t.name: t for t in r.tensors}
    tied = "output.weight" not in tensors
    print(f"convert_gguf: {os.path.basename(src)}: {L} layers, hidden {d}, ffn {f}, heads {hq}/{hk}, "
          f"vocab {V}, context {ctx}, rope theta {theta:g}, rms eps {eps:g}, "
          f"{'tied' if tied else 'separate'} output, {len(merges)} merges", flush=True)

    def get(name, shape):
        t = tensors.get(name)
        if t is None:
            sys.exit(f"convert_gguf: tensor '{name}' missing")
        a = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if not np.all(np.isfinite(a)):
            sys.exit(f"convert_gguf: tensor '{name}' has non-finite values")
        return a

    kv = hk * head_dim
    per_layer = [("attn_norm", (d,)), ("attn_q", (d, d)), ("attn_k", (kv, d)), ("attn_v", (kv, d)),
                 ("attn_output", (d, d)), ("ffn_norm", (d,)), ("ffn_gate", (f, d)), ("ffn_up", (f, d)),
                 ("ffn_down", (d, f))]
    tmp = dst + ".tmp"
    with open(tmp, "wb") as out:
        out.write(MAGIC)
        out.write(struct.pack("<I7i2f3i", VERSION, L, d, f, hq, hk, V, ctx, theta, eps, int(tied), bos, eos))
        for tok, ty in zip(tokens, types):
            out.write(struct.pack("<I", len(tok)) + tok + struct.pack("<B", ty))
        out.write(struct.pack("<I", len(merges)))
        for m in merges:
            out.write(struct.pack("<I", len(m)) + m)
        out.write(struct.pack("<I", len(template)) + template)
        out.write(get("token_embd.weight", (V, d)).tobytes())
        for name, shape in per_layer:
            for l in range(L):
                out.write(get(f"blk.{l}.{name}.weight", shape).tobytes())
            print(f"convert_gguf:   {name} x {L} layers", flush=True)
        out.write(get("output_norm.weight", (d,)).tobytes())
        if not tied:
            out.write(get("output.weight", (V, d)).tobytes())
    os.replace(tmp, dst)
    print(f"convert_gguf: wrote {dst} ({os.path.getsize(dst) / 2**20:.0f} MiB) in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
