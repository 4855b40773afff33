"""Exercise 4, Algorithm 1 with the scale-offsets: the checker, hints and known bugs."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from exercises.framework import Bug, Case, forbidden, randn, tiny_model
from exercises.solutions import ex04_algorithm1 as solution
from orthros import OrthrosAttention, apply_rope, attention_mask, rope_cos_sin

TITLE = "Algorithm 1 with the scale-offsets"
DIFFICULTY = 3
MINUTES = 45
TEACHES = "Alg. 1: K, V from base tokens only; W_Q, W_K, W_V, W_O shared; the streams differ only by alpha*q+beta and alpha'*q+beta'"
FUNCTIONS = ("orthros_attention",)
REFERENCE = SimpleNamespace(orthros_attention=solution.orthros_attention)

HINTS = [
    "Split z into the base tokens x (the first n_base rows) and the output tokens x'. Keys and values "
    "come from x only: they are the KV cache. Both streams use the same W_Q; only their element-wise "
    "scale-offsets differ. Base queries attend with the window, output queries attend every key up to "
    "their own position. Then merge heads, concatenate, and apply W_O once.",
    "k, v = c_k(x), c_v(x)                         (B, n_base, C)\n"
    "q = alpha * c_q(x) + beta;  q' = alpha_out * c_q(x') + beta_out\n"
    "split heads: (B, rows, C) -> view (B, rows, H, D) -> transpose(1, 2) -> (B, H, rows, D)\n"
    "RoPE: q and k with cos[:n_base], sin[:n_base]; q' with cos[n_base:], sin[n_base:]; not v\n"
    "y = sdpa(q, k, v, attn_mask=attention_mask(n_base, n_base, w));  y' = sdpa(q', k, v, "
    "attn_mask=attention_mask(n_out, n_base, None))\n"
    "c_proj(cat([y, y'], dim=2).transpose(1, 2).reshape(B, n_base + n_out, C))",
    "Paper, Algorithm 1: line 3 splits X and X_cross; line 4, K, V <- XW_K, XW_V (the shared KV cache); "
    "line 5, Q, Q_cross <- alpha (.) (XW_Q) + beta, alpha' (.) (X_cross W_Q) + beta'; lines 8-9, "
    "Flash-Attn with window_size=W, then window_size=inf; lines 10-12, merge heads, concatenate, Y = OW_O. "
    "In orthros.py: OrthrosAttention.forward, marks '# Alg. 1, line N'.",
]


# -- Known bugs: the solution with one classic mistake -----------------------------------------

def make_bug(swap=False, top_left=False, kv_out=False):
    def orthros_attention(attn, z, n_base, cos, sin):
        B, L, C = z.shape
        H, D, n_out = attn.n_head, attn.head_dim, L - n_base
        x, x_out = z[:, :n_base], z[:, n_base:]
        alpha, alpha_out = (attn.alpha_out, attn.alpha) if swap else (attn.alpha, attn.alpha_out)
        q = alpha * attn.c_q(x) + attn.beta
        q_out = alpha_out * attn.c_q(x_out) + attn.beta_out

        def split(t):
            return t.view(B, -1, H, D).transpose(1, 2)

        q = apply_rope(split(q), cos[:n_base], sin[:n_base])
        q_out = apply_rope(split(q_out), cos[n_base:], sin[n_base:])
        kv_rows = z if kv_out else x                                 # kv_out: the output tokens join K, V
        k, v = apply_rope(split(attn.c_k(kv_rows)), cos[:kv_rows.size(1)], sin[:kv_rows.size(1)]), split(attn.c_v(kv_rows))
        out_mask = attention_mask(n_out, n_base, None)
        if kv_out:
            out_mask = torch.cat([out_mask, attention_mask(n_out, n_out, None)], dim=1)
        y = F.scaled_dot_product_attention(q, k[:, :, :n_base], v[:, :, :n_base],
                                           attn_mask=attention_mask(n_base, n_base, attn.window))
        y_out = F.scaled_dot_product_attention(q_out, k, v, is_causal=True) if top_left else \
            F.scaled_dot_product_attention(q_out, k, v, attn_mask=out_mask)
        return attn.c_proj(torch.cat([y, y_out], dim=2).transpose(1, 2).reshape(B, L, C))
    return SimpleNamespace(orthros_attention=orthros_attention)


BUGS = [
    Bug("alpha and alpha' swapped", "the base queries took the output stream's scale (alpha') and the output "
        "queries the base stream's (alpha): alpha * (x W_Q) + beta for base tokens, alpha' * (x' W_Q) + beta' "
        "for output tokens.", make_bug(swap=True)),
    Bug("is_causal=True for the output tokens", "SDPA's is_causal aligns the mask top-left: with n_out < n_base "
        "it puts the output queries at positions 0 ... n_out-1. They sit at the LAST n_out positions: "
        "attention_mask(n_out, n_base, None) aligns them bottom-right.", make_bug(top_left=True)),
    Bug("K and V from the output tokens too", "keys and values come from the base tokens only (Alg. 1, "
        "line 4): they are the KV cache, and the output tokens read it, never write to it.", make_bug(kv_out=True)),
]


def cases(**options):
    attn = tiny_model("orthros", window=3, n_embd=16, n_head=2).blocks[1].attn
    so = (attn.alpha, attn.alpha_out, attn.beta, attn.beta_out)
    assert not torch.equal(so[0], so[1]) and not torch.equal(so[2], so[3]), "the check needs distinct scale-offsets"
    found = []
    for n_base in (1, 2, 3, 5, 8, 13):
        for n_out in sorted({1, 2, n_base} & set(range(1, n_base + 1))):
            positions = torch.cat([torch.arange(n_base), torch.arange(n_base - n_out, n_base)])
            cos, sin = rope_cos_sin(positions, attn.head_dim, 10000.0, torch.float64)
            z = randn(2, n_base + n_out, 16, seed=10 * n_base + n_out)
            found.append(Case(
                f"orthros_attention(attn, z, n_base={n_base}, cos, sin): z of shape (2, {n_base + n_out}, 16) "
                f"({n_out} output token{'s' if n_out > 1 else ''}), 2 heads, w=3, alpha != alpha', beta != beta'",
                lambda impl, z=z, n_base=n_base, cos=cos, sin=sin: layer(impl, attn, z, n_base, cos, sin),
                "the output equals attn(z, n_base, (cos, sin)): K, V from the base tokens only; one W_Q, then "
                "alpha * q + beta for base tokens and alpha' * q + beta' for output tokens; base tokens attend "
                "the window (eq. 4), output tokens every key up to their position (eq. 5)", atol=1e-12,
                expected=lambda z=z, n_base=n_base, cos=cos, sin=sin: attn(z, n_base, (cos, sin))[0]))
    return found


def layer(impl, attn, z, n_base, cos, sin):
    with torch.no_grad(), forbidden(OrthrosAttention, "forward", why="this exercise asks you to write"):
        return impl.orthros_attention(attn, z, n_base, cos, sin)
