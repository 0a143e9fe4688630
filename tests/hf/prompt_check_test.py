"""assay-hf-worker render-prompt against transformers itself, on Qwen3's real tokenizer.

Usage: prompt_check_test.py WORKER

For each message set (system prompts, several turns, assistant turns with reasoning, tool calls
and tool results, non-ASCII text, emoji, code, empty content, thinking on and off, with and
without the generation prompt), the worker is run as assayd runs it (input.json, the model's
files as inherited descriptors, a fresh work directory) and must report the ids that
transformers' own AutoTokenizer.apply_chat_template gives from the fixture directory, and a
match; for some, the same ids with one changed must be reported as a mismatch at that index,
with both ids' texts. Every output is validated against schemas/prompt-check-output.schema.json.
Runs two workers at a time (each imports transformers: seconds). Exit 0 when every case holds.
"""
import concurrent.futures
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import jsonschema
import transformers

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "qwen3-tokenizer"
OUTPUT_SCHEMA = json.loads((ROOT / "schemas" / "prompt-check-output.schema.json").read_text())
# The cases whose altered ids are run too (every run costs a transformers import).
ALTERED = {"one user turn", "tool call and result", "emoji", "no generation prompt"}

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

CASES = [
    ("one user turn", [{"role": "user", "content": "Hello"}], {"enable_thinking": False}, True),
    ("system prompt", [{"role": "system", "content": "Be terse."},
                       {"role": "user", "content": "Why is the sky blue?"}], {}, True),
    ("several turns", [{"role": "user", "content": "2+2?"},
                       {"role": "assistant", "content": "4"},
                       {"role": "user", "content": "And 3+3?"}],
     {"enable_thinking": False}, True),
    ("assistant with reasoning", [
        {"role": "user", "content": "Pick a number."},
        {"role": "assistant", "content": "7", "reasoning_content": "Seven is prime."},
        {"role": "user", "content": "Why?"}], {"enable_thinking": True}, True),
    ("tool call and result", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"temp_c\": 21}"}], {"tools": [TOOL]}, True),
    ("non-ASCII", [{"role": "user", "content": "Schrödinger's Katze, naïve café, 東京, Ελλάδα"}],
     {"enable_thinking": False}, True),
    ("emoji", [{"role": "user", "content": "🙂🚀 👩🏽‍💻 family: 👨‍👩‍👧‍👦"}], {}, True),
    ("code", [{"role": "user", "content": "```python\ndef f(x):\n\treturn x ** 2  # <|im_end|>?\n```"}],
     {"enable_thinking": False}, True),
    ("empty content", [{"role": "system", "content": ""}, {"role": "user", "content": ""}], {},
     True),
    ("thinking on", [{"role": "user", "content": "Think first."}], {"enable_thinking": True},
     True),
    ("no generation prompt", [{"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "Hello!"}],
     {"enable_thinking": False}, False),
]


def reference_ids(tokenizer, messages, kwargs, add_generation_prompt):
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            **kwargs)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def run_worker(worker, messages, kwargs, add_generation_prompt, ids):
    """The worker as assayd runs it: descriptors 3, 4, ... for the model's files."""
    with tempfile.TemporaryDirectory() as work:
        names = sorted(p.name for p in FIXTURE.iterdir())
        fds = [os.open(FIXTURE / n, os.O_RDONLY) for n in names]
        try:
            # dup2 the files onto 3, 4, ... in the child, in order.
            targets = list(range(3, 3 + len(fds)))
            doc = {"schema": "assay.prompt-check-input.v1", "model_dir": "/nonexistent",
                   "model_fds": [{"name": n, "fd": t} for n, t in zip(names, targets)],
                   "messages": messages, "add_generation_prompt": add_generation_prompt,
                   "template_kwargs": kwargs, "token_ids": ids}
            pathlib.Path(work, "input.json").write_text(json.dumps(doc))

            def place():
                moved = [os.dup(fd) for fd in fds]
                for src, dst in zip(moved, targets):
                    os.dup2(src, dst, inheritable=True)

            proc = subprocess.run([worker, "render-prompt", "--input", "input.json",
                                   "--workdir", "."], cwd=work, preexec_fn=place,
                                  pass_fds=(), close_fds=False, capture_output=True, text=True)
        finally:
            for fd in fds:
                os.close(fd)
        if proc.returncode != 0:
            raise AssertionError(f"worker exited {proc.returncode}: {proc.stderr}")
        out = json.loads(pathlib.Path(work, "output.json").read_text())
        jsonschema.validate(out, OUTPUT_SCHEMA)
        return out


def ids_sha256(ids):
    return "sha256:" + hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()


def matches(tokenizer, case, ids, out):
    """The worker rendered exactly `ids`."""
    return out["match"] and out["first_difference"] is None and \
        out["token_ids_sha256"] == ids_sha256(ids) and out["token_count"] == len(ids)


def differs_at(tokenizer, k, ids, sent, out):
    """The worker found `sent` to differ from the rendered `ids` first at k, with both texts."""
    d = out["first_difference"] or {}
    want_sent = sent[k] if k < len(sent) else None
    return not out["match"] and d.get("index") == k and d.get("request_id") == want_sent and \
        d.get("rendered_id") == ids[k] and d.get("rendered_text") == tokenizer.decode([ids[k]]) \
        and d.get("request_text") == (None if want_sent is None else tokenizer.decode([want_sent]))


def main(argv):
    worker = argv[1]
    tokenizer = transformers.AutoTokenizer.from_pretrained(FIXTURE, local_files_only=True)
    runs = []  # (label, check, messages, kwargs, generation prompt, ids sent)
    for name, messages, kwargs, gen in CASES:
        ids = reference_ids(tokenizer, messages, kwargs, gen)
        runs.append((f"{name}: {len(ids)} ids", lambda out, ids=ids: matches(
            tokenizer, name, ids, out), messages, kwargs, gen, ids))
        if name in ALTERED:
            k = len(ids) // 2
            sent = ids[:k] + [ids[k] + 1] + ids[k + 1:]
            runs.append((f"{name}, id {k} changed", lambda out, ids=ids, k=k, sent=sent:
                         differs_at(tokenizer, k, ids, sent, out), messages, kwargs, gen, sent))
    ids = reference_ids(tokenizer, CASES[0][1], CASES[0][2], True)
    runs.append(("one id short", lambda out, ids=ids: differs_at(
        tokenizer, len(ids) - 1, ids, ids[:-1], out), CASES[0][1], CASES[0][2], True, ids[:-1]))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda r: run_worker(worker, r[2], r[3], r[4], r[5]), runs))
    failures = 0
    for (label, check, *_), out in zip(runs, outs):
        ok = check(out)
        print(f"{'PASS' if ok else 'FAIL'}  {label}" + ("" if ok else f": {out}"))
        failures += not ok
    print(f"{len(runs) - failures} of {len(runs)} checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
