"""The attention pattern of the paper's Figure 1 from orthros.py's live attention_mask: the base
tokens' band, then the output tokens' full causal rows. python -m exercises show mask"""

from pathlib import Path

import torch

import orthros


def pattern(T, w, t_out):
    """(T + t_out, T) booleans: rows the T base tokens (eq. 4), then the output tokens (eq. 5)."""
    base = orthros.attention_mask(T, T, w)                 # (T, T): the band
    output = orthros.attention_mask(t_out, T, None)        # (t_out, T): causal, bottom-right
    return torch.cat([base, output])


def show_mask(T, w, t_out, png):
    if not (1 <= w and 1 <= t_out <= T):
        raise SystemExit("need w >= 1 and 1 <= t_out <= T")
    rows = pattern(T, w, t_out)
    print(f"Orthros attention, T = {T}, w = {w}, t_out = {t_out} (the paper's Figure 1), from "
          "orthros.attention_mask.\nRows are queries, columns the keys 0 ... T-1: keys and values "
          "come from the base tokens only. # = attends, . = masked\n")
    if T > 10:
        print(" " * 16 + "".join(str(j // 10) if j >= 10 else " " for j in range(T)))
    print(" " * 16 + "".join(str(j % 10) for j in range(T)))
    for i, row in enumerate(rows.tolist()):
        label = f"base   x_{i}" if i < T else f"output x'_{T - t_out + i - T}"
        if i == T:
            print(" " * 16 + "-" * T + "   the output tokens: full causal rows (eq. 5)")
        note = "   the base tokens: a band of w keys (eq. 4)" if i == 0 else ""
        print(f"  {label:<14}" + "".join("#" if v else "." for v in row) + note)
    if png:
        draw(rows, T, w, t_out, Path(png))


def draw(rows, T, w, t_out, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
    except ImportError:
        print("\n(matplotlib is not installed: no picture written; the pattern above is the same)")
        return
    kinds = rows.long()
    kinds[T:] *= 2                         # 1 = a base token attends, 2 = an output token
    fig, ax = plt.subplots(figsize=(0.32 * T + 1.8, 0.32 * (T + t_out) + 1.4))
    ax.imshow(kinds, cmap=ListedColormap(["#f4f4f4", "#3b75af", "#ef8636"]), vmin=0, vmax=2)
    ax.axhline(T - 0.5, color="black", linewidth=1.5)
    ax.set_xticks(range(T))
    ax.set_yticks(range(T + t_out), [f"$x_{{{i}}}$" for i in range(T)]
                  + [f"$x'_{{{T - t_out + j}}}$" for j in range(t_out)])
    ax.set_xticks([x - 0.5 for x in range(T + 1)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(T + t_out + 1)], minor=True)
    ax.grid(which="minor", color="white", linewidth=1)
    ax.tick_params(which="minor", length=0)
    ax.set(xlabel="keys and values: the base tokens 0 ... T-1", ylabel="queries")
    ax.set_title(f"Orthros attention, T = {T}, w = {w}, t_out = {t_out}\nblue: base tokens, "
                 "sliding window (eq. 4)\norange: output tokens, full causal (eq. 5)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"\nwrote {path}")
