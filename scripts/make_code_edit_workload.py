"""Write benchmarks/code_edit.json: "rewrite this code with one change" prompts for the
bundled SmolLM2 (chat template applied), the repetitive workload of speculative
decoding (prompt lookup proposes the code being copied).

    .venv/bin/python scripts/make_code_edit_workload.py

Deterministic: the same tokenizer gives the same file.
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedllm.config import default_model_path
from pagedllm.loader import load_tokenizer

MAX_TOKENS = 160

SNIPPETS = [
    ("binary_search", "lo", "low", '''def binary_search(items, target):
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1'''),
    ("word_count", "counts", "frequencies", '''def word_count(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])'''),
    ("merge", "result", "merged", '''def merge(left, right):
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result'''),
    ("matmul", "acc", "total", '''def matmul(a, b):
    rows, inner, cols = len(a), len(b), len(b[0])
    out = [[0.0] * cols for _ in range(rows)]
    for r in range(rows):
        for c in range(cols):
            acc = 0.0
            for k in range(inner):
                acc += a[r][k] * b[k][c]
            out[r][c] = acc
    return out'''),
    ("flatten", "stack", "pending", '''def flatten(nested):
    flat = []
    stack = [nested]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        else:
            flat.append(item)
    return flat'''),
    ("moving_average", "window", "span", '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            averages.append(total / window)
    return averages'''),
    ("parse_config", "line", "entry", '''def parse_config(text):
    config = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        config[key.strip()] = value.strip()
    return config'''),
    ("gcd_lcm", "a", "x", '''def gcd(a, b):
    while b:
        a, b = b, a % b
    return abs(a)


def lcm(a, b):
    if a == 0 or b == 0:
        return 0
    return abs(a * b) // gcd(a, b)'''),
]


def main() -> None:
    tokenizer = load_tokenizer(default_model_path())
    items = []
    for name, old, new, code in SNIPPETS:
        message = (f"Rewrite this Python code with one change: rename the variable `{old}` "
                   f"to `{new}`. Keep everything else exactly the same and output only the "
                   f"code.\n\n```python\n{code}\n```")
        text = tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                             add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        items.append({"name": name, "prompt_token_ids": ids, "max_tokens": MAX_TOKENS})
    out = Path(__file__).resolve().parent.parent / "benchmarks" / "code_edit.json"
    out.write_text(json.dumps(items) + "\n")
    print(f"wrote {out}: {len(items)} prompts")


if __name__ == "__main__":
    main()
