"""SFT data: JSONL lines {"prompt": ..., "response": ...} or {"turns": [prompt, response, ...]}
(other keys kept; "bucket" groups the exact-match report). The loss covers each response and the
END token after it; a batch is right-padded, its t_out the smallest suffix of columns holding every
output position (the paper's section 3.2)."""

import json
from collections import defaultdict
from pathlib import Path

import torch

from data.prepare_utils import to_device
from orthros import IGNORE, check_targets  # the target the loss skips; the model's check of them


def read_jsonl(path):
    """An SFT JSONL file's examples; a bad line is an error that names it."""
    examples = []
    for n, line in enumerate(open(path, encoding="utf-8"), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {n}"
        try:
            ex = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(ex, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(ex).__name__}")
        if "turns" not in ex and not {"prompt", "response"} <= set(ex):
            raise ValueError(f"{where}: needs 'prompt' and 'response', or 'turns'")
        turns = ex["turns"] if "turns" in ex else [ex["prompt"], ex["response"]]
        if not isinstance(turns, list) or len(turns) < 2 or len(turns) % 2:
            raise ValueError(f"{where}: 'turns' must be [prompt, response, ...]: an even number")
        if not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{where}: prompts and responses must be strings")
        if not turns[0]:
            raise ValueError(f"{where}: the first prompt is empty: it must hold a token")
        if isinstance(ex.get("bucket"), (dict, list)):
            raise ValueError(f"{where}: 'bucket' must be a string or a number, not a "
                             f"{type(ex['bucket']).__name__}")
        if "bucket" in ex and not isinstance(ex["bucket"], str):  # 3 and "3": the same bucket
            ex["bucket"] = json.dumps(ex["bucket"])
        examples.append({**{k: v for k, v in ex.items() if k not in ("prompt", "response")},
                         "turns": turns})
    if not examples:
        raise ValueError(f"{path} holds no examples")
    return examples


def encode_example(turns, tokenizer):
    """tokens and a same-length train mask: True where the token is a target (responses and END)."""
    tokens, mask = [], []
    for i, text in enumerate(turns):
        ids = tokenizer.encode(text) + [tokenizer.eot] * (i % 2)  # END after each response
        tokens += ids
        mask += [i % 2 == 1] * len(ids)
    return tokens, mask


def load_examples(path, tokenizer, max_len, overlong="drop"):
    """(examples with "tokens", "mask", a report): the overlong dropped or truncated on the left."""
    if overlong not in ("drop", "truncate"):
        raise ValueError(f"overlong must be 'drop' or 'truncate', got {overlong!r}")
    examples, too_long = [], 0
    for ex in read_jsonl(path):
        tokens, mask = encode_example(ex["turns"], tokenizer)
        if len(tokens) - 1 > max_len:  # max_len inputs, and the last target after them
            too_long += 1
            tokens, mask = tokens[-(max_len + 1):], mask[-(max_len + 1):]
            if overlong == "drop" or not any(mask[1:]):
                continue
        examples.append({**ex, "tokens": tokens, "mask": mask})
    report = f"{path}: {len(examples)} examples" + (
        f"; {too_long} longer than {max_len} tokens were "
        f"{'dropped' if overlong == 'drop' else 'truncated from the left'}" if too_long else "")
    if not examples:
        raise ValueError(f"{report}: none left; raise seq_len or use --sft_overlong truncate")
    return examples, report


def collate(examples, pad_id=0):
    """x, y (B, T) right-padded, y the next token or IGNORE; t_out covering every target (>= 1)."""
    T = max(len(ex["tokens"]) - 1 for ex in examples)
    x = torch.full((len(examples), T), pad_id, dtype=torch.long)
    y = torch.full((len(examples), T), IGNORE, dtype=torch.long)
    for i, ex in enumerate(examples):
        tokens, n = torch.tensor(ex["tokens"]), len(ex["tokens"]) - 1
        x[i, :n] = tokens[:-1]
        y[i, :n] = torch.where(torch.tensor(ex["mask"][1:]), tokens[1:], IGNORE)
    has_target = (y != IGNORE).any(dim=0)
    first = int(has_target.nonzero()[0]) if has_target.any() else T - 1
    return x, y, T - first


def has_prompt(example):
    """Whether truncation left a prompt token before the last response (else it cannot be asked)."""
    return not all(example["mask"])


def exact_match(examples, generate, batch_size=64):
    """Exact match of the last responses (with END) per "bucket"; generate(prompts, n) -> tokens."""
    groups = defaultdict(list)  # equal prompt and answer lengths can share a batch
    for ex in examples:
        if not has_prompt(ex):
            raise ValueError("an example has no prompt token before its answer (truncated away?): "
                             "filter with has_prompt() first")
        start = len(ex["mask"]) - ex["mask"][::-1].index(False)  # the trailing run of targets
        groups[start, len(ex["mask"]) - start].append(ex)
    hits = defaultdict(list)
    for (start, n_answer), group in groups.items():
        for i in range(0, len(group), batch_size):
            batch = group[i:i + batch_size]
            answers = generate([ex["tokens"][:start] for ex in batch], n_answer)
            for ex, answer in zip(batch, answers):
                hits[ex.get("bucket", "all")].append(list(answer) == ex["tokens"][start:])
    return {b: {"n": len(h), "accuracy": sum(h) / len(h)}
            for b, h in sorted(hits.items(), key=lambda item: bucket_order(item[0]))}


def bucket_order(name):
    """Numbers and ranges "lo-hi" by their (lower) value, then other names by name."""
    try:
        return (0, float(name.split("-")[0]), name)
    except ValueError:
        return (1, 0.0, name)


def exact_match_report(examples, generate, limit=-1, log=print):
    """exact_match on the first `limit` examples (-1: all) that keep a prompt, logged; or None."""
    examples = examples[:None if limit < 0 else limit]
    scorable = [ex for ex in examples if has_prompt(ex)]
    if len(scorable) < len(examples):
        log(f"note: {len(examples) - len(scorable)} of {len(examples)} test examples are not "
            "scored: truncation to seq_len left no prompt before their answer")
    if not scorable:
        return None
    scores = exact_match(scorable, generate)
    log("exact-match accuracy of greedy generation (KV cache) on test.jsonl" + (
        f": {scores['all']['accuracy']:.3f} ({scores['all']['n']} examples)"
        if list(scores) == ["all"] else ", by bucket:\n" + "\n".join(
            f"  {b:>12}: {r['accuracy']:.3f}  ({r['n']} examples)" for b, r in scores.items())))
    return scores


class SFTBatches:
    """Random batches of a folder's train.jsonl, val.jsonl (and curriculum.jsonl): --task sft."""

    def __init__(self, data_dir, tokenizer, seq_len, overlong="drop", curriculum="", device="cpu",
                 log=print):
        splits = {p.stem: p for p in sorted(Path(data_dir).glob("*.jsonl"))}
        if not splits and list(Path(data_dir).glob("*.bin")):
            raise ValueError(f"{data_dir} holds pre-training data (*.bin), not SFT JSONL: drop "
                             "--task sft, or give --dataset a folder of train.jsonl, val.jsonl")
        for needed in ("train", "val") + ((curriculum,) if curriculum else ()):
            if needed not in splits:
                raise ValueError(f"{data_dir} has no {needed}.jsonl: SFT needs train.jsonl, "
                                 "val.jsonl and the --curriculum's")
        self.examples, self.device = {}, device
        for name, path in splits.items():
            self.examples[name], report = load_examples(path, tokenizer, seq_len, overlong)
            log(report)

    def get(self, split, batch_size, generator):
        """(x, y, t_out), the targets checked here: on a GPU the model reads only the last t_out."""
        pool = self.examples[split]
        ix = torch.randint(len(pool), (batch_size,), generator=generator).tolist()
        x, y, t_out = collate([pool[i] for i in ix])
        check_targets(y, t_out)
        return to_device(x, self.device), to_device(y, self.device), t_out
