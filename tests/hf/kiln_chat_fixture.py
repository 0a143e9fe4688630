"""Makes a chat model and a Kiln request for it, for the prompt-check tests.

Usage: kiln_chat_fixture.py OUT_DIR [--alter-index N] [--looping-template]

OUT_DIR/model: a tiny Qwen3ForCausalLM (transformers' own class, random weights, seed 0) with
Qwen3's real tokenizer and chat template (tests/fixtures/qwen3-tokenizer/), so that every id the
template renders is in its vocabulary. OUT_DIR/request.json: a kiln.hf-next-token-request.v1
whose prompt.token_ids are transformers' own rendering of its messages (apply_chat_template,
add_generation_prompt, enable_thinking False), with the model's identity as Kiln computes it;
--alter-index N changes the id at N to another token, as a request with a wrong prompt would.
--looping-template then replaces the model's chat template (tokenizer_config.json) with one whose
loops never end in practice (three nested ranges of Jinja's sandboxed maximum, 10^15 turns) and
names that template's hash in the request: a model that would hold a render worker forever.
"""
import argparse
import hashlib
import json
import pathlib
import shutil
import subprocess
import sys

import torch
import transformers

HERE = pathlib.Path(__file__).resolve().parent
TOKENIZER = HERE.parent / "fixtures" / "qwen3-tokenizer"
MESSAGES = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Explain déterminisme in one line ✓"},
]


def sha256_id(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def make_model(out):
    config = transformers.Qwen3Config(
        vocab_size=151936, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=512,
        tie_word_embeddings=True, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    for f in TOKENIZER.iterdir():
        shutil.copyfile(f, out / f.name)


def identity(model_dir):
    script = HERE.parent / "fingerprint" / "independent_identity.py"
    text = subprocess.run([sys.executable, str(script), str(model_dir), "qwen3-chat-tiny"],
                          check=True, capture_output=True, text=True).stdout
    return json.loads(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--alter-index", type=int)
    parser.add_argument("--looping-template", action="store_true")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    model_dir = out / "model"
    if not (model_dir / "config.json").exists():
        model_dir.mkdir(parents=True)
        make_model(model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    encoded = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                            enable_thinking=False)
    ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    if args.alter_index is not None:
        ids[args.alter_index] = 1879 if ids[args.alter_index] != 1879 else 1880
    prefix = [tokenizer.encode("The", add_special_tokens=False)[0]]
    if args.looping_template:
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = (
            "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
            "{% endfor %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}")
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    user = MESSAGES[1]["content"]
    request = {
        "schema": "kiln.hf-next-token-request.v1",
        "id": "kiln-chat" + ("" if args.alter_index is None else f"-altered-{args.alter_index}")
              + ("-looping" if args.looping_template else ""),
        "source": {
            "source_commit": "0" * 40,
            "kiln_receipt": {"path": "receipts/r.kiln.json", "file_sha256": "sha256:" + "1" * 64,
                             "content_sha256": "sha256:" + "2" * 64},
            "vllm_receipt": {"path": "receipts/r.vllm.json", "file_sha256": "sha256:" + "3" * 64,
                             "content_sha256": "sha256:" + "4" * 64},
        },
        "model_identity": identity(model_dir),
        "prompt": {
            "generator": {"run_id": "chat-run", "phase": "measure-c001-r000", "request_index": 0,
                          "profile": "short", "template_version": "fixed-serving-profiles-v1"},
            "messages": MESSAGES,
            "add_generation_prompt": True,
            "template_kwargs": {"enable_thinking": False},
            "utf8_sha256": sha256_id(user.encode()),
            "token_count": len(ids),
            "token_ids": ids,
        },
        "continuation_prefix": [{"token_id": prefix[0], "text": tokenizer.decode(prefix)}],
        "input_token_ids": ids + prefix,
        "input_token_ids_sha256": sha256_id(json.dumps(ids + prefix, separators=(",", ":")).encode()),
        "candidates": [
            {"engine": "kiln", "token_id": 1156, "text": tokenizer.decode([1156])},
            {"engine": "vllm", "token_id": 3405, "text": tokenizer.decode([3405])},
        ],
    }
    (out / "request.json").write_text(json.dumps(request, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
