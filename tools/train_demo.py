"""Train edgespec's demo pair on CPU: a small Llama *target* and a much cheaper *draft*.

Both share one byte-level BPE tokenizer and learn from a corpus every machine has: the
Python standard library's own source (tests and idlelib left out, every 40th file held
aside for evaluation). The draft is distilled from the trained target (KL to the target's
next-token distribution plus a little cross-entropy), because speculative decoding only
pays when the draft predicts what the *target* will say, not what the corpus says.

Everything is seeded; the model card written next to the weights records the corpus, the
shapes, the steps, the losses, the wall time and the greedy agreement of draft and target.

    python tools/train_demo.py --out tools/demo_pair            # full run (about 80 min, 2 cores)
    python tools/train_demo.py --out /tmp/t --target-steps 20 --draft-steps 20   # smoke run
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIALS = [EOS, IM_START, IM_END]

# ChatML, the convention most small chat models use; `bos_token` opens every conversation
# because the models saw EOS/BOS before every training document.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Roles must be system, user or assistant.') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TARGET_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                    num_attention_heads=4, num_key_value_heads=2)
DRAFT_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1)


def corpus_files() -> tuple[list[Path], list[Path]]:
    """The stdlib's .py files in a fixed order, split into training and held-aside files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py")
                   if not skip.intersection(p.relative_to(root).parts))
    held = files[::40]
    held_set = set(held)
    return [p for p in files if p not in held_set], held


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def chat_examples(source: str) -> list[str]:
    """Turn documented functions into chat turns ("write this" -> the function).

    A few thousand of these teach the code model what the chat template means, so
    `edgespec chat` on the demo answers with code instead of babbling after the prompt.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.end_lineno is None:
            continue
        doc = ast.get_docstring(node)
        if not doc or node.end_lineno - node.lineno > 40:
            continue
        body = "\n".join(lines[node.lineno - 1:node.end_lineno])
        first = doc.strip().splitlines()[0]
        user = f"Write a Python function `{node.name}`: {first}"
        out.append(f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{body}{IM_END}\n")
    return out


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    eos_id = tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B", special_tokens=[(EOS, eos_id)])
    return tok


def encode_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """One long token stream; every document starts with EOS (which doubles as BOS)."""
    ids = [e.ids for e in tok.encode_batch(texts)]  # post-processor prepends EOS
    return np.concatenate([np.asarray(i, dtype=np.int32) for i in ids])


def batches(stream: np.ndarray, batch: int, seq: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(stream) - seq - 1, size=batch)
        x = np.stack([stream[s:s + seq + 1] for s in starts]).astype(np.int64)
        yield torch.from_numpy(x)


def lr_at(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def eval_loss(model: LlamaForCausalLM, stream: np.ndarray, seq: int, n: int = 32) -> float:
    rng = np.random.default_rng(1234)
    losses = []
    for x in [next(batches(stream, 8, seq, rng)) for _ in range(n // 8)]:
        logits = model(x[:, :-1]).logits
        losses.append(F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).item())
    return float(np.mean(losses))


def make_model(shape: dict, vocab: int, tok: Tokenizer, seq: int) -> LlamaForCausalLM:
    eos_id = tok.token_to_id(EOS)
    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=2 * seq, rope_theta=10000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=eos_id,
                      eos_token_id=[eos_id, tok.token_to_id(IM_END)], pad_token_id=eos_id,
                      head_dim=shape["hidden_size"] // shape["num_attention_heads"], **shape)
    return LlamaForCausalLM(cfg)


def train(model, data, held, steps, peak_lr, seq, teacher=None, log=print):
    """AdamW + cosine over batches from `data`; with a teacher, the loss is
    KL(teacher || model) + 0.1 * CE."""
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr)
        x = next(data)
        logits = model(x[:, :-1]).logits.flatten(0, 1)
        loss = F.cross_entropy(logits, x[:, 1:].flatten())
        if teacher is not None:
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(x[:, :-1]).logits.flatten(0, 1), -1)
            kl = F.kl_div(F.log_softmax(logits, -1), t_logp, log_target=True,
                          reduction="batchmean")
            loss = kl + 0.1 * loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"step {step}/{steps} loss {loss.item():.3f} "
                f"({(time.time() - t0) / (step + 1):.2f} s/step)")
    return eval_loss(model, held, seq), time.time() - t0


@torch.no_grad()
def target_continuations(target, stream: np.ndarray, n: int, prompt: int, new: int,
                         seed: int, eos: int, batch: int = 64) -> torch.Tensor:
    """n sequences: a corpus window and the target's greedy continuation of it. The
    continuations are the text a draft must predict when decoding (on-policy distillation,
    as in DistillSpec): the corpus alone teaches it what the corpus says next."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(0, n, batch):
        starts = rng.integers(0, len(stream) - prompt, size=batch)
        x = torch.from_numpy(np.stack([stream[s:s + prompt] for s in starts]).astype(np.int64))
        out.append(target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                   min_new_tokens=new, do_sample=False, pad_token_id=eos))
    return torch.cat(out)[:n]


def epochs(seqs: torch.Tensor, batch: int, seed: int):
    """Shuffled batches of `seqs`, epoch after epoch."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        for idx in torch.randperm(len(seqs), generator=gen).split(batch):
            if len(idx) == batch:
                yield seqs[idx]


@torch.no_grad()
def greedy_agreement(target, draft, tok: Tokenizer, held_files: list[Path],
                     n_prompts: int = 48, new: int = 48, gamma: int = 4) -> dict:
    """How often the draft's argmax equals the target's on the target's own greedy text.

    That per-token agreement is exactly the greedy acceptance rate of speculative
    decoding; from the per-position match pattern we also count the tokens a γ-chain
    would emit per target pass.
    """
    rng = random.Random(0)
    matches, per_pass = [], []
    for path in held_files:
        ids = tok.encode(read(path)).ids
        if len(ids) < 200:
            continue
        for _ in range(max(1, n_prompts // len(held_files))):
            s = rng.randrange(1, len(ids) - 100)
            x = torch.tensor([ids[:1] + ids[s:s + 64]])
            out = target.generate(x, max_new_tokens=new, do_sample=False,
                                  pad_token_id=tok.token_to_id(EOS))
            t_pred = out[0, x.shape[1] - 1:-1]
            d_pred = draft(out[:, :-1]).logits[0, x.shape[1] - 1:].argmax(-1)
            agree = (d_pred == out[0, x.shape[1]:]).tolist()
            matches += agree
            i = 0
            while i < len(agree):  # simulate γ-chains over the match pattern
                run = 0
                while run < gamma and i + run < len(agree) and agree[i + run]:
                    run += 1
                per_pass.append(run + 1)
                i += run + 1
            assert len(t_pred) == len(d_pred)
    return {"greedy_acceptance": float(np.mean(matches)), "positions": len(matches),
            f"tokens_per_pass_gamma{gamma}": float(np.mean(per_pass))}


def write_checkpoint(model: LlamaForCausalLM, tok: Tokenizer, out: Path, seq: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out)
    model.to(torch.float32)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS, "eos_token": EOS, "pad_token": EOS, "unk_token": None,
        "add_bos_token": False, "model_max_length": 2 * seq,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(tok.token_to_id(t)): {
            "content": t, "special": True, "lstrip": False, "rstrip": False,
            "normalized": False, "single_word": False} for t in SPECIALS},
    }, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tok.token_to_id(EOS),
        "eos_token_id": [tok.token_to_id(EOS), tok.token_to_id(IM_END)],
        "pad_token_id": tok.token_to_id(EOS), "do_sample": False,
    }, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--target-steps", type=int, default=2000)
    ap.add_argument("--draft-steps", type=int, default=1200)
    ap.add_argument("--onpolicy-steps", type=int, default=800)
    ap.add_argument("--onpolicy-seqs", type=int, default=3072)
    ap.add_argument("--target-from", type=Path,
                    help="load this trained target (and its tokenizer) instead of training one")
    ap.add_argument("--draft-from", type=Path,
                    help="load this corpus-distilled draft and run only the on-policy phase")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    for given in (args.target_from, args.draft_from):
        if given is not None and not (given / "config.json").is_file():
            ap.error(f"{given} is not a checkpoint directory (no config.json); pass the "
                     "directory train_demo.py wrote, e.g. tools/demo_pair/target.")

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = (args.out / "train.log").open("w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    t_start = time.time()
    train_files, held_files = corpus_files()
    texts = [read(p) for p in train_files]
    chats = [c for t in texts for c in chat_examples(t)]
    log(f"corpus: {len(train_files)} files ({sum(map(len, texts))/1e6:.1f} M chars), "
        f"{len(chats)} chat examples, {len(held_files)} files held aside")
    if args.target_from:
        tok = Tokenizer.from_file(str(args.target_from / "tokenizer.json"))
    else:
        tok = train_tokenizer(texts + chats, args.vocab_size)
    stream = encode_stream(tok, texts + chats)
    held = encode_stream(tok, [read(p) for p in held_files])
    log(f"tokens: train {len(stream)/1e6:.2f} M, held-out {len(held)/1e6:.2f} M "
        f"({time.time() - t_start:.0f} s)")

    if args.target_from:
        target = LlamaForCausalLM.from_pretrained(args.target_from, torch_dtype=torch.float32)
        t_loss, t_time = eval_loss(target, held, args.seq), 0.0
    else:
        target = make_model(TARGET_SHAPE, args.vocab_size, tok, args.seq)
        log(f"target: {target.num_parameters()/1e6:.2f} M params")
        t_loss, t_time = train(target, batches(stream, args.batch, args.seq,
                                               np.random.default_rng(args.seed)),
                               held, args.target_steps, args.lr, args.seq, log=log)
    target.eval()
    write_checkpoint(target, tok, args.out / "target", args.seq)
    log(f"target held-out loss {t_loss:.3f} after {t_time/60:.1f} min")

    torch.manual_seed(args.seed + 1)
    if args.draft_from:
        draft = LlamaForCausalLM.from_pretrained(args.draft_from, torch_dtype=torch.float32)
        d_time = 0.0
    else:
        draft = make_model(DRAFT_SHAPE, args.vocab_size, tok, args.seq)
        log(f"draft: {draft.num_parameters()/1e6:.2f} M params")
        _, d_time = train(draft, batches(stream, args.batch, args.seq,
                                         np.random.default_rng(args.seed + 1)),
                          held, args.draft_steps, args.lr, args.seq, teacher=target, log=log)
    corpus_agreement = greedy_agreement(target, draft, tok, held_files)
    log(f"agreement after corpus distillation: {corpus_agreement}")
    t0 = time.time()
    seqs = target_continuations(target, stream, args.onpolicy_seqs, 64, 64, args.seed + 2,
                                tok.token_to_id(EOS))
    log(f"{len(seqs)} target continuations in {(time.time() - t0) / 60:.1f} min")
    draft.train()
    d_loss, p_time = train(draft, epochs(seqs, args.batch, args.seed + 2), held,
                           args.onpolicy_steps, args.lr / 4, args.seq, teacher=target, log=log)
    d_time += time.time() - t0
    draft.eval()
    write_checkpoint(draft, tok, args.out / "draft", args.seq)
    log(f"draft held-out loss {d_loss:.3f} after {d_time/60:.1f} min")

    agreement = greedy_agreement(target, draft, tok, held_files)
    log(f"agreement: {agreement}")
    sample = target.generate(torch.tensor([tok.encode("def quicksort(items):").ids]),
                             max_new_tokens=80, do_sample=False,
                             pad_token_id=tok.token_to_id(EOS))
    card = {
        "corpus": f"Python {sys.version.split()[0]} standard library .py files "
                  "(without test/, tests/, idlelib/, lib2to3/, site-packages/), "
                  f"{len(train_files)} training files + {len(chats)} chat examples built "
                  "from documented functions; every 40th file held aside",
        "held_aside_files": [str(p.relative_to(sysconfig.get_paths()["stdlib"]))
                             for p in held_files],
        "tokenizer": f"byte-level BPE, {args.vocab_size} tokens, trained with `tokenizers`",
        "train_tokens": int(len(stream)), "held_out_tokens": int(len(held)),
        "seed": args.seed, "seq_len": args.seq, "batch": args.batch, "peak_lr": args.lr,
        "target": {**TARGET_SHAPE, "params": target.num_parameters(),
                   "steps": args.target_steps, "held_out_loss": round(t_loss, 4),
                   "train_minutes": round(t_time / 60, 1)},
        "draft": {**DRAFT_SHAPE, "params": draft.num_parameters(),
                  "steps": args.draft_steps, "held_out_loss": round(d_loss, 4),
                  "train_minutes": round(d_time / 60, 1),
                  "onpolicy_steps": args.onpolicy_steps,
                  "onpolicy_sequences": f"{args.onpolicy_seqs} corpus windows of 64 tokens "
                                        "+ the target's greedy 64-token continuations",
                  "objective": "KL(target || draft) + 0.1 * cross-entropy, on the corpus, "
                               "then on the target's own continuations at lr / 4"},
        "agreement_after_corpus_distillation": corpus_agreement,
        "agreement_on_held_aside_files": agreement,
        "sample_greedy_target": tok.decode(sample[0].tolist()),
        "total_minutes": round((time.time() - t_start) / 60, 1),
        "torch": torch.__version__, "threads": args.threads,
    }
    (args.out / "model_card.json").write_text(json.dumps(card, indent=2))
    log(json.dumps({k: v for k, v in card.items() if k != "held_aside_files"}, indent=2))


if __name__ == "__main__":
    main()
