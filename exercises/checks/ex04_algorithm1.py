"""Exercise 4, Algorithm 1 with the scale-offsets: the checker, hints and known bugs."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from exercises.framework import Bug, Case, Mutant, randn, tiny_model
from exercises.solutions import ex04_algorithm1 as solution
from orthros import Block, Orthros, OrthrosAttention, apply_rope, attention_mask, rope_cos_sin

TITLE = "Algorithm 1 with the scale-offsets"
DIFFICULTY = 3
MINUTES = 45
TEACHES = "Alg. 1: K, V from base tokens only; W_Q, W_K, W_V, W_O shared; the streams differ only by alpha*q+beta and alpha'*q+beta'"
FUNCTIONS = ("orthros_attention",)
REFERENCE = SimpleNamespace(orthros_attention=solution.orthros_attention)
RETURNS = {"orthros_attention": "output"}
THE_LAYER = "it runs the layer (Algorithm 1) that this exercise asks you to write from its parameters"
FORBIDDEN = {OrthrosAttention.forward: THE_LAYER, Block.forward: THE_LAYER, Orthros.forward: THE_LAYER}

HINTS = [
    "Split z into the base tokens x (the first T rows) and the output tokens x' (the other t_out). Keys "
    "and values come from x only: they are the KV cache. Both streams use the same W_Q; only their "
    "element-wise scale-offsets differ. Base queries attend with the window, output queries attend every "
    "key up to their own position. Then merge heads, concatenate, and apply W_O once.",
    "Shapes (H heads of D = C / H channels; t_out = z.size(1) - T):\n"
    "K, V: W_K, W_V on the base rows only -> (B, T, C) each\n"
    "Q: W_Q on the base rows, then alpha (.) q + beta; Q': W_Q on the output rows, then alpha' (.) q' + beta'\n"
    "split heads: (B, rows, C) -> (B, H, rows, D)\n"
    "RoPE on Q and K with the first T rows of cos, sin; on Q' with the last t_out rows; not on V\n"
    "base attention: Q (B, H, T, D) against K, V with the window's (T, T) mask; output attention: Q' "
    "(B, H, t_out, D) against the same K, V with the causal (t_out, T) mask, bottom-right aligned\n"
    "stack the two results along the rows, merge heads back to (B, T + t_out, C), then W_O",
    "Paper, Algorithm 1: line 3 splits X and X_cross; line 4, K, V <- XW_K, XW_V (the shared KV cache); "
    "line 5, Q, Q_cross <- alpha (.) (XW_Q) + beta, alpha' (.) (X_cross W_Q) + beta'; lines 8-9, "
    "Flash-Attn with window_size=W, then window_size=inf; lines 10-12, merge heads, concatenate, Y = OW_O. "
    "In orthros.py: OrthrosAttention.forward, marks '# Alg. 1, line N'.",
]


# -- Known bugs: the solution with one classic mistake -----------------------------------------

def make_bug(swap=False, top_left=False, kv_out=False):
    def orthros_attention(attn, z, T, cos, sin):
        B, L, C = z.shape
        H, D, t_out = attn.n_head, attn.head_dim, L - T
        x, x_out = z[:, :T], z[:, T:]
        alpha, alpha_out = (attn.alpha_out, attn.alpha) if swap else (attn.alpha, attn.alpha_out)
        q = alpha * attn.c_q(x) + attn.beta
        q_out = alpha_out * attn.c_q(x_out) + attn.beta_out

        def split(t):
            return t.view(B, -1, H, D).transpose(1, 2)

        q = apply_rope(split(q), cos[:T], sin[:T])
        q_out = apply_rope(split(q_out), cos[T:], sin[T:])
        kv_rows = z if kv_out else x                                 # kv_out: the output tokens join K, V
        k, v = apply_rope(split(attn.c_k(kv_rows)), cos[:kv_rows.size(1)], sin[:kv_rows.size(1)]), split(attn.c_v(kv_rows))
        out_mask = attention_mask(t_out, T, None, z.device)
        if kv_out:
            out_mask = torch.cat([out_mask, attention_mask(t_out, t_out, None, z.device)], dim=1)
        y = F.scaled_dot_product_attention(q, k[:, :, :T], v[:, :, :T],
                                           attn_mask=attention_mask(T, T, attn.window, z.device))
        y_out = F.scaled_dot_product_attention(q_out, k, v, is_causal=True) if top_left else \
            F.scaled_dot_product_attention(q_out, k, v, attn_mask=out_mask)
        return attn.c_proj(torch.cat([y, y_out], dim=2).transpose(1, 2).reshape(B, L, C))
    return SimpleNamespace(orthros_attention=orthros_attention)


BUGS = [
    Bug("alpha and alpha' swapped", "the base queries took the output stream's scale (alpha') and the output "
        "queries the base stream's (alpha): alpha * (x W_Q) + beta for base tokens, alpha' * (x' W_Q) + beta' "
        "for output tokens.", make_bug(swap=True)),
    Bug("is_causal=True for the output tokens", "SDPA's is_causal aligns the mask top-left: with t_out < T "
        "it puts the output queries at positions 0 ... t_out-1. They sit at the LAST t_out positions: "
        "attention_mask(t_out, T, None) aligns them bottom-right.", make_bug(top_left=True)),
    Bug("K and V from the output tokens too", "keys and values come from the base tokens only (Alg. 1, "
        "line 4): they are the KV cache, and the output tokens read it, never write to it.", make_bug(kv_out=True)),
]


# -- Further wrong answers the checker must reject (phase 2 adds more) -------------------------

MUTANTS = [
    Mutant("the layer called", SimpleNamespace(orthros_attention=lambda attn, z, T, cos, sin: attn(z, T, (cos, sin))),
           expect="your code called orthros.OrthrosAttention.forward"),
]


def cases(**options):
    attn = tiny_model("orthros", window=3, n_embd=16, n_head=2).blocks[1].attn
    so = (attn.alpha, attn.alpha_out, attn.beta, attn.beta_out)
    assert not torch.equal(so[0], so[1]) and not torch.equal(so[2], so[3]), "the check needs distinct scale-offsets"
    found = []
    for T in (1, 2, 3, 5, 8, 13):
        for t_out in sorted({1, 2, T} & set(range(1, T + 1))):
            positions = torch.cat([torch.arange(T), torch.arange(T - t_out, T)])
            cos, sin = rope_cos_sin(positions, attn.head_dim, 10000.0, torch.float64)
            z = randn(2, T + t_out, 16, seed=10 * T + t_out)
            found.append(Case(
                f"orthros_attention(attn, z, T={T}, cos, sin): z of shape (2, {T + t_out}, 16) "
                f"({t_out} output token{'s' if t_out > 1 else ''}), 2 heads, w=3, alpha != alpha', beta != beta'",
                inputs=lambda z=z, T=T, cos=cos, sin=sin: dict(attn=attn, z=z, T=T, cos=cos, sin=sin),
                call=layer,
                invariant="the output equals attn(z, T, (cos, sin)): K, V from the base tokens only; one W_Q, then "
                          "alpha * q + beta for base tokens and alpha' * q + beta' for output tokens; base tokens "
                          "attend the window (eq. 4), output tokens every key up to their position (eq. 5)",
                atol=1e-12, expected=lambda attn, z, T, cos, sin: attn(z, T, (cos, sin)).detach()))
    return found


def layer(answer, attn, z, T, cos, sin):
    with torch.no_grad():
        return answer.orthros_attention(attn, z, T, cos, sin)
