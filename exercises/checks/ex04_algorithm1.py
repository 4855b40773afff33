"""Exercise 4, Algorithm 1 with the scale-offsets: the checker."""

import torch

from exercises.framework import ZOO, Bug, Case, Mutant, randn, tiny_model
from exercises.solutions import ex04_algorithm1 as solution
from orthros import Block, Orthros, OrthrosAttention, rope_cos_sin

TITLE, DIFFICULTY, MINUTES = "Algorithm 1 with the scale-offsets", 3, 45
FUNCTIONS = ("orthros_attention",)
REFERENCE = solution   # the stored solution: its functions
FORBIDDEN = dict.fromkeys((OrthrosAttention.forward, Block.forward, Orthros.forward),
                          "it runs the layer (Algorithm 1) that this exercise asks you to write from its parameters")
PAPER = "w=128 (the paper's window)"

HINTS = [
    "Split z into the base tokens x (the first T rows) and the output tokens x' (the other t_out). Keys and values "
    "come from x only: they are the KV cache. Both streams use the same W_Q; only their element-wise scale-offsets "
    "differ. Base queries attend with the window, output queries attend every key up to their own position. Then merge"
    " heads, concatenate, and apply W_O once.",
    "Shapes (H heads of D = C / H channels; t_out = z.size(1) - T):\n"
    "K, V: W_K, W_V on the base rows only -> (B, T, C) each\n"
    "Q: W_Q on the base rows, then alpha (.) q + beta; Q': W_Q on the output rows, then alpha' (.) q' + beta'\n"
    "split heads: (B, rows, C) -> (B, H, rows, D)\n"
    "RoPE on Q and K with the first T rows of cos, sin; on Q' with the last t_out rows; not on V\n"
    "base attention: Q (B, H, T, D) against K, V with the window's (T, T) mask; output attention: Q' (B, H, t_out, D) "
    "against the same K, V with the causal (t_out, T) mask, bottom-right aligned\n"
    "stack the two results along the rows, merge heads back to (B, T + t_out, C), then W_O",
    "Paper, Algorithm 1: line 3 splits X and X_cross; line 4, K, V <- XW_K, XW_V (the shared KV cache); line 5, Q, "
    "Q_cross <- alpha (.) (XW_Q) + beta, alpha' (.) (X_cross W_Q) + beta'; lines 8-9, Flash-Attn with window_size=W, "
    "then window_size=inf; lines 10-12, merge heads, concatenate, Y = OW_O. In orthros.py: OrthrosAttention.forward, "
    "marks '# Alg. 1, line N'.",
]

BASE_MASK, OUT_MASK = "attention_mask(T, T, attn.window, z.device)", "attention_mask(t_out, T, None, z.device)"
SDPA, SDPA_OUT = "F.scaled_dot_product_attention(q, k, v, attn_mask=", "F.scaled_dot_product_attention(q_out, k, v, attn_mask="
BUGS = [
    Bug("alpha and alpha' swapped", "the base queries took the output stream's scale (alpha') and the output queries the "
        "base stream's (alpha): alpha * (x W_Q) + beta for base tokens, alpha' * (x' W_Q) + beta' for output tokens.",
        {"attn.alpha * q + attn.beta, attn.alpha_out * q_out": "attn.alpha_out * q + attn.beta, attn.alpha * q_out"}),
    Bug("is_causal=True for the output tokens", "SDPA's is_causal aligns the mask top-left: with t_out < T it puts the "
        "output queries at positions 0 ... t_out-1. They sit at the LAST t_out positions: attention_mask(t_out, T, None) "
        "aligns them bottom-right.", {f"attn_mask={OUT_MASK}": "is_causal=True"}),
    Bug("K and V from the output tokens too", "keys and values come from the base tokens only (Alg. 1, line 4): they are "
        "the KV cache, and the output tokens read it, never write to it.",
        {"k, v = attn.c_k(x), attn.c_v(x)": "k, v = attn.c_k(z), attn.c_v(z)",
         "k, v = apply_rope(split(k), cos[:T], sin[:T]), split(v)": "k, v = apply_rope(split(k), cos, sin), split(v)",
         f"{SDPA}{BASE_MASK})": "F.scaled_dot_product_attention(q, k[:, :, :T], v[:, :, :T], attn_mask=" + BASE_MASK + ")",
         f"attn_mask={OUT_MASK}": f"attn_mask=torch.cat([{OUT_MASK}, attention_mask(t_out, t_out, None, z.device)], dim=1)"}),
]

MUTANTS = [
    Mutant("the layer called", "your code called orthros.OrthrosAttention.forward",
           source="def orthros_attention(attn, z, T, cos, sin):\n    return attn(z, T, (cos, sin))\n"),
    Mutant("the stored solution imported", "is not available to your code",
           source="from exercises.solutions.ex04_algorithm1 import orthros_attention\n"),
    Mutant("the layer's forward kept at import time", "holds orthros.OrthrosAttention.forward",
           source="from orthros import OrthrosAttention\n\n_forward = OrthrosAttention.forward\n\n\n"
                  "def orthros_attention(attn, z, T, cos, sin):\n    return _forward(attn, z, T, (cos, sin))\n"),
    Mutant("the window written in", "w=5", {BASE_MASK: "attention_mask(T, T, 3, z.device)"}),
    Mutant("two heads written in", "n_head=4", {"H, D = attn.n_head, attn.head_dim": "H, D = 2, C // 2"}),
    Mutant("the softmax written out, without subtracting each row's max", "z of magnitude 1000", {SDPA: "attend(q, k, v, ",
           SDPA_OUT: "attend(q_out, k, v, ", "def orthros_attention(": "def attend(q, k, v, mask):\n    weights = (q @ k."
           "transpose(-2, -1) / q.size(-1) ** 0.5).exp() * mask\n    return weights / weights.sum(-1, keepdim=True) @ v\n\n\n"
           "def orthros_attention("}),
    Mutant("the masks built on the default device", "on the meta device",
           {BASE_MASK: "attention_mask(T, T, attn.window)", OUT_MASK: "attention_mask(t_out, T, None)"}),
    Mutant("K, V split into n_head heads", "n_kv_head=2 (GQA)", {"t.view(B, t.size(1), -1, D)": "t.view(B, -1, H, D)"}),
    Mutant("K, V heads not repeated for their groups", "n_kv_head=2 (GQA)", {"    k, v = repeat_kv(k, H), repeat_kv(v, H)": ""}),
    Mutant("the scale-offsets applied whatever attn.scale_offset says", "scale_offset=False", {"if attn.scale_offset:": "if True:"}),
    Mutant("the output tokens windowed too", "output tokens every key up to their position",
           {OUT_MASK: "attention_mask(t_out, T, attn.window, z.device)"}),
    Mutant("the attention written out, its additive mask in the default dtype (float32)", "in bfloat16",
           {"def orthros_attention(": "def attend(q, k, v, mask):\n"
                                      "    bias = torch.zeros(mask.shape).masked_fill(~mask, float('-inf'))   # 0: seen\n"
                                      "    scores = q @ k.transpose(-2, -1) / q.size(-1) ** 0.5\n"
                                      "    return torch.softmax(scores + bias, dim=-1) @ v\n\n\ndef orthros_attention(",
            SDPA: "attend(q, k, v, ", SDPA_OUT: "attend(q_out, k, v, "}),
    Mutant("the RoPE tables made anew with the default base", "rope_base=500.0",
           {"    t_out = L - T\n": "    t_out = L - T\n    positions = torch.cat([torch.arange(T), torch.arange(T - t_out, T)])\n"
                                  "    cos, sin = rope_cos_sin(positions, D, 10000.0, z.dtype)\n",
            "repeat_kv\n": "repeat_kv, rope_cos_sin\n"}),
    Mutant("dropout in eval mode", "dropout=0.1, in eval mode",
           {f"{BASE_MASK})": f"{BASE_MASK}, dropout_p=attn.dropout)", f"{OUT_MASK})": f"{OUT_MASK}, dropout_p=attn.dropout)"}),
    Mutant("the merged heads written into z", "changed its input `z` in place",
           {"y = torch.cat([y, y_out], dim=2).transpose(1, 2).reshape(B, L, C)":
            "y = z.copy_(torch.cat([y, y_out], dim=2).transpose(1, 2).reshape(B, L, C))   # z is spent"}),
]
INVARIANT = ("the output equals attn(z, T, (cos, sin)): K, V from the base tokens only; one W_Q, then alpha * q + beta for "
             "base tokens and alpha' * q + beta' for output tokens; base tokens attend the window (eq. 4), output tokens "
             "every key up to their position (eq. 5)")
ABOUT = "2 heads, C=16, w=3, alpha != alpha', beta != beta'"


def layer(seed=0, window=3, **config):
    """The last OrthrosAttention of a tiny model: its weights drawn in float64, alpha != alpha', beta != beta'."""
    return tiny_model("orthros", seed=seed, window=window, **config).blocks[-1].attn


def layer_case(attn, about, B, T, t_out, invariant=INVARIANT, rope_base=10000.0, dtype=None, scale=1, device=None):
    cos, sin = rope_cos_sin(torch.cat([torch.arange(T), torch.arange(T - t_out, T)]), attn.head_dim, rope_base, torch.float64)
    z = scale * randn(B, T + t_out, attn.n_head * attn.head_dim, seed=10 * T + t_out)
    return Case(f"orthros_attention(attn, z, T={T}, cos, sin): z of shape {tuple(z.shape)} ({t_out} output token"
                f"{'s' if t_out > 1 else ''}); attn: {about}", dict(attn=attn, z=z, T=T, cos=cos, sin=sin), run_layer,
                invariant, dtype=dtype, device=device, expected=lambda attn, z, T, cos, sin: streams(attn(z, T, (cos, sin)).detach(), T))


def cases(**options):
    attn = layer()
    yield from [layer_case(attn, ABOUT, 2, T, t_out) for T in (1, 2, 3, 5, 8, 13) for t_out in sorted({1, 2, T} & set(range(1, T + 1)))]
    # One dimension at a time, each named in the case: what an answer could have written in
    yield from [layer_case(attn, f"{ABOUT} (a batch of {B})", B, 8, 3, f"{INVARIANT}, for every sequence of the batch") for B in (1, 3)]
    yield layer_case(layer(seed=1), "another layer (seed 1), " + ABOUT, 2, 8, 3)
    yield layer_case(layer(window=5), "2 heads, C=16, w=5, T=13 (w does not divide T)", 2, 13, 4,
                     f"{INVARIANT}; the window is the layer's, attn.window")
    yield from [layer_case(layer(**more), f"{name}, w=3", 2, 8, 3, dtype=dtype)
                for name, more, dtype in ZOO]
    yield layer_case(attn, ABOUT + "; cos, sin from rope_base=500.0 (not the default 10000.0)", 2, 8, 3,
                     f"{INVARIANT}; RoPE rotates by the tables it is given, cos and sin", rope_base=500.0)
    yield layer_case(layer(dropout=0.1), "2 heads, C=16, w=3, dropout=0.1, in eval mode", 2, 8, 3, f"{INVARIANT}; a layer "
                     "in eval mode drops nothing (its own forward: dropout_p = attn.dropout if attn.training else 0)")
    # The paper's sizes: w = 128 over T = 300; C = 768 and 6 heads of 128 channels (the bench model's layer)
    yield layer_case(layer(window=128), f"2 heads, C=16, {PAPER}", 2, 300, 300)
    yield layer_case(layer(n_layer=1, n_head=6, n_embd=768, window=128), f"the bench model's layer: n_head=6, C=768 "
                     f"(head_dim = 128), {PAPER}", 1, 300, 2)
    yield layer_case(attn, f"{ABOUT}; z of magnitude 1000 (scores in the millions)", 2, 8, 3, f"{INVARIANT}; a softmax "
                     "subtracts each row's max (exp of a large score overflows)", scale=1000)
    yield layer_case(attn, f"{ABOUT}, on the meta device (shapes, no values)", 2, 8, 3, "the masks are made where z is",
                     device="meta")


def run_layer(answer, attn, z, T, cos, sin):
    with torch.no_grad():
        return streams(answer.orthros_attention(attn, z, T, cos, sin), T)


def streams(y, T):
    """The output's rows by stream, so that a difference names the stream it is in."""
    return {"base tokens, rows [:, :T]": y[:, :T], "output tokens, rows [:, T:]": y[:, T:]} if isinstance(y, torch.Tensor) else y
