"""Exercise 4, Algorithm 1 with the scale-offsets: the checker, hints and known bugs."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from exercises.framework import Bug, Case, Mutant, randn, tiny_model
from exercises.solutions import ex04_algorithm1 as solution
from orthros import SCALE_OFFSETS, Block, Orthros, OrthrosAttention, OrthrosConfig, apply_rope, attention_mask, rope_cos_sin

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


# -- Further wrong answers the checker must reject ---------------------------------------------

def student_file(body):
    """A whole student file: orthros_attention with this body."""
    return ("import torch\nimport torch.nn.functional as F\n\nfrom orthros import apply_rope, attention_mask, "
            "rope_cos_sin\n\n\ndef orthros_attention(attn, z, T, cos, sin):\n" +
            "".join(f"    {line}\n" for line in body.splitlines()))


def solution_body(H="attn.n_head", D="attn.head_dim", window="attn.window", out_window="None", rope="",
                  masks="", dropout="", merge="y = torch.cat([y, y_out], dim=2).transpose(1, 2).reshape(B, L, C)"):
    masks = masks or (f"base_mask = attention_mask(T, T, {window}, z.device)\n"
                      f"out_mask = attention_mask(t_out, T, {out_window}, z.device)\n")
    return ("B, L, C = z.shape\n"
            f"H, D = {H}, {D}\n"
            "t_out = L - T\n"
            "x, x_out = z[:, :T], z[:, T:]\n"
            "k, v = attn.c_k(x), attn.c_v(x)\n"
            "q = attn.alpha * attn.c_q(x) + attn.beta\n"
            "q_out = attn.alpha_out * attn.c_q(x_out) + attn.beta_out\n"
            "split = lambda t: t.view(B, -1, H, D).transpose(1, 2)\n" + rope +
            "q = apply_rope(split(q), cos[:T], sin[:T])\n"
            "q_out = apply_rope(split(q_out), cos[T:], sin[T:])\n"
            "k, v = apply_rope(split(k), cos[:T], sin[:T]), split(v)\n" + masks +
            f"y = F.scaled_dot_product_attention(q, k, v, attn_mask=base_mask{dropout})\n"
            f"y_out = F.scaled_dot_product_attention(q_out, k, v, attn_mask=out_mask{dropout})\n"
            f"{merge}\nreturn attn.c_proj(y)")


MUTANTS = [
    Mutant("the layer called", SimpleNamespace(orthros_attention=lambda attn, z, T, cos, sin: attn(z, T, (cos, sin))),
           expect="your code called orthros.OrthrosAttention.forward"),
    Mutant("the stored solution imported", source="from exercises.solutions.ex04_algorithm1 import orthros_attention\n",
           expect="is not available to your code"),
    Mutant("the layer's forward kept at import time",
           source="from orthros import OrthrosAttention\n\n_forward = OrthrosAttention.forward\n\n\n"
                  "def orthros_attention(attn, z, T, cos, sin):\n    return _forward(attn, z, T, (cos, sin))\n",
           expect="holds orthros.OrthrosAttention.forward"),
    Mutant("the window written in", source=student_file(solution_body(window="3")), expect="w=5"),
    Mutant("two heads written in", source=student_file(solution_body(H="2", D="C // 2")), expect="n_head=4"),
    Mutant("the output tokens windowed too", source=student_file(solution_body(out_window="attn.window")),
           expect="output tokens every key up to their position"),
    Mutant("an additive mask in float64", source=student_file(solution_body(masks=(
        "neg = float('-inf')\n"
        "base_mask = torch.zeros(T, T, dtype=torch.float64).masked_fill(~attention_mask(T, T, attn.window), neg)\n"
        "out_mask = torch.zeros(t_out, T, dtype=torch.float64).masked_fill(~attention_mask(t_out, T), neg)\n"))),
        expect="in float32"),
    Mutant("the RoPE tables made anew with the default base", source=student_file(solution_body(rope=(
        "positions = torch.cat([torch.arange(T), torch.arange(T - t_out, T)])\n"
        "cos, sin = rope_cos_sin(positions, D, 10000.0, z.dtype)\n"))), expect="rope_base=500.0"),
    Mutant("dropout in eval mode", source=student_file(solution_body(dropout=", dropout_p=attn.dropout")),
           expect="dropout=0.1, in eval mode"),
    Mutant("the merged heads written into z", source=student_file(solution_body(
        merge="y = z.copy_(torch.cat([y, y_out], dim=2).transpose(1, 2).reshape(B, L, C))   # z is spent")),
        expect="changed its input `z` in place"),
]

INVARIANT = ("the output equals attn(z, T, (cos, sin)): K, V from the base tokens only; one W_Q, then alpha * q + beta "
             "for base tokens and alpha' * q + beta' for output tokens; base tokens attend the window (eq. 4), output "
             "tokens every key up to their position (eq. 5)")


def layer(seed=0, n_head=2, n_embd=16, window=3, **overrides):
    """An OrthrosAttention in float64 and eval mode, its weights GPT-2's, its scale-offsets off identity and
    distinct (alpha != alpha', beta != beta')."""
    torch.manual_seed(seed)
    config = OrthrosConfig(vocab_size=37, n_layer=2, n_head=n_head, n_embd=n_embd, window=window, max_seq_len=512,
                           **overrides)
    attn = OrthrosAttention(config).double().eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name in SCALE_OFFSETS:
                p.add_(0.5 * torch.randn_like(p))
            else:
                torch.nn.init.normal_(p, std=0.02 if n_embd > 64 else 0.3)
    assert not torch.equal(attn.alpha, attn.alpha_out) and not torch.equal(attn.beta, attn.beta_out)
    return attn


def layer_case(attn, about, B, T, t_out, invariant=INVARIANT, rope_base=10000.0, dtype=None, atol=1e-12, seed=None):
    positions = torch.cat([torch.arange(T), torch.arange(T - t_out, T)])
    cos, sin = rope_cos_sin(positions, attn.head_dim, rope_base, torch.float64)
    z = randn(B, T + t_out, attn.n_head * attn.head_dim, seed=10 * T + t_out if seed is None else seed)
    return Case(
        f"orthros_attention(attn, z, T={T}, cos, sin): z of shape {tuple(z.shape)} ({t_out} output "
        f"token{'s' if t_out > 1 else ''}); attn: {about}",
        inputs=lambda: dict(attn=attn, z=z, T=T, cos=cos, sin=sin),
        call=run_layer, invariant=invariant, atol=atol, dtype=dtype,
        expected=lambda attn, z, T, cos, sin: streams(attn(z, T, (cos, sin)).detach(), T), output="your output")


def cases(**options):
    attn = tiny_model("orthros", window=3, n_embd=16, n_head=2).blocks[1].attn
    so = (attn.alpha, attn.alpha_out, attn.beta, attn.beta_out)
    assert not torch.equal(so[0], so[1]) and not torch.equal(so[2], so[3]), "the check needs distinct scale-offsets"
    about = "2 heads, C=16, w=3, alpha != alpha', beta != beta'"
    found = []
    for T in (1, 2, 3, 5, 8, 13):
        for t_out in sorted({1, 2, T} & set(range(1, T + 1))):
            found.append(layer_case(attn, about, 2, T, t_out, f"{INVARIANT}; in float64, to 1e-12"))
    # One dimension at a time, each named in the case: what an answer could have written in
    for B in (1, 3):
        found.append(layer_case(attn, f"{about} (a batch of {B})", B, 8, 3, f"{INVARIANT}, for every sequence of the batch"))
    found.append(layer_case(layer(seed=1), "another layer (seed 1), " + about, 2, 8, 3))
    found.append(layer_case(layer(window=5), "2 heads, C=16, w=5, T=13 (w does not divide T)", 2, 13, 4,
                            f"{INVARIANT}; the window is the layer's, attn.window"))
    found.append(layer_case(layer(n_head=4, n_embd=48), "n_head=4, C=48 (head_dim = 12), w=3", 2, 8, 3,
                            f"{INVARIANT}; H = attn.n_head heads of D = attn.head_dim channels"))
    found.append(layer_case(attn, about + "; cos, sin from rope_base=500.0 (not the default 10000.0)", 2, 8, 3,
                            f"{INVARIANT}; RoPE rotates by the tables it is given, cos and sin", rope_base=500.0))
    found.append(layer_case(attn, about + ", in float32 (attn, z, cos, sin all float32)", 2, 8, 3,
                            f"{INVARIANT}; the output in the layer's dtype, float32 here, every step in it",
                            dtype=torch.float32, atol=1e-5))
    found.append(layer_case(layer(dropout=0.1), "2 heads, C=16, w=3, dropout=0.1, in eval mode", 2, 8, 3,
                            f"{INVARIANT}; a layer in eval mode drops nothing (its own forward: dropout_p = "
                            "attn.dropout if attn.training else 0)"))
    # The paper's sizes: w = 128 over T = 300; C = 768 and 6 heads of 128 channels (the bench model's layer)
    found.append(layer_case(layer(window=128), "2 heads, C=16, w=128 (the paper's window)", 2, 300, 300,
                            f"{INVARIANT}; in float64, to 1e-12"))
    found.append(layer_case(layer(n_head=6, n_embd=768, window=128), "the bench model's layer: n_head=6, C=768 "
                            "(head_dim = 128), w=128", 1, 300, 2, f"{INVARIANT}; in float64, to 1e-12"))
    return found


def run_layer(answer, attn, z, T, cos, sin):
    with torch.no_grad():
        return streams(answer.orthros_attention(attn, z, T, cos, sin), T)


def streams(y, T):
    """The output's rows by stream, so that a difference names the stream it is in."""
    return {"base tokens, rows [:, :T]": y[:, :T], "output tokens, rows [:, T:]": y[:, T:]}
