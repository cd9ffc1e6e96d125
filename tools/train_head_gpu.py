"""Draft heads for a chat target trained on a GPU against the clock, for a lent machine's
few minutes: what `edgespec train-draft --device cuda` does, with a deadline instead of a
step count, two heads compared on held-out conversations, and a run's data kept.

A head is data-limited (SmolLM2's: 61% top-1 on its training answers, 30% on held-out
ones), and on the CPU a target writes ~30 conversations a minute. On a GPU the float
model writes requests (Magpie, data.self_requests) and greedy answers (data.answered) in
batches of 2,048, reads its own states along them (data.float_states: the exported
graph runs on the CPU only), and heads train on those (trainer.head_loss) until the clock
says stop. Two heads train side by side on the same batches: one from `--init` (a shipped
head, its tokens and shape), one fresh (`--fresh-intermediate` wide, its tokens the most
frequent in this data); both are scored on held-out conversations against `--init` as it
was, teacher-forced, top-1 per unroll step on answer tokens.

Everything lands in --out as it is made (a lent GPU machine returns only what it wrote
before its time ran out): the heads (.npz and card, every minute), the conversations'
tokens (conversations.npz, for reading them with the exported target later), the requests
and report.json.

    python tools/train_head_gpu.py MODEL.gguf --out OUT --seconds 420 \\
        --init edgespec/assets/drafts/smollm2-135m-instruct.npz

tools/draft_data/smollm2-135m-instruct/ holds what the runs behind SmolLM2's shipped head
wrote (23,530 requests, all answered, and the built-in prompts: 23,840 conversations'
tokens; not the task requests, which --tasks writes again): `--data` that folder, and a
run spends its minutes training instead of writing.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from edgespec.bench_sets import load_set
from edgespec.export.architectures import adapter_for
from edgespec.export.draft_head import DraftHead, HeadConfig, fingerprint, load_head
from edgespec.export.graph import as_float
from edgespec.export.source import open_source
from edgespec.quant.vocab_trim import kept_tokens
from edgespec.tokenizer import Tokenizer
from edgespec.train import data, tasks
from edgespec.train.model import EagleHead
from edgespec.train.trainer import TrainOptions, batch_of, head_loss, starting_head, windows


class Clock:
    def __init__(self, seconds: float):
        self.start, self.seconds = time.time(), seconds

    def elapsed(self) -> float:
        return time.time() - self.start

    def say(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {text}", flush=True)


def bench_prompts() -> set[str]:
    """The benchmark's user turns: a self-written request equal to one is dropped."""
    turns = [m for item in load_set("real") for m in item.get("messages", [])]
    return {m["content"].strip() for m in turns if m["role"] == "user"} | \
        {item["prompt"].strip() for item in load_set("real") if "prompt" in item}


def write_requests(model, tokenizer, eos, args, clock: Clock, until: float) -> list[str]:
    held = bench_prompts()
    requests: dict[str, None] = {}
    seed = args.seed
    while clock.elapsed() < until and len(requests) < args.max_requests:
        for text in data.self_requests(model, tokenizer, eos, args.batch // 2, seed,
                                       args.batch, lambda n: None):
            if text not in held:
                requests[text] = None
        seed += 1
        clock.say(f"{len(requests)} requests")
    return list(requests)


def answer(model, tokenizer, eos, prompts: list[str], args, clock: Clock, until: float
           ) -> tuple[list[list[int]], list[int]]:
    """Greedy conversations, and each one's prompt length (through the chat template)."""
    seqs, prompt_lens = [], []
    if clock.elapsed() > until:
        return seqs, prompt_lens
    batches = data.answered(model, tokenizer, eos, prompts, args.max_new_tokens, args.batch,
                            max_tokens=args.answer_tokens)
    for convs in batches:
        start = len(seqs)
        seqs += convs
        prompt_lens += [len(data.prompt_ids(tokenizer, p))
                        for p in prompts[start:start + len(convs)]]
        clock.say(f"{len(seqs)} conversations, {sum(map(len, seqs))} tokens")
        if clock.elapsed() > until:
            break
    return seqs, prompt_lens


class Trainee:
    def __init__(self, name: str, config: HeadConfig, kept: np.ndarray, embed, lm_head,
                 embed_scale, lr: float, device: str, start: DraftHead | None):
        self.name, self.config, self.kept, self.lr = name, config, kept, lr
        self.head = starting_head(config, embed, lm_head[torch.from_numpy(kept)], embed_scale,
                                  start).to(device)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=lr, weight_decay=0.0)
        self.steps, self.history = 0, []

    def step(self, batch, opts: TrainOptions, progress: float) -> None:
        """One step at a cosine learning rate over the time budget (5% warm-up)."""
        lr = self.lr * min(1.0, progress / 0.05) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss, stats = head_loss(self.head, batch, opts)
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.optimizer.step()
        self.steps += 1
        self.history.append([loss.item(), *stats])

    def save(self, out: Path, fp: np.ndarray, card: dict) -> None:
        weights = {k: v.numpy() for k, v in self.head.export_weights().items()}
        recent = np.mean(self.history[-50:], axis=0) if self.history else []
        card = {**card, "steps": self.steps,
                "final_loss": round(float(recent[0]), 4) if len(recent) else None,
                "train_top1_by_step": [round(float(x), 4) for x in recent[1:]]}
        DraftHead(self.config, weights, self.kept, fp, card).save(out / f"head_{self.name}.npz")
        (out / f"head_{self.name}.json").write_text(json.dumps(card, indent=1) + "\n")


@torch.no_grad()
def heldout_top1(head: EagleHead, kept: np.ndarray, seqs, states, prompt_lens, unroll: int,
                 device: str) -> list[float]:
    """Top-1 of each unroll step against the target's own next answer token."""
    kept_t = torch.from_numpy(kept).to(device)
    hits, total = np.zeros(unroll), np.zeros(unroll)
    for start in range(0, len(seqs), 64):
        items = [(np.asarray(t[:257]), s[:257]) for t, s in
                 zip(seqs[start:start + 64], states[start:start + 64], strict=True)]
        ids, st, _, valid, mask = batch_of(items, unroll, device)
        for k, predicted in enumerate(head.unrolled(ids, st, mask)):
            guess = kept_t[head.logits(predicted).argmax(-1)]  # [B, T]
            for i, (t, _) in enumerate(items):
                n = len(t) - 2 - k  # chains j whose step k predicts token t[j + 2 + k]
                if n <= 0:
                    continue
                j = torch.arange(n, device=device)
                answer = (j + 2 + k) >= prompt_lens[start + i]
                right = guess[i, :n] == torch.from_numpy(t[2 + k:2 + k + n]).to(device)
                hits[k] += int((right & answer & valid[i, k, :n]).sum())
                total[k] += int(answer.sum())
    return [round(float(h / max(t, 1)), 4) for h, t in zip(hits, total, strict=True)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--init", type=Path, required=True)
    ap.add_argument("--data", type=Path,
                    help="an earlier run's --out: its requests and conversations again")
    ap.add_argument("--fresh", action=argparse.BooleanOptionalAction, default=True,
                    help="train a fresh head beside the one from --init")
    ap.add_argument("--kept-from-data", action="store_true",
                    help="the --init head proposes this data's most frequent tokens")
    ap.add_argument("--init-lr", type=float, default=3e-4)
    ap.add_argument("--text", type=Path, action="append",
                    help="text files or directories the float model reads too (repeatable)")
    ap.add_argument("--text-tokens", type=int, default=1_000_000)
    ap.add_argument("--tasks", type=int, default=0,
                    help="task requests (train.tasks: code, summaries, questions on "
                         "documents, the --text corpus among them) answered too")
    ap.add_argument("--task-chars", type=int, default=8000,
                    help="task requests longer than this many characters are left out")
    ap.add_argument("--task-tail", type=int, default=384,
                    help="of a task conversation the head trains on its last tokens "
                         "(the answer and the document's end), not the whole document")
    ap.add_argument("--answer-tokens", type=int, default=600_000,
                    help="rows times length at most in one answering batch (KV memory)")
    ap.add_argument("--state-tokens", type=int, default=131_072,
                    help="rows times length at most in one batch read for its states")
    ap.add_argument("--seconds", type=float, default=420, help="the whole run's budget")
    ap.add_argument("--write-share", type=float, default=0.5,
                    help="of the budget: writing requests and answers")
    ap.add_argument("--max-requests", type=int, default=60_000)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--heldout", type=int, default=256)
    ap.add_argument("--fresh-intermediate", type=int, default=0,
                    help="the fresh head's MLP width (0: four times the width)")
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--ce-rows", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    clock = Clock(args.seconds)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    with tempfile.TemporaryDirectory() as scratch:
        source = open_source(args.model, Path(scratch))
        tokenizer = Tokenizer.from_dir(source.tokenizer_dir)
        adapter = adapter_for(source.load())
    spec, embeddings = adapter.spec, adapter.embeddings()
    fp = fingerprint(embeddings)
    embed = torch.from_numpy(as_float(embeddings))
    lm_head = torch.from_numpy(as_float(adapter.lm_head()))
    start = load_head(args.init)
    model = data.float_model(str(args.model), "gguf").to(args.device)
    clock.say(f"loaded {args.model.name} on {args.device}")

    loaded = clock.elapsed()
    write_until = loaded + (args.seconds - loaded) * args.write_share
    # conversations are kept as the requests answered, in order, then the built-in prompts'
    if args.data:  # an earlier run's requests and conversations, answered further
        packed = args.data / "requests.json.xz"  # as kept in the repository
        requests = json.loads(lzma.decompress(packed.read_bytes()) if packed.is_file() else
                              (args.data / "requests.json").read_text())
        with np.load(args.data / "conversations.npz") as z:
            seqs = [t.tolist() for t in np.split(z["tokens"].astype(np.int64),
                                                 np.cumsum(z["lengths"])[:-1])]
            prompt_lens = z["prompt_lengths"].tolist()
            answered = int(z["requests_answered"]) if "requests_answered" in z else len(seqs)
            held = z["heldout"].tolist() if "heldout" in z else None
    else:
        requests = write_requests(model, tokenizer, source.eos_ids, args, clock,
                                  loaded + 0.3 * (write_until - loaded))
        seqs, prompt_lens, answered, held = [], [], 0, None
    corpus = data.read_texts(args.text) if args.text else []
    first_task = len(requests)  # requests from here on are tasks
    if args.tasks:  # after the self-written ones, in groups of like length (little
        # padding a batch) in a shuffled order: a run out of time answers some of every
        # length, so of every kind (shortest first, run 3 answered no question on
        # documents, which are all long)
        known = set(requests)
        written = sorted([t for t in tasks.task_requests(args.seed, texts=corpus,
                                                         max_chars=args.task_chars)
                          if t not in known][:args.tasks], key=len)
        groups = [written[i:i + 256] for i in range(0, len(written), 256)]
        requests += [t for g in np.random.default_rng(args.seed).permutation(
            len(groups)) for t in groups[g]]
    (args.out / "requests.json").write_text(json.dumps(requests, ensure_ascii=False))
    builtin = data.builtin_prompts() if len(seqs) == answered else []  # first: few, sure
    more, more_lens = answer(model, tokenizer, source.eos_ids, builtin + requests[answered:],
                             args, clock, write_until)
    b = min(len(builtin), len(more))
    seqs = seqs[:answered] + more[b:] + seqs[answered:] + more[:b]
    prompt_lens = prompt_lens[:answered] + more_lens[b:] + prompt_lens[answered:] + more_lens[:b]
    # held out: requests the head never trains on, the same ones run after run
    held = held if held is not None else sorted(
        np.random.default_rng(args.seed).permutation(answered or len(more) - b)[:args.heldout])
    answered += len(more) - b
    lengths = np.array([len(s) for s in seqs])
    np.savez_compressed(args.out / "conversations.npz", lengths=lengths,
                        prompt_lengths=prompt_lens, requests_answered=answered,
                        heldout=np.array(held, dtype=np.int64),
                        tokens=np.concatenate(seqs).astype(
                            np.uint16 if spec.vocab_size <= 1 << 16 else np.uint32))
    states = list(data.float_states(model, seqs, 256, args.state_tokens))
    read = data.windows_of(tokenizer, corpus, 257, args.text_tokens,
                           args.seed) if args.text else []
    texts = [data.Conversation(np.array(ids), s) for ids, s in
             zip(read, data.float_states(model, read, 256, args.state_tokens),
                                strict=True)]
    del model
    clock.say(f"states of {len(seqs)} conversations and {len(texts)} text windows")

    rng = np.random.default_rng(args.seed)

    def conversation(i: int) -> data.Conversation:  # a task's: its tail only
        c = data.Conversation(np.asarray(seqs[i]), states[i])
        return c.last(args.task_tail) if first_task <= i < answered else c

    train = [conversation(i) for i in sorted(set(range(len(seqs))) - set(held))] + texts
    held_seqs = [np.asarray(seqs[i]) for i in held]
    held_states = [states[i] for i in held]
    held_prompt = [prompt_lens[i] for i in held]
    counts = np.bincount(np.concatenate([c.tokens for c in train]), minlength=spec.vocab_size)
    fresh_config = HeadConfig.for_target(spec, args.fresh_intermediate or 4 * spec.hidden_size)
    kept = kept_tokens(counts, len(start.kept), source.eos_ids)
    trainees = [  # a head's layer does not depend on which LM-head rows it scores
        Trainee("init", start.config, kept if args.kept_from_data else start.kept, embed,
                lm_head, spec.embed_scale, args.init_lr, args.device, start),
        Trainee("fresh", fresh_config, kept,
                embed, lm_head, spec.embed_scale, 1e-3, args.device, None)][:1 + args.fresh]
    opts = TrainOptions(unroll=3, seq_len=256, batch_tokens=args.batch_tokens,
                        ce_rows=args.ce_rows)
    report = {"model": args.model.name, "requests": len(requests),
              "conversations": len(seqs), "tokens": int(lengths.sum()),
              "heldout": len(held), "write_seconds": round(clock.elapsed(), 1),
              "before": heldout_top1(starting_head(
                  start.config, embed, lm_head[torch.from_numpy(start.kept)], spec.embed_scale,
                  start).to(args.device), start.kept, held_seqs, held_states, held_prompt, 3,
                  args.device)}
    clock.say(f"held-out top-1 of --init as shipped: {report['before']}")
    items = windows(train, opts.seq_len)
    per_batch = max(1, opts.batch_tokens // opts.seq_len)
    train_from, train_until = clock.elapsed(), args.seconds - 30
    card = {"target": args.model.name, "trained_on": "a GPU (tools/train_head_gpu.py)",
            "data": {**{k: report[k] for k in ("requests", "conversations", "tokens")},
                 "text_windows": len(texts), "text_tokens": sum(len(t.tokens) for t in texts)},
            "options": json.loads(json.dumps(vars(args), default=str))}
    saved = clock.elapsed()
    while clock.elapsed() < train_until:
        progress = (clock.elapsed() - train_from) / (train_until - train_from)
        pick = rng.choice(len(items), min(per_batch, len(items)), replace=False)
        batch = batch_of([items[i] for i in pick], 3, args.device)
        for t in trainees:
            t.step(batch, opts, progress)
        if clock.elapsed() - saved > 60:
            for t in trainees:
                t.save(args.out, fp, card)
            saved = clock.elapsed()
            clock.say(" ".join(f"{t.name}: {t.steps} steps, loss "
                               f"{np.mean([h[0] for h in t.history[-50:]]):.3f}"
                               for t in trainees))
    for t in trainees:
        t.head.eval()
        report[t.name] = {"steps": t.steps, "heldout_top1": heldout_top1(
            t.head, t.kept, held_seqs, held_states, held_prompt, 3, args.device)}
        t.save(args.out, fp, {**card, "heldout_top1": report[t.name]["heldout_top1"],
                              "heldout_top1_before": report["before"]})
    report["seconds"] = round(clock.elapsed(), 1)
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    clock.say(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
